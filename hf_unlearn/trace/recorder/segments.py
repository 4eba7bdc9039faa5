"""A segment's plan entries, written before it runs: every process's slots, each microbatch's seed, the learning
rate, the loss normaliser, keyed digests of each collated batch and row, and the program's changes (guards)."""

from __future__ import annotations

import hashlib
import hmac

import torch

from ...errors import UnlearnError
from ..hashing import batch_digest
from ..plan import PlanEntry
from ..rows import keyed_rows, row_hashes
from ..seeds import microbatch_seed
from ..tags import tag
from . import program
from .optimizers import jsonable
from .slots import plain_id


def keyed_batch_digest(key: bytes, digest: str) -> str:
    """What the plan stores for a batch: 16 hex digits of HMAC(key, its SHA-256), so published plans reveal nothing."""
    return hmac.new(key, b"hf_unlearn.batch\0" + digest.encode(), hashlib.sha256).hexdigest()[:16]


def epoch_text(epoch) -> str | None:
    """``state.epoch`` as the plan records it: exact (float hex), and not a number an id scan could take for an id."""
    return None if epoch is None else float(epoch).hex()


def collect(trainer, batch_samples) -> list:
    """Take the ids out of a segment's batches and gather every process's ``(ids, batch digests)`` (and keyed rows)."""
    ids, digests, rows = [], [], []
    for batch in batch_samples:
        if trainer.id_column not in batch:
            raise UnlearnError(f"the batch has no {trainer.id_column!r} entry: TraceRecordingTrainer's dataloader "
                               "carries the ids; do not override get_train_dataloader without IdCarryingCollator")
        raw = batch.pop(trainer.id_column)
        ids.append([plain_id(i) for i in (raw.tolist() if torch.is_tensor(raw) else raw)])
        digests.append(batch_digest(batch))
        hashes = row_hashes(batch)  # every row as the model sees it (hf_unlearn.trace.rows); none when merged
        rows.append(hashes if hashes is not None and len(hashes) == len(ids[-1]) else None)
    if trainer.accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        trainer._trace_rows = gather_object([rows])
        per_rank = gather_object([(ids, digests)])
        if len({len(r[0]) for r in per_rank}) != 1:
            raise UnlearnError("the processes ran different numbers of microbatches in one optimizer step; "
                               "exact deletion needs even batches (accelerate's default)")
    else:
        per_rank, trainer._trace_rows = [(ids, digests)], [rows]
    return per_rank


def lr_record(trainer) -> tuple[float, list[float] | None]:
    lrs = [float(g["lr"]) for g in trainer.optimizer.param_groups]
    return lrs[0], (lrs if len(set(lrs)) > 1 else None)


def group_settings(trainer) -> list[dict]:
    """Param-group settings other than the learning rate (a scheduler may cycle momentum, e.g. OneCycleLR)."""
    return [{k: jsonable(v) for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
            for g in trainer.optimizer.param_groups]


def entries(trainer, step: int, per_rank: list, num_items) -> list[PlanEntry]:
    lr0, group_lrs = lr_record(trainer)
    groups = group_settings(trainer)
    extra = {}
    if groups != trainer._trace_groups:
        extra = {"groups": groups}
        trainer._trace_groups = groups
    if trainer._trace_guard is not None and step > 0:
        extra.update(trainer._trace_guard.flush(step - 1))  # step - 1's fingerprint and program changes
    extra.update(program.callback_extra(trainer, step))
    rows = [[keyed_rows(trainer._trace_key, r[j]) for r in trainer._trace_rows] for j in range(len(per_rank[0][0]))]
    if all(None not in mb for mb in rows):  # every kept row checked by replays (hf_unlearn.trace.rows)
        extra["rows"] = ["".join(mb) for mb in rows]
    if trainer._trace_guard is not None:  # what callbacks and compute_loss read of state.epoch during this step
        extra["ep"] = epoch_text(trainer.state.epoch)  # exact, and not a number an id scan could take for an id
    if torch.is_tensor(num_items):
        norm, norm_dtype = float(num_items.item()), str(num_items.dtype).removeprefix("torch.")
    elif num_items is None:
        norm, norm_dtype = None, None
    else:
        norm, norm_dtype = float(num_items), "python"
    world = len(per_rank)
    entries = []
    n_mb = len(per_rank[0][0])
    for j in range(n_mb):
        mb_ids = [i for ids, _ in per_rank for i in ids[j]]
        entries.append(PlanEntry(
            mb=trainer._trace_mb, step=step, j=j, end=j == n_mb - 1,
            seed=microbatch_seed(trainer._trace_header_seed, step, j),
            lr=lr0, norm=norm, norm_dtype=norm_dtype, accum=n_mb,
            slots=[tag(trainer._trace_key, i) for i in mb_ids], lens=[trainer._trace_lens[i] for i in mb_ids],
            epoch=trainer._trace_epoch, group_lrs=group_lrs,
            ranks=[len(ids[j]) for ids, _ in per_rank] if world > 1 else None,
            batch=[keyed_batch_digest(trainer._trace_key, digests[j]) for _, digests in per_rank],
            extra=extra if j == 0 else {},
        ))
        trainer._trace_mb += 1
    return entries

