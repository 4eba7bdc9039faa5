"""Approximate unlearning, a fair comparison: every registered method, one learning-rate grid, seeds, stopping.

Setting: fine-tune MODEL on the first ``--authors`` TOFU authors (20 QA pairs each); forget the last
``--forget-authors``. For **every** method the same ``--validation-fraction`` of the forget rows is held out from
training (a seeded draw per unlearning seed); the stopping checks read only those rows, the evaluation reads all forget
rows (the whole request). A retain-only reference (the same fine-tuning without the forget authors) gives forget
quality.

Each run (method, learning rate, seed) trains for the same budget (``--epochs`` over the trained forget rows, the same
``--schedule`` for every method) and yields up to two rows:

* **fixed**: the model at the end of the budget; time = ``train()`` minus the time of the monitoring checks;
* **stop**: the model at the first check (every ``--check-every`` steps, on the held-out rows) whose violation rate is
  ``<= --alpha``, the level MASC's own rule certifies; time = ``train()`` up to that check, checks included. The
  baselines get it from an ``UnlearningStoppingCallback`` in monitor mode, which saves that checkpoint and lets
  training run on: training is deterministic and the checks change nothing, so this is exactly the run a stop-mode
  callback would have made (``tests/test_stopping_callback.py`` proves it bit for bit). MASC stops by its own rule
  (probe on its training batches, confirmation on the same held-out rows, the same cap).

Timing: wall clock and this process's CPU time of ``train()`` (one torch thread): on a machine shared with other
jobs the CPU time is the steadier measure of the work done; the ratios are given for both. Output is not unlearning
work: the baselines' checkpoint writes and MASC's end-of-run report and plot are left out of both.

Utility: TOFU's model utility by default; ``--utility retain_utility`` (its retain-set part) for a model built from
scratch, which never knew the real authors or world facts and scores 0 on them.

Phases (each resumable; a run is claimed with a lock file, so two processes can share one queue):

    B="python benchmarks/bench_methods.py --out OUT"          # plus the setting flags (README)
    $B --phase prepare            # fine-tune, reference, their evaluations (cached in OUT); --phase reference:
                                  # only the reference (beside a process that fine-tunes or runs the grid)
    $B --phase grid               # every method x --lrs on --grid-seed
    $B --phase seeds              # every method at its chosen and its default lr, --seeds
    $B --phase table              # tables, ratios, the target verdict per seed (OUT/bench_methods.json, .md, .png)

The lr choice is fixed in advance (``choose_lr``): for each method and mode (fixed / stop), among its grid runs on
``--grid-seed``, the lr with the highest forget quality whose model utility is within ``--utility-tolerance`` of the
fine-tuned model's; ties go to the higher utility, then the lower lr; if no lr keeps utility, the highest utility.
``--phase all`` runs every phase in one process (the quick tiny-model check: ``python benchmarks/bench_methods.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from hf_unlearn.runtime import bench_output_dir

os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "data"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PHASES = ("prepare", "reference", "grid", "seeds", "table", "all")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=PHASES, default="all")
    p.add_argument("--out", default=bench_output_dir("methods"), help="output folder, outside the repo (default: %(default)s)")
    p.add_argument("--model", default=None, help="Hub id / local folder / GGUF (default: tiny Llama built locally)")
    p.add_argument("--authors", type=int, default=4)
    p.add_argument("--forget-authors", type=int, default=1)
    p.add_argument("--finetune-epochs", type=float, default=30.0)
    p.add_argument("--finetune-lr", type=float, default=None, help="default: 3e-3 tiny, 2e-5 otherwise")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--methods", default="all",
                   help="'all' (every registered method) or a comma list; METHOD[field=value;...] sets config "
                        "fields of a variant, e.g. masc[retain_loss=ce]")
    p.add_argument("--extra-methods", default="", help="variants added to --methods (same syntax)")
    p.add_argument("--lrs", default=None, help="the lr grid, the same for every method (default: 1e-3,3e-3,1e-2 "
                                                "tiny; 1e-5,3e-5,1e-4 otherwise)")
    p.add_argument("--default-lr", type=float, default=None, help="the library default (1e-5) unless set")
    p.add_argument("--grid-seed", type=int, default=0)
    p.add_argument("--seeds", default="1,2", help="unlearning seeds of the seeds phase")
    p.add_argument("--epochs", type=float, default=5.0, help="budget over the trained forget rows (MASC's cap too)")
    p.add_argument("--schedule", default="constant", help="lr_scheduler_type for every method")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--validation-fraction", type=float, default=0.2)
    p.add_argument("--alpha", type=float, default=0.2, help="MASC's alpha and the baselines' violation-rate target")
    p.add_argument("--check-every", type=int, default=2, help="MASC's probe_steps and the callbacks' eval_steps")
    p.add_argument("--masc-probe-size", type=int, default=0, help="MASC probe rows (0 = its training batches)")
    p.add_argument("--eval-items", type=int, default=12, help="items per utility set (retain, real authors, facts)")
    p.add_argument("--eval-max-new-tokens", type=int, default=32)
    p.add_argument("--utility", choices=("model_utility", "retain_utility"), default="model_utility",
                   help="the utility the tolerance and the lr rule read: TOFU's model utility (retain, real authors, "
                        "world facts), or retain_utility, its retain-set part alone (harmonic mean of retain "
                        "probability, ROUGE-L and truth ratio) for a model built from scratch that never knew the "
                        "real authors or world facts (its model utility is 0)")
    p.add_argument("--utility-tolerance", type=float, default=0.05)
    p.add_argument("--speedup-target", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--finetune-seed", type=int, default=0)
    p.add_argument("--max-runs", type=int, default=None, help="stop this process after N runs (time slicing)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ the setting


def default_lrs(args) -> list[float]:
    if args.lrs:
        return [float(x) for x in args.lrs.split(",")]
    return [1e-3, 3e-3, 1e-2] if args.model is None else [1e-5, 3e-5, 1e-4]


def default_lr(args) -> float:
    from hf_unlearn.methods.base import UnlearningConfig

    if args.default_lr:
        return args.default_lr
    return 3e-3 if args.model is None else UnlearningConfig.learning_rate


def method_specs(args) -> list[str]:
    from hf_unlearn.methods.registry import METHODS

    names = list(METHODS) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    names += [m.strip() for m in args.extra_methods.split(",") if m.strip()]
    for spec in names:
        parse_spec(spec)  # fail before anything runs
    return names


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"masc[retain_loss=ce;k=5]"`` -> ("masc", {"retain_loss": "ce", "k": 5})."""
    from hf_unlearn.methods.registry import get_method

    name, _, rest = spec.partition("[")
    overrides = {}
    for item in filter(None, rest.rstrip("]").split(";")):
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    get_method(name)
    return name, overrides


