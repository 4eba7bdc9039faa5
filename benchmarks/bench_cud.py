"""CUD on a real model: does circuit-guided difficulty, measured before unlearning, predict what unlearning leaves?

Stages, each cached in --out (a stopped run resumes where it was):

1. fine-tune MODEL on the first ``--authors`` TOFU authors; the last ``--forget-authors`` are the forget set;
2. EAP-IG circuits of every forget sample, timed, beside the time of one plain forward+backward of the same rows;
3. agreement of EAP-IG with real edge patching on ``--patch-samples`` samples (top-|score| edges and random edges);
4. anchors: unlearn the whole forget set with each ``--anchor-methods`` run, per-sample answer loss afterwards;
5. CUD of every forget sample and its Spearman correlation with the anchor runs' post-unlearning loss on the samples
   that are not anchors, beside the trivial predictor "loss before unlearning";
6. easy / hard / random forget sets of ``--set-size`` (anchors excluded), each unlearned with every ``--set-methods``
   method and ``--seeds`` seed at the same budget: unlearning efficacy ``UE = 100 * (1 - mean answer probability)`` on
   the set (answer probability = exp(-mean answer-token NLL)), and the retain loss;
7. a table, ``cud_results.json`` and plots (CUD vs loss, circuit statistics, UE by set).

    PYTHONPATH=. python benchmarks/bench_cud.py                    # tiny Llama built locally: a smoke run (minutes)
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
    p.add_argument("--authors", type=int, default=5)
    p.add_argument("--forget-authors", type=int, default=3)
    p.add_argument("--finetune-epochs", type=float, default=None, help="default: 30 tiny, 4 otherwise")
    p.add_argument("--finetune-lr", type=float, default=None, help="default: 3e-3 tiny, 1e-4 otherwise")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--ig-steps", type=int, default=5)
    p.add_argument("--top-edges", type=int, default=None, help="edges per circuit (default: 20 tiny, 75 as the paper)")
    p.add_argument("--baseline", choices=["corrupted", "zero"], default="corrupted")
    p.add_argument("--circuit-batch-size", type=int, default=4)
    p.add_argument("--similarity", default="cosine", choices=["cosine", "jaccard", "hamming"])
    p.add_argument("--anchor-methods", default=None,
                   help="METHOD[@LR],... (default: grad_diff,npo,masc with 1e-3 tiny / grad_diff@2e-5,npo@5e-5,masc@5e-5)")
    p.add_argument("--anchor-epochs", type=float, default=3.0)
    p.add_argument("--anchor-fraction", type=float, default=0.2)
    p.add_argument("--set-size", type=int, default=8)
    p.add_argument("--set-methods", default=None, help="METHOD[@LR],... (default: as --anchor-methods)")
    p.add_argument("--set-epochs", type=float, default=5.0)
    p.add_argument("--seeds", default="0,1", help="training seeds of the set runs (and random-set draws)")
    p.add_argument("--batch-size", type=int, default=4, help="forget (and retain) rows per unlearning step")
    p.add_argument("--patch-samples", type=int, default=2)
    p.add_argument("--patch-top", type=int, default=20)
    p.add_argument("--patch-random", type=int, default=40)
    p.add_argument("--report-only", action="store_true",
                   help="train nothing new: report the set runs already in --out (whole easy/hard/random triples)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (1 on a shared CPU)")
    p.add_argument("--out", default=bench_output_dir("cud"), help="output folder, outside the repo (default: %(default)s)")
    p.add_argument("--figures", default=None, help="also copy the plots here with this prefix (e.g. benchmarks/cud_smollm2)")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def save_json(path: Path, value) -> None:
    from hf_unlearn.utils import atomic_write_text

    atomic_write_text(path, json.dumps(value, indent=1))


def tiny(args) -> bool:
    return args.model is None


# ------------------------------------------------------------------------------------------------ stage 1


def prepare(args):
    """Fine-tuned model (cached in OUT/finetuned-model), tokenizer, tokenised forget and retain rows."""
    import torch

    from hf_unlearn.data import tokenize_qa
    from hf_unlearn.demo import DemoConfig, fine_tune, load_demo_data, load_demo_model
    from hf_unlearn.models import load_model, load_tokenizer

    torch.manual_seed(0)
    cfg = DemoConfig(model=args.model, output_dir=args.out, authors=args.authors, forget_authors=args.forget_authors,
                     epochs=args.finetune_epochs or (30.0 if tiny(args) else 4.0),
                     learning_rate=args.finetune_lr or (3e-3 if tiny(args) else 1e-4), max_length=args.max_length)
    subset, forget_ids = load_demo_data(cfg)
    cache = Path(args.out) / "finetuned-model"
    cached = (cache / "config.json").exists()
    if cached:
        model, tokenizer = load_model(cache), load_tokenizer(cache)
    else:
        model, tokenizer, _ = load_demo_model(cfg, [r["question"] + " " + r["answer"] for r in subset])
    data = tokenize_qa(subset, tokenizer, max_length=args.max_length, keep_columns=("question",))
    fset = set(forget_ids)
    forget = data.filter(lambda r: r["id"] in fset)
    retain = data.filter(lambda r: r["id"] not in fset)
    if not cached:
        log(f"fine-tuning on {len(data)} rows ({cfg.epochs} epochs, lr {cfg.learning_rate})")
        start = time.perf_counter()
        fine_tune(cfg, model, tokenizer, data, Path(args.out) / "finetune")
        save_json(Path(args.out) / "finetune.json", {"seconds": time.perf_counter() - start, "rows": len(data),
                                                     "epochs": cfg.epochs, "lr": cfg.learning_rate})
        model.save_pretrained(cache)
        tokenizer.save_pretrained(cache)
    model.eval()
    return model, tokenizer, forget, retain


# ------------------------------------------------------------------------------------------------ stages 2-3


def circuits_stage(args, model, tokenizer, forget):
    import torch

    from hf_unlearn.analysis.circuits import CircuitConfig, CircuitSet, compute_circuits
    from hf_unlearn.losses import sequence_logprob

    folder = Path(args.out) / "circuits"
    if (folder / "circuits.json").exists():
        return CircuitSet.load(folder), load_json(Path(args.out) / "cost.json")
    config = CircuitConfig(ig_steps=args.ig_steps, baseline=args.baseline,
                           top_edges=args.top_edges or (20 if tiny(args) else 75),
                           batch_size=args.circuit_batch_size, max_length=args.max_length)
    log(f"EAP-IG on {len(forget)} forget samples (m = {args.ig_steps}, {args.baseline} baseline)")
    circuits = compute_circuits(model, tokenizer, forget, config)
    circuits.save(folder)
    # one plain forward+backward of the same rows, batched the same way, for scale
    from hf_unlearn.data import QACollator

    collate = QACollator.from_tokenizer(tokenizer)
    start = time.perf_counter()
    for i in range(0, len(forget), args.circuit_batch_size):
        batch = collate([{k: forget[j][k] for k in ("input_ids", "attention_mask", "labels")}
                         for j in range(i, min(i + args.circuit_batch_size, len(forget)))])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        (-sequence_logprob(logits, batch["labels"], average=True)).sum().backward()
    model.zero_grad(set_to_none=True)
    plain = (time.perf_counter() - start) / len(forget)
    cost = {"eap_ig_seconds_per_sample": circuits.seconds / len(circuits), "plain_fwd_bwd_seconds_per_sample": plain,
            "ratio": circuits.seconds / len(circuits) / plain, "passes_per_sample": config.passes_per_sample,
            "num_edges": circuits.graph.num_edges, "samples": len(circuits),
            "mean_tokens": circuits.extra.get("tokens", 0) / len(circuits), "torch_threads": torch.get_num_threads()}
    save_json(Path(args.out) / "cost.json", cost)
    return circuits, cost


def patching_stage(args, model, tokenizer, forget, circuits):
    import numpy as np
    from scipy.stats import pearsonr, spearmanr

    from hf_unlearn.analysis.circuits import edge_patching_effects

    path = Path(args.out) / "patching.json"
    if path.is_file() or args.patch_samples < 1:
        return load_json(path)
    rng = np.random.default_rng(0)
    out = []
    for k in range(min(args.patch_samples, len(forget))):
        scores = circuits.scores[k].numpy()
        top = np.argsort(-np.abs(scores))[:args.patch_top]
        rest = np.setdiff1d(np.arange(scores.size), top)
        rand = rng.choice(rest, size=min(args.patch_random, rest.size), replace=False)
        edges = [int(e) for e in np.concatenate([top, rand])]
        log(f"patching {len(edges)} edges of sample {circuits.ids[k]} for real")
        start = time.perf_counter()
        eff = edge_patching_effects(model, tokenizer, forget.select([k]), edges, circuits.config, batch_size=8)[0]
        eff = eff.numpy()
        s = scores[edges]
        n_top = len(top)
        out.append({
            "id": circuits.ids[k], "seconds": time.perf_counter() - start, "edges": len(edges),
            "spearman_abs_all": float(spearmanr(np.abs(s), np.abs(eff)).statistic),
            "pearson_all": float(pearsonr(s, eff).statistic),
            "spearman_abs_random": float(spearmanr(np.abs(s[n_top:]), np.abs(eff[n_top:])).statistic),
            "spearman_signed_random": float(spearmanr(s[n_top:], eff[n_top:]).statistic),
            "top_score_sum": float(s[:n_top].sum()), "top_effect_sum": float(eff[:n_top].sum()),
        })
    save_json(path, out)
    return out


# ------------------------------------------------------------------------------------------------ stages 4-5


def parse_methods(spec: str, default_lr: float):
    from hf_unlearn.commands.analyze import parse_methods as parse

    methods, options = parse(spec)
    return [(m, options.get(m, {}).get("learning_rate", default_lr)) for m in methods]


def default_methods(args) -> str:
    return "grad_diff,npo,masc" if tiny(args) else "grad_diff@2e-5,npo@5e-5,masc@5e-5"


def anchors_stage(args, model, tokenizer, forget, retain):
    from hf_unlearn.analysis.cud import AnchorConfig, AnchorSet, build_anchors

    folder = Path(args.out) / "anchors"
    if (folder / "anchors.json").exists():
        return AnchorSet.load(folder)
    lr = 1e-3 if tiny(args) else 1e-5
    methods = parse_methods(args.anchor_methods or default_methods(args), lr)
    config = AnchorConfig(methods=[m for m, _ in methods], epochs=args.anchor_epochs, learning_rate=lr,
                          batch_size=args.batch_size, max_length=args.max_length, fraction=args.anchor_fraction,
                          method_options={m: {"learning_rate": x} for m, x in methods})
    log(f"anchor runs: {', '.join(f'{m}@{x:g}' for m, x in methods)} on all {len(forget)} forget rows")
    anchors = build_anchors(model, tokenizer, forget, retain, config)
    anchors.save(folder)
    return anchors


# ------------------------------------------------------------------------------------------------ stage 6


def set_runs(args, model, tokenizer, forget, retain, sets_by_seed):
    from hf_unlearn.analysis.cud import answer_losses
    from hf_unlearn.methods.registry import get_method

    path = Path(args.out) / "set_runs.json"
    done = load_json(path) or []
    have = {(r["set"], r["method"], r["seed"]) for r in done}
    lr = 1e-3 if tiny(args) else 1e-5
    methods = parse_methods(args.set_methods or args.anchor_methods or default_methods(args), lr)
    rows_by_id = {r["id"]: r for r in forget}
    retain_rows = list(retain)
    retain_before = sum(answer_losses(model, tokenizer, retain_rows)) / len(retain_rows)
    for seed, sets in sets_by_seed.items():
        subsets = {name: forget.filter(lambda r, wanted=set(ids): r["id"] in wanted) for name, ids in sets.items()}
        # method-major: a run stopped early still leaves whole easy/hard/random triples to compare
        for method, mlr in methods:
            for name, subset in subsets.items():
                if (name, method, seed) in have or args.report_only:
                    continue
                before = answer_losses(model, tokenizer, [rows_by_id[i] for i in subset["id"]])
                spec = get_method(method)
                cfg = spec.make_config(output_dir=str(Path(args.out) / "runs" / f"{name}-{method}-{seed}"),
                                       num_train_epochs=args.set_epochs, learning_rate=mlr,
                                       per_device_train_batch_size=args.batch_size, max_length=args.max_length,
                                       seed=seed, save_strategy="no", report_to=[], logging_steps=10,
                                       disable_tqdm=True)
                trainer = spec.trainer_class(model=copy.deepcopy(model), args=cfg, forget_dataset=subset,
                                             retain_dataset=retain, processing_class=tokenizer)
                start = time.perf_counter()
                trainer.train()
                seconds = time.perf_counter() - start
                after = answer_losses(trainer.model, tokenizer, [rows_by_id[i] for i in subset["id"]])
                retain_after = sum(answer_losses(trainer.model, tokenizer, retain_rows)) / len(retain_rows)
                rec = {"set": name, "method": method, "lr": mlr, "seed": seed, "ids": list(subset["id"]),
                       "steps": int(trainer.state.global_step), "seconds": seconds, "loss_before": before,
                       "loss_after": after, "ue_before": ue(before), "ue_after": ue(after),
                       "retain_loss_before": retain_before, "retain_loss_after": retain_after}
                done.append(rec)
                save_json(path, done)
                log(f"  {name:6s} {method}@{mlr:g} seed {seed}: UE {rec['ue_before']:.1f} -> {rec['ue_after']:.1f}, "
                    f"retain loss {retain_before:.3f} -> {retain_after:.3f} ({seconds:.0f} s, {rec['steps']} steps)")
                del trainer
    return done


def whole_triples(runs):
    """The set runs of the (method, seed) pairs that have all of easy, hard and random: a stopped benchmark must not
    tilt one set's mean towards a method."""
    sets = {}
    for r in runs:
        sets.setdefault((r["method"], r["seed"]), set()).add(r["set"])
    return [r for r in runs if sets[(r["method"], r["seed"])] >= {"easy", "hard", "random"}]


