"""Hazards a recorder of an earlier release did not name, found in a run's files when a deletion is asked for.

Each check says why no deletion from the run can be exact, or None: not such a run, or one whose header lists the
hazard (recorded with ``trace_allow_hazards=True``, so every verdict carries it). One list, read by ``forget``, a
pipeline's stages and every replay with deletions, before any compute.
"""

from __future__ import annotations

from .model_info import experts_refusal
from .trainers import SCHEDULE_HAZARD, metric_schedule, schedule_hazard


def schedule_refusal(run) -> str | None:
    """A run whose learning rates a metric-driven scheduler set (ReduceLROnPlateau, GreedyLR), recorded before the
    recorder named it a hazard."""
    header = run.header
    kind = metric_schedule(header.get("training_args") or {})
    if not kind or any(SCHEDULE_HAZARD in h for h in header.get("hazards") or []):
        return None
    return (f"{run.path} cannot delete exactly: {schedule_hazard(kind)} (this run was recorded before the recorder "
            "refused it); record the run again so")


CHECKS = (experts_refusal, schedule_refusal)


def unlisted_hazard(run) -> str | None:
    """The first of :data:`CHECKS` that refuses ``run``'s deletions, or None."""
    for check in CHECKS:
        why = check(run)
        if why:
            return why
    return None
