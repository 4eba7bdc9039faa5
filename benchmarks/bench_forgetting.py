"""Random-label forgetting experiment: does forgetting generalise to unseen rows, per task?

Runs ``hf-unlearn analyze forgetting`` (fine-tune on all tasks, forget each with random labels, measure) and prints
the per-task figures side by side. Sized for a shared CPU by default; on a GPU raise --n-train/--n-test/--epochs.

    PYTHONPATH=. python benchmarks/bench_forgetting.py # report under ~/.cache/hf_unlearn/bench/forgetting
    PYTHONPATH=. python benchmarks/bench_forgetting.py --tiny     # a tiny random Llama instead (pipeline check)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from hf_unlearn.runtime import bench_output_dir

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHARED / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--tiny", action="store_true", help="use a tiny random Llama with the GPT-2 tokenizer")
    ap.add_argument("--tasks", default="rte,cola,piqa,sciq")
    ap.add_argument("--n-train", default="12")
    ap.add_argument("--n-test", default="12")
    ap.add_argument("--epochs", default="2")
    ap.add_argument("--forget-epochs", default="2")
    ap.add_argument("--lr", default="1e-4")
    ap.add_argument("--forget-lr", default=None, help="random-label learning rate (default: --lr)")
    ap.add_argument("--no-cross-task", action="store_true", help="skip the cross-task matrix")
    ap.add_argument("--batch-size", default="4")
    ap.add_argument("--max-length", default="64")
    ap.add_argument("--train-last-layers", default="4")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--out", default=bench_output_dir("forgetting"), help="output folder (default: %(default)s)")
    args = ap.parse_args()
    os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(SHARED / "data"))
    sys.path.insert(0, str(ROOT))
    from hf_unlearn.cli import main as cli

    model = args.model
    if args.tiny:
        from hf_unlearn.models import build_tiny_model, load_tokenizer

        tok = load_tokenizer(SHARED / "tokenizers" / "gpt2")
        model = tempfile.mkdtemp(prefix="tiny_llama_")
        build_tiny_model("llama", tok, hidden_size=64, num_layers=4, num_heads=4).save_pretrained(model)
        tok.save_pretrained(model)
    argv = ["analyze", "forgetting", model, "--tasks", args.tasks, "--out", args.out, "--n-train", args.n_train,
            "--n-test", args.n_test, "--epochs", args.epochs, "--forget-epochs", args.forget_epochs, "--lr", args.lr,
            "--batch-size", args.batch_size, "--max-length", args.max_length, "--threads", args.threads,
            "--train-last-layers", args.train_last_layers]
    argv += ["--forget-lr", args.forget_lr] if args.forget_lr else []
    argv += ["--no-cross-task"] if args.no_cross_task else []
    print("hf-unlearn " + " ".join(argv), flush=True)
    code = cli(argv)
    if code:
        return code
    res = json.loads((Path(args.out) / "results.json").read_text())
    cols = ["chance", "acc_ft_train", "acc_ft_test", "acc_forgot_train", "acc_forgot_test", "forget_ratio_train",
            "forget_ratio_test", "total_variance_last_layer", "probe_best", "acc_forgot_all", "order_spearman"]
    print("task  " + "  ".join(cols))
    for name, row in res["tasks"].items():
        vals = [row.get(c) for c in cols]
        print(f"{name}  " + "  ".join("n/a" if v is None else f"{v:.3f}" for v in vals))
    print("cross-task forget ratio (row forgotten, column evaluated):")
    for a, accs in res["cross_task_ratio"].items():  # without the matrix: the diagonal only
        print(f"  {a}: " + ", ".join(f"{b}={'n/a' if v is None else f'{v:.2f}'}" for b, v in accs.items()))
    print("predictors vs test forget ratio (spearman):", json.dumps(res["predictors"]["spearman"]))
    print(f"total {res['timing_s']['total']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