def run_id(spec: str, lr: float, seed: int) -> str:
    clean = spec.replace("[", "(").replace("]", ")").replace(";", ",").replace("=", "-")
    return f"{clean}_lr{lr:g}_s{seed}"


def prepare_data(args, retain_only: bool = False):
    """Fine-tune once (cached in OUT; fine-tuning seed fixed); the model, tokenizer, forget/retain rows and ids."""
    import torch

    from hf_unlearn.data import tokenize_qa
    from hf_unlearn.demo import DemoConfig, fine_tune, load_demo_data, load_demo_model

    torch.manual_seed(args.finetune_seed)
    cfg = DemoConfig(model=args.model, output_dir=args.out, authors=args.authors, forget_authors=args.forget_authors,
                     epochs=args.finetune_epochs, learning_rate=args.finetune_lr, max_length=args.max_length,
                     seed=args.finetune_seed)
    subset, forget_ids = load_demo_data(cfg)
    tag = "reference-model" if retain_only else "finetuned-model"
    cache = Path(args.out) / tag
    cached = (cache / "config.json").exists() and (cache / "tokenizer_config.json").exists()
    if cached:
        from hf_unlearn.models import load_model, load_tokenizer

        model, tokenizer = load_model(cache), load_tokenizer(cache)
    else:
        model, tokenizer, _ = load_demo_model(cfg, [r["question"] + " " + r["answer"] for r in subset])
    data = tokenize_qa(subset, tokenizer, max_length=args.max_length)
    fset = set(forget_ids)
    forget = data.filter(lambda r: r["id"] in fset)
    retain = data.filter(lambda r: r["id"] not in fset)
    if not cached:
        started = time.perf_counter()
        fine_tune(cfg, model, tokenizer, retain if retain_only else data, Path(args.out) / tag.replace("-model", ""))
        print(f"fine-tuned {tag} in {time.perf_counter() - started:.0f} s", flush=True)
        model.save_pretrained(cache)
        tokenizer.save_pretrained(cache)
    retain_ids = [i for i in subset["id"] if i not in fset]
    return model, tokenizer, forget, retain, forget_ids, retain_ids


