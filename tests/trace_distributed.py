"""Run by every process of ``accelerate launch --multi_gpu --num_processes 2`` (CPU, gloo) in the trace tests.

    accelerate launch --multi_gpu --num_processes 2 tests/trace_distributed.py OUT [SINGLE_PROCESS_RUN]

Records a data-parallel run, then honours a deletion with the CLI's replay and oracle (both under the same
launch), replays the run without deletions, and tries to replay a single-process run at world size 2. Process 0
writes what happened to OUT/result.json for the test to check.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def main(out: Path, single_run: str | None) -> None:
    import torch
    from accelerate import PartialState

    from hf_unlearn.cli import main as cli
    from hf_unlearn.data import QACollator
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import ReplayTrainer, TraceRecordingTrainer, open_run, redact_store
    from hf_unlearn.trace.run import load_checkpoint
    from hf_unlearn.trace.verification import compare_states, verify

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.test_trace_common import get_trace_data, tiny, train_args

    torch.set_num_threads(1)
    state = PartialState(cpu=True)
    tok, data = get_trace_data()
    data = data.select(range(32))
    trace = out / "trace"
    trainer = TraceRecordingTrainer(model=tiny(tok, dropout=0.1), args=train_args(out / "ft", per_device_train_batch_size=2,
                                    max_steps=4), train_dataset=data, data_collator=QACollator.from_tokenizer(tok),
                                    trace_dir=trace, trace_checkpoint_steps=2)
    trainer.train()
    state.wait_for_everyone()
    run = open_run(trace)
    forget = run.ids_at_steps([3])[:1]
    if state.is_main_process:
        write_ids(out / "forget.jsonl", forget)
        redact_store(run.store_path, forget, out / "store", run.key)  # a one-process command
    state.wait_for_everyone()
    f = str(out / "forget.jsonl")
    codes = [cli(["trace", "replay", str(trace), "--store", str(out / "store"), "--forget", f, "--out", str(out / "replay")]),
             cli(["trace", "oracle", str(trace), "--forget", f, "--out", str(out / "oracle")])]
    again = ReplayTrainer(trace, start="full").train()
    refused = None
    if single_run:
        try:
            ReplayTrainer(single_run, start="full")
        except UnlearnError as e:
            refused = str(e)
    state.wait_for_everyone()
    if state.is_main_process:
        report = verify(out / "replay", out / "oracle")
        result = {
            "codes": codes, "verified": report["verified"], "elements": report["params"]["elements"],
            "header_world_size": run.header["world_size"], "ranks": [e.ranks for e in run.plan],
            "batch_digests": [len(e.batch) for e in run.plan], "forget": forget,
            "reproduces_recording": compare_states(again, load_checkpoint(run.final_checkpoint()))["identical"],
            "oracle_differs_from_recording": not compare_states(load_checkpoint(run.final_checkpoint()),
                                                                 load_checkpoint(open_run(out / "oracle").final_checkpoint())
                                                                 )["identical"],
            "refused_single_process_run": refused,
            "self_check": run.header["fidelity"]["recording"],  # every process replayed it, the main one sealed it
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
