"""Approximate unlearning side by side: MASC until it stops vs the baselines at a fixed budget.

Fine-tunes a model on a TOFU subset (``--authors`` authors, 20 QA pairs each), then forgets the last
``--forget-authors`` authors with each method from the same fine-tuned weights, and prints wall clock, answer loss on
the forget and retain rows, and (when ``hf_unlearn.eval.tofu.evaluate_tofu`` is available) forget probability,
ROUGE-L, truth ratio, forget quality and model utility, plus the time ratios against MASC.

    PYTHONPATH=. python benchmarks/bench_methods.py                       # tiny Llama built locally (minutes on CPU)

A method may carry its own learning rate (``--methods masc@1e-4,npo@1e-5,npo@5e-5``: a small lr sweep). With
``--reference train`` it also fine-tunes the retain-only reference (the same base, the retained authors only) and
reports forget quality (KS test of forget truth ratios against the reference's); ``--reference-only`` does just that
(to run it in a second process beside the methods), and ``--reference PATH`` reuses its ``tofu_results.json``.
Every evaluated model's full result is kept in ``OUT/results/<label>.json``; ``--table-only`` rebuilds the table,
ratios and plot from them (for example once a reference finished in another process).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

from hf_unlearn.runtime import bench_output_dir

os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "data"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Hub id / local folder / GGUF (default: tiny Llama built locally)")
    p.add_argument("--authors", type=int, default=4)
    p.add_argument("--forget-authors", type=int, default=1)
    p.add_argument("--finetune-epochs", type=float, default=30.0)
    p.add_argument("--finetune-lr", type=float, default=None, help="default: 3e-3 tiny, 2e-5 otherwise")
    p.add_argument("--methods", default="masc,npo,grad_diff",
                   help="comma list of registered methods (hf_unlearn.methods.registry), each optionally METHOD@LR")
    p.add_argument("--epochs", type=float, default=5.0, help="baseline budget in epochs over the forget set")
    p.add_argument("--masc-max-epochs", type=float, default=20.0, help="MASC's budget cap (it normally stops first)")
    p.add_argument("--lr", type=float, default=None, help="baseline learning rate (default: 1e-3 tiny, 1e-5 otherwise)")
    p.add_argument("--masc-lr", type=float, default=None, help="MASC learning rate (default: as --lr)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--alpha", type=float, default=0.2)
    p.add_argument("--probe-steps", type=int, default=2)
    p.add_argument("--probe-size", type=int, default=8, help="MASC probe rows; 0 = probe on the training batches")
    p.add_argument("--masc-retain-loss", default="kl", choices=("kl", "ce", "none"), help="MASC's retain term")
    p.add_argument("--eval-items", type=int, default=20, help="max items per split for evaluate_tofu")
    p.add_argument("--eval-forget-items", type=int, default=None,
                   help="max forget items (default: as --eval-items; forget quality wants them all)")
    p.add_argument("--reference", default=None,
                   help="'train' (fine-tune the retain-only reference here) or the path of its tofu_results.json")
    p.add_argument("--no-base-eval", action="store_true",
                   help="skip evaluating the fine-tuned model (another process sharing its weights already did)")
    p.add_argument("--reference-only", action="store_true", help="only fine-tune and evaluate the reference")
    p.add_argument("--table-only", action="store_true", help="rebuild table/ratios/plot from OUT/bench_methods.json")
    p.add_argument("--merge", nargs="*", default=[],
                   help="with --table-only: also take the method rows of these bench_methods.json files (runs of the "
                        "same fine-tuned model in other processes)")
    p.add_argument("--eval-max-new-tokens", type=int, default=200, help="generation length for ROUGE-L in evaluate_tofu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (1 is much faster on an oversubscribed CPU: threads wait on each other)")
    p.add_argument("--out", default=bench_output_dir("methods"), help="output folder, outside the repo (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def prepare(args, retain_only: bool = False):
    """Fine-tune once (cached in OUT); return the model, tokenizer, data and ids.

    ``retain_only`` fine-tunes the retain-only reference instead: the same base and settings, without the forget rows.
    """
    import torch

    from hf_unlearn.data import tokenize_qa
    from hf_unlearn.demo import DemoConfig, fine_tune, load_demo_data, load_demo_model

    torch.manual_seed(args.seed)
    cfg = DemoConfig(model=args.model, output_dir=args.out, authors=args.authors, forget_authors=args.forget_authors,
                     epochs=args.finetune_epochs, learning_rate=args.finetune_lr, max_length=args.max_length,
                     seed=args.seed)
    subset, forget_ids = load_demo_data(cfg)
    tag = "reference-model" if retain_only else "finetuned-model"
    cache = Path(args.out) / tag
    cached = (cache / "config.json").exists() and (cache / "tokenizer_config.json").exists()
    if cached:  # same --out and settings: reuse the fine-tuned weights (the base model is not loaded)
        from hf_unlearn.models import load_model, load_tokenizer

        model, tokenizer = load_model(cache), load_tokenizer(cache)
        name = f"{args.model or 'tiny Llama'} (fine-tuned weights reused from {cache})"
    else:
        model, tokenizer, name = load_demo_model(cfg, [r["question"] + " " + r["answer"] for r in subset])
    data = tokenize_qa(subset, tokenizer, max_length=args.max_length)
    fset = set(forget_ids)
    forget = data.filter(lambda r: r["id"] in fset)
    retain = data.filter(lambda r: r["id"] not in fset)
    seconds = 0.0
    if not cached:
        start = time.perf_counter()
        fine_tune(cfg, model, tokenizer, retain if retain_only else data, Path(args.out) / tag.replace("-model", ""))
        seconds = time.perf_counter() - start
        model.save_pretrained(cache)
        tokenizer.save_pretrained(cache)
    retain_ids = [i for i in subset["id"] if i not in fset]
    return model, tokenizer, name, forget, retain, forget_ids, retain_ids, seconds


def spec_slug(spec: str) -> str:
    """``"npo@5e-5"`` -> ``"npo_lr5e-5"``: the run's folder and result-file name."""
    return spec.strip().replace("@", "_lr")


