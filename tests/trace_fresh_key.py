"""Run by every process of ``torchrun --nproc_per_node 2`` (CPU, gloo) in tests/test_keys_multiprocess.py.

    torchrun --nproc_per_node 2 tests/trace_fresh_key.py OUT [MODE RANK]

A data-parallel recording (4 optimizer steps, proven when ``train()`` ends) started with ``$HF_UNLEARN_KEY_FILE``
naming a file that does not exist yet. MODE ``proof``: process RANK alone cannot find the run's key when the
end-of-recording proof opens the run (its ``$HF_UNLEARN_KEY_FILE`` names a missing file from then on); ``key``:
process RANK is given another key file from the start. Each process writes OUT/rank-R.json: ``{"error": ...}`` or
``{"trained": true}``, the fingerprint of the run key it finds afterwards, and the warnings about the proof.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(out: Path, mode: str, rank: int) -> None:
    import torch
    from accelerate import PartialState

    import hf_unlearn.trace.recording as recording
    from hf_unlearn.data import QACollator
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.keys import KEY_FILE_ENV, key_fingerprint
    from hf_unlearn.trace import TraceRecordingTrainer
    from hf_unlearn.trace.tags import run_key
    from tests.test_trace_common import get_trace_data, tiny, train_args

    torch.set_num_threads(1)
    state = PartialState(cpu=True)
    mine = state.process_index == rank
    if mine and mode == "key":
        os.environ[KEY_FILE_ENV] = str(out / f"other-{rank}" / "id_tag.key")
    if mine and mode == "proof":  # this process alone loses the key just before the end-of-recording proof
        original = recording.prove_recording

        def without_key(trainer):
            kept = os.environ[KEY_FILE_ENV]
            os.environ[KEY_FILE_ENV] = str(out / "missing" / "id_tag.key")
            try:
                return original(trainer)
            finally:
                os.environ[KEY_FILE_ENV] = kept

        recording.prove_recording = without_key
    tok, data = get_trace_data()
    trainer = TraceRecordingTrainer(model=tiny(tok), args=train_args(out / "ft", per_device_train_batch_size=2,
                                                                     gradient_accumulation_steps=1, max_steps=4),
                                    train_dataset=data.select(range(16)), data_collator=QACollator.from_tokenizer(tok),
                                    trace_dir=out / "trace", trace_checkpoint_steps=2, trace_self_check="all")
    result: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.train()
            result["trained"] = True
        except UnlearnError as e:
            result["error"] = str(e)
    found = run_key(out / "trace", required=False) if (out / "trace" / "header.json").exists() else None
    result["fingerprint"] = key_fingerprint(found) if found else None
    result["warnings"] = [str(w.message) for w in caught if "proven" in str(w.message)]
    (out / f"rank-{state.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(sys.argv[2], int(sys.argv[3])) if len(sys.argv) > 3 else ("fresh", -1))
