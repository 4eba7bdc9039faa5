"""What a proof and the environment probe cost (issue #41): ``trace prove`` against the recorded steps' training
compute (goal <= 1.05x), and the probe a deletion runs before any compute against two steps' compute (goal <= 1).

    PYTHONPATH=. python benchmarks/bench_trace_proof.py [--family llama] [--hidden 256] [--layers 4] [--steps 32]
                                                        [--every 8] [--micro 1] [--repeats 3] [--threads 1]
                                                        [--smollm2 DIR]

One run is recorded (``trace_self_check=1``: no proof at the end), then the arms alternate (order swapped every
repeat): a plain ``Trainer`` run of the same model, data, arguments and step count (the recorded steps' training
compute, no recording), ``prove(RUN)`` (the default: one replay from step 0 with the per-step fingerprints),
``prove(RUN, fresh_starts=True)`` (``--fresh-starts``: one more step from each kept checkpoint after step 0; both
with ``seal=False``, so each proves from scratch),
``probe_environment(RUN)`` (what ``forget`` adds before any compute when its start is proven or its replay's first
step proves it) and the worst case of a fresh start whose first step is affected: the environment probe with that
checkpoint's step added (``before_deletion``: one more step from that checkpoint with no deletion, a model rebuilt and
the checkpoint loaded), at the latest kept checkpoint after step 0 that is not already a probe step. CPU time (user +
system of this process) is the steadier measure on a shared machine; wall time is shown too. Ratios per repeat and medians.
``--micro 1``: one microbatch of 4 x 128 tokens per optimizer step (``gradient_accumulation_steps=1``); ``--micro 4``
with accumulation.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(SHARED / "data"))
warnings.filterwarnings("ignore")


def _model(args, tok):
    if args.smollm2:
        from hf_unlearn.models import load_model

        return load_model(args.smollm2)
    from hf_unlearn.models import build_tiny_model

    return build_tiny_model(args.family, tok, hidden_size=args.hidden, num_layers=args.layers, num_heads=4)


def _targs(args, out):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=args.micro,
                             max_steps=args.steps, learning_rate=1e-4, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, disable_tqdm=True, logging_strategy="no")


def _timed(fn) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="llama")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--micro", type=int, default=1, help="microbatches per optimizer step (accumulation)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smollm2", default=None, help="a local SmolLM2-135M folder (full fine-tune)")
    args = p.parse_args(argv)
    from hf_unlearn.runtime import quiet_benchmark

    quiet_benchmark(args.threads)
    from transformers import Trainer

    from hf_unlearn.data import QACollator, load_tofu, tokenize_qa
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.models import build_tiny_tokenizer, load_tokenizer
    from hf_unlearn.trace import TraceRecordingTrainer, open_run
    from hf_unlearn.trace.proof import probe_environment, probe_steps, prove

    rows = load_tofu("full", SHARED / "data" / "tofu").select(range(4 * args.micro * args.steps))
    tok = load_tokenizer(args.smollm2) if args.smollm2 else build_tiny_tokenizer(
        [r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
    data = tokenize_qa(rows, tok, max_length=128)
    work = Path(tempfile.mkdtemp(prefix="bench_proof_"))
    try:
        run = work / "rec" / "trace"
        TraceRecordingTrainer(model=_model(args, tok), args=_targs(args, work / "rec"), train_dataset=data,
                              data_collator=QACollator.from_tokenizer(tok), trace_dir=run,
                              trace_checkpoint_steps=args.every, trace_self_check=1).train()

        def plain():
            out = work / "plain"
            Trainer(model=_model(args, tok), args=_targs(args, out), train_dataset=data,
                    data_collator=_DropIds(QACollator.from_tokenizer(tok))).train()
            shutil.rmtree(out, ignore_errors=True)

        opened = open_run(run).kept()
        chosen = probe_steps(opened)
        later = [c for c in sorted(opened.checkpoints()) if 0 < c < opened.total_steps]
        worst = next((c for c in reversed(later) if c not in chosen), later[-1] if later else None)

        def probe_b():  # a fresh start at `worst` whose first step is affected (hf_unlearn.trace.proof.before_deletion)
            probe_environment(opened, fresh_start=worst)

        # seal=False: each proof from scratch (a sealed proof would let --fresh-starts prove the fresh starts only)
        arms = {"train": plain, "prove": lambda: prove(run, progress=False, seal=False),
                "prove_fresh": lambda: prove(run, progress=False, seal=False, fresh_starts=True),
                "probe": lambda: probe_environment(run), **({"probe_b": probe_b} if worst is not None else {})}
        ratios = {name: [] for name in arms if name != "train"}
        for r in range(args.repeats):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            t = {name: _timed(arms[name]) for name in order}
            step = t["train"][0] / args.steps
            for name in ratios:
                ratios[name].append(t[name][0] / (t["train"][0] if name.startswith("prove") else 2 * step))
            print(f"repeat {r}: training {t['train'][0]:.1f} s CPU ({t['train'][1]:.1f} s wall); "
                  + "; ".join(f"{name} {t[name][0]:.2f} s CPU ({t[name][1]:.2f} s wall) = {ratios[name][-1]:.3f}x "
                              + ("training" if name.startswith("prove") else f"two steps ({2 * step:.2f} s CPU)")
                              for name in ratios), flush=True)
        what = "SmolLM2-135M" if args.smollm2 else f"{args.family} hidden {args.hidden} x {args.layers} layers"
        med = {name: statistics.median(v) for name, v in ratios.items()}
        print(f"{what}, {args.steps} steps of {args.micro} microbatch(es) of 4 x <=128 tokens, a checkpoint every "
              f"{args.every} (kept after step 0: {later}; probe steps {chosen}): prove / training {med['prove']:.3f}x "
              f"(goal <= 1.05x); prove --fresh-starts / training {med['prove_fresh']:.3f}x; probe / two steps "
              f"{med['probe']:.2f}x (goal <= 1)"
              + (f"; probe with a fresh start at checkpoint {worst} (its first step affected) / two steps "
                 f"{med['probe_b']:.2f}x" if "probe_b" in med else "")
              + f" [medians of {args.repeats}, CPU time]")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
