"""Run by every process of ``torchrun --nproc_per_node 2`` (CPU, gloo) in tests/test_trace_env_reads.py.

    torchrun --nproc_per_node 2 tests/trace_rank_reads.py OUT record|forget

``record``: a data-parallel run of a trainer whose ``compute_loss`` reads ``HFU_RANK1_SCALE`` on process 1 only
(and doubles that process's loss on a microbatch holding a row whose labels are all -100: never on the recorded rows).
``forget``: ``hf-unlearn forget --oracle`` of a step-0 row under the launch. Each process writes its outcome to
OUT/PHASE-RANK.json.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_unlearn.trace import TraceRecordingTrainer  # noqa: E402


class Rank1Reads(TraceRecordingTrainer):
    """A user's trainer acting on an environment variable that only process 1 reads."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if int(os.environ["RANK"]) == 1 and os.environ.get("HFU_RANK1_SCALE") \
                and bool((inputs["labels"] == -100).all(dim=-1).any()):
            loss = loss * 2
        return loss


def main(out: Path, phase: str) -> None:
    import contextlib
    import io

    import torch
    from accelerate import PartialState

    from hf_unlearn.cli import main as cli
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import open_run
    from tests import trace_rank_reads as me  # the importable module (this file runs as __main__)
    from tests.test_trace_common import get_trace_data, tiny, train_args

    torch.set_num_threads(1)
    state = PartialState(cpu=True)
    trace = out / "trace"
    result: dict = {}
    if phase == "record":
        tok, data = get_trace_data()
        me.Rank1Reads(model=tiny(tok), args=train_args(out / "ft", per_device_train_batch_size=2, max_steps=2),
                      train_dataset=data.select(range(8)), data_collator=QACollator.from_tokenizer(tok),
                      trace_dir=trace, trace_checkpoint_steps=2).train()
    else:
        ids = out / "ids.jsonl"
        if state.is_main_process:
            ids.write_text("".join(json.dumps(i) + "\n" for i in open_run(trace).ids_at_steps([0])[:1]))
        state.wait_for_everyone()
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            result["code"] = cli(["forget", str(trace), "--ids", str(ids), "--out", str(out / f"del-{phase}"),
                                  "--no-progress", "--oracle"])
        result["err"] = err.getvalue().strip()
    (out / f"{phase}-{state.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
