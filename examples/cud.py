"""Which forget samples will resist unlearning? Circuit-guided unlearning difficulty (CUD), before unlearning.

    PYTHONPATH=. python examples/cud.py                           # tiny Llama fine-tuned here on 4 TOFU authors (~2 min)
    PYTHONPATH=. python examples/cud.py --model path/to/model-finetuned-on-tofu --forget-split forget01
    accelerate launch --num_processes 1 examples/cud.py           # accelerate works with one process

Steps: EAP-IG circuits of every forget sample -> anchors from real unlearning runs (GradDiff, NPO) -> CUD of every
sample -> easy / hard / random forget sets (typed id files) -> unlearn the easy and the hard set with GradDiff at the
same budget and print how much each forgot. Without --model the rows are the TOFU subset shipped with hf_unlearn;
with --model, the split comes from --tofu DIR or $HF_UNLEARN_DATA_DIR/tofu, else the Hub. Single-process
only: circuits are scored in one process (several `accelerate` processes would each score everything), so with more
than one process the script stops and says so.
"""

from __future__ import annotations

import argparse
import copy
import math
from pathlib import Path

from hf_unlearn import (
    AnchorConfig,
    CircuitConfig,
    GradDiffConfig,
    GradDiffTrainer,
    build_anchors,
    compute_circuits,
    compute_cud,
    stratify,
)
from hf_unlearn.analysis.cud import answer_losses, write_sets
from hf_unlearn.data.ids import read_ids


def setup(args):
    """(model, tokenizer, forget rows, retain rows): a given model on a TOFU split, or a tiny one fine-tuned here."""
    from hf_unlearn import load_model, load_tofu, load_tokenizer, tokenize_qa

    if args.model:
        tok, model = load_tokenizer(args.model), load_model(args.model)
        forget = load_tofu(args.forget_split, args.tofu)
        retain = load_tofu(f"retain{100 - int(args.forget_split[-2:]):02d}", args.tofu).select(range(80))
        return model, tok, tokenize_qa(forget, tok, max_length=128), tokenize_qa(retain, tok, max_length=128)
    from hf_unlearn.demo import DemoConfig, fine_tune, load_demo_data, load_demo_model

    cfg = DemoConfig(authors=4, forget_authors=2, epochs=30, output_dir=args.out)
    subset, forget_ids = load_demo_data(cfg)
    model, tok, _ = load_demo_model(cfg, [r["question"] + " " + r["answer"] for r in subset])
    data = tokenize_qa(subset, tok, max_length=cfg.max_length)
    fine_tune(cfg, model, tok, data, Path(args.out) / "finetune")
    fset = set(forget_ids)
    return model.eval(), tok, data.filter(lambda r: r["id"] in fset), data.filter(lambda r: r["id"] not in fset)


def efficacy(model, tok, rows) -> float:
    """100 * (1 - mean answer probability): how much of the set is forgotten."""
    losses = answer_losses(model, tok, list(rows))
    return 100 * (1 - sum(math.exp(-x) for x in losses) / len(losses))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model fine-tuned on TOFU (default: a tiny one trained here)")
    p.add_argument("--forget-split", default="forget01")
    p.add_argument("--tofu", default=None)
    p.add_argument("--lr", type=float, default=None, help="unlearning learning rate (default: 1e-3 tiny, 1e-5)")
    p.add_argument("--set-size", type=int, default=6)
    p.add_argument("--out", default="cud_example_output")
    args = p.parse_args()
    from accelerate import PartialState

    if PartialState().num_processes > 1:
        raise SystemExit("examples/cud.py runs in one process (EAP-IG scores every sample in one process); "
                         "use `python` or `accelerate launch --num_processes 1`")
    out = Path(args.out)
    lr = args.lr or (1e-5 if args.model else 1e-3)
    model, tok, forget, retain = setup(args)

    circuits = compute_circuits(model, tok, forget, CircuitConfig(ig_steps=5, top_edges=30))
    circuits.save(out / "circuits")
    anchors = build_anchors(model, tok, forget, retain, AnchorConfig(
        methods=["grad_diff", "npo"], epochs=3, learning_rate=lr, max_length=128, fraction=0.2))
    anchors.save(out / "anchors")
    result = compute_cud(circuits, anchors, similarity="cosine")
    result.to_jsonl(out / "cud.jsonl")
    sets = stratify(result, args.set_size, seed=0)
    write_sets(out / "sets", sets, result)
    print(f"{len(circuits)} circuits, {len(anchors.easy)} easy / {len(anchors.hard)} hard anchors; sets in {out / 'sets'}")

    for name in ("easy", "hard", "random"):
        wanted = set(read_ids(out / "sets" / f"{name}.jsonl"))  # the id files select forget rows for any trainer
        rows = forget.filter(lambda r, wanted=wanted: r["id"] in wanted)
        trainer = GradDiffTrainer(model=copy.deepcopy(model), args=GradDiffConfig(
            output_dir=str(out / f"unlearn-{name}"), num_train_epochs=2, learning_rate=lr,
            per_device_train_batch_size=2, save_strategy="no", report_to=[], disable_tqdm=True),
            forget_dataset=rows, retain_dataset=retain, processing_class=tok)
        before = efficacy(model, tok, rows)
        trainer.train()
        cuds = [result.by_id()[i]["cud"] for i in wanted]
        print(f"{name:6s} set (CUD {min(cuds):.2f}..{max(cuds):.2f}): unlearning efficacy "
              f"{before:.1f} -> {efficacy(trainer.model, tok, rows):.1f}")


if __name__ == "__main__":
    main()
