"""Exact deletion on the real SmolLM2-135M: recording overhead against a plain Trainer with the same checkpoint
cadence, provenance size against one checkpoint, and a late deletion verified against the oracle.

    PYTHONPATH=. python benchmarks/bench_trace_smollm2.py [--steps 10] [--every 5] [--repeats 2] [--threads 1]

Three configurations alternate (order rotated per repeat; the minimum of the repeats is reported, ratios side by
side): a plain ``Trainer`` without checkpoints, a plain ``Trainer`` saving a resumable checkpoint every ``--every``
steps (model + optimizer + scheduler + RNG), and ``TraceRecordingTrainer`` with ``trace_checkpoint_steps=--every``
(and no Trainer checkpoints). Every run starts from the same weights. Batch 4 x accumulation 2 of TOFU rows,
128 tokens at most, fp32, on CPU. Wall time and CPU time (user + system of this process) are both reported: on a
shared machine the CPU time is the steadier of the two, the wall time includes waiting for the disk.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(SHARED / "data"))
warnings.filterwarnings("ignore")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--model", default=str(SHARED / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--tmp", default=None, help="scratch folder (checkpoints: ~1.6 GB each)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a shared 2-core machine: 1)")
    a = p.parse_args()

    from hf_unlearn.runtime import quiet_benchmark

    quiet_benchmark(a.threads)
    from transformers import Trainer, TrainingArguments

    from hf_unlearn import (
        OracleReplayTrainer,
        QACollator,
        RedactedReplayTrainer,
        TraceRecordingTrainer,
        load_model,
        load_tofu,
        load_tokenizer,
        redact_store,
        tokenize_qa,
        verify_replay,
    )
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import open_run, replay_cost

    tmp = Path(tempfile.mkdtemp(prefix="bench_smollm2_", dir=a.tmp))
    try:
        tok = load_tokenizer(a.model)
        base = load_model(a.model)
        data = tokenize_qa(load_tofu("full").select(range(8 * a.steps)), tok, max_length=a.max_length)
        collator = QACollator.from_tokenizer(tok)

        def run(kind: str, out: Path) -> tuple[float, float]:
            checkpoints = kind == "trainer+ckpt"
            args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                     max_steps=a.steps, learning_rate=2e-5, warmup_steps=1, max_grad_norm=1.0,
                                     report_to=[], use_cpu=True, seed=0, disable_tqdm=True, logging_strategy="no",
                                     save_strategy="steps" if checkpoints else "no", save_steps=a.every)
            model = copy.deepcopy(base)
            if kind == "trace":
                trainer = TraceRecordingTrainer(model=model, args=args, train_dataset=data, data_collator=collator,
                                                trace_dir=out / "trace", trace_checkpoint_steps=a.every)
            else:
                trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=_DropIds(collator))
            t, c = time.perf_counter(), time.process_time()
            trainer.train()
            return time.perf_counter() - t, time.process_time() - c

        kinds = ["trainer", "trainer+ckpt", "trace"]
        times = {k: [] for k in kinds}
        for r in range(a.repeats):
            order = kinds[r % 3:] + kinds[:r % 3]
            for kind in order:
                out = tmp / f"{kind}-{r}"
                times[kind].append(run(kind, out))
                print(f"repeat {r} {kind:12s} wall {times[kind][-1][0]:7.1f} s  CPU {times[kind][-1][1]:7.1f} s", flush=True)
                if not (kind == "trace" and r == a.repeats - 1):
                    shutil.rmtree(out, ignore_errors=True)
        print(f"\nrecording overhead, {a.steps} optimizer steps of 8 rows, checkpoints every {a.every} steps "
              f"(min of {a.repeats}):")
        for i, clock in enumerate(("wall", "CPU")):
            best = {k: min(x[i] for x in v) for k, v in times.items()}
            for k in kinds:
                print(f"  {clock:4s} {k:12s} {best[k]:7.1f} s   ratio to Trainer {best[k] / best['trainer']:.3f}   "
                      f"ratio to Trainer+checkpoints {best[k] / best['trainer+ckpt']:.3f}")

        trace = tmp / f"trace-{a.repeats - 1}" / "trace"
        run_ = open_run(trace)
        from hf_unlearn.trace.checkpoints import checkpoint_bytes

        ck = checkpoint_bytes(run_.final_checkpoint(), with_frozen=True)
        wal, man = (trace / "wal.bin").stat().st_size, (trace / "manifest.bin").stat().st_size
        from hf_unlearn.trace.plan import plan_file

        plan = plan_file(trace).stat().st_size
        print(f"\nprovenance: WAL {wal} B + manifest {man} B = {100 * (wal + man) / ck:.5f}% of one checkpoint "
              f"({ck / 1e6:.0f} MB, model + AdamW state, tied embedding once); with the plan ({plan} B) "
              f"{100 * (wal + man + plan) / ck:.4f}%; {len(run_.checkpoints())} trace checkpoints")

        forget = run_.ids_at_steps([run_.total_steps - 1])[:2]
        cost = replay_cost(run_, forget)
        redact_store(run_.store_path, forget, tmp / "store", run_.key)
        t = time.perf_counter()
        RedactedReplayTrainer(run_, tmp / "store", forget, tmp / "replay").train()
        replay_s = time.perf_counter() - t
        t = time.perf_counter()
        OracleReplayTrainer(run_, forget, out_dir=tmp / "oracle").train()
        oracle_s = time.perf_counter() - t
        report = verify_replay(tmp / "replay", tmp / "oracle")
        p_, o_ = report["params"], report["optimizer"]
        print(f"\nlate deletion of {len(forget)} rows: suffix replay of {cost['steps_to_replay']} of {cost['total_steps']} "
              f"steps {replay_s:.0f} s, oracle (full replay) {oracle_s:.0f} s; {p_['mismatched_elements']} of "
              f"{p_['elements']:,} parameter and {o_['mismatched_elements']} of {o_['elements']:,} optimizer elements "
              f"differ -> {'VERIFIED' if report['verified'] else 'NOT VERIFIED'}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
