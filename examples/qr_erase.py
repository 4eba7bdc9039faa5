"""Erase a TOFU author from a model's weights in closed form with QR-Erase (no unlearning steps).

    PYTHONPATH=. python examples/qr_erase.py                                   # tiny Llama built locally, ~1 minute
    PYTHONPATH=. python examples/qr_erase.py --model ../shared/models/SmolLM2-135M-Instruct --authors 4
    accelerate launch examples/qr_erase.py                                     # the fine-tunes run on every process

Steps: (1) the model learns a few TOFU authors (skipped with --no-finetune for a model that already knows them);
(2) task matrices: LoRA fine-tunes on the forget author's rows and on the other authors' rows
(``make_task_matrices``); (3) ``qr_erase`` subtracts the forget task's CPQR subspace, minus the retain subspace, in
the blocks holding its energy; (4) answer losses before/after, the edit report and the saved model. Rows come from
the TOFU subset shipped with hf_unlearn (up to 10 authors), or from --tofu DIR / $HF_UNLEARN_DATA_DIR/tofu for more.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from hf_unlearn import load_tofu, make_task_matrices, qr_erase, tokenize_qa
from hf_unlearn.data.embedded import EMBEDDED_TOFU_AUTHORS, load_embedded_tofu
from hf_unlearn.demo import DemoConfig, fine_tune, load_demo_model, mean_answer_loss
from hf_unlearn.runtime import init_processes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Hub id, local folder or .gguf file (default: a tiny Llama)")
    p.add_argument("--tofu", default=None, help="TOFU folder (default: the embedded subset for up to 10 authors)")
    p.add_argument("--authors", type=int, default=4, help="TOFU authors learned; the last one is forgotten")
    p.add_argument("--no-finetune", action="store_true", help="the model already knows these authors")
    p.add_argument("--method", default="qr", choices=["qr", "qr-truncated", "svd"])
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--scale", type=float, default=2.0)
    p.add_argument("--out", default="qr_erase_output")
    args = p.parse_args()
    state = init_processes()  # every process prints "process R of N"
    tiny = args.model is None

    if args.tofu is None and args.authors <= EMBEDDED_TOFU_AUTHORS:
        rows = load_embedded_tofu(args.authors)  # offline, no data folder needed
    else:
        rows = load_tofu("full", args.tofu).select(range(20 * args.authors))
    forget = rows.select(range(20 * (args.authors - 1), 20 * args.authors))
    retain = rows.select(range(20 * (args.authors - 1)))
    cfg = DemoConfig(model=args.model, output_dir=args.out, authors=args.authors, epochs=30 if tiny else 3,
                     learning_rate=3e-3 if tiny else 1e-4)
    model, tokenizer, name = load_demo_model(cfg, [r["question"] + " " + r["answer"] for r in rows])
    data = {k: tokenize_qa(v, tokenizer, max_length=128) for k, v in (("forget", forget), ("retain", retain))}
    if not args.no_finetune:
        fine_tune(cfg, model, tokenizer, tokenize_qa(rows, tokenizer, max_length=128), Path(args.out) / "finetune")
    model.eval()
    before = {k: mean_answer_loss(model, tokenizer, v) for k, v in data.items()}

    task_dir = Path(args.out) / "task_matrices"
    if state.is_main_process and task_dir.exists():
        shutil.rmtree(task_dir)  # this example's own output of an earlier run
    state.wait_for_everyone()
    folder = make_task_matrices(model, tokenizer, forget, retain, task_dir, lora=True,
                                lora_r=8, epochs=10 if tiny else 3, learning_rate=1e-2 if tiny else 2e-4,
                                max_length=128, batch_size=8, progress=state.is_main_process)
    model, report = qr_erase(model, folder.path, method=args.method, rank=args.rank, scale=args.scale, localize=True,
                             progress=state.is_main_process)
    after = {k: mean_answer_loss(model, tokenizer, v) for k, v in data.items()}
    if state.is_main_process:
        print(f"{name}: {report.method_name} edited {len(report.layers)} layers in blocks {report.selected_blocks} "
              f"of {report.num_blocks} in {report.seconds_total:.1f} s")
        print(f"answer loss forget {before['forget']:.3f} -> {after['forget']:.3f}, "
              f"retain {before['retain']:.3f} -> {after['retain']:.3f}")
        edited = Path(args.out) / "edited"
        model.save_pretrained(edited)
        tokenizer.save_pretrained(edited)
        report.save(edited)
        print(f"saved the edited model and edit_report.md / layer_energies.png to {edited}")


if __name__ == "__main__":
    main()