def ue(losses) -> float:
    """Unlearning efficacy: 100 * (1 - mean answer probability), probability = exp(-mean answer-token NLL)."""
    import math

    return 100.0 * (1.0 - sum(math.exp(-x) for x in losses) / len(losses))


# ------------------------------------------------------------------------------------------------ report


def summarise(args, circuits, cost, patching, anchors, result, runs, sets_by_seed):
    import numpy as np
    from scipy.stats import spearmanr

    from hf_unlearn.analysis.cud import cud_correlation

    post = anchors.mean_post_loss()
    corr = cud_correlation(result, post)
    non_anchor = [k for k, i in enumerate(anchors.ids) if anchors.role(i) is None]
    pre_corr = spearmanr([anchors.pre_loss[k] for k in non_anchor], [post[anchors.ids[k]] for k in non_anchor])
    per_method = {}
    for m in anchors.methods:
        losses = dict(zip(anchors.ids, anchors.post_loss[m]))
        per_method[m] = cud_correlation(result, losses)["spearman"]
    # CUD vs loss after the set runs (every sample that was in an easy/hard/random set, loss averaged over runs)
    set_losses: dict = {}
    for r in runs:
        for i, x in zip(r["ids"], r["loss_after"]):
            set_losses.setdefault(i, []).append(x)
    set_corr = cud_correlation(result, {i: float(np.mean(v)) for i, v in set_losses.items()})
    # UE by set: mean over methods and seeds, and the difference to the random set per (method, seed)
    table = {}
    for name in ("easy", "hard", "random"):
        rs = [r for r in runs if r["set"] == name]
        table[name] = {"ue_before": float(np.mean([r["ue_before"] for r in rs])),
                       "ue_after": float(np.mean([r["ue_after"] for r in rs])),
                       "retain_loss_after": float(np.mean([r["retain_loss_after"] for r in rs]))}
    deltas = {}
    for name in ("easy", "hard"):
        diffs = []
        for r in (x for x in runs if x["set"] == name):
            ref = [x for x in runs if x["set"] == "random" and x["method"] == r["method"] and x["seed"] == r["seed"]]
            if ref:
                diffs.append(r["ue_after"] - ref[0]["ue_after"])
        deltas[name] = {"mean": float(np.mean(diffs)), "std": float(np.std(diffs, ddof=1)) if len(diffs) > 1 else 0.0,
                        "n": len(diffs), "by_run": diffs}
    by_method = {}
    for m in sorted({r["method"] for r in runs}):
        by_method[m] = {name: float(np.mean([r["ue_after"] for r in runs if r["set"] == name and r["method"] == m]))
                        for name in ("easy", "hard", "random")}
    # every scoring variant on the same circuits and anchors (all reported; the CLI default is cosine / circuit)
    from hf_unlearn.analysis.cud import compute_cud

    variants = {}
    for sim in ("cosine", "jaccard", "hamming"):
        for agg in ("circuit", "mean"):
            for weighted in ((False, True) if sim == "cosine" else (False,)):
                res = compute_cud(circuits, anchors, similarity=sim, aggregate=agg, weighted=weighted)
                by_id = res.by_id()
                variants[f"{sim}/{agg}" + ("/weighted" if weighted else "")] = {
                    **cud_correlation(res, post),
                    "easy_anchor_cud": float(np.nanmean([by_id[i]["cud"] or np.nan for i in anchors.easy])),
                    "hard_anchor_cud": float(np.nanmean([by_id[i]["cud"] or np.nan for i in anchors.hard]))}
    stats = {}
    rows = result.by_id()
    for group, ids in (("easy anchors", anchors.easy), ("hard anchors", anchors.hard),
                       ("easy set", sets_by_seed[next(iter(sets_by_seed))]["easy"]),
                       ("hard set", sets_by_seed[next(iter(sets_by_seed))]["hard"])):
        stats[group] = {k: float(np.mean([rows[i]["stats"][k] for i in ids]))
                        for k in ("mean_edge_depth", "longest_path", "mlp_share", "late_share")}
    return {"cost": cost, "patching": patching, "anchor_runs": anchors.runs,
            "cud_spearman_vs_anchor_post_loss": corr, "cud_spearman_by_method": per_method,
            "pre_loss_spearman_vs_post_loss": {"spearman": float(pre_corr.statistic), "p_value": float(pre_corr.pvalue),
                                               "n": len(non_anchor)},
            "cud_spearman_vs_set_run_loss": set_corr, "cud_variants": variants, "ue_by_set": table, "ue_minus_random": deltas,
            "ue_by_method": by_method, "set_runs": sorted({(r["method"], r["seed"]) for r in runs}), "circuit_stats": stats, "cud_meta": result.meta}


