"""Exact deletion with ``SFTConfig(packing=True)``: the replay cost of a late deletion against the oracle.

    PYTHONPATH=. python benchmarks/bench_trace_packing.py [--steps 8] [--every 2] [--max-length 256] [--strategy bfd]

Records one ``trace_recording(SFTTrainer)`` run with TRL's best-fit-decreasing packing (``--strategy bfd`` or
``bfd_split``; padding-free with position ids, so packed documents do not attend to each other) on TOFU
prompt-completion rows, then deletes one document of the last optimizer step that shares its packed row with other
documents: the redacted store keeps the row with the document's tokens replaced by dummies of the same length. The
suffix replay (from the latest kept checkpoint) and the oracle (a full replay on the original store) run side by
side in this process; CPU time is user + system (the steadier measure on a shared machine), wall time is shown
too, and the two are compared element by element (``VERIFIED`` = bit-identical with the provenance checked).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(SHARED / "data"))
warnings.filterwarnings("ignore")


def timed(fn):
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, (time.perf_counter() - t, time.process_time() - c)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2, help="trace_checkpoint_steps")
    p.add_argument("--max-length", type=int, default=256, help="packed row length")
    p.add_argument("--strategy", default="bfd", choices=["bfd", "bfd_split"])
    p.add_argument("--model", default=str(SHARED / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--tmp", default=None, help="scratch folder (checkpoints: ~1.6 GB each at 135M parameters)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a shared 2-core machine: 1)")
    a = p.parse_args()

    from hf_unlearn.runtime import quiet_benchmark

    quiet_benchmark(a.threads)
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_unlearn import (
        OracleReplayTrainer,
        RedactedReplayTrainer,
        load_model,
        load_tofu,
        load_tokenizer,
        redact_store,
        trace_recording,
        verify_replay,
    )
    from hf_unlearn.trace import open_run, replay_cost
    from hf_unlearn.trace.store import load_store
    from hf_unlearn.trace.tags import tag

    tmp = Path(tempfile.mkdtemp(prefix="bench_packing_", dir=a.tmp))
    try:
        tok = load_tokenizer(a.model)
        rows = load_tofu("full").select(range(24 * a.steps))  # more documents than the run packs: none runs out
        data = Dataset.from_dict({"id": rows["id"], "prompt": rows["question"],
                                  "completion": [" " + x for x in rows["answer"]]})
        args = SFTConfig(output_dir=str(tmp / "rec"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=a.steps, learning_rate=2e-5, warmup_steps=1, max_grad_norm=1.0, report_to=[],
                         use_cpu=True, bf16=False, seed=0, disable_tqdm=True, logging_strategy="no",
                         save_strategy="no", packing=True, packing_strategy=a.strategy, max_length=a.max_length)
        trainer = trace_recording(SFTTrainer)(model=load_model(a.model), args=args, train_dataset=data,
                                              processing_class=tok, trace_dir=tmp / "rec" / "trace",
                                              trace_checkpoint_steps=a.every)
        _, rec_s = timed(trainer.train)
        run = open_run(tmp / "rec" / "trace")
        packing = run.header["dataset"]["packing"]
        print(f"recorded {run.total_steps} optimizer steps ({rec_s[1]:.0f} s CPU, {rec_s[0]:.0f} s wall): "
              f"{packing['documents']} documents in {packing['packed_rows']} packed rows of {a.max_length} tokens "
              f"({a.strategy}), 4 packed rows per step", flush=True)
        store = load_store(run.store_path)
        by_tag = {tag(run.key, i): docs for i, docs in zip(store["id"], store["packed_ids"])}
        last = [by_tag[s] for e in run.plan if e.step == run.total_steps - 1 for s in e.slots]
        docs = next(d for d in last if len(d) > 1)
        forget = [docs[0]]
        cost = replay_cost(run, forget)
        redact_store(run.store_path, forget, tmp / "store", run.key)
        _, replay_s = timed(RedactedReplayTrainer(run, tmp / "store", forget, tmp / "replay").train)
        _, oracle_s = timed(OracleReplayTrainer(run, forget, out_dir=tmp / "oracle").train)
        report = verify_replay(tmp / "replay", tmp / "oracle")
        p_, o_ = report["params"], report["optimizer"]
        print(f"\nlate deletion of 1 document (first affected step {cost['first_affected_step']}, packed with "
              f"{len(docs) - 1} other(s)): suffix replay of {cost['steps_to_replay']} of {cost['total_steps']} steps "
              f"{replay_s[1]:.0f} s CPU ({replay_s[0]:.0f} s wall), oracle (full replay) {oracle_s[1]:.0f} s CPU "
              f"({oracle_s[0]:.0f} s wall): ratio {replay_s[1] / oracle_s[1]:.2f} CPU, "
              f"{replay_s[0] / oracle_s[0]:.2f} wall; steps ratio to the minimum (T - s) "
              f"{cost['ratio_to_minimum']:.2f}; {p_['mismatched_elements']} of {p_['elements']:,} parameter and "
              f"{o_['mismatched_elements']} of {o_['elements']:,} optimizer elements differ -> "
              f"{'VERIFIED' if report['verified'] else 'NOT VERIFIED'}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