def evaluate(model, tokenizer, forget_ids, retain_ids, args, label) -> dict:
    """TOFU metrics on every forget row and ``--eval-items`` per utility set; full result in OUT/results/LABEL.json."""
    from hf_unlearn.eval.tofu import TofuResult, evaluate_tofu

    caps = {"retain": args.eval_items, "real_authors": args.eval_items, "world_facts": args.eval_items}
    ref = Path(args.out) / "results" / "reference.json"
    started = time.perf_counter()
    # the table reports no membership inference: skip the gradient-norm attack (one backward per forget/holdout item)
    from hf_unlearn.eval.metrics import SCORE_ATTACKS

    result = evaluate_tofu(model, tokenizer, forget_ids=forget_ids, retain_ids=retain_ids, max_items=caps,
                           max_new_tokens=args.eval_max_new_tokens, max_length=args.max_length, progress=False,
                           mia_attacks=SCORE_ATTACKS)
    path = result.to_json(Path(args.out) / "results" / f"{label}.json")
    if ref.is_file() and label != "reference":
        result = TofuResult.from_json(path).with_reference(ref)
        result.to_json(path)
    return {"result": str(path), "eval_seconds": time.perf_counter() - started, **summary_metrics(result)}


SUMMARY_KEYS = ("forget_quality", "model_utility", "retain_utility", "forget_probability", "forget_rouge_l",
                "forget_truth_ratio", "retain_probability")


def summary_metrics(result) -> dict:
    s = dict(result.summary)
    parts = [s.get(k) for k in ("retain_probability", "retain_rouge_l", "retain_truth_ratio")]
    s["retain_utility"] = statistics.harmonic_mean(parts) if None not in parts else None
    return {k: s.get(k) for k in SUMMARY_KEYS}


# ------------------------------------------------------------------------------------------------ one run


def _atomic_json(path: Path, data) -> None:
    from hf_unlearn.utils import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def claim(path: Path) -> bool:
    """Take the run ``path`` for this process (a lock file created exclusively); False if done or taken."""
    if path.exists():
        return False
    lock = path.with_suffix(".lock")
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:  # a lock left by a process that died (killed mid-run) is taken over
            os.kill(int(lock.read_text() or 0), 0)
            return False
        except (ProcessLookupError, ValueError, FileNotFoundError):
            lock.unlink(missing_ok=True)
            return claim(path)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def run_one(spec: str, lr: float, seed: int, args, ctx) -> dict:
    """Train one (method, lr, seed), evaluate its final model and, if earlier, its stop checkpoint."""
    from hf_unlearn.eval.stopping import UnlearningStoppingCallback
    from hf_unlearn.methods.registry import get_method
    from hf_unlearn.models import load_model

    name, overrides = parse_spec(spec)
    method = get_method(name)
    out = Path(args.out) / "runs" / run_id(spec, lr, seed)
    common = dict(output_dir=str(out), per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=8,
                  learning_rate=lr, lr_scheduler_type=args.schedule, warmup_steps=0, save_strategy="no",
                  report_to=[], logging_steps=5, disable_tqdm=True, seed=seed, max_length=args.max_length,
                  num_train_epochs=args.epochs, validation_fraction=args.validation_fraction)
    callbacks = []
    if method.stops_itself:
        common.update(alpha=args.alpha, probe_steps=args.check_every, probe_size=args.masc_probe_size)
    else:
        callbacks.append(UnlearningStoppingCallback("violation_rate", args.alpha, eval_steps=args.check_every,
                                                    mode="monitor", save_checkpoint="target"))
    config = method.make_config(**{**common, **overrides})
    trainer = method.trainer_class(model=copy.deepcopy(ctx["model"]), args=config, forget_dataset=ctx["forget"],
                                   retain_dataset=ctx["retain"], processing_class=ctx["tokenizer"],
                                   callbacks=callbacks)
    report = _time_stopping_report(trainer)
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - wall - report["wall"], time.process_time() - cpu - report["cpu"]
    steps = trainer.state.global_step
    label = trainer.unlearning_card_info()["method"]
    row = {"id": run_id(spec, lr, seed), "spec": spec, "method": label, "lr": lr, "seed": seed, "steps": steps,
           "train_seconds": wall, "train_cpu_seconds": cpu, "held_out_ids": trainer.held_out_forget_ids}
    if method.stops_itself:
        row["stop"] = {"reached_step": trainer.stopped_step, "seconds": wall, "cpu_seconds": cpu, "steps": steps,
                       "reason": trainer.stop_reason, "history": trainer.violation_history}
        row["fixed"] = None  # MASC has no fixed-budget row: its cap is a safety net
        evaluated = trainer.model
        row["stop"].update(evaluate(evaluated, ctx["tokenizer"], ctx["forget_ids"], ctx["retain_ids"], args,
                                    f"{row['id']}_stop"))
    else:
        cb = callbacks[0]
        row["fixed"] = {"seconds": wall - cb.check_seconds, "cpu_seconds": cpu - cb.check_cpu_seconds,
                        "steps": steps, "check_seconds": cb.check_seconds}
        row["fixed"].update(evaluate(trainer.model, ctx["tokenizer"], ctx["forget_ids"], ctx["retain_ids"], args,
                                     f"{row['id']}_fixed"))
        reached = cb.reached_step
        row["stop"] = {"reached_step": reached, "history": cb.history}
        if reached is not None:
            row["stop"].update(seconds=cb.reached_seconds, cpu_seconds=cb.reached_cpu_seconds, steps=reached)
            if reached == steps:  # reached at the last step: the same model
                row["stop"].update({k: v for k, v in row["fixed"].items() if k not in ("seconds", "cpu_seconds",
                                                                                       "steps", "check_seconds")})
            else:
                kept = load_model(cb.best_model_path)
                row["stop"].update(evaluate(kept, ctx["tokenizer"], ctx["forget_ids"], ctx["retain_ids"], args,
                                            f"{row['id']}_stop"))
                del kept
    del trainer
    return row