def print_report(s) -> None:
    c = s["cost"]
    print("\n== cost")
    print(f"EAP-IG {c['eap_ig_seconds_per_sample']:.2f} s/sample ({c['passes_per_sample']} passes, {c['num_edges']} "
          f"edges, {c['mean_tokens']:.0f} tokens/sample) vs plain fwd+bwd {c['plain_fwd_bwd_seconds_per_sample']:.2f} "
          f"s/sample: ratio {c['ratio']:.1f}")
    if s["patching"]:
        print("== EAP-IG vs real patching (per sample: top-|score| + random edges)")
        for p in s["patching"]:
            print(f"  id {p['id']}: Spearman |score|~|effect| {p['spearman_abs_all']:.3f} (all), "
                  f"{p['spearman_abs_random']:.3f} (random edges only); Pearson {p['pearson_all']:.3f}; "
                  f"{p['edges']} edges in {p['seconds']:.0f} s")
    print("== CUD as a predictor (Spearman; negative = higher CUD, lower loss left after unlearning)")
    a = s["cud_spearman_vs_anchor_post_loss"]
    b = s["pre_loss_spearman_vs_post_loss"]
    print(f"  CUD vs anchor-run loss (non-anchors, n={a['n']}): {a['spearman']:.3f} (p={a['p_value']:.3g}); "
          f"by method {', '.join(f'{m} {v:.3f}' for m, v in s['cud_spearman_by_method'].items())}")
    print(f"  trivial predictor, loss before vs after (same samples): {b['spearman']:.3f} (p={b['p_value']:.3g})")
    print("  every variant (Spearman vs anchor-run loss; leave-one-out mean CUD of the easy / hard anchors):")
    for name, v in s["cud_variants"].items():
        print(f"    {name:22s} {v['spearman']:+.3f} (p={v['p_value']:.2g})   anchors easy {v['easy_anchor_cud']:.3f} "
              f"/ hard {v['hard_anchor_cud']:.3f}")
    d = s["cud_spearman_vs_set_run_loss"]
    print(f"  CUD vs loss after the set runs (n={d['n']}): {d['spearman']:.3f} (p={d['p_value']:.3g})")
    print("== unlearning efficacy UE = 100 (1 - answer probability), mean over methods and seeds")
    for name, t in s["ue_by_set"].items():
        print(f"  {name:6s} UE {t['ue_before']:.1f} -> {t['ue_after']:.1f}   retain loss after {t['retain_loss_after']:.3f}")
    for name, dlt in s["ue_minus_random"].items():
        print(f"  {name} - random: {dlt['mean']:+.1f} +- {dlt['std']:.1f} points (n={dlt['n']} method x seed pairs)")
    print("  by method: " + "; ".join(f"{m}: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items())
                                      for m, t in s["ue_by_method"].items()))
    print("== circuit statistics (mean)")
    for group, st in s["circuit_stats"].items():
        print(f"  {group:13s} " + ", ".join(f"{k} {v:.3f}" for k, v in st.items()))


