"""The recording's self-check: the replay engine replays the run's first step(s) and must reach the state the
recorder hashed in memory (or its first checkpoint). It runs the replay engine, so it sits above it; the recording
calls it when ``train()`` ends."""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import UnlearnError
from .fidelity import FidelityError
from .replay import ReplayTrainer
from .run import open_run


def self_check(run_path: Path, data_collator=None, reference: dict | None = None) -> dict:
    """Replay the run's first step(s) with the replay engine and compare the state with the recording's.

    ``reference`` (:func:`in_memory_reference`): the recorder's own state after step N, hashed in memory while it
    trained; the replay runs steps 0..N from the step-0 checkpoint and must reach those hashes (and every recorded
    checkpoint it passes). Without one (a resumed recording past step N) the first checkpoint interval is replayed
    and compared with the recorded checkpoint. Returns the ``fidelity`` entry the recorder seals into the header.
    """
    started, wall = time.process_time(), time.perf_counter()
    try:  # each process reads the run and its key itself (before any collective of the replay): all must hold them
        run = open_run(run_path)
        _ = run.key
        _first_refusal(None)
    except UnlearnError as e:
        if "another process" not in str(e):
            _first_refusal(e)
        return {"checked": False, "why": f"the replay engine could not replay the run: {e}"}
    cps = sorted(run.checkpoints())
    later = [c for c in cps if c > 0]
    if 0 not in cps or not (later or reference):
        return {"checked": False, "why": "the run has no step-0 checkpoint and a later state to compare with"}
    until = reference["step"] if reference else later[0]
    against = {"against": "the recording's state hashed in memory at that step" if reference else
               "the recorded checkpoint"}
    if reference:
        against["roots"] = {k: reference["hashes"].get(k) for k in ("params_root", "optimizer_root")}
    try:
        try:
            trainer = ReplayTrainer(run, start="full", stop_step=until, data_collator=data_collator, _self_check=True)
        except UnlearnError as e:
            _first_refusal(e)
            raise
        _first_refusal(None)  # every process of a multi-process run replays, or none does
        if reference:
            trainer._fidelity_reference = {until: reference["hashes"]}
        trainer.train()
        result = {"checked": True, "reproduced": True, "steps": [0, until], **against}
    except FidelityError as e:
        result = {"checked": True, "reproduced": False, "steps": [0, until], **against, "why": str(e)}
    except UnlearnError as e:
        result = {"checked": False, "why": f"the replay engine could not replay the run: {e}"}
    result.update(cpu_seconds=round(time.process_time() - started, 3), wall_seconds=round(time.perf_counter() - wall, 3))
    return result


def _first_refusal(error: Exception | None) -> None:
    """With more than one process: raise on every process the first process's refusal to build the self-check's
    replay (else one process would skip the replay while the others wait in its collectives)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if error is None else str(error))
    why = next((w for w in everyone if w), None)
    if why is not None and error is None:
        raise UnlearnError(f"another process could not replay the run: {why}")
