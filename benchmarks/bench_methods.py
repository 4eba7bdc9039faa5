"""Approximate unlearning side by side: MASC until it stops vs the baselines at a fixed budget.

Fine-tunes a model on a TOFU subset (``--authors`` authors, 20 QA pairs each), then forgets the last
``--forget-authors`` authors with each method from the same fine-tuned weights, and prints wall clock, answer loss on
the forget and retain rows, and (when ``hf_unlearn.eval.tofu.evaluate_tofu`` is available) forget probability,
ROUGE-L, truth ratio, forget quality and model utility, plus the time ratios against MASC.

    PYTHONPATH=. python benchmarks/bench_methods.py                       # tiny Llama built locally (minutes on CPU)
    PYTHONPATH=. python benchmarks/bench_methods.py --model ../shared/models/SmolLM2-135M-Instruct \\
        --authors 20 --forget-authors 2 --finetune-epochs 5 --lr 1e-5 --masc-lr 1e-5   # the issue's setting (GPU)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "data"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Hub id / local folder / GGUF (default: tiny Llama built locally)")
    p.add_argument("--authors", type=int, default=4)
    p.add_argument("--forget-authors", type=int, default=1)
    p.add_argument("--finetune-epochs", type=float, default=30.0)
    p.add_argument("--finetune-lr", type=float, default=None, help="default: 3e-3 tiny, 2e-5 otherwise")
    p.add_argument("--methods", default="masc,npo,grad_diff", help="comma list of masc,npo,npo_klr,grad_diff,simnpo")
    p.add_argument("--epochs", type=float, default=5.0, help="baseline budget in epochs over the forget set")
    p.add_argument("--masc-max-epochs", type=float, default=20.0, help="MASC's budget cap (it normally stops first)")
    p.add_argument("--lr", type=float, default=None, help="baseline learning rate (default: 1e-3 tiny, 1e-5 otherwise)")
    p.add_argument("--masc-lr", type=float, default=None, help="MASC learning rate (default: as --lr)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--alpha", type=float, default=0.2)
    p.add_argument("--probe-steps", type=int, default=2)
    p.add_argument("--eval-items", type=int, default=20, help="max items per split for evaluate_tofu")
    p.add_argument("--eval-max-new-tokens", type=int, default=200, help="generation length for ROUGE-L in evaluate_tofu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (1 is much faster on an oversubscribed CPU: threads wait on each other)")
    p.add_argument("--out", default="bench_methods_output")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def prepare(args):
    """Fine-tune once; return (model, tokenizer, forget, retain tokenised, forget_ids, retain_ids, seconds)."""
    import torch

    from hf_unlearn.data import tokenize_qa
    from hf_unlearn.demo import DemoConfig, fine_tune, load_demo_data, load_demo_model

    torch.manual_seed(args.seed)
    cfg = DemoConfig(model=args.model, output_dir=args.out, authors=args.authors, forget_authors=args.forget_authors,
                     epochs=args.finetune_epochs, learning_rate=args.finetune_lr, max_length=args.max_length,
                     seed=args.seed)
    subset, forget_ids = load_demo_data(cfg)
    model, tokenizer, name = load_demo_model(cfg, [r["question"] + " " + r["answer"] for r in subset])
    data = tokenize_qa(subset, tokenizer, max_length=args.max_length)
    fset = set(forget_ids)
    forget = data.filter(lambda r: r["id"] in fset)
    retain = data.filter(lambda r: r["id"] not in fset)
    cache = Path(args.out) / "finetuned-model"
    seconds = 0.0
    if (cache / "config.json").exists():  # same --out and settings: reuse the fine-tuned weights
        from hf_unlearn.models import load_model

        model = load_model(cache)
        name += f" (fine-tuned weights reused from {cache})"
    else:
        start = time.perf_counter()
        fine_tune(cfg, model, tokenizer, data, Path(args.out) / "finetune")
        seconds = time.perf_counter() - start
        model.save_pretrained(cache)
    retain_ids = [i for i in subset["id"] if i not in fset]
    return model, tokenizer, name, forget, retain, forget_ids, retain_ids, seconds


def run_method(method, args, base_model, tokenizer, forget, retain):
    from hf_unlearn.methods import (
        GradDiffConfig,
        GradDiffTrainer,
        MASCConfig,
        MASCTrainer,
        NPOConfig,
        NPOTrainer,
        SimNPOConfig,
        SimNPOTrainer,
    )

    tiny = args.model is None
    lr = args.lr or (1e-3 if tiny else 1e-5)
    common = dict(output_dir=str(Path(args.out) / method), per_device_train_batch_size=args.batch_size,
                  per_device_eval_batch_size=8, learning_rate=lr, save_strategy="no", report_to=[], logging_steps=5,
                  disable_tqdm=True, seed=args.seed, max_length=args.max_length, num_train_epochs=args.epochs)
    if method == "masc":
        config = MASCConfig(**{**common, "learning_rate": args.masc_lr or lr, "num_train_epochs": args.masc_max_epochs},
                            alpha=args.alpha, probe_steps=args.probe_steps, k=10)
        cls = MASCTrainer
    else:
        cls, config = {
            "npo": (NPOTrainer, lambda: NPOConfig(**common)),
            "npo_klr": (NPOTrainer, lambda: NPOConfig(**common, retain_loss="kl")),
            "grad_diff": (GradDiffTrainer, lambda: GradDiffConfig(**common)),
            "simnpo": (SimNPOTrainer, lambda: SimNPOConfig(**common)),
        }[method]
        config = config()
    model = copy.deepcopy(base_model)
    trainer = cls(model=model, args=config, forget_dataset=forget, retain_dataset=retain, processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    return trainer, seconds


def evaluate(model, tokenizer, forget, retain, forget_ids, retain_ids, eval_items, max_new_tokens=200):
    from hf_unlearn.demo import mean_answer_loss

    row = {"forget_loss": mean_answer_loss(model, tokenizer, forget),
           "retain_loss": mean_answer_loss(model, tokenizer, retain)}
    try:
        from hf_unlearn.eval.tofu import evaluate_tofu
    except ImportError:
        return row
    result = evaluate_tofu(model, tokenizer, forget_ids=forget_ids, retain_ids=retain_ids, max_items=eval_items,
                           max_new_tokens=max_new_tokens, progress=False)
    keys = ("forget_probability", "forget_rouge_l", "forget_truth_ratio", "forget_quality", "model_utility")
    # forget_quality is None without a retain-only reference model's result
    row.update({k: float(result.summary[k]) for k in keys if result.summary.get(k) is not None})
    return row


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    if all("forget_quality" in r and "model_utility" in r for r in rows):
        x, y = "forget_quality", "model_utility"
    elif all("forget_probability" in r and "model_utility" in r for r in rows):
        x, y = "forget_probability", "model_utility"
    else:
        x, y = "forget_loss", "retain_loss"
    fig, ax = plt.subplots(figsize=(5, 4))
    for r in rows:
        ax.scatter(r[x], r[y], s=20 + 4 * r["seconds"])
        ax.annotate(f"{r['method']} ({r['seconds']:.0f} s)", (r[x], r[y]), fontsize=8)
    ax.set_xlabel(x + {"forget_loss": " (higher = more forgotten)",
                       "forget_probability": " (lower = more forgotten)"}.get(x, ""))
    ax.set_ylabel(y + (" (lower = better kept)" if y == "retain_loss" else ""))
    ax.set_title("forget/retain trade-off (marker size ~ wall clock)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok, name, forget, retain, forget_ids, retain_ids, ft_seconds = prepare(args)
    print(f"model {name}; {len(forget)} forget rows, {len(retain)} retain rows; fine-tuned in {ft_seconds:.1f} s")
    rows = [{"method": "fine-tuned", "seconds": 0.0, "steps": 0,
             **evaluate(model, tok, forget, retain, forget_ids, retain_ids, args.eval_items, args.eval_max_new_tokens)}]
    print(json.dumps(rows[0]), flush=True)
    for method in args.methods.split(","):
        trainer, seconds = run_method(method, args, model, tok, forget, retain)
        row = {"method": trainer.unlearning_card_info()["method"], "seconds": seconds,
               "steps": trainer.state.global_step}
        if method == "masc":
            row["stopped_step"] = trainer.stopped_step
        row.update(evaluate(trainer.model, tok, forget, retain, forget_ids, retain_ids, args.eval_items,
                            args.eval_max_new_tokens))
        rows.append(row)
        print(json.dumps(row), flush=True)
        # written after every method so that a run stopped early still leaves its finished rows
        (out / "bench_methods.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
        del trainer

    keys = [k for k in rows[0] if k not in ("method",)]
    print("\n| " + " | ".join(["method", *keys]) + " |")
    print("|" + "---|" * (len(keys) + 1))
    for r in rows:
        print("| " + " | ".join([r["method"], *(f"{r.get(k):.3f}" if isinstance(r.get(k), float) else str(r.get(k))
                                               for k in keys)]) + " |")
    masc = next((r for r in rows if r["method"] == "MASC"), None)
    if masc:
        for r in rows[1:]:
            if r is not masc:
                print(f"wall clock {r['method']} / MASC = {r['seconds'] / masc['seconds']:.2f}x "
                      f"({r['seconds']:.1f} s vs {masc['seconds']:.1f} s)")
    (out / "bench_methods.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    plot(rows, out / "tradeoff.png")
    print(f"wrote {out / 'bench_methods.json'} and {out / 'tradeoff.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
