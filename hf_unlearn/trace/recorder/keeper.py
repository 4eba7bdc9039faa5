"""The checkpoint keeper: a checkpoint every ``trace_checkpoint_steps`` (a shard peer writes its shards), retention
thinning them while training (:mod:`hf_unlearn.trace.retention`), the budget, and a resume checked against the
recorded checkpoint."""

from __future__ import annotations

import json
import logging

from ...errors import UnlearnError
from ..checkpoints import FROZEN_DIR, capture_state, checkpoint_bytes, checkpoint_dir, run_uses_plain_names
from ..hashing import checkpoint_hashes, uses_plain_names
from ..model_info import first_non_finite
from ..retention import dense_steps, describe, factor_for_budget, final_keep, geometric_keep
from ..retention import thin as retention_thin
from ..shards import save as save_shards
from .header import non_finite_hazard


def check_resumed_state(trainer, step: int) -> None:
    """The state a resume loaded (the Trainer's checkpoint) must be the recorded checkpoint at that step when
    the trace holds one: an edited or foreign checkpoint would continue a run the plan does not describe."""
    saved = checkpoint_dir(trainer.trace_dir, step) / "hashes.json"
    if not saved.is_file():
        return  # no recorded checkpoint at the resume step: the guards' missing fingerprint says so (verify)
    recorded = json.loads(saved.read_text())
    now = checkpoint_hashes(capture_state(trainer.accelerator.unwrap_model(trainer.model), trainer.optimizer, step),
                            plain=uses_plain_names(recorded))
    for part in ("params_root", "optimizer_root"):
        if now.get(part) != recorded.get(part):
            raise UnlearnError(f"the state resumed from {trainer._trace_resume} at step {step} is not the recorded "
                               f"checkpoint {saved.parent} ({part.split('_')[0]} differ): the trace cannot "
                               "continue from it; resume from the checkpoint the run saved at that step")


def shard_peer(trainer) -> bool:
    """A process other than the main one of a sharded (FSDP2) recording: it writes its shards of each checkpoint."""
    return trainer._trace_started and trainer.is_fsdp_enabled and not trainer.accelerator.is_main_process \
        and not trainer._is_replay


def final_params_root(trainer, step: int) -> str:
    """A sharded run's output root: its final checkpoint's ``params_root`` (over the full logical tensors, as
    :func:`~hf_unlearn.trace.lineage.weights_root` computes it), read instead of gathering the model again."""
    return json.loads((checkpoint_dir(trainer.trace_dir, step) / "hashes.json").read_text())["params_root"]


def checkpoint(trainer, step: int, final: bool = False) -> None:
    """Save the checkpoint after ``step`` optimizer steps (bound to the run by its index), then thin the kept set."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if trainer._trace_writer is None:  # a shard peer: writes its shards (hf_unlearn.trace.shards), joins the hashes
        save_shards(trainer.trace_dir, step, model, trainer.optimizer, run_uses_plain_names(trainer.trace_dir))
        trainer._trace_saved.add(step)
        return
    if not trainer._is_replay and trainer._trace_non_finite is None:
        frozen = trainer._trace_writer.frozen  # the frozen tensors still as the store saved them (and this read)
        bad = first_non_finite(model, skip=frozen.unchanged_stamps(model) if frozen.saved_step == 0 else ())
        if bad:
            non_finite_hazard(trainer, f"parameter {bad} holds a NaN or infinity at the checkpoint after "
                                       f"{step} optimizer steps")
    trainer._trace_writer.save_checkpoint(step, model, trainer.optimizer)
    trainer._trace_saved.add(step)
    if step > 0 and trainer.trace_checkpoint_budget and trainer.trace_checkpoint_retention == "geometric" \
            and "max_kept" not in trainer._trace_header["checkpoint_retention"]:
        fit_budget(trainer, step)  # the first checkpoint with optimizer state sets the size of each
    thin(trainer, step, final)


def fit_budget(trainer, step: int) -> None:
    """Pick the retention factor whose kept set fits ``trace_checkpoint_budget`` (sizes from ``step``'s files)."""
    each = checkpoint_bytes(checkpoint_dir(trainer.trace_dir, step))
    frozen_dir = trainer.trace_dir / "checkpoints" / FROZEN_DIR
    frozen = sum(f.stat().st_size for f in frozen_dir.iterdir()) if frozen_dir.exists() else 0
    budget = trainer.trace_checkpoint_budget
    fits = max(0, budget - frozen) // each
    factor = factor_for_budget(trainer._trace_total, trainer._trace_every, fits)
    if factor is None:
        raise UnlearnError(f"trace_checkpoint_budget={budget} bytes holds {fits} checkpoint(s) of {each} bytes "
                           f"(+ {frozen} bytes of frozen tensors once); a run needs at least 2 (step 0 and the "
                           f"end): raise it to at least {2 * each + frozen}, or drop it")
    trainer._trace_factor = factor
    retention = trainer._trace_header["checkpoint_retention"]
    retention.update(factor=factor, budget=budget, max_kept=int(fits))
    trainer._trace_writer.index.retention = retention
    if factor != 2:
        logging.getLogger(__name__).warning(
            "trace_checkpoint_budget=%d keeps at most %d checkpoints: %s (2 x (T - s) + K without the budget)",
            budget, fits, describe(retention))


def thin(trainer, step: int, final: bool = False) -> None:
    """Drop the checkpoints retention no longer needs (crash-safe: see CheckpointIndex.thin)."""
    index, mode = trainer._trace_writer.index, trainer.trace_checkpoint_retention
    have = sorted(index.entries)
    if 0 not in have or step not in have:
        return  # a run resumed without its step-0 checkpoint: keep everything
    if final:
        keep = final_keep(step, have, trainer._trace_every, trainer._trace_factor, mode)
    else:
        keep = retention_thin(step, have, trainer._trace_total, trainer._trace_every, trainer._trace_factor, mode)
        cap = trainer._trace_header["checkpoint_retention"].get("max_kept")
        if cap and len(keep) > cap:  # while training, the bound for an early stop gives way to the budget
            planned = set(geometric_keep(trainer._trace_total, dense_steps(trainer._trace_total, trainer._trace_every),
                                         trainer._trace_every, trainer._trace_factor))
            extra = [c for c in keep if c not in planned and c not in (0, step)]
            keep = sorted(set(keep) - set(extra[:len(keep) - cap]))
    index.thin(keep)
    if final:
        index.retention = {**(index.retention or {}), "kept": sorted(index.entries)}
        trainer._trace_header["checkpoint_retention"] = index.retention
        index.save()

