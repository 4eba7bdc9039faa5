"""Robustness of approximate unlearning against the exact deletion of the same rows: relearning curves (recovery
fraction per step), 4/8-bit quantisation, paraphrased questions and a hidden-state probe, side by side in one run.

Setting (the fair benchmark's, benchmarks/README.md "The fair comparison of issues #15/#16"): a tiny Llama fine-tuned
on the first ``--authors`` TOFU authors (30 epochs, lr 3e-3), forget the last ``--forget-authors``; each method at its
lr chosen there (MASC 3e-3 stopping itself at violation rate <= 0.2, NPO 3e-3, GradDiff 1e-3, RMU 3e-3, fixed budget of
5 epochs, batch 4, constant lr, 20% of the forget rows held out). The fine-tune is recorded with
``TraceRecordingTrainer``, so the **exact deletion** is the library's trace-preserving replay without the forget rows.
Every model is attacked with the same seed, so the relearned half and the measured half are the same rows for all.

    python benchmarks/bench_robustness.py [--out DIR] [--methods masc:3e-3,npo:3e-3,grad_diff:1e-3,rmu:3e-3]
        [--relearn-on half,paraphrased] [--conventions-method grad_diff]

``--relearn-on``: the relearning sources compared (``half``: the other half of the forget rows, today's; ``paraphrased``:
TOFU's paraphrased questions and answers of every forget row, measured on every forget row). ``--conventions-method``:
the unlearned model whose TOFU metrics are computed under hf_unlearn's defaults, under ``--preset open-unlearning`` and
with each convention of the preset alone (``none`` skips it).

Writes OUT/bench_robustness.json, .md and recovery.png.
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
    p.add_argument("--out", default=bench_output_dir("robustness"))
    p.add_argument("--model", default=None, help="Hub id / local folder / GGUF (default: tiny Llama built locally)")
    p.add_argument("--authors", type=int, default=6)
    p.add_argument("--forget-authors", type=int, default=2)
    p.add_argument("--finetune-epochs", type=float, default=30.0)
    p.add_argument("--finetune-lr", type=float, default=None, help="default: 3e-3 tiny, 2e-5 otherwise")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--methods", default="masc:3e-3,npo:3e-3,grad_diff:1e-3,rmu:3e-3", help="METHOD:LR,...")
    p.add_argument("--epochs", type=float, default=5.0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--validation-fraction", type=float, default=0.2)
    p.add_argument("--alpha", type=float, default=0.2)
    p.add_argument("--check-every", type=int, default=2)
    p.add_argument("--steps", default="0,10,25,50")
    p.add_argument("--relearn-lr", type=float, default=1e-3)
    p.add_argument("--bits", default="4,8")
    p.add_argument("--seed", type=int, default=0, help="unlearning and attack seed")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--relearn-on", default="half", help="comma list of relearning sources: half, paraphrased")
    p.add_argument("--in-context-rows", type=int, default=4)
    p.add_argument("--conventions-method", default="none",
                   help="method whose TOFU metrics are compared under the default and the preset (none: skip)")
    p.add_argument("--conventions-max-new-tokens", type=int, default=64)
    return p.parse_args(argv)


def conventions_table(model, tok, forget_ids, retain_ids, max_new_tokens: int) -> tuple[str, dict]:
    """TOFU metrics of ``model`` under hf_unlearn's defaults, under the open-unlearning preset, and with each of the
    preset's conventions alone; a markdown table (metric rows, one column per setting) and the raw summaries."""
    from hf_unlearn.eval.tofu import evaluate_tofu
    from hf_unlearn.presets import evaluation_preset

    preset = evaluation_preset("open-unlearning", "tofu")
    settings = {"default": {}, "open-unlearning preset": preset}
    settings.update({f"only {k}={v}": {k: v} for k, v in preset.items() if k != "max_length"})  # 512 either way
    common = dict(forget_ids=forget_ids, retain_ids=retain_ids, max_new_tokens=max_new_tokens, progress=False,
                  mia_attacks=["loss", "zlib", "min_k", "min_k_plus_plus"])
    summaries = {}
    for name, kw in settings.items():
        started = time.process_time()
        summaries[name] = evaluate_tofu(model, tok, **common, **kw).summary
        print(f"conventions: {name} in {time.process_time() - started:.0f} s CPU", flush=True)
    keys = ["model_utility", "forget_probability", "forget_rouge_l", "forget_truth_ratio", "forget_extraction_strength",
            "forget_exact_memorization", "retain_probability", "retain_rouge_l", "retain_extraction_strength",
            "mia_loss_auc", "mia_zlib_auc", "mia_min_k_auc", "mia_min_k_plus_plus_auc"]
    names = list(settings)
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join("n/a" if summaries[n].get(k) is None else f"{summaries[n][k]:.4g}"
                                               for n in names) + " |")
    return "\n".join(lines) + "\n", summaries


