"""Where a deletion's replay starts and what it costs, read from the plan and the deletion log before any
compute (``trace cost``, ``forget``'s estimate, the request service's batching)."""

from __future__ import annotations

from ...errors import UnlearnError
from ..packing import deleted_spans, emptied_rows, is_packed, load_map
from ..plan import PlanEntry
from ..request import forget_tags, never_trained_tags, unplanned_store_ids
from ..run import TraceRun, open_run, read_deletion_log
from ..tags import tag


def already_deleted(run: TraceRun, forget_ids) -> list:
    """The ids among ``forget_ids`` that are absent from the store: an earlier request deleted them (the run's
    deletion log has their tags) or the trainer dropped them before training (:func:`never_trained_tags`)."""
    logged = {t for entry in read_deletion_log(run.path) for t in entry.get("forget_tags", [])}
    logged |= never_trained_tags(run)
    key = run.key
    return [i for i in dict.fromkeys(forget_ids) if tag(key, i) in logged]


def emptied_steps(plan: list[PlanEntry], tags: set[str]) -> list[int]:
    """Steps whose every slot is deleted (now or before): replayed on dummies only, the optimizer stepping on zero
    gradients (as the plain run with those rows' labels masked)."""
    weighted: dict[int, bool] = {}
    for e in plan:
        weighted[e.step] = weighted.get(e.step, False) or any(s is not None and s not in tags for s in e.slots)
    return sorted(step for step, w in weighted.items() if not w)


def replay_cost(run: TraceRun, forget_ids) -> dict:
    """Where a suffix replay starts and how much of the run it re-executes (0 steps: nothing left to replay).

    ``minimum_steps`` is the physical limit of a trace-preserving deletion (``T - s``, ``s`` the first affected
    step); ``steps_to_replay / minimum_steps`` is what the kept checkpoints cost on top of it, and ``bound_steps``
    the most the run's retention rule allows (``factor * (T - s) + K``; None for runs without one). In a
    multi-epoch run the ids' first occurrence (its epoch) sets the start; every later occurrence is replayed too.
    """
    run = (run if isinstance(run, TraceRun) else open_run(run, check_checkpoints=False)).kept()
    tags = forget_tags(run, forget_ids)
    hit_rows, gone = set(), tags
    if is_packed(run.header):  # the packed rows that hold a fragment of a deleted document
        doc_map = load_map(run)
        spans = deleted_spans(doc_map, tags)
        hit_rows, gone = set(spans), emptied_rows(doc_map, tags)
    hits = [e for e in run.plan if (tags | hit_rows) & set(e.slots)]
    affected = sorted({e.step for e in hits})
    total = run.total_steps
    cps = sorted(run.checkpoints())
    first = affected[0] if affected else total
    start = max([c for c in cps if c <= first], default=None)
    if start is None:
        raise UnlearnError(f"{run.path} has no checkpoint at or before step {first}; cannot replay")
    n_ids = len(set(forget_ids))
    dropped = never_trained_tags(run)
    # never trained on: dropped by the trainer, or rows of the store the plan never reached (max_steps < an epoch)
    never = sum(tag(run.key, i) in dropped for i in set(forget_ids)) + len(unplanned_store_ids(run, forget_ids))
    retention = run.header.get("checkpoint_retention") or {}
    minimum = total - first
    bound = None
    if retention.get("mode") == "geometric" and affected:
        bound = retention.get("factor", 2) * minimum + retention.get("every", 0)
    epochs = sorted({e.epoch for e in hits if e.epoch is not None})
    return {
        "forget_ids": n_ids,
        "already_deleted": n_ids - len(tags) - never,
        "never_trained": never,
        "slots_deleted": sum(s in tags for e in run.plan for s in e.slots),
        **({"packed_rows_touched": sum(s in hit_rows for e in run.plan for s in e.slots)} if hit_rows else {}),
        "affected_steps": len(affected),
        "first_affected_step": affected[0] if affected else None,
        "start_checkpoint": start,
        "steps_to_replay": total - start,
        "minimum_steps": minimum,
        "ratio_to_minimum": (total - start) / minimum if minimum else None,
        "bound_steps": bound,
        "epochs": epochs,
        "first_epoch": epochs[0] if epochs else None,
        "total_steps": total,
        "fraction_replayed": (total - start) / total if total else 0.0,
        "segments_emptied": len(emptied_steps(run.plan, gone)),
        "world_size": run.header.get("world_size", 1),
        **({"kept_step": total} if run.served_plan else {}),
    }


def describe_cost(cost: dict) -> list[str]:
    """The cost estimate as the lines ``trace cost`` and ``forget`` print before any compute."""
    never = cost.get("never_trained") or 0
    never_line = [f"{never} of the id(s) were never trained on (rows the trainer's dataset preparation dropped, or "
                  "rows of the store the plan never reached, max_steps shorter than an epoch): they leave the store, "
                  "nothing is replayed for them"] if never else []
    if cost["first_affected_step"] is None:
        if never == cost["forget_ids"]:
            return [f"nothing to replay: the {never} id(s) were never trained on (rows the trainer's dataset "
                    "preparation dropped, or rows of the store the plan never reached, max_steps shorter than an "
                    "epoch): they leave the store"]
        kept = (f", or trained only after the kept model (load_best_model_at_end: the state after "
                f"{cost['kept_step']} optimizer steps), which never saw them") if cost.get("kept_step") is not None else ""
        return [f"nothing to replay: the {cost['forget_ids'] - never} id(s) were deleted by an earlier request{kept}",
                *never_line]
    ratio = cost["ratio_to_minimum"]
    lines = [f"suffix replay from checkpoint step {cost['start_checkpoint']}: {cost['steps_to_replay']} of "
             f"{cost['total_steps']} steps ({100 * cost['fraction_replayed']:.1f}% of the run); the minimum is "
             f"{cost['minimum_steps']} steps (T - s, first affected step s = {cost['first_affected_step']}), ratio "
             + (f"{ratio:.2f}" if ratio is not None else "n/a")
             + (f" (the run's retention bound: at most {cost['bound_steps']:g} steps)" if cost["bound_steps"] else "")]
    lines += never_line
    if cost.get("packed_rows_touched"):
        lines.append(f"packing: the documents sit in {cost['packed_rows_touched']} packed row slot(s), which stay; "
                     "their fragments become dummy tokens of the same length (the other documents are unchanged)")
    if len(cost["epochs"]) > 1:
        lines.append(f"the ids occur in epochs {cost['epochs']}: their first occurrence (epoch {cost['first_epoch']}, "
                     f"step {cost['first_affected_step']}) sets the start; the later ones are replayed with it")
    return lines