def plots(args, result, anchors, runs, sets_by_seed):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from hf_unlearn.analysis.cud import plot_circuit_statistics, plot_cud_vs_loss

    out = Path(args.out)
    paths = [plot_cud_vs_loss(result, anchors.mean_post_loss(), out / "cud_vs_loss.png")]
    rows = result.by_id()
    first = sets_by_seed[next(iter(sets_by_seed))]
    groups = {"easy anchors": [rows[i]["stats"] for i in anchors.easy],
              "hard anchors": [rows[i]["stats"] for i in anchors.hard],
              **{name: [rows[i]["stats"] for i in ids] for name, ids in first.items()}}
    paths.append(plot_circuit_statistics(groups, out / "circuit_stats.png"))
    methods = sorted({r["method"] for r in runs})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / 3
    for k, name in enumerate(("easy", "random", "hard")):
        vals = [[r["ue_after"] for r in runs if r["set"] == name and r["method"] == m] for m in methods]
        ax.bar(np.arange(len(methods)) + (k - 1) * width, [np.mean(v) for v in vals], width,
               yerr=[np.std(v) for v in vals], capsize=3, label=name,
               color={"easy": "tab:green", "random": "tab:gray", "hard": "tab:red"}[name])
    ax.set_xticks(np.arange(len(methods)), methods)
    ax.set_ylabel("unlearning efficacy (100 (1 - p))")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ue_by_set.png", dpi=120)
    plt.close(fig)
    paths.append(out / "ue_by_set.png")
    if args.figures:
        import shutil

        for p in paths:
            shutil.copyfile(p, f"{args.figures}_{p.name}")
    return paths