def prepare(args):
    """The recorded fine-tune (cached in OUT) and its exact deletion of the forget rows."""
    from hf_unlearn import forget
    from hf_unlearn.data import tokenize_qa
    from hf_unlearn.demo import DemoConfig, fine_tune, load_demo_data, load_demo_model
    from hf_unlearn.models import load_model, load_tokenizer
    from hf_unlearn.trace import TraceRecordingTrainer

    out = Path(args.out)
    cfg = DemoConfig(model=args.model, output_dir=args.out, authors=args.authors, forget_authors=args.forget_authors,
                     epochs=args.finetune_epochs, learning_rate=args.finetune_lr, max_length=args.max_length, seed=0)
    subset, forget_ids = load_demo_data(cfg)
    cache = out / "finetuned-model"
    if (cache / "config.json").exists():
        model, tok = load_model(cache), load_tokenizer(cache)
    else:
        model, tok, _ = load_demo_model(cfg, [r["question"] + " " + r["answer"] for r in subset])
        started = time.perf_counter()
        fine_tune(cfg, model, tok, tokenize_qa(subset, tok, max_length=args.max_length), out / "finetune",
                  trainer_cls=TraceRecordingTrainer, trace_checkpoint_steps=50)
        print(f"recorded fine-tune in {time.perf_counter() - started:.0f} s", flush=True)
        model.save_pretrained(cache)
        tok.save_pretrained(cache)
    exact_dir = out / "exact"
    if not (exact_dir / "model" / "config.json").exists():
        started = time.perf_counter()
        receipt = forget(out / "finetune" / "trace", forget_ids, exact_dir, tokenizer=tok, progress=False,
                         overwrite=True, log=lambda m: None)
        if not receipt.ok:
            sys.exit("the exact deletion did not verify; see " + str(exact_dir / "receipt.json"))
        print(f"exact deletion (replay) in {time.perf_counter() - started:.0f} s", flush=True)
    exact = load_model(exact_dir / "model")
    data = tokenize_qa(subset, tok, max_length=args.max_length)
    fset = set(forget_ids)
    return model.eval(), exact.eval(), tok, data.filter(lambda r: r["id"] in fset), \
        data.filter(lambda r: r["id"] not in fset), forget_ids


def unlearn(name: str, lr: float, args, model, tok, forget, retain):
    from hf_unlearn.methods.registry import get_method

    method = get_method(name)
    common = dict(output_dir=str(Path(args.out) / "runs" / f"{name}_lr{lr:g}"), per_device_train_batch_size=args.batch_size,
                  learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, save_strategy="no", report_to=[],
                  logging_steps=50, disable_tqdm=True, seed=args.seed, max_length=args.max_length,
                  num_train_epochs=args.epochs, validation_fraction=args.validation_fraction)
    if method.stops_itself:
        common.update(alpha=args.alpha, probe_steps=args.check_every, probe_size=0)
    trainer = method.trainer_class(model=copy.deepcopy(model), args=method.make_config(**common),
                                   forget_dataset=forget, retain_dataset=retain, processing_class=tok)
    started = time.process_time()
    trainer.train()
    label = trainer.unlearning_card_info()["method"]
    return trainer.accelerator.unwrap_model(trainer.model).eval(), label, trainer.state.global_step, \
        time.process_time() - started


