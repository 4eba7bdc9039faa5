"""QR-Erase end to end on a TOFU subset: QR vs SVD vs truncated QR, all layers vs localised, next to MASC.

1. Fine-tune the model on the first ``--authors`` TOFU authors (full fine-tune, cached in OUT; the same routine as
   ``bench_methods.py``); the last ``--forget-authors`` authors are the forget set.
2. Task matrices: LoRA fine-tunes of that model on the forget rows and on the retain rows
   (``hf_unlearn.editing.finetune.fine_tune_task``, timed, cached per ``--task-seed``).
3. A scale sweep with answer losses only (cheap): every method x all layers (and localised for
   ``--localize-methods``) x ``--scales``; the edit's
   wall clock (``qr_erase`` without the reference decompositions) is recorded for each.
4. TOFU metrics (``evaluate_tofu`` with ``max_items`` caps) of the fine-tuned model, of each method at
   ``--eval-scale`` (all layers), of localised QR at the scale whose forget loss is closest to all-layer QR's
   (equal forgetting), and of MASC on the same forget set (``--masc`` options as bench_methods' fastest setting).

Prints a table, the "QR forgets within 5% of SVD" and "localisation improves utility at equal forgetting" checks,
and writes OUT/bench_qr_erase_e2e.json. Run in the background on a shared CPU::

    PYTHONPATH=. nohup python benchmarks/bench_qr_erase_e2e.py --model ../shared/models/SmolLM2-135M-Instruct \
        --threads 1 --out /tmp/qr_e2e > /tmp/qr_e2e.log 2>&1 &

Without ``--model`` a tiny Llama is built locally (a smoke run of the whole pipeline in a few minutes).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import time
from pathlib import Path

from hf_unlearn.runtime import bench_output_dir

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Hub id / local folder / GGUF (default: tiny Llama built locally)")
    p.add_argument("--authors", type=int, default=6)
    p.add_argument("--forget-authors", type=int, default=1)
    p.add_argument("--finetune-epochs", type=float, default=3.0)
    p.add_argument("--finetune-lr", type=float, default=None, help="default: 3e-3 tiny, 1e-4 otherwise")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--task-lora-r", type=int, default=16)
    p.add_argument("--task-epochs", type=float, default=4.0, help="epochs of the forget LoRA fine-tune")
    p.add_argument("--retain-task-epochs", type=float, default=1.0, help="epochs of the retain LoRA fine-tune")
    p.add_argument("--task-lr", type=float, default=None, help="default: 1e-2 tiny, 2e-4 otherwise")
    p.add_argument("--task-seed", type=int, default=0, help="seed of the task fine-tunes (data order)")
    p.add_argument("--rank", type=int, default=4, help="edit rank (below the LoRA rank, so the decomposition matters)")
    p.add_argument("--methods", default="qr,svd,qr-truncated")
    p.add_argument("--localize-methods", default="qr", help="methods also swept with localisation")
    p.add_argument("--scales", default="1,2,4,8,16")
    p.add_argument("--eval-scale", type=float, default=None, help="scale of the TOFU evaluation (default: the "
                   "smallest swept scale at which all-layer QR raises the forget loss by --target-gain)")
    p.add_argument("--target-gain", type=float, default=1.0, help="forget answer-loss increase that defines 'forgot'")
    p.add_argument("--masc", action="store_true", help="also run MASC on the same forget set (wall clock + metrics)")
    p.add_argument("--masc-lr", type=float, default=5e-5)
    p.add_argument("--eval-items", type=int, default=12, help="retain/real_authors/world_facts items")
    p.add_argument("--eval-max-new-tokens", type=int, default=32)
    p.add_argument("--no-eval", action="store_true", help="stop after the sweep")
    p.add_argument("--summary", action="store_true", help="only print the tables of OUT's results file (a partial run's)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=bench_output_dir("qr_erase_e2e"), help="output folder, outside the repo (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def bench_methods():
    """benchmarks/bench_methods.py as a module (its fine-tune, evaluation and MASC runner are reused as they are)."""
    spec = importlib.util.spec_from_file_location("bench_methods", HERE / "bench_methods.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def methods_args(args, bm):
    """The argument namespace bench_methods' helpers expect, for the same model, subset and evaluation caps (MASC as
    in its fair benchmark: probes on its training batches, 5 epochs over the trained forget rows as the cap)."""
    return bm.parse_args([
        *(["--model", args.model] if args.model else []), "--authors", str(args.authors), "--forget-authors",
        str(args.forget_authors), "--finetune-epochs", str(args.finetune_epochs),
        *(["--finetune-lr", str(args.finetune_lr)] if args.finetune_lr else []), "--max-length", str(args.max_length),
        "--batch-size", str(args.batch_size), "--eval-items", str(args.eval_items), "--eval-max-new-tokens",
        str(args.eval_max_new_tokens), "--out", args.out, "--finetune-seed", str(args.seed), "--masc-probe-size", "0",
        "--epochs", "5",
    ])


def evaluate(bm, model, tokenizer, forget, retain, forget_ids, retain_ids, margs, label) -> dict:
    """Answer losses next to bench_methods' TOFU metrics (every forget row; --eval-items per utility set)."""
    from hf_unlearn.demo import mean_answer_loss

    row = {"forget_loss": mean_answer_loss(model, tokenizer, forget),
           "retain_loss": mean_answer_loss(model, tokenizer, retain)}
    row.update(bm.evaluate(model, tokenizer, forget_ids, retain_ids, margs, label))
    return row


