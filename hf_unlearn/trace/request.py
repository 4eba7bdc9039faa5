"""The ids of a deletion request checked against a recorded run: their keyed tags, and the ids its plan never
served. Light on purpose (the run's header, plan and deletion log; no ``transformers``, no ``datasets``), so
``forget`` refuses ids that are not in the run before anything is loaded."""

from __future__ import annotations

from ..errors import UnlearnError
from .packing import document_tags, is_packed, load_map
from .run import TraceRun, read_deletion_log
from .tags import tag


def _check_types(run: TraceRun, forget_ids) -> None:
    from ..data.ids import check_id_types

    id_type = {"int": int, "str": str}.get(run.header["dataset"].get("id_type"))
    if id_type is not None:
        check_id_types(forget_ids, id_type, what=f"the run {run.path}")


def forget_tags(run: TraceRun, forget_ids) -> set[str]:
    """Tags of the ids to delete; ids the plan never served are an error (listed), unless deleted before."""
    forget_ids = list(dict.fromkeys(forget_ids))
    if not forget_ids:
        raise UnlearnError("the forget list is empty")
    _check_types(run, forget_ids)
    key = run.key
    tags = {i: tag(key, i) for i in forget_ids}
    if is_packed(run.header):  # a packed run's plan slots are packed rows: the documents are in its map
        in_plan = served = document_tags(load_map(run))
    else:
        in_plan = {s for e in run.plan for s in e.slots if s}
        served = {s for e in run.served_plan for s in e.slots if s} if run.served_plan else in_plan
    deleted_before = {t for entry in read_deletion_log(run.path) for t in entry.get("forget_tags", [])}
    deleted_before |= never_trained_tags(run)
    unknown = [i for i, t in tags.items() if t not in served and t not in deleted_before]
    if unknown:
        raise UnlearnError(f"{len(unknown)} id(s) to forget never appear in the recorded plan of {run.path}: "
                           f"{unknown[:20]}{' ...' if len(unknown) > 20 else ''}; check the forget list")
    return set(tags.values()) & in_plan


def never_trained_tags(run: TraceRun) -> set[str]:
    """Tags of the rows the trainer's own dataset preparation dropped (SFTTrainer: fully masked after truncation):
    given to the trainer, never in the store or the plan."""
    return set((run.header.get("trainer") or {}).get("dropped_tags", []))