def parse_method(spec: str, args) -> tuple[str, float]:
    """``"npo@5e-5"`` -> ("npo", 5e-5); without ``@`` the lr is --masc-lr / --lr / the size default."""
    name, _, lr = spec.strip().partition("@")
    default = args.lr or (1e-3 if args.model is None else 1e-5)
    if not lr and name == "masc" and args.masc_lr:
        lr = args.masc_lr
    return name, float(lr) if lr else default


def run_method(spec, args, base_model, tokenizer, forget, retain):
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.methods.registry import get_method

    method, lr = parse_method(spec, args)
    try:
        registered = get_method(method)
    except UnlearnError as e:
        raise SystemExit(f"--methods: {e}") from None
    common = dict(output_dir=str(Path(args.out) / spec_slug(spec)), per_device_train_batch_size=args.batch_size,
                  per_device_eval_batch_size=8, learning_rate=lr, save_strategy="no", report_to=[], logging_steps=5,
                  disable_tqdm=True, seed=args.seed, max_length=args.max_length, num_train_epochs=args.epochs)
    if method == "masc":
        config = registered.make_config(**{**common, "num_train_epochs": args.masc_max_epochs},
                                        alpha=args.alpha, probe_steps=args.probe_steps, probe_size=args.probe_size,
                                        k=10, retain_loss=args.masc_retain_loss)
    else:
        config = registered.make_config(**common)
    cls = registered.trainer_class
    model = copy.deepcopy(base_model)
    trainer = cls(model=model, args=config, forget_dataset=forget, retain_dataset=retain, processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    return trainer, seconds, lr


def evaluate(model, tokenizer, forget, retain, forget_ids, retain_ids, args, label):
    """Answer losses, and the TOFU metrics (full result kept in OUT/results/<label>.json)."""
    from hf_unlearn.demo import mean_answer_loss
    from hf_unlearn.eval.tofu import evaluate_tofu

    row = {"forget_loss": mean_answer_loss(model, tokenizer, forget),
           "retain_loss": mean_answer_loss(model, tokenizer, retain)}
    caps = {k: args.eval_items for k in ("forget", "retain", "real_authors", "world_facts", "holdout")}
    caps["forget"] = caps["holdout"] = args.eval_forget_items or args.eval_items
    result = evaluate_tofu(model, tokenizer, forget_ids=forget_ids, retain_ids=retain_ids, max_items=caps,
                           max_new_tokens=args.eval_max_new_tokens, progress=False)
    row["result"] = str(result.to_json(Path(args.out) / "results" / f"{label}.json"))
    row.update(summary_metrics(result))
    return row


SUMMARY_KEYS = ("forget_probability", "forget_rouge_l", "forget_truth_ratio", "forget_quality", "model_utility")


def summary_metrics(result) -> dict:
    # forget_quality is None without a retain-only reference model's result
    return {k: float(result.summary[k]) for k in SUMMARY_KEYS if result.summary.get(k) is not None}


def add_forget_quality(rows, reference_path):
    """Fill forget quality (and privleak) of every row from its saved result and the reference's; the reference
    itself becomes a row (what a model that never saw the forget rows scores)."""
    from hf_unlearn.eval.tofu import TofuResult

    if not any(r["method"] == "retain-only reference" for r in rows):
        rows.insert(1, {"method": "retain-only reference", "seconds": 0.0, "steps": 0, "result": str(reference_path)})
    for r in rows:
        if r.get("result") and Path(r["result"]).is_file():
            res = TofuResult.from_json(r["result"]).with_reference(reference_path)
            r.update(summary_metrics(res))
            r["privleak"] = res.summary.get("privleak")


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
    fig, ax = plt.subplots(figsize=(10, 5))
    for i, r in enumerate(rows):
        marker = "o" if r["method"].startswith("MASC") else "*" if not r.get("seconds") else "s"
        ax.scatter(r[x], r[y], s=30 + 1.5 * r.get("seconds", 0), alpha=0.6, marker=marker, color=plt.cm.tab20(i % 20),
                   label=f"{r['method']} ({r.get('seconds', 0):.0f} s)")
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=7, markerscale=0.5)
    if x == "forget_quality":
        ax.set_xscale("log")  # a KS p-value: orders of magnitude apart
    ax.set_xlabel(x + {"forget_loss": " (higher = more forgotten)", "forget_quality": " (higher = closer to retain-only)",
                       "forget_probability": " (lower = more forgotten)"}.get(x, ""))
    ax.set_ylabel(y + (" (lower = better kept)" if y == "retain_loss" else ""))
    ax.set_title("forget/retain trade-off (marker area ~ wall clock; o MASC, s baselines)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_table(rows, out: Path):
    keys = [k for k in ("seconds", "steps", "stopped_step", "lr", *SUMMARY_KEYS, "privleak", "forget_loss",
                        "retain_loss") if any(k in r for r in rows)]
    print("\n| " + " | ".join(["method", *keys]) + " |")
    print("|" + "---|" * (len(keys) + 1))
    for r in rows:
        cells = [f"{r.get(k):.3g}" if isinstance(r.get(k), float) else str(r.get(k, "-")) for k in keys]
        print("| " + " | ".join([r["method"], *cells]) + " |")
    for masc in (r for r in rows if r["method"].startswith("MASC")):
        for r in rows:
            if not r["method"].startswith("MASC") and r.get("seconds"):
                print(f"wall clock {r['method']} / {masc['method']} = {r['seconds'] / masc['seconds']:.2f}x "
                      f"({r['seconds']:.1f} s vs {masc['seconds']:.1f} s; steps {r['steps']} vs {masc['steps']})")
    plot(rows, out / "tradeoff.png")
    print(f"wrote {out / 'bench_methods.json'} and {out / 'tradeoff.png'}")


def save(out: Path, args, rows):
    # written after every model so that a run stopped early still leaves its finished rows
    (out / "bench_methods.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


def reference_path(args) -> Path | None:
    if args.reference in (None, "train"):
        path = Path(args.out) / "results" / "reference.json"
        return path if path.is_file() else None
    return Path(args.reference)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        rows = json.loads((out / "bench_methods.json").read_text())["rows"]
        for other in args.merge:
            seen = {r["method"] for r in rows}
            rows += [r for r in json.loads(Path(other).read_text())["rows"] if r["method"] not in seen]
        ref = reference_path(args)
        if ref:
            add_forget_quality(rows, ref)
            save(out, args, rows)
        print_table(rows, out)
        return 0
    if args.reference_only or args.reference == "train":
        model, tok, name, forget, retain, forget_ids, retain_ids, ft_seconds = prepare(args, retain_only=True)
        print(f"reference {name}: {len(retain)} retain rows only; fine-tuned in {ft_seconds:.1f} s", flush=True)
        row = evaluate(model, tok, forget, retain, forget_ids, retain_ids, args, "reference")
        print(json.dumps({"method": "retain-only reference", **row}), flush=True)
        if args.reference_only:
            return 0
        del model
    model, tok, name, forget, retain, forget_ids, retain_ids, ft_seconds = prepare(args)
    print(f"model {name}; {len(forget)} forget rows, {len(retain)} retain rows; fine-tuned in {ft_seconds:.1f} s")
    rows = []
    if not args.no_base_eval:
        rows.append({"method": "fine-tuned", "seconds": 0.0, "steps": 0,
                     **evaluate(model, tok, forget, retain, forget_ids, retain_ids, args, "fine-tuned")})
        print(json.dumps(rows[0]), flush=True)
        save(out, args, rows)
    for spec in args.methods.split(","):
        trainer, seconds, lr = run_method(spec, args, model, tok, forget, retain)
        variant = ""
        if spec.startswith("masc"):
            variant += ", batch probe" if args.probe_size == 0 else ""
            variant += f", probe every {args.probe_steps}" if args.probe_steps != 2 else ""
            variant += f", retain {args.masc_retain_loss}" if args.masc_retain_loss != "kl" else ""
        variant += f", seed {args.seed}" if args.seed else ""
        label = f"{trainer.unlearning_card_info()['method']} (lr {lr:g}{variant})"
        row = {"method": label, "seconds": seconds, "steps": trainer.state.global_step, "lr": lr}
        if spec.startswith("masc"):
            row["stopped_step"] = trainer.stopped_step
            row["violation_history"] = trainer.violation_history
        row.update(evaluate(trainer.model, tok, forget, retain, forget_ids, retain_ids, args,
                            spec_slug(spec)))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "violation_history"}), flush=True)
        save(out, args, rows)
        del trainer
    ref = reference_path(args)
    if ref:
        add_forget_quality(rows, ref)
        save(out, args, rows)
    else:
        print("no reference result yet: forget quality n/a (rerun with --table-only once it exists)")
    print_table(rows, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
