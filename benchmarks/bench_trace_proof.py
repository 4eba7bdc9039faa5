"""What a proof and the environment probe cost (issue #41): ``trace prove`` against the recorded steps' training
compute (goal <= 1.05x), and the probe a deletion runs before any compute against two steps' compute (goal <= 1).

    PYTHONPATH=. python benchmarks/bench_trace_proof.py [--family llama] [--hidden 256] [--layers 4] [--steps 32]
                                                        [--every 8] [--micro 1] [--repeats 3] [--threads 1]
                                                        [--smollm2 DIR]

One run is recorded (``trace_self_check=1``: no proof at the end), then the arms alternate (order swapped every
repeat): a plain ``Trainer`` run of the same model, data, arguments and step count (the recorded steps' training
compute, no recording), ``prove(RUN)`` (one replay from step 0, the per-step fingerprints, each kept checkpoint's
fresh start), and ``probe_environment(RUN)`` (what ``forget`` adds before any compute). CPU time (user + system of
this process) is the steadier measure on a shared machine; wall time is shown too. Ratios per repeat and medians.
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
    from hf_unlearn.trace import TraceRecordingTrainer
    from hf_unlearn.trace.proof import probe_environment, prove

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

        arms = {"train": plain, "prove": lambda: prove(run, progress=False), "probe": lambda: probe_environment(run)}
        ratios = {"prove": [], "probe": []}
        for r in range(args.repeats):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            t = {name: _timed(arms[name]) for name in order}
            step = t["train"][0] / args.steps
            ratios["prove"].append(t["prove"][0] / t["train"][0])
            ratios["probe"].append(t["probe"][0] / (2 * step))
            print(f"repeat {r}: training {t['train'][0]:.1f} s CPU ({t['train'][1]:.1f} s wall), prove "
                  f"{t['prove'][0]:.1f} s CPU ({t['prove'][1]:.1f} s wall): {ratios['prove'][-1]:.3f}x; probe "
                  f"{t['probe'][0]:.2f} s CPU ({t['probe'][1]:.2f} s wall) = {ratios['probe'][-1]:.2f} x two steps' "
                  f"compute ({2 * step:.2f} s CPU)", flush=True)
        what = "SmolLM2-135M" if args.smollm2 else f"{args.family} hidden {args.hidden} x {args.layers} layers"
        print(f"{what}, {args.steps} steps of {args.micro} microbatch(es) of 4 x <=128 tokens, a checkpoint every "
              f"{args.every}: prove / training {statistics.median(ratios['prove']):.3f}x (goal <= 1.05x); probe / two "
              f"steps {statistics.median(ratios['probe']):.2f}x (goal <= 1) [medians of {args.repeats}, CPU time]")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
