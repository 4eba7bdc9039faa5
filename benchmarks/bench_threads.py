"""Thread oversubscription: the demo's fine-tune under artificial CPU load, with several thread settings side by side.

Why: on a shared 2-core machine the demo's fine-tune once ran 20x slower than on an idle one (436 s vs 22 s at a
load of about 5), far more than the 2-3x that sharing the cores explains. This script starts ``--loads`` busy
processes (a pure-Python spin loop each), then times the same training steps in a fresh interpreter per setting,
interleaving the settings round by round so that every setting sees the same background:

* ``default``: torch's own choice (one OpenMP thread per core, libgomp's default spin-then-sleep waiting);
* ``1``: ``OMP_NUM_THREADS=1``;
* ``cores-load``: ``OMP_NUM_THREADS=max(1, cores - load)``;
* ``passive``: default threads with ``OMP_WAIT_POLICY=PASSIVE`` (idle OpenMP threads sleep instead of spinning);
* ``auto``: what hf_unlearn's CLI does when the user set nothing (:func:`hf_unlearn.runtime.configure_threads`).

    PYTHONPATH=. python benchmarks/bench_threads.py                        # loads 0,2,4; 3 rounds; ~10 min on 2 cores
    PYTHONPATH=. python benchmarks/bench_threads.py --loads 0,4 --rounds 2 --steps 30

It prints milliseconds per step (median and range over rounds) and each setting's time relative to torch's default
at the first load level (on a quiet machine, pass ``--loads 0,...`` to make that the idle reference).
Nothing is written inside the repository; ``--json PATH`` saves the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = ("default", "1", "cores-load", "passive", "auto")


def worker(steps: int, warmup: int) -> None:
    """Run the demo's fine-tune for ``warmup + steps`` optimizer steps and print seconds per measured step."""
    auto = bool(os.environ.get("BENCH_AUTO_THREADS"))
    if auto:  # exactly what the CLI does: the environment before torch loads, the thread count after
        from hf_unlearn.runtime import prepare_environment

        prepare_environment()
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_unlearn.data import QACollator, tokenize_qa
    from hf_unlearn.data.embedded import load_embedded_tofu
    from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer

    if auto:
        from hf_unlearn.runtime import configure_threads

        configure_threads()
    import torch

    transformers.logging.set_verbosity_error()
    rows = load_embedded_tofu(8)
    tok = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
    model = build_tiny_model("llama", tok, hidden_size=128, num_layers=2, num_heads=4)
    data = tokenize_qa(rows, tok, max_length=128).remove_columns(["id"])
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    args = TrainingArguments(output_dir="/tmp/hf_unlearn_bench_threads", max_steps=warmup + steps,
                             per_device_train_batch_size=8, learning_rate=3e-3, save_strategy="no", report_to=[],
                             disable_tqdm=True, logging_strategy="no", use_cpu=True, seed=0)
    Trainer(model=model, args=args, train_dataset=data, data_collator=QACollator.from_tokenizer(tok),
            callbacks=[Clock()]).train()
    per_step = (marks[-1] - marks[warmup - 1]) / steps
    print(json.dumps({"s_per_step": per_step, "torch_threads": torch.get_num_threads()}))


def setting_env(setting: str, load: int, cores: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS",
                                                             "BENCH_AUTO_THREADS")}
    if setting == "1":
        env["OMP_NUM_THREADS"] = "1"
    elif setting == "cores-load":
        env["OMP_NUM_THREADS"] = str(max(1, cores - load))
    elif setting == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif setting == "auto":
        env["BENCH_AUTO_THREADS"] = "1"
    return env


def spin() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loads", default="0,2,4", help="numbers of busy processes, comma-separated (default 0,2,4)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"thread settings (default {','.join(SETTINGS)})")
    p.add_argument("--rounds", type=int, default=3, help="rounds per load (settings interleaved; default 3)")
    p.add_argument("--steps", type=int, default=40, help="measured optimizer steps per run (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured first steps per run (default 5)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.steps, args.warmup)
        return

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    loads = [int(x) for x in args.loads.split(",")]
    settings = [s for s in args.settings.split(",") if s]
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise SystemExit(f"unknown settings {sorted(unknown)}; choose from {', '.join(SETTINGS)}")
    print(f"{cores} cores; load average before starting {os.getloadavg()[0]:.2f}; {args.steps} steps per run",
          flush=True)
    results: dict[int, dict[str, list[float]]] = {}
    threads: dict[tuple[int, str], int] = {}
    for load in loads:
        spinners = [spin() for _ in range(load)]
        try:
            time.sleep(1.0)
            results[load] = {s: [] for s in settings}
            for r in range(args.rounds):
                for s in settings:
                    cmd = [sys.executable, __file__, "--worker", "--steps", str(args.steps), "--warmup",
                           str(args.warmup)]
                    out = subprocess.run(cmd, capture_output=True, text=True, env=setting_env(s, load, cores))
                    if out.returncode != 0:
                        raise SystemExit(f"worker failed ({s}, load {load}):\n{out.stderr[-2000:]}")
                    rec = json.loads(out.stdout.strip().splitlines()[-1])
                    results[load][s].append(rec["s_per_step"])
                    threads[(load, s)] = rec["torch_threads"]
                    print(f"load {load} round {r + 1} {s:10s} threads {rec['torch_threads']}: "
                          f"{rec['s_per_step'] * 1000:.1f} ms/step (load avg {os.getloadavg()[0]:.2f})", flush=True)
        finally:
            for proc in spinners:
                proc.kill()
                proc.wait()

    base = statistics.median(results[loads[0]]["default"]) if "default" in settings else None
    print(f"\n| busy processes | setting | torch threads | ms/step median (min-max) | vs default at {loads[0]} busy |")
    print("|---|---|---|---|---|")
    for load in loads:
        for s in settings:
            v = results[load][s]
            med = statistics.median(v)
            ratio = f"{med / base:.2f}x" if base else "n/a"
            print(f"| {load} | {s} | {threads[(load, s)]} | {med * 1000:.1f} ({min(v) * 1000:.1f}-{max(v) * 1000:.1f}) "
                  f"| {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": cores, "steps": args.steps, "results": {str(k): v for k, v in results.items()},
                       "threads": {f"{k[0]}:{k[1]}": v for k, v in threads.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
