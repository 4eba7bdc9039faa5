"""Exactness on the real SmolLM2-135M: fine-tune on a TOFU subset with accumulation, delete, replay, verify.

    PYTHONPATH=. python benchmarks/bench_trace_smollm2.py [--rows 8] [--max-length 64]

Slow on CPU (about a minute of training per run, five runs); prints replay == oracle on every element and the
distances of the naive filter and repack counterfactuals.
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--model", default=str(SHARED / "models" / "SmolLM2-135M-Instruct"))
    a = p.parse_args()
    import datasets
    import transformers
    from transformers import TrainingArguments

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
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
    from hf_unlearn.trace import compare_states, filter_counterfactual, open_run, repack_counterfactual, replay_cost
    from hf_unlearn.trace.verification import load_state

    tmp = Path(tempfile.mkdtemp(prefix="bench_smollm2_"))
    try:
        tok = load_tokenizer(a.model)
        model = load_model(a.model)
        rows = load_tofu("full").select(range(a.rows))
        data = tokenize_qa(rows, tok, max_length=a.max_length)
        args = TrainingArguments(output_dir=str(tmp / "ft"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 num_train_epochs=1, learning_rate=2e-5, warmup_steps=1, max_grad_norm=1.0,
                                 report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                                 logging_strategy="no")
        t = time.perf_counter()
        TraceRecordingTrainer(model=model, args=args, train_dataset=data, data_collator=QACollator.from_tokenizer(tok),
                              trace_dir=tmp / "trace", trace_checkpoint_steps=1).train()
        print(f"recorded: {a.rows} rows, batch 2 x accumulation 2, {time.perf_counter() - t:.0f} s")
        run = open_run(tmp / "trace")
        forget = run.ids_at_steps([run.total_steps - 1])[:1]
        cost = replay_cost(run, forget)
        ck = (run.final_checkpoint() / "state.pt").stat().st_size
        prov = (run.path / "wal.bin").stat().st_size + (run.path / "manifest.bin").stat().st_size
        print(f"forget {len(forget)} row(s); suffix replay from step {cost['start_checkpoint']}: "
              f"{cost['steps_to_replay']} of {cost['total_steps']} steps; provenance {prov} B vs checkpoint "
              f"{ck / 1e6:.0f} MB ({100 * prov / ck:.6f}%)")
        redact_store(run.store_path, forget, tmp / "store", run.key)
        RedactedReplayTrainer(run, tmp / "store", forget, tmp / "replay").train()
        OracleReplayTrainer(run, forget, out_dir=tmp / "oracle").train()
        report = verify_replay(tmp / "replay", tmp / "oracle")
        p_, o_ = report["params"], report["optimizer"]
        print(f"replay vs oracle: {p_['mismatched_elements']} of {p_['elements']:,} parameter elements and "
              f"{o_['mismatched_elements']} of {o_['elements']:,} optimizer elements differ -> identical: "
              f"{report['identical']}")
        oracle = load_state(tmp / "oracle")
        for name, state in (("filter", filter_counterfactual(run, forget)),
                            ("repack", repack_counterfactual(run, forget, tmp / "repack"))):
            cmp = compare_states(state, oracle)["params"]
            print(f"{name} vs oracle: {cmp['mismatched_elements']:,} of {cmp['elements']:,} parameter elements differ, "
                  f"L2 {cmp['l2']:.4g}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
