"""The ids of a deletion request checked against a recorded run: their keyed tags, and the ids its plan never
served. Light on purpose (the run's header, plan and deletion log, and for ids the plan does not hold the id column
of its token store, read with ``pyarrow``; no ``transformers``, no ``datasets``), so ``forget`` refuses ids that are
not in the run before anything is loaded."""

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


def _reach(run: TraceRun):
    """``(in_plan, served, deleted_before)``: the tags of the rows the plan holds, the rows the run served (a run cut
    at its kept step served more than its plan), and the rows absent from the store before any training step (an
    earlier request's, or the trainer's dropped rows)."""
    if is_packed(run.header):  # a packed run's plan slots are packed rows: the documents are in its map
        in_plan = served = document_tags(load_map(run))
    else:
        in_plan = {s for e in run.plan for s in e.slots if s}
        served = {s for e in run.served_plan for s in e.slots if s} if run.served_plan else in_plan
    deleted_before = {t for entry in read_deletion_log(run.path) for t in entry.get("forget_tags", [])}
    deleted_before |= never_trained_tags(run)
    return in_plan, served, deleted_before


def forget_tags(run: TraceRun, forget_ids) -> set[str]:
    """Tags of the ids to delete that the plan holds. An id the plan never served is accepted if it was deleted
    before, dropped by the trainer, or is a row of the run's token store the plan never reached
    (:func:`unplanned_store_ids`: never trained on, removed from the store); any other is an error (listed)."""
    forget_ids = list(dict.fromkeys(forget_ids))
    if not forget_ids:
        raise UnlearnError("the forget list is empty")
    _check_types(run, forget_ids)
    key = run.key
    tags = {i: tag(key, i) for i in forget_ids}
    in_plan, served, deleted_before = _reach(run)
    unknown = [i for i, t in tags.items() if t not in served and t not in deleted_before]
    if unknown:
        stored = _stored_ids(run, unknown)
        unknown = [i for i in unknown if i not in stored]
    if unknown:
        where = "its token store" if run.store_path.is_dir() else "its token store (absent here)"
        raise UnlearnError(f"{len(unknown)} id(s) to forget never appear in the recorded plan of {run.path}, nor in "
                           f"{where}: {unknown[:20]}{' ...' if len(unknown) > 20 else ''}; check the forget list")
    return set(tags.values()) & in_plan


def unplanned_store_ids(run: TraceRun, forget_ids) -> list:
    """The ids of ``forget_ids`` that are rows of the run's token store but that its plan never reached
    (``max_steps`` shorter than an epoch): never trained on, like the rows the trainer dropped. A deletion removes
    them from the store and replays nothing for them. The store is read only for ids the plan does not hold."""
    key = run.key
    _, served, deleted_before = _reach(run)
    rest = [i for i in dict.fromkeys(forget_ids) if tag(key, i) not in served and tag(key, i) not in deleted_before]
    if not rest:
        return []
    stored = _stored_ids(run, rest)
    return [i for i in rest if i in stored]


def unplanned_store_tags(run: TraceRun) -> set[str]:
    """Keyed tags of every row of the run's token store that its plan never reached (:func:`unplanned_store_ids`):
    what ``trace verify`` accepts as answered "never trained on" by a pipeline stage left unchanged."""
    key = run.key
    _, served, _ = _reach(run)
    return {t for t in (tag(key, i) for i in _stored_ids(run, None)) if t not in served}


def _stored_ids(run: TraceRun, wanted) -> set:
    """The ids of ``wanted`` (None: all) in the id column of the run's token store (``private/store``), read with
    ``pyarrow`` alone (no ``datasets``: ``forget`` checks a request before anything loads); empty without a store.
    The store is checked against the run's fingerprint when a replay opens it."""
    store = run.store_path
    if is_packed(run.header) or not store.is_dir():
        return set()
    import pyarrow as pa
    import pyarrow.ipc

    wanted, found = (None if wanted is None else set(wanted)), set()
    id_column = run.id_column
    for f in sorted(store.glob("*.arrow")):
        try:
            with pa.memory_map(str(f)) as source:
                table = pyarrow.ipc.open_stream(source).read_all()
        except (OSError, pa.ArrowInvalid) as e:
            raise UnlearnError(f"cannot read the token store file {f}: {e}; restore the run's store") from None
        if id_column in table.column_names:
            column = table.column(id_column).to_pylist()
            found |= set(column) if wanted is None else wanted.intersection(column)
    return found


def never_trained_tags(run: TraceRun) -> set[str]:
    """Tags of the rows the trainer's own dataset preparation dropped (SFTTrainer: fully masked after truncation):
    given to the trainer, never in the store or the plan."""
    return set((run.header.get("trainer") or {}).get("dropped_tags", []))