def _time_stopping_report(trainer) -> dict:
    """Time MASC's end-of-training report (JSON + matplotlib plot) so it can be left out of its training time, as
    every checkpoint write of the baselines' stopping callback is: both are output, not unlearning work."""
    from hf_unlearn.methods.masc import MASCStoppingCallback

    spent = {"wall": 0.0, "cpu": 0.0}
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, MASCStoppingCallback):
            inner = cb.on_train_end

            def on_train_end(*a, _inner=inner, **kw):
                wall, cpu = time.perf_counter(), time.process_time()
                try:
                    return _inner(*a, **kw)
                finally:
                    spent["wall"] += time.perf_counter() - wall
                    spent["cpu"] += time.process_time() - cpu

            cb.on_train_end = on_train_end
    return spent


def run_queue(runs, args, ctx) -> int:
    """Run every (spec, lr, seed) not done or claimed yet; a row per run in OUT/runs/ID.json."""
    done = 0
    for spec, lr, seed in runs:
        path = Path(args.out) / "runs" / f"{run_id(spec, lr, seed)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not claim(path):
            continue
        try:
            started = time.perf_counter()
            row = run_one(spec, lr, seed, args, ctx)
            _atomic_json(path, row)
            print(f"[{time.strftime('%H:%M:%S')}] {row['id']}: {row['steps']} steps, train {row['train_seconds']:.0f} s "
                  f"(cpu {row['train_cpu_seconds']:.0f} s), stop at {row['stop']['reached_step']}, "
                  f"run {time.perf_counter() - started:.0f} s", flush=True)
        finally:
            path.with_suffix(".lock").unlink(missing_ok=True)
        done += 1
        if args.max_runs and done >= args.max_runs:
            break
    return done


def load_context(args) -> dict:
    model, tok, forget, retain, forget_ids, retain_ids = prepare_data(args)
    return {"model": model, "tokenizer": tok, "forget": forget, "retain": retain, "forget_ids": forget_ids,
            "retain_ids": retain_ids}


def phase_prepare(args, reference_only: bool = False) -> None:
    results = Path(args.out) / "results"
    if not (results / "reference.json").is_file():
        model, tok, _, _, forget_ids, retain_ids = prepare_data(args, retain_only=True)
        row = evaluate(model, tok, forget_ids, retain_ids, args, "reference")
        print(f"reference: {json.dumps(row)}", flush=True)
        del model
    if not reference_only and not (results / "finetuned.json").is_file():
        ctx = load_context(args)
        row = evaluate(ctx["model"], ctx["tokenizer"], ctx["forget_ids"], ctx["retain_ids"], args, "finetuned")
        print(f"fine-tuned: {json.dumps(row)}", flush=True)


