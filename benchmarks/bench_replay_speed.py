"""Replay at training speed (issue #24 item 6): CPU time of a replayed optimizer step against a recorded one.

    PYTHONPATH=. python benchmarks/bench_replay_speed.py [--model tiny|PATH] [--steps 40] [--repeats 3]
        [--batch 8] [--accum 2] [--max-length 128] [--profile] [--dummy-every-microbatch]

``--dummy-every-microbatch`` deletes one row of every microbatch instead of one row of step 0, so every replayed
microbatch holds a dummy and runs the dummy-gradient check (issue #31: a second collation to locate the dummies, a
hook on the input embeddings' output, one read of the flag): the check's worst case.

Each repeat records a run with ``TraceRecordingTrainer`` (checkpoints only at step 0 and the end), then replays all
of it the way a deletion does (``ReplayTrainer`` from step 0 with one row of step 0 deleted, writing its output
run), one after the other in one process. Per optimizer step it takes the process CPU time (user + system, one
torch thread) between consecutive steps: the recording's from ``on_step_end`` to ``on_step_end`` (data loading,
trace writing, forward, backward, clipping, optimizer step), the replay's from one segment to the next (plan and WAL
writing, row lookup, collation, forward, backward, clipping, optimizer step). The first step of each is dropped
(warm-up). It prints the median and mean per-step ratio replay / recording for each repeat, and the one-off costs
outside the steps: the replay's checks before any compute (integrity, MACs, store binding, the start checkpoint's
hashes, every untouched microbatch collated against its recorded digest) and the recorder's set-up and sealing.
``--profile`` prints where the replay's per-step time goes beyond the model (cProfile, top functions).
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="'tiny' (a 2-layer Llama, hidden 64) or a model folder")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--dummy-every-microbatch", action="store_true",
                   help="delete one row of every microbatch (every replayed microbatch runs the dummy-gradient check)")
    p.add_argument("--tmp", default=None, help="scratch folder (default: a temporary one, removed)")
    a = p.parse_args(argv)

    import datasets
    import torch
    import transformers
    from transformers import TrainerCallback, TrainingArguments

    torch.set_num_threads(a.threads)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    from hf_unlearn import QACollator, TraceRecordingTrainer, load_tofu, tokenize_qa
    from hf_unlearn.trace import ReplayTrainer, open_run

    rows = a.batch * a.accum * a.steps
    if a.model == "tiny":
        from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer

        raw = load_tofu("full").select(range(min(rows, 4000)))
        tok = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in raw], vocab_size=1024)

        def new_model():
            return build_tiny_model("llama", tok, hidden_size=64, num_layers=2, num_heads=4, seed=0)
    else:
        from hf_unlearn import load_model, load_tokenizer

        raw = load_tofu("full").select(range(min(rows, 4000)))
        tok = load_tokenizer(a.model)

        def new_model():
            return load_model(a.model)
    data = tokenize_qa(raw, tok, max_length=a.max_length)
    collator = QACollator.from_tokenizer(tok)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ticks = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ticks.append(time.process_time())

    class TimedReplay(ReplayTrainer):
        ticks: list

        def _run_segment(self, model, seg):
            self.ticks.append(time.process_time())  # successive starts: one whole step of the replay loop
            return super()._run_segment(model, seg)

        def _check_dummy_gradient(self, e, watch, loss):
            checked.append(e.mb)
            return super()._check_dummy_gradient(e, watch, loss)

    tmp = Path(tempfile.mkdtemp(prefix="bench_replay_", dir=a.tmp))
    results = []
    try:
        for r in range(a.repeats):
            out = tmp / f"rec{r}"
            args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=a.batch,
                                     gradient_accumulation_steps=a.accum, max_steps=a.steps, learning_rate=2e-4,
                                     warmup_steps=2, max_grad_norm=1.0, report_to=[], use_cpu=True, seed=0,
                                     disable_tqdm=True, logging_strategy="no", save_strategy="no",
                                     dataloader_drop_last=True)
            clock = StepClock()
            rec = TraceRecordingTrainer(model=new_model(), args=args, train_dataset=data, data_collator=collator,
                                        trace_checkpoint_steps=a.steps, callbacks=[clock])
            c = time.process_time()
            rec.train()
            rec_total = time.process_time() - c
            run = open_run(out / "trace")
            forget = run.ids_at_steps([0])[:1]
            if a.dummy_every_microbatch:  # the first row of each microbatch (plan order)
                ids, forget = iter(run.ids_at_steps(range(run.total_steps))), []
                for e in run.plan:
                    chunk = [next(ids) for _ in e.slots]
                    forget.append(chunk[0])
            checked = []
            c = time.process_time()
            replay = TimedReplay(run, forget_ids=forget, start="full", out_dir=tmp / f"replay{r}")
            checks = time.process_time() - c
            replay.ticks = []
            profiler = None
            if a.profile and r == a.repeats - 1:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            c = time.process_time()
            replay.train()
            end = time.process_time()
            if profiler is not None:
                profiler.disable()
            # from step 1 to the last step's start: the warm-up step and the final checkpoint left out of both
            rec_steps = [y - x for x, y in zip(clock.ticks[:-1], clock.ticks[1:])][:-1]
            rep_steps = [y - x for x, y in zip(replay.ticks[1:], replay.ticks[2:])]
            row = {"rec_median": statistics.median(rec_steps), "rep_median": statistics.median(rep_steps),
                   "rec_mean": statistics.mean(rec_steps), "rep_mean": statistics.mean(rep_steps),
                   "checks": checks, "rec_fixed": rec_total - sum(rec_steps) - (clock.ticks[1] - clock.ticks[0]),
                   "replay_total": end - c}
            row["checked"] = len(checked)
            results.append(row)
            print(f"repeat {r}: {len(checked)} of {len(run.plan)} microbatches checked for the dummies' gradient; recorded step {1e3 * row['rec_median']:.2f} ms (mean {1e3 * row['rec_mean']:.2f}), "
                  f"replayed step {1e3 * row['rep_median']:.2f} ms (mean {1e3 * row['rep_mean']:.2f}): ratio "
                  f"{row['rep_median'] / row['rec_median']:.3f} median, {row['rep_mean'] / row['rec_mean']:.3f} mean; "
                  f"replay checks before compute {row['checks']:.2f} s, recorder set-up and sealing "
                  f"{row['rec_fixed']:.2f} s (CPU)", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(tmp / f"replay{r}", ignore_errors=True)
            if profiler is not None:
                import pstats

                stats = pstats.Stats(profiler).sort_stats("cumulative")
                stats.print_stats(r"hf_unlearn|trainer\.py|accelerate|datasets|traceback|warnings", 30)
        med = statistics.median(x["rep_median"] / x["rec_median"] for x in results)
        mean = statistics.median(x["rep_mean"] / x["rec_mean"] for x in results)
        print(f"\n{a.model}: {a.steps} optimizer steps of {a.batch} x {a.accum} rows; replayed / recorded step CPU time "
              f"(median of {a.repeats} repeats): {med:.3f} (per-step medians), {mean:.3f} (per-step means); "
              f"target 1.03: {'met' if max(med, mean) <= 1.03 else 'NOT met'}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