def task_models(args, model, tokenizer, forget, retain):
    """LoRA adapters of the fine-tuned model on the forget and on the retain rows (cached); their training time."""
    from hf_unlearn.editing.finetune import fine_tune_task

    out = Path(args.out) / f"task-seed{args.task_seed}"
    timing_file = out / "timing.json"
    if timing_file.is_file():
        return out / "forget", out / "retain", json.loads(timing_file.read_text())
    lr = args.task_lr or (1e-2 if args.model is None else 2e-4)
    seconds = {}
    for name, data, epochs in (("forget", forget, args.task_epochs), ("retain", retain, args.retain_task_epochs)):
        start = time.perf_counter()
        fine_tune_task(model, tokenizer, data, out / name, lora=True, lora_r=args.task_lora_r, epochs=epochs,
                       learning_rate=lr, batch_size=args.batch_size, max_length=args.max_length, seed=args.task_seed,
                       progress=False)
        seconds[name] = time.perf_counter() - start
    timing_file.write_text(json.dumps(seconds))
    return out / "forget", out / "retain", seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summary:
        print_summary(json.loads((Path(args.out) / f"bench_qr_erase_e2e_seed{args.task_seed}.json").read_text()), args)
        return 0
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from hf_unlearn.demo import mean_answer_loss
    from hf_unlearn.editing.qr_erase import qr_erase

    bm = bench_methods()
    margs = methods_args(args, bm)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model, tok, forget, retain, forget_ids, retain_ids = bm.prepare_data(margs)  # the fine-tune is cached in OUT
    ft_seconds = time.perf_counter() - started
    model.eval()
    print(f"model {args.model or 'tiny Llama'}; {len(forget)} forget rows, {len(retain)} retain rows; fine-tuned (or "
          f"loaded from OUT) in {ft_seconds:.0f} s", flush=True)
    forget_task, retain_task, task_seconds = task_models(args, model, tok, forget, retain)
    print(f"task LoRA fine-tunes (r={args.task_lora_r}): forget {task_seconds['forget']:.0f} s, retain "
          f"{task_seconds['retain']:.0f} s", flush=True)
    results_file = out / f"bench_qr_erase_e2e_seed{args.task_seed}.json"
    state = json.loads(results_file.read_text()) if results_file.is_file() else {}
    state.update(args=vars(args), task_seconds=task_seconds, finetune_seconds=ft_seconds)

    def losses(m):
        return {"forget_loss": mean_answer_loss(m, tok, forget), "retain_loss": mean_answer_loss(m, tok, retain)}

    def edit(method, localize, scale, compare=False):
        edited, report = qr_erase(copy.deepcopy(model), forget_task, retain_task, method=method, rank=args.rank,
                                  scale=scale, localize=localize, compare_subspaces=compare, progress=False,
                                  forget_ids=forget_ids, seed=args.task_seed)
        return edited, report

    def save():
        results_file.write_text(json.dumps(state, indent=1))

    if "base" not in state:
        state["base"] = losses(model)
        save()
    print(f"fine-tuned model: {state['base']}", flush=True)
    # 3. the sweep (answer losses) -----------------------------------------------------------------------------
    sweep = state.setdefault("sweep", {})
    scales = [float(s) for s in args.scales.split(",")]
    for method in args.methods.split(","):
        for localize in (False, True) if method in args.localize_methods.split(",") else (False,):
            for scale in scales:
                key = f"{method}|{'localized' if localize else 'all'}|{scale:g}"
                if key in sweep:
                    continue
                edited, report = edit(method, localize, scale)
                sweep[key] = {**losses(edited), "edit_seconds": report.seconds_total,
                              "decomposition_seconds": report.seconds_decomposition,
                              "blocks": report.selected_blocks, "layers": len(report.layers)}
                print(f"{key:28s} forget {sweep[key]['forget_loss']:.3f} retain {sweep[key]['retain_loss']:.3f} "
                      f"edit {report.seconds_total:.1f} s ({len(report.selected_blocks)} blocks)", flush=True)
                save()
                del edited
    if args.no_eval:
        compare_subspaces(args, state, edit, save, out)
        print_summary(state, args)
        return 0
    # 4. TOFU metrics --------------------------------------------------------------------------------------------
    base_gain = state["base"]["forget_loss"]
    eval_scale = args.eval_scale
    if eval_scale is None:
        hits = [s for s in scales if sweep[f"qr|all|{s:g}"]["forget_loss"] - base_gain >= args.target_gain]
        eval_scale = hits[0] if hits else scales[-1]
    target = sweep[f"qr|all|{eval_scale:g}"]["forget_loss"]
    swept = [float(k.split("|")[2]) for k in sweep if k.startswith("qr|localized|")]  # every scale swept so far
    loc_scale = min(swept, key=lambda s: abs(sweep[f"qr|localized|{s:g}"]["forget_loss"] - target))
    state["eval_scale"], state["localized_eval_scale"] = eval_scale, loc_scale
    evals = state.setdefault("eval", {})
    methods = args.methods.split(",")
    # most informative first, so that a run stopped early (shared CPU) still answers the two questions
    todo = [("fine-tuned", None, None, None)]
    todo += [(f"{m} all x{eval_scale:g}", m, False, eval_scale) for m in methods if m in ("qr", "svd")]
    todo += [(f"qr localized x{loc_scale:g}", "qr", True, loc_scale)]
    todo += [(f"{m} all x{eval_scale:g}", m, False, eval_scale) for m in methods if m not in ("qr", "svd")]
    evaluate_all(todo, evals, edit, bm, model, tok, forget, retain, forget_ids, retain_ids, margs, save)
    if args.masc and "MASC" not in evals:
        ctx = {"model": model, "tokenizer": tok, "forget": forget, "retain": retain, "forget_ids": forget_ids,
               "retain_ids": retain_ids}
        row = bm.run_one("masc[retain_loss=ce]", args.masc_lr, args.seed, margs, ctx)  # trains and evaluates
        stop = row["stop"]
        evals["MASC"] = {"train_seconds": row["train_seconds"], "train_cpu_seconds": row["train_cpu_seconds"],
                         "steps": row["steps"], "stopped_step": stop["reached_step"], "stop_reason": stop["reason"],
                         **{k: stop[k] for k in bm.SUMMARY_KEYS if k in stop}}
        print(json.dumps({"MASC": evals["MASC"]}), flush=True)
        save()
    # then localised QR at the same scale as the all-layer runs, and the subspace comparison (cheapest to lose)
    evaluate_all([(f"qr localized x{eval_scale:g}", "qr", True, eval_scale)], evals, edit, bm, model, tok, forget,
                 retain, forget_ids, retain_ids, margs, save)
    compare_subspaces(args, state, edit, save, out)
    print_summary(state, args)
    return 0


