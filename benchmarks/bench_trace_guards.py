"""Recording overhead of the per-step program guards (issue #31): ``TraceRecordingTrainer`` with ``trace_guards=True``
(the default) against ``trace_guards=False``, the same model, data, checkpoint cadence and self-check.

    PYTHONPATH=. python benchmarks/bench_trace_guards.py [--family llama] [--hidden 256] [--layers 4] [--steps 32]
                                                         [--every 8] [--repeats 3] [--threads 1] [--smollm2 DIR]
                                                         [--micro N]

The two arms alternate (order swapped every repeat) and the ratio guards-on / guards-off is printed per repeat and
as the median; CPU time (user + system of this process) is the steadier measure on a shared machine, wall time is
shown too. ``--smollm2 DIR`` records the full fine-tune of a local SmolLM2-135M folder instead of a tiny model.

``--micro N`` measures what the guards add to one optimizer step without recording (steadier on a busy machine):
N alternating repeats of a training step (two microbatches of 4 rows forward and backward, AdamW) and of the
guards' work per step (one cheap snapshot when the batches are fetched, two exact ones around ``optimizer.step()``:
checksums of every parameter, buffer and optimizer-state tensor), CPU time of each, and the ratio.
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


def _record(args, tok, data, guards: bool) -> tuple[float, float]:
    from transformers import TrainingArguments

    from hf_unlearn.data import QACollator
    from hf_unlearn.models import build_tiny_model
    from hf_unlearn.trace import TraceRecordingTrainer

    if args.smollm2:
        from hf_unlearn.models import load_model

        model = load_model(args.smollm2)  # a folder with config and weights, or with one .gguf
    else:
        model = build_tiny_model(args.family, tok, hidden_size=args.hidden, num_layers=args.layers, num_heads=4)
    out = Path(tempfile.mkdtemp(prefix="bench_guards_"))
    try:
        targs = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                  max_steps=args.steps, learning_rate=1e-4, report_to=[], save_strategy="no",
                                  use_cpu=True, seed=0, disable_tqdm=True, logging_strategy="no")
        trainer = TraceRecordingTrainer(model=model, args=targs, train_dataset=data,
                                        data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=args.every,
                                        trace_guards=guards)
        cpu, wall = time.process_time(), time.perf_counter()
        trainer.train()
        return time.process_time() - cpu, time.perf_counter() - wall
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _micro(args, tok, data) -> None:
    import torch

    from hf_unlearn.data import QACollator
    from hf_unlearn.models import build_tiny_model
    from hf_unlearn.trace.guards import snapshot

    if args.smollm2:
        from hf_unlearn.models import load_model

        model = load_model(args.smollm2)  # a folder with config and weights, or with one .gguf
    else:
        model = build_tiny_model(args.family, tok, hidden_size=args.hidden, num_layers=args.layers, num_heads=4)
    collate = QACollator.from_tokenizer(tok)
    rows = [{k: v for k, v in r.items() if k != "id"} for r in data.select(range(8))]
    batches = [collate(rows[:4]), collate(rows[4:])]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()

    def step():
        for b in batches:
            model(**b).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def guards():
        snapshot(model, optimizer)
        snapshot(model, optimizer, exact=True)
        snapshot(model, optimizer, exact=True)

    step()  # the optimizer state exists from here
    times = {"step": [], "guards": []}
    for r in range(args.micro):
        for name, fn in ((("step", step), ("guards", guards)) if r % 2 == 0 else (("guards", guards), ("step", step))):
            cpu = time.process_time()
            fn()
            times[name].append(time.process_time() - cpu)
    s, g = statistics.median(times["step"]), statistics.median(times["guards"])
    tensors = sum(p.numel() for p in model.parameters())
    what = "SmolLM2-135M" if args.smollm2 else f"{args.family} hidden {args.hidden} x {args.layers} layers"
    print(f"{what} ({tensors / 1e6:.1f}M parameters), {args.micro} repeats: training step {s * 1e3:.1f} ms CPU, "
          f"guards per step {g * 1e3:.1f} ms CPU (1 cheap + 2 exact snapshots): step with guards / without "
          f"{(s + g) / s:.3f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="llama")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smollm2", default=None, help="a local SmolLM2-135M folder (full fine-tune)")
    p.add_argument("--micro", type=int, default=0, help="measure the guards' work per step, N repeats (no recording)")
    args = p.parse_args(argv)
    from hf_unlearn.runtime import quiet_benchmark

    quiet_benchmark(args.threads)
    from hf_unlearn.data import load_tofu, tokenize_qa
    from hf_unlearn.models import build_tiny_tokenizer, load_tokenizer

    rows = load_tofu("full", SHARED / "data" / "tofu").select(range(4 * 2 * args.steps))
    tok = load_tokenizer(args.smollm2) if args.smollm2 else build_tiny_tokenizer(
        [r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
    data = tokenize_qa(rows, tok, max_length=128)
    if args.micro:
        _micro(args, tok, data)
        return 0
    ratios = {"cpu": [], "wall": []}
    for r in range(args.repeats):
        times = {}
        for guards in ((True, False) if r % 2 == 0 else (False, True)):
            times[guards] = _record(args, tok, data, guards)
        for k, i in (("cpu", 0), ("wall", 1)):
            ratios[k].append(times[True][i] / times[False][i])
        print(f"repeat {r}: guards on {times[True][0]:.1f} s CPU ({times[True][1]:.1f} s wall), off "
              f"{times[False][0]:.1f} s CPU ({times[False][1]:.1f} s wall): ratio {ratios['cpu'][-1]:.3f}x CPU, "
              f"{ratios['wall'][-1]:.3f}x wall", flush=True)
    what = "SmolLM2-135M" if args.smollm2 else f"{args.family} hidden {args.hidden} x {args.layers} layers"
    print(f"{what}, {args.steps} steps, checkpoint every {args.every}: recording with per-step guards / without: "
          f"median {statistics.median(ratios['cpu']):.3f}x CPU ({', '.join(f'{x:.3f}' for x in ratios['cpu'])}), "
          f"{statistics.median(ratios['wall']):.3f}x wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
