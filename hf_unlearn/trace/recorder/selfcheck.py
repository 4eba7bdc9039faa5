"""The self-check's reference: the state hashes after the first step(s), kept in memory on every process, which
the replay engine is compared with when ``train()`` ends (:mod:`hf_unlearn.trace.recording`, above the engine)."""

from __future__ import annotations

import json

from ..checkpoints import capture_state, checkpoint_dir, run_uses_plain_names
from ..fidelity import SELF_CHECK_STEPS, in_memory_reference
from ..hashing import checkpoint_hashes


def steps(trainer) -> int | None:
    """N of the self-check (steps 0..N reproduced), None when it does not run (off, a replay)."""
    if trainer._is_replay or not trainer.trace_self_check or trainer.trace_self_check == "all":
        return None
    return SELF_CHECK_STEPS if trainer.trace_self_check is True else int(trainer.trace_self_check)


def keep_reference(trainer, step: int) -> None:
    """Keep the state hashes after ``step`` optimizer steps for the self-check: the checkpoint's just written
    at that step, else hashed from the live state now (no file: the self-check compares in memory). With more
    than one process every process hashes the live state (each replays the self-check; under FSDP2 the hashes
    gather each tensor: a collective)."""
    if step in trainer._trace_saved and trainer.accelerator.num_processes == 1:
        hashes = json.loads((checkpoint_dir(trainer.trace_dir, step) / "hashes.json").read_text())
    else:
        model = trainer.accelerator.unwrap_model(trainer.model)
        writer = trainer._trace_writer  # the run's hash rule (a resumed run recorded before the plain rule: its own)
        plain = writer.frozen.plain if writer is not None else run_uses_plain_names(trainer.trace_dir)
        hashes = checkpoint_hashes(capture_state(model, trainer.optimizer, step), plain=plain)
    trainer._trace_check_ref = in_memory_reference(step, hashes)


def peer(trainer) -> bool:
    """A process other than the main one of a multi-process recording (DDP or FSDP2)."""
    return trainer._trace_started and not trainer.accelerator.is_main_process and not trainer._is_replay