def evaluate_all(todo, evals, edit, bm, model, tok, forget, retain, forget_ids, retain_ids, margs, save) -> None:
    """TOFU metrics of each (label, method, localize, scale) not yet in ``evals`` (method None: the model as is)."""
    for label, method, localize, scale in todo:
        if label in evals:
            continue
        if method is None:
            m, seconds, cpu = model, 0.0, 0.0
        else:
            cpu = time.process_time()
            m, report = edit(method, localize, scale)
            seconds, cpu = report.seconds_total, time.process_time() - cpu  # cpu includes the model copy
        row = evaluate(bm, m, tok, forget, retain, forget_ids, retain_ids, margs, label.replace(" ", "_"))
        evals[label] = {"edit_seconds": seconds, "edit_cpu_seconds": cpu,
                        **{k: v for k, v in row.items() if k != "result"}}
        print(json.dumps({label: evals[label]}), flush=True)
        save()


def compare_subspaces(args, state, edit, save, out) -> None:
    """One comparison run per method: per-layer times and principal angles on the same task matrices (svd's run is
    skipped when qr's is there: it would only repeat the same two decompositions and the same angles)."""
    for method in args.methods.split(","):
        if method == "svd" and "qr" in args.methods.split(","):
            continue
        if method not in state.get("angles", {}):
            _, report = edit(method, False, 1.0, compare=True)
            state.setdefault("angles", {})[method] = {
                "max_angle_deg": report.max_angles(), "decomposition_seconds": report.decomposition_seconds(),
                "mean_rank": report.mean_rank()}
            if method == "qr":
                report.save(out / "qr_report")
            save()