# ------------------------------------------------------------------------------------------------ choice and table


def load_runs(args) -> list[dict]:
    """Every finished run; rows evaluated before the reference existed get their forget quality now."""
    from hf_unlearn.eval.tofu import TofuResult

    runs = [json.loads(p.read_text()) for p in sorted((Path(args.out) / "runs").glob("*.json"))]
    ref = Path(args.out) / "results" / "reference.json"
    if ref.is_file():
        for run in runs:
            for row in (run.get("fixed"), run["stop"]):
                if row and row.get("result") and any(row.get(k) is None for k in ("forget_quality", "retain_utility")):
                    row.update(summary_metrics(TofuResult.from_json(row["result"]).with_reference(ref)))
    return runs


def base_utility(args) -> float:
    from hf_unlearn.eval.tofu import TofuResult

    return summary_metrics(TofuResult.from_json(Path(args.out) / "results" / "finetuned.json"))[args.utility]


def rows_of(run: dict) -> list[tuple[str, dict]]:
    """(mode, row) pairs a run yields; a stop that was never reached yields no stop row."""
    out = []
    if run.get("fixed"):
        out.append(("fixed", run["fixed"]))
    if run["stop"].get("reached_step") is not None:
        out.append(("stop", run["stop"]))
    return out


def choose_lr(candidates: list[tuple[float, dict]], utility_floor: float, key: str = "model_utility") -> float | None:
    """The rule fixed in advance: highest forget quality with utility >= floor (ties: higher utility, lower lr);
    if no candidate keeps utility, the highest utility."""
    if not candidates:
        return None
    ok = [(lr, r) for lr, r in candidates if (r.get(key) or 0.0) >= utility_floor]
    if ok:
        return max(ok, key=lambda c: (c[1].get("forget_quality") or 0.0, c[1][key], -c[0]))[0]
    return max(candidates, key=lambda c: (c[1].get(key) or 0.0, -c[0]))[0]


def choices(runs: list[dict], args) -> dict[tuple[str, str], float]:
    """(spec, mode) -> chosen lr, from the grid-seed runs."""
    floor = (1 - args.utility_tolerance) * base_utility(args)
    picked = {}
    for spec in sorted({r["spec"] for r in runs}):
        for mode in ("fixed", "stop"):
            cands = [(r["lr"], row) for r in runs if r["spec"] == spec and r["seed"] == args.grid_seed
                     for m, row in rows_of(r) if m == mode]
            lr = choose_lr(cands, floor, args.utility)
            if lr is not None:
                picked[(spec, mode)] = lr
    return picked


def phase_seeds_runs(args) -> list[tuple[str, float, int]]:
    runs = load_runs(args)
    picked = choices(runs, args)
    seeds = [int(x) for x in args.seeds.split(",")]
    chosen = [(spec, lr, seed) for seed in seeds for spec in method_specs(args)
              for lr in sorted({lr for (s, _), lr in picked.items() if s == spec})]
    defaults = [(spec, default_lr(args), seed) for seed in seeds for spec in method_specs(args)]
    return chosen + [run for run in defaults if run not in chosen]  # the chosen lrs first


