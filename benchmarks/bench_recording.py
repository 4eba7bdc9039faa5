"""Recording overhead: the whole TraceRecordingTrainer (guards, whole-program digests, per-row digests, plan, WAL,
checkpoints) against a plain ``Trainer`` that saves a checkpoint at the same cadence, arms alternating in one run.

    PYTHONPATH=. python benchmarks/bench_recording.py --model tiny --steps 32 --every 4 --accum 1 --pairs 2
    PYTHONPATH=. python benchmarks/bench_recording.py --model smollm2 --steps 32 --every 4 --accum 1 --pairs 2
    PYTHONPATH=. python benchmarks/bench_recording.py --model smollm2 --steps 8 --profile   # where the time goes
    BENCH_WALL=1 ... --profile --profile-out F   # the profile with a wall-clock timer, its pstats kept in F
    ... --profile --profile-arm plain   # the plain Trainer under the same profiler, for the comparison
    ... --step-times   # each arm's wall and CPU time per optimizer step (checkpoint steps stand out)

``smollm2`` is a randomly initialised ``LlamaConfig`` of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3
key/value heads, MLP 1536, vocabulary 49152, tied embeddings): the GGUF weights in /work/shared are quantised,
and the overhead depends on the shape, not on the values. ``tiny`` is the test suite's tiny Llama (hidden 64, 2
layers). Each optimizer step takes ``--accum`` microbatches of 4 rows x 128 tokens (synthetic token ids, every
label counted). Prints wall and CPU (process) time of each arm, the minimum over the pairs, and their ratio.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def build_model(kind: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if kind == "smollm2":
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                             tie_word_embeddings=True, rope_theta=100000.0, pad_token_id=2, bos_token_id=1,
                             eos_token_id=2)
    else:
        config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, pad_token_id=2, bos_token_id=1,
                             eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def dataset(rows: int, length: int = 128):
    import numpy as np
    from datasets import Dataset

    rng = np.random.default_rng(0)
    ids = rng.integers(3, 1000, size=(rows, length)).tolist()
    return Dataset.from_dict({"id": list(range(rows)), "input_ids": ids, "attention_mask": [[1] * length] * rows,
                              "labels": ids})


def make_trainer(kind, model_kind, data, out, steps, every, accum):
    from transformers import Trainer, TrainingArguments

    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import TraceRecordingTrainer

    plain = kind == "plain"
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=accum,
                             max_steps=steps, learning_rate=1e-3, warmup_steps=2, max_grad_norm=1.0, report_to=[],
                             use_cpu=True, seed=0, disable_tqdm=True, logging_strategy="no",
                             save_strategy="steps" if plain else "no", save_steps=every)
    collator = QACollator(pad_token_id=2)
    model = build_model(model_kind)
    if plain:
        return Trainer(model=model, args=args, train_dataset=data, data_collator=_DropIds(collator))
    return TraceRecordingTrainer(model=model, args=args, train_dataset=data, data_collator=collator,
                                 trace_checkpoint_steps=every, trace_checkpoint_retention="even",
                                 trace_self_check=False)


def step_timer():
    """A callback that notes the wall and CPU time at the start of training, the end of each optimizer step and the
    end of training (checkpoint steps stand out; the set-up and the sealing are the first and last parts)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends = []

        def _note(self):
            self.ends.append((time.perf_counter(), time.process_time()))

        def on_train_begin(self, args, state, control, **kwargs):
            self.ends = []
            self._note()

        def on_step_end(self, args, state, control, **kwargs):
            self._note()

        def steps(self, which: int = 0):
            """Seconds per optimizer step (``which``: 0 wall, 1 CPU)."""
            return [round(b[which] - a[which], 2) for a, b in zip(self.ends, self.ends[1:])]

    return StepTimer()


def summarise_steps(times: list[float], every: int) -> str:
    """The first step (the set-up, and the trace's step-0 checkpoint), the median of the ordinary steps and of the
    checkpoint steps: a checkpoint of step k is written after step k's ``on_step_end`` (the Trainer) or as step k + 1
    fetches its batches (the trace), so it lands in the interval that ends at step k + 1."""
    import statistics

    kept = [t for i, t in enumerate(times, 1) if i > 1 and i % every == 1 % every]
    plain = [t for i, t in enumerate(times, 1) if i > 1 and i % every != 1 % every]
    return (f"first step {times[0]:.2f} s, median ordinary step {statistics.median(plain):.2f} s, median checkpoint "
            f"step {statistics.median(kept) if kept else float('nan'):.2f} s")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="profile one recording instead (top functions)")
    p.add_argument("--profile-out", help="with --profile: also write the pstats file here")
    p.add_argument("--profile-arm", choices=["trace", "plain"], default="trace",
                   help="with --profile: which arm to profile (the plain Trainer for the comparison)")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="an untimed plain run of this many steps first: the first arm of a process otherwise pays "
                        "the cold start (seconds on SmolLM2's shape), which favours the other arm")
    p.add_argument("--step-times", action="store_true", help="also print each arm's wall and CPU time per optimizer step")
    a = p.parse_args()
    data = dataset(4 * a.accum * a.steps)
    tmp = Path(tempfile.mkdtemp(prefix="bench_recording_"))
    try:
        if a.profile:
            trainer = make_trainer(a.profile_arm, a.model, data, tmp / "prof", a.steps, a.every, a.accum)
            prof = cProfile.Profile(time.perf_counter if os.environ.get("BENCH_WALL") else time.process_time)
            prof.runcall(trainer.train)
            if a.profile_out:
                prof.dump_stats(a.profile_out)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
            return
        if a.warmup_steps:
            make_trainer("plain", a.model, data, tmp / "warmup", a.warmup_steps, a.every, a.accum).train()
            shutil.rmtree(tmp / "warmup", ignore_errors=True)
        wall, cpu = {"plain": [], "trace": []}, {"plain": [], "trace": []}
        for r in range(a.pairs):
            for kind in (("plain", "trace") if r % 2 == 0 else ("trace", "plain")):
                out = tmp / f"{kind}{r}"
                trainer = make_trainer(kind, a.model, data, out, a.steps, a.every, a.accum)
                timer = step_timer()
                if a.step_times:
                    trainer.add_callback(timer)
                t, c = time.perf_counter(), time.process_time()
                trainer.train()
                wall[kind].append(time.perf_counter() - t)
                cpu[kind].append(time.process_time() - c)
                shutil.rmtree(out, ignore_errors=True)
                print(f"  pair {r} {kind}: wall {wall[kind][-1]:.2f} s, CPU {cpu[kind][-1]:.2f} s", flush=True)
                if a.step_times:
                    for which, name in ((0, "wall"), (1, "CPU")):
                        print(f"    {name} s per step: {timer.steps(which)}; "
                              f"{summarise_steps(timer.steps(which), a.every)}", flush=True)
        print(f"{a.model}, {a.steps} steps, {a.accum} microbatch(es) of 4 x 128 tokens per step, a checkpoint every "
              f"{a.every}, threads {os.environ.get('OMP_NUM_THREADS', 'default')}:")
        for name, d in (("wall", wall), ("CPU", cpu)):
            plain, trace = min(d["plain"]), min(d["trace"])
            print(f"  {name} (min of {a.pairs}): Trainer {plain:.2f} s, TraceRecordingTrainer {trace:.2f} s; "
                  f"ratio {trace / plain:.3f}; per pair {[round(t / q, 3) for t, q in zip(d['trace'], d['plain'])]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
