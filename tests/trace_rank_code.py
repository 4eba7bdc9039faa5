"""Run by every process of ``torchrun --nproc_per_node 2`` (CPU, gloo) in tests/test_trace_program_code.py.

    torchrun --nproc_per_node 2 tests/trace_rank_code.py OUT RANK

A data-parallel recording stopped after optimizer step 2 (an early stop: the Trainer checkpoints there), then resumed
from ``checkpoint-2`` in the same processes, process RANK alone having patched
``transformers.loss.loss_utils.fixed_cross_entropy`` (a wrapper that computes the same). Each process writes what its
resume did to OUT/resume-RANK.json: ``{"error": "..."}`` or ``{"trained": true}``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(out: Path, patched: int) -> None:
    import torch
    from accelerate import PartialState
    from transformers import TrainerCallback
    from transformers.loss import loss_utils

    from hf_unlearn.data import QACollator
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import TraceRecordingTrainer
    from tests.test_trace_common import get_trace_data, tiny, train_args

    torch.set_num_threads(1)
    state = PartialState(cpu=True)
    tok, data = get_trace_data()

    class StopAt2(TrainerCallback):  # watched: not part of the run's record, so the resume may leave it out
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    def trainer(*callbacks):
        return TraceRecordingTrainer(model=tiny(tok), args=train_args(out / "ft", per_device_train_batch_size=2,
                                                                      gradient_accumulation_steps=1, max_steps=4,
                                                                      save_strategy="steps", save_steps=2),
                                     train_dataset=data.select(range(16)), data_collator=QACollator.from_tokenizer(tok),
                                     trace_dir=out / "trace", trace_checkpoint_steps=2, callbacks=list(callbacks))

    trainer(StopAt2()).train()
    if state.process_index == patched:  # this process alone runs other code than the first launch did
        original = loss_utils.fixed_cross_entropy
        loss_utils.fixed_cross_entropy = lambda *a, **k: original(*a, **k)
    result: dict = {}
    try:
        trainer().train(resume_from_checkpoint=str(out / "ft" / "checkpoint-2"))
        result["trained"] = True
    except UnlearnError as e:
        result["error"] = str(e)
    (out / f"resume-{state.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