def _fmt(v, digits=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != 0 and abs(v) < 1e-3:
            return f"{v:.1e}"
        return f"{v:.{digits}g}"
    return str(v)


def relative(value, ref) -> str:
    if value is None or not ref:
        return "n/a"
    return f"{(value / ref - 1) * 100:+.1f}%"


def mean_spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def phase_table(args) -> int:
    runs = load_runs(args)
    if not runs:
        print("no runs yet")
        return 1
    from hf_unlearn.eval.tofu import TofuResult

    base = summary_metrics(TofuResult.from_json(Path(args.out) / "results" / "finetuned.json"))
    ref_path = Path(args.out) / "results" / "reference.json"
    ref = summary_metrics(TofuResult.from_json(ref_path)) if ref_path.is_file() else {}
    key = args.utility
    util0 = base[key]
    picked = choices(runs, args)
    lines = [f"fine-tuned: forget quality {_fmt(base.get('forget_quality'))}, utility {_fmt(util0)}, forget prob. "
             f"{_fmt(base.get('forget_probability'))}; retain-only reference: utility {_fmt(ref.get(key))}, "
             f"forget prob. {_fmt(ref.get('forget_probability'))}, truth ratio {_fmt(ref.get('forget_truth_ratio'))}",
             "", "### Every run", "",
             "| method | lr | seed | mode | steps | wall s | cpu s | s/step (cpu) | forget quality | utility (vs ft) | "
             "forget prob. | forget TR | retain prob. |", "|" + "---|" * 13]
    for r in sorted(runs, key=lambda r: (r["spec"], r["seed"], r["lr"])):
        modes = rows_of(r) or [("stop", {"seconds": None})]
        if r.get("fixed") is None and r["stop"].get("reached_step") is None:  # MASC at its cap
            modes = [("cap (no stop)", r["stop"])]
        for mode, row in modes:
            util = row.get(key)
            rel = f" ({relative(util, util0)})" if util is not None and util0 else ""
            chosen = " *" if picked.get((r["spec"], mode)) == r["lr"] else ""
            cpu = row.get("cpu_seconds")
            lines.append(f"| {r['method']} `{r['spec']}` | {r['lr']:g}{chosen} | {r['seed']} | {mode} | "
                         f"{row.get('steps', r['steps'])} | {_fmt(row.get('seconds'))} | {_fmt(cpu)} | "
                         f"{_fmt(cpu / max(row.get('steps') or r['steps'], 1) if cpu else None)} | "
                         f"{_fmt(row.get('forget_quality'))} | {_fmt(util)}{rel} | "
                         f"{_fmt(row.get('forget_probability'))} | {_fmt(row.get('forget_truth_ratio'))} | "
                         f"{_fmt(row.get('retain_probability'))} |")
        if r["stop"].get("reached_step") is None and r.get("fixed"):
            lines.append(f"| {r['method']} `{r['spec']}` | {r['lr']:g} | {r['seed']} | stop | not reached in "
                         f"{r['steps']} steps | | | | | | | | |")
    lines += ["", "(* = the lr the rule chose for that mode on the grid seed)", ""]
    lines += summary_by_seed(runs, picked, args, util0)
    text = "\n".join(lines)
    print(text)
    from hf_unlearn.utils import atomic_write_text

    atomic_write_text(Path(args.out) / "bench_methods.md", text + "\n")
    _atomic_json(Path(args.out) / "bench_methods.json", {"args": vars(args), "choices": {
        f"{s}|{m}": lr for (s, m), lr in picked.items()}, "runs": runs})
    plot(runs, picked, util0, key, Path(args.out) / "tradeoff.png")
    return 0


def summary_by_seed(runs, picked, args, util0) -> list[str]:
    """Per (method, mode) at the chosen lr and at the default lr: mean and spread over seeds; the target per seed."""
    seeds = sorted({r["seed"] for r in runs})
    lines = ["### Chosen and default learning rates over seeds (mean ± sd)", "",
             "| method | mode | lr | seeds | steps | cpu s | wall s | forget quality | utility | reached |",
             "|" + "---|" * 10]
    default = default_lr(args)
    for spec in sorted({r["spec"] for r in runs}):
        for mode in ("stop", "fixed"):
            for which, lr in (("chosen", picked.get((spec, mode))), ("default", default)):
                if lr is None or (which == "default" and lr == picked.get((spec, mode))):
                    continue
                group = [r for r in runs if r["spec"] == spec and r["lr"] == lr]
                rows = [dict(rows_of(r)).get(mode) for r in group]
                if mode == "fixed" and not any(rows):
                    continue
                got = [x for x in rows if x]
                if not group:
                    continue
                cells = []
                for name in ("steps", "cpu_seconds", "seconds", "forget_quality", args.utility):
                    m, sd = mean_spread([x.get(name) for x in got])
                    cells.append("-" if m is None else f"{_fmt(m)} ± {_fmt(sd, 2)}")
                lines.append(f"| {group[0]['method']} `{spec}` | {mode} | {lr:g} ({which}) | "
                             f"{','.join(str(r['seed']) for r in group)} | " + " | ".join(cells)
                             + f" | {len(got)}/{len(group)} |")
    lines += ["", "### The target per seed", "",
              f"MASC reaches the best baseline's forget quality with utility within {args.utility_tolerance:.0%} of the "
              f"fine-tuned model in at least {args.speedup_target:g}x less time. Best baseline = the baseline row "
              "(any method, fixed or stop, at its chosen lr) with the highest forget quality among those within the "
              "utility tolerance (ties: less time).", ""]
    floor = (1 - args.utility_tolerance) * util0
    for seed in seeds:
        masc = [(r, row) for r in runs if r["seed"] == seed and r.get("fixed") is None
                and picked.get((r["spec"], "stop")) == r["lr"] for row in [r["stop"]]]
        base = [(r, m, row) for r in runs if r["seed"] == seed and r.get("fixed") is not None
                for m, row in rows_of(r) if picked.get((r["spec"], m)) == r["lr"]
                and (row.get(args.utility) or 0) >= floor]
        if not masc or not base:
            lines.append(f"- seed {seed}: not enough rows (MASC {len(masc)}, eligible baselines {len(base)})")
            continue
        best = max(base, key=lambda b: (b[2].get("forget_quality") or 0, -(b[2].get("cpu_seconds") or math.inf)))
        for r, row in masc:
            fq_ok = (row.get("forget_quality") or 0) >= (best[2].get("forget_quality") or 0)
            util_ok = (row.get(args.utility) or 0) >= floor
            cpu_ratio = (best[2].get("cpu_seconds") or 0) / max(row.get("cpu_seconds") or 1e-9, 1e-9)
            wall_ratio = (best[2].get("seconds") or 0) / max(row.get("seconds") or 1e-9, 1e-9)
            verdict = "HOLDS" if fq_ok and util_ok and cpu_ratio >= args.speedup_target else "does NOT hold"
            lines.append(
                f"- seed {seed}, {r['method']} `{r['spec']}` lr {r['lr']:g}: forget quality {_fmt(row.get('forget_quality'))}"
                f" vs best baseline {best[0]['method']} `{best[0]['spec']}` lr {best[0]['lr']:g} ({best[1]}) "
                f"{_fmt(best[2].get('forget_quality'))} -> {'reached' if fq_ok else 'NOT reached'}; utility "
                f"{_fmt(row.get(args.utility))} ({relative(row.get(args.utility), util0)}) -> "
                f"{'within' if util_ok else 'NOT within'} {args.utility_tolerance:.0%}; time {_fmt(best[2].get('cpu_seconds'))}"
                f" / {_fmt(row.get('cpu_seconds'))} cpu s = {cpu_ratio:.2f}x (wall {wall_ratio:.2f}x), steps "
                f"{best[2].get('steps')} vs {row.get('steps')}: **{verdict}**")
    return lines


def plot(runs, picked, util0, key, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    fig, ax = plt.subplots(figsize=(11, 6.5))
    specs = sorted({r["spec"] for r in runs})
    labelled = set()  # one legend entry per method, not one per seed
    for i, spec in enumerate(specs):
        for r in runs:
            if r["spec"] != spec:
                continue
            for mode, row in rows_of(r) or [("cap", r["stop"])]:
                if row.get("forget_quality") is None or row.get(key) is None:
                    continue
                chosen = picked.get((spec, mode)) == r["lr"]
                label = f"{r['method']} ({spec})" if chosen and mode in ("stop", "cap") else None
                if label in labelled:
                    label = None
                labelled.add(label)
                ax.scatter(max(row["forget_quality"], 1e-6), row[key],
                           s=20 + 0.3 * (row.get("cpu_seconds") or 0), alpha=0.8 if chosen else 0.25,
                           marker={"fixed": "s", "stop": "o", "cap": "x"}[mode], color=plt.cm.tab20(i % 20),
                           label=label)
    ax.axhline(util0 * 0.95, color="gray", linestyle=":", label="utility -5%")
    ax.set_xscale("log")
    ax.set_xlabel("forget quality (KS p-value vs retain-only reference; higher = closer)")
    ax.set_ylabel(key.replace("_", " "))
    ax.set_title("o stopped at the certified level, s fixed budget; area ~ CPU s; opaque = chosen lr")
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main


def main(argv=None):
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    specs = method_specs(args)
    if args.phase in ("prepare", "reference", "all"):
        phase_prepare(args, reference_only=args.phase == "reference")
    if args.phase in ("grid", "all"):
        ctx = load_context(args)
        # method by method, so that a queue cut short leaves complete grids for the methods it reached
        run_queue([(s, lr, args.grid_seed) for s in specs for lr in default_lrs(args)], args, ctx)
    if args.phase in ("seeds", "all"):
        ctx = load_context(args)
        run_queue(phase_seeds_runs(args), args, ctx)
    if args.phase in ("table", "all"):
        return phase_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