def main(argv=None) -> int:
    import torch

    from hf_unlearn.eval.plots import plot_recovery_curves
    from hf_unlearn.eval.robustness import evaluate_robustness, tofu_robustness_rows

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    finetuned, exact, tok, forget, retain, forget_ids = prepare(args)
    sets = tofu_robustness_rows("forget10", forget_ids=forget_ids, retain_ids=list(retain["id"]))
    steps = [int(k) for k in args.steps.split(",")]
    bits = [int(b) for b in args.bits.split(",") if b.strip()]
    rows = sets["forget"]
    attack = dict(original=finetuned, holdout_rows=sets["holdout"], probe_rows=sets["retain"], steps=steps, learning_rate=args.relearn_lr, bits=bits,
                  seed=args.seed, max_length=args.max_length, progress=False, in_context_rows=args.in_context_rows)
    sources = [s.strip() for s in args.relearn_on.split(",") if s.strip()]
    results, related, runs, conventions = {}, {}, {}, None

    def attack_all(key, model):
        started = time.process_time()
        results[key] = evaluate_robustness(model, tok, rows, **attack)
        for source in sources[1:]:  # the other relearning sources: the relearning attack alone
            related[(key, source)] = evaluate_robustness(model, tok, rows, **{**attack, "attacks": ["relearning"]},
                                                         relearn_rows=None if source == "half" else source)
        runs[key] = {**runs.get(key, {}), "attack_cpu_s": time.process_time() - started}

    attack_all("exact deletion", exact)
    for spec in args.methods.split(","):
        name, _, lr = spec.partition(":")
        model, label, steps_run, cpu = unlearn(name, float(lr), args, finetuned, tok, forget, retain)
        key = f"{label} lr {float(lr):g}"
        runs[key] = {"unlearning_steps": steps_run, "unlearning_cpu_s": cpu}
        attack_all(key, model)
        print(f"{key}: {steps_run} steps, recovery {results[key].curves()['model']}", flush=True)
        if name == args.conventions_method:
            conventions = conventions_table(model, tok, forget_ids, list(retain["id"]),
                                            args.conventions_max_new_tokens)

    header = ["model", "forget prob."] + [f"recovery @{k}" for k in steps] + \
        [f"recovery @{steps[-1]} / exact's", f"held-out prob. @{steps[-1]} / exact's"] + \
        [f"{b}-bit recovery" for b in bits] + ["paraphrase prob.", "membership probe", "truth probe"]
    exact_last = results["exact deletion"].summary["models"]["model"]["relearning"][-1]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def f(x):
        return "n/a" if x is None else f"{x:.3g}"

    def ratio(a, b):
        return None if a is None or not b else a / b

    for key, r in results.items():
        m = r.summary["models"]["model"]
        last = m["relearning"][-1]
        cells = [key, f(m["forget"]["probability"])] + [f(p["recovery"]) for p in m["relearning"]]
        cells += [f(ratio(last["recovery"], exact_last["recovery"])),
                  f(ratio(last["probability"], exact_last["probability"]))]
        cells += [f(m["quantization"][str(b)]["recovery"]) for b in bits]
        cells += [f(m.get("paraphrase", {}).get("probability")), f(m.get("probe", {}).get("max")),
                  f(m.get("truth_probe", {}).get("max"))]
        lines.append("| " + " | ".join(cells) + " |")
    orig = results["exact deletion"].summary["models"]["original"]
    lines.append(f"\nfine-tuned (before unlearning): forget probability {orig['forget']['probability']:.3g}, "
                 f"measured half {orig['evaluated_half']['probability']:.3g}, paraphrased "
                 f"{orig.get('paraphrase', {}).get('probability', float('nan')):.3g}, membership probe "
                 f"{orig.get('probe', {}).get('max', float('nan')):.3g}, truth probe "
                 f"{orig.get('truth_probe', {}).get('max', float('nan')):.3g}")
    table = "\n".join(lines) + "\n"
    if related:
        head = ["model", "relearned on"] + [f"recovery @{k}" for k in steps] + [f"held-out prob. @{steps[-1]}",
                                                                              "in-context prob. (recovery)"]
        rel = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for key, r in results.items():
            m = r.summary["models"]["model"]
            icl = m.get("in_context") or {}
            for source, res in [(sources[0], r)] + [(s, related[(key, s)]) for s in sources[1:]]:
                curve = res.summary["models"]["model"]["relearning"]
                rel.append("| " + " | ".join([key, source] + [f(p["recovery"]) for p in curve] + [
                    f(curve[-1]["probability"]),
                    f"{f(icl.get('probability'))} ({f(icl.get('recovery'))})" if source == sources[0] else ""]) + " |")
        table += "\n" + "\n".join(rel) + "\n"
    if conventions:
        table += f"\nTOFU metrics of {args.conventions_method} under each convention:\n\n" + conventions[0]
    print(table)
    out = Path(args.out)
    payload = {"args": vars(args), "runs": runs, "results": {k: r.to_dict() for k, r in results.items()},
               "related": {f"{k} | {s}": r.to_dict() for (k, s), r in related.items()},
               "conventions": conventions[1] if conventions else None}
    (out / "bench_robustness.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "bench_robustness.md").write_text(table)
    print(f"wrote {plot_recovery_curves(results, out / 'recovery.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