def print_summary(state, args) -> None:
    sweep = state["sweep"]
    print("\n| method | layers | scale | forget loss | retain loss | edit s |")
    print("|---|---|---|---|---|---|")
    for key, r in sweep.items():
        method, where, scale = key.split("|")
        print(f"| {method} | {where} | {scale} | {r['forget_loss']:.3f} | {r['retain_loss']:.3f} | "
              f"{r['edit_seconds']:.1f} |")
    base = state["base"]
    for key, r in sweep.items():  # QR vs SVD forgetting (forget-loss gain), same scale and layers
        method, where, scale = key.split("|")
        other = sweep.get(f"svd|{where}|{scale}")
        if method == "qr" and other:
            gain_qr, gain_svd = r["forget_loss"] - base["forget_loss"], other["forget_loss"] - base["forget_loss"]
            if abs(gain_svd) > 1e-9:
                print(f"forgetting QR / SVD ({where}, x{scale}): {gain_qr / gain_svd:.3f} "
                      f"(gains {gain_qr:.3f} / {gain_svd:.3f})")
    for method, a in state.get("angles", {}).items():
        print(f"{method}: largest principal angle over layers {a['max_angle_deg']} (degrees), decomposition seconds "
              f"{a['decomposition_seconds']}, mean rank {a['mean_rank']}")
    evals = state.get("eval", {})
    if evals:
        keys = ["forget_probability", "forget_rouge_l", "forget_truth_ratio", "model_utility", "forget_loss",
                "retain_loss", "edit_seconds", "edit_cpu_seconds", "train_seconds", "train_cpu_seconds"]
        print("\n| model | " + " | ".join(keys) + " |")
        print("|---|" + "---|" * len(keys))
        for label, r in evals.items():
            cells = [f"{r[k]:.4g}" if isinstance(r.get(k), (int, float)) else "-" for k in keys]
            print(f"| {label} | " + " | ".join(cells) + " |")
        base_row = evals.get("fine-tuned")
        s = state.get("eval_scale")
        qr, svd = evals.get(f"qr all x{s:g}"), evals.get(f"svd all x{s:g}")
        if base_row and qr and svd:
            for metric in ("forget_probability", "forget_rouge_l"):
                dq, ds = base_row[metric] - qr[metric], base_row[metric] - svd[metric]
                if abs(ds) > 1e-12:
                    print(f"{metric} drop QR / SVD = {dq / ds:.3f} ({dq:.4f} / {ds:.4f}); within 5%: "
                          f"{abs(dq / ds - 1) <= 0.05}")
        loc = evals.get(f"qr localized x{state.get('localized_eval_scale', 0):g}")
        if qr and loc:
            print(f"localised QR x{state['localized_eval_scale']:g} vs all-layer QR x{s:g}: forget loss "
                  f"{loc['forget_loss']:.3f} vs {qr['forget_loss']:.3f}, model utility {loc['model_utility']:.4f} vs "
                  f"{qr['model_utility']:.4f}, retain loss {loc['retain_loss']:.3f} vs {qr['retain_loss']:.3f}")
        if "MASC" in evals and qr:
            m = evals["MASC"]
            task = sum(state["task_seconds"].values())
            print(f"wall clock: QR edit {qr['edit_seconds']:.1f} s (+ {task:.0f} s of task LoRA fine-tunes) vs MASC "
                  f"train() {m['train_seconds']:.1f} s ({m['steps']} steps); CPU: QR edit "
                  f"{qr.get('edit_cpu_seconds', float('nan')):.1f} s vs MASC {m.get('train_cpu_seconds', float('nan')):.1f} s")


if __name__ == "__main__":
    sys.exit(main())