def main(argv=None):
    args = parse_args(argv)
    import torch

    from hf_unlearn.analysis.cud import compute_cud, stratify, write_sets

    if args.threads:
        torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model, tokenizer, forget, retain = prepare(args)
    log(f"{len(forget)} forget rows, {len(retain)} retain rows")
    circuits, cost = circuits_stage(args, model, tokenizer, forget)
    patching = patching_stage(args, model, tokenizer, forget, circuits)
    anchors = anchors_stage(args, model, tokenizer, forget, retain)
    result = compute_cud(circuits, anchors, similarity=args.similarity)
    result.to_jsonl(Path(args.out) / "cud.jsonl")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    sets_by_seed = {s: stratify(result, args.set_size, seed=s) for s in seeds}
    write_sets(Path(args.out) / "sets", sets_by_seed[seeds[0]], result, {"size": args.set_size, "seed": seeds[0]})
    runs = whole_triples(set_runs(args, model, tokenizer, forget, retain, sets_by_seed))
    summary = summarise(args, circuits, cost, patching, anchors, result, runs, sets_by_seed)
    summary["args"] = vars(args)
    save_json(Path(args.out) / "cud_results.json", summary)
    print_report(summary)
    for p in plots(args, result, anchors, runs, sets_by_seed):
        print(f"plot: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
