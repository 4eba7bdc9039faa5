"""Exact deletion for trl.SFTTrainer: recording overhead against a plain SFTTrainer with the same checkpoint cadence,
and a late deletion (suffix replay) against the oracle.

    PYTHONPATH=. python benchmarks/bench_trace_sft.py [--steps 6] [--every 3] [--repeats 2] [--padding-free]

Two configurations alternate (order rotated per repeat; the minimum of the repeats is reported, the ratio side by
side): a plain ``SFTTrainer`` saving a resumable checkpoint every ``--every`` steps (model + optimizer + scheduler +
RNG), and ``trace_recording(SFTTrainer)`` with ``trace_checkpoint_steps=--every`` (no Trainer checkpoints). Both
start from the same weights, on TOFU prompt-completion rows (completion-only loss), batch 4 x accumulation 2,
``max_length`` 128, fp32, SFTConfig's defaults otherwise (activation checkpointing on). CPU time is user + system of
this process (the steadier measure on a shared machine); wall time is shown too. ``--padding-free`` records with
``padding_free=True`` (each microbatch packed into one sequence with position ids).
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
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default=str(SHARED / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--tmp", default=None, help="scratch folder (checkpoints: ~1.6 GB each at 135M parameters)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a shared 2-core machine: 1)")
    p.add_argument("--padding-free", action="store_true")
    a = p.parse_args()
    import datasets
    import torch

    torch.set_num_threads(a.threads)
    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
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

    tmp = Path(tempfile.mkdtemp(prefix="bench_sft_", dir=a.tmp))
    try:
        tok = load_tokenizer(a.model)
        base = load_model(a.model)
        rows = load_tofu("full").select(range(8 * a.steps))
        data = Dataset.from_dict({"id": rows["id"], "prompt": rows["question"],
                                  "completion": [" " + x for x in rows["answer"]]})

        def run(kind: str, out: Path) -> tuple[float, float]:
            checkpoints = kind == "sft+ckpt"
            args = SFTConfig(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=a.steps, learning_rate=2e-5, warmup_steps=1, max_grad_norm=1.0, report_to=[],
                             use_cpu=True, bf16=False, seed=0, disable_tqdm=True, logging_strategy="no",
                             max_length=None if a.padding_free else 128, padding_free=a.padding_free,
                             save_strategy="steps" if checkpoints else "no", save_steps=a.every)
            model = copy.deepcopy(base)
            t, c = time.perf_counter(), time.process_time()  # dataset preparation included, as a user sees it
            if kind == "trace":
                trainer = trace_recording(SFTTrainer)(model=model, args=args, train_dataset=data, processing_class=tok,
                                                      trace_dir=out / "trace", trace_checkpoint_steps=a.every)
            else:
                trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
            trainer.train()
            return time.perf_counter() - t, time.process_time() - c

        kinds = ["sft+ckpt", "trace"]
        times = {k: [] for k in kinds}
        for r in range(a.repeats):
            for kind in kinds[r % 2:] + kinds[:r % 2]:
                out = tmp / f"{kind}-{r}"
                times[kind].append(run(kind, out))
                print(f"repeat {r} {kind:9s} wall {times[kind][-1][0]:7.1f} s  CPU {times[kind][-1][1]:7.1f} s", flush=True)
                if not (kind == "trace" and r == a.repeats - 1):
                    shutil.rmtree(out, ignore_errors=True)
        print(f"\nrecording overhead, {a.steps} optimizer steps of 8 rows, checkpoints every {a.every} steps "
              f"(min of {a.repeats}):")
        for i, clock in enumerate(("wall", "CPU")):
            best = {k: min(x[i] for x in v) for k, v in times.items()}
            print(f"  {clock:4s} SFTTrainer+checkpoints {best['sft+ckpt']:7.1f} s, trace_recording(SFTTrainer) "
                  f"{best['trace']:7.1f} s, ratio {best['trace'] / best['sft+ckpt']:.3f}")

        run_ = open_run(tmp / f"trace-{a.repeats - 1}" / "trace")
        forget = run_.ids_at_steps([run_.total_steps - 1])[:2]
        cost = replay_cost(run_, forget)
        redact_store(run_.store_path, forget, tmp / "store", run_.key)
        t, c = time.perf_counter(), time.process_time()
        RedactedReplayTrainer(run_, tmp / "store", forget, tmp / "replay").train()
        replay_s = (time.perf_counter() - t, time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        OracleReplayTrainer(run_, forget, out_dir=tmp / "oracle").train()
        oracle_s = (time.perf_counter() - t, time.process_time() - c)
        report = verify_replay(tmp / "replay", tmp / "oracle")
        p_, o_ = report["params"], report["optimizer"]
        print(f"\nlate deletion of {len(forget)} rows: suffix replay of {cost['steps_to_replay']} of {cost['total_steps']} "
              f"steps {replay_s[1]:.0f} s CPU ({replay_s[0]:.0f} s wall), oracle (full replay) {oracle_s[1]:.0f} s CPU "
              f"({oracle_s[0]:.0f} s wall), ratio {replay_s[1] / oracle_s[1]:.2f}; {p_['mismatched_elements']} of "
              f"{p_['elements']:,} parameter and {o_['mismatched_elements']} of {o_['elements']:,} optimizer elements "
              f"differ -> {'VERIFIED' if report['verified'] else 'NOT VERIFIED'}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
