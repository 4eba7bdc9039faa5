"""The self-check: the state hashes after the first step(s), kept in memory, and, when ``train()`` ends, the replay
engine run on the recording (its first steps, or the whole run proven) with the outcome sealed into the header."""

from __future__ import annotations

import json
import time
import warnings

from ...errors import UnlearnError
from ..checkpoints import capture_state, checkpoint_dir
from ..fidelity import SELF_CHECK_STEPS, in_memory_reference, self_check
from ..hashing import checkpoint_hashes
from ..proof import AUTO_PROVE_SECONDS, prove
from ..rng import rng_kept
from ..writer import TraceWriter


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
        hashes = checkpoint_hashes(capture_state(model, trainer.optimizer, step))
    trainer._trace_check_ref = in_memory_reference(step, hashes)


def run(trainer) -> None:
    """Prove the replay engine on this run (its first checkpoint interval) and seal the outcome into it. With more
    than one process (DDP, FSDP2) every process replays at the recorded world size; the main process decides
    whether it runs (and tells the others) and seals the verdict once."""
    if trainer._is_replay or not trainer._trace_started:
        return
    main = trainer.accelerator.is_main_process
    header = trainer._trace_header if main else None
    fid = header.setdefault("fidelity", {}) if main and header.get("sealed") else None
    # fid["recording"] already set: decided when sealing (a buffer changed during training)
    run = [fid is not None and not fid.get("recording") and bool(trainer.trace_self_check),
           bool(main and fid is not None and header["collator"].get("rebuildable")), prove_all(trainer)]
    if trainer.accelerator.num_processes > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(run, src=0)
    record = None
    if run[0] and run[2]:  # the whole run proven (hf_unlearn.trace.proof): every step's state reproduced
        try:
            with rng_kept():
                record = prove(trainer.trace_dir, data_collator=None if run[1] else trainer.data_collator,
                               progress=not trainer.args.disable_tqdm, seal=False)
        except UnlearnError as e:  # a run the engine cannot prove as a whole (a resumed recording without
            # every step's fingerprint, a random collator allowed as a hazard, ...): never a crash at the end of
            # train(); the self-check below decides, as for a longer run, and `trace prove` says why later
            warnings.warn(f"{trainer.trace_dir}: the run was not proven at the end of recording ({e}); the "
                          "first step(s) are self-checked instead", stacklevel=2)
    if record is not None:
        trainer._trace_check_ref = None
        if fid is not None:
            fid["proof"] = record
            # the steps it reproduced from step 0 (a divergence later is the proof's, fidelity.proof: a
            # deletion that passes it is never VERIFIED); one at step 0 refuses every replay, as the self-check's
            upto = (record["steps"] or [0, -1])[1] + 1
            fid["recording"] = {"checked": True, "reproduced": upto > 0,
                                "steps": [0, upto if upto else record["total_steps"]], "by": "proof",
                                "against": "the recording's per-step state fingerprints and kept checkpoints",
                                **({"why": record["diverged"]["why"]} if not upto else {}),
                                "cpu_seconds": record["cpu_seconds"], "wall_seconds": record["wall_seconds"]}
    elif run[0]:
        with rng_kept():
            result = self_check(trainer.trace_dir, data_collator=None if run[1] else trainer.data_collator,
                                reference=trainer._trace_check_ref)
        trainer._trace_check_ref = None
        if fid is not None:
            fid["recording"] = result
    elif fid is not None and not fid.get("recording"):
        fid["recording"] = {"checked": False, "why": "trace_self_check=False"}
    else:
        return
    if fid is not None:
        TraceWriter(trainer.trace_dir, trainer._trace_key).reseal_header(header)


def prove_all(trainer) -> bool:
    """Whether the end of recording proves the whole run: ``trace_self_check="all"``, or the default (True) on a
    run whose training took at most :data:`~hf_unlearn.trace.proof.AUTO_PROVE_SECONDS` (the proof costs about
    as much again); a longer run gets the first step checked, and ``hf-unlearn trace prove`` when convenient."""
    if not trainer.trace_guards:  # no per-step fingerprints to prove against: the self-check's steps only
        return False
    if trainer.trace_self_check == "all":
        return True
    if trainer.trace_self_check is not True:
        return False
    return time.perf_counter() - getattr(trainer, "_trace_train_started", 0.0) <= AUTO_PROVE_SECONDS


def peer(trainer) -> bool:
    """A process other than the main one of a multi-process recording (DDP or FSDP2)."""
    return trainer._trace_started and not trainer.accelerator.is_main_process and not trainer._is_replay

