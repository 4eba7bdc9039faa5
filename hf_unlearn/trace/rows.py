"""Per-row digests: every kept row a replay trains on is checked against the row the recording trained on.

The recorder keeps one keyed digest per collated microbatch; a replay can rebuild and compare it only for the
microbatches a deletion leaves unchanged. A row that shares a microbatch with a deleted one was never compared, so
a program change to the rows themselves (a callback that adds a ``set_transform`` to the training dataset at step
3) replayed over every microbatch a deletion touches, and the replay trained on other tokens than the run did.

So the recorder also keeps, per microbatch, a digest of every row as the model saw it: the row's slice of every
collated tensor whose first dimension is the batch (``input_ids``, ``labels``, ``attention_mask``, any other),
with its dtype and shape, and every other entry of the batch. A dummy that takes a deleted row's place has the
deleted row's length, so the padding, and every kept row's slice, is unchanged by a deletion. The digest is keyed
(HMAC with the run key, as the slot tags and batch digests are), 12 hex digits, in the plan (``extra.rows``):
published plans reveal no row. A collator that flattens the rows into one sequence (``DataCollatorWithFlattening``:
one row of ``input_ids``, ``position_ids`` restarting at each row) is split where ``position_ids`` restart, and
each row's digest covers its span of every flattened tensor; other collators that merge rows have no per-row
digests, and their microbatches are checked whole where a deletion leaves them.
"""

from __future__ import annotations

import hashlib
import hmac
import json

import torch

DIGEST_HEX = 12


def flattened_spans(batch: dict) -> list[tuple[int, int]] | None:
    """The rows of a flattened batch (one sequence, ``position_ids`` restarting at each row: what
    ``DataCollatorWithFlattening`` makes) as ``(start, stop)`` spans of its sequence, or None when it is not one."""
    positions = batch.get("position_ids")
    if not (torch.is_tensor(positions) and positions.dim() == 2 and positions.shape[0] == 1):
        return None
    length = positions.shape[1]
    if not length or any(torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] != 1 for v in batch.values()):
        return None
    pos = positions[0].detach().to("cpu")
    starts = [0] + (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist()
    return list(zip(starts, starts[1:] + [length]))


def row_hashes(batch: dict) -> list[str] | None:
    """SHA-256 (hex) of every row of a collated batch, or None when its rows cannot be told apart."""
    spans = flattened_spans(batch)
    if spans is not None and len(spans) > 1:
        return _flattened_hashes(batch, spans)
    rows = None
    for value in batch.values():
        if torch.is_tensor(value) and value.dim() >= 1:
            rows = value.shape[0] if rows is None else rows
            if value.shape[0] != rows:
                return None
    if not rows:
        return None
    shared = hashlib.sha256(b"hf_unlearn.row.v1")
    for key in sorted(batch):
        value = batch[key]
        if not torch.is_tensor(value) or value.dim() == 0:
            shared.update(key.encode() + b"\0" + json.dumps(_plain(value), default=repr, sort_keys=True).encode())
    out = []
    for i in range(rows):
        h = shared.copy()
        for key in sorted(batch):
            value = batch[key]
            if torch.is_tensor(value) and value.dim() >= 1:
                _add_row(h, key, value[i])
        out.append(h.hexdigest())
    return out


def _flattened_hashes(batch: dict, spans: list[tuple[int, int]]) -> list[str]:
    """Per row of a flattened batch: its span of every tensor laid along the sequence (``input_ids``, ``labels``,
    ``position_ids``, ...), and every other entry of the batch (what the model sees of the rows around it, e.g.
    ``cu_seq_lens``: a dummy has the deleted row's length, so a deletion leaves those unchanged)."""
    length = batch["position_ids"].shape[1]
    shared = hashlib.sha256(b"hf_unlearn.row.flattened.v1")
    along = []
    for key in sorted(batch):
        value = batch[key]
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == length:
            along.append(key)
        else:
            raw = value.detach().to("cpu").tolist() if torch.is_tensor(value) else _plain(value)
            shared.update(key.encode() + b"\0" + json.dumps(raw, default=repr, sort_keys=True).encode())
    out = []
    for start, stop in spans:
        h = shared.copy()
        for key in along:
            _add_row(h, key, batch[key][0, start:stop])
        out.append(h.hexdigest())
    return out


def _add_row(h, key: str, row: torch.Tensor) -> None:
    """One tensor's share of a row digest: its name, dtype, shape and bytes."""
    row = row.detach().to("cpu").contiguous()
    h.update(f"{key}\0{str(row.dtype)}\0{list(row.shape)}\0".encode())
    h.update(row.reshape(-1).view(torch.uint8).numpy().tobytes())


def _plain(value):
    return value.item() if torch.is_tensor(value) else value


def keyed_rows(key: bytes, hashes: list[str] | None) -> str | None:
    """What the plan keeps of a microbatch's rows: 12 hex digits of HMAC(key, row hash) per row, concatenated."""
    if hashes is None:
        return None
    return "".join(hmac.new(key, b"hf_unlearn.row\0" + h.encode(), hashlib.sha256).hexdigest()[:DIGEST_HEX]
                   for h in hashes)


def split(packed: str) -> list[str]:
    return [packed[i:i + DIGEST_HEX] for i in range(0, len(packed), DIGEST_HEX)]


def recorded_rows(plan) -> dict[int, str]:
    """Microbatch number -> its recorded row digests (from each segment's first entry)."""
    out = {}
    by_step = {e.step: e.extra.get("rows") for e in plan if e.j == 0}
    for e in plan:
        rows = by_step.get(e.step)
        if rows and e.j < len(rows) and rows[e.j]:
            out[e.mb] = rows[e.j]
    return out


def check_rows(replay) -> int:
    """Before any compute: every kept row of every microbatch the replay runs with a deleted row in it collates to
    the row the recording trained on (microbatches without one are compared whole by their batch digest). Raises
    UnlearnError at the first row that differs, naming its step; returns the number of rows checked."""
    from ..errors import UnlearnError

    recorded = recorded_rows(replay.run.plan)
    world, key, checked = replay.accelerator.num_processes, replay.run.key, 0
    for e in replay.run.plan:
        if e.step < replay.start_step or not replay._hit(e) or e.mb not in recorded:
            continue
        digests = split(recorded[e.mb])
        for r in range(world):
            lo, hi = e.rank_slots(r, world)
            feats, dummy_pos = replay._rows(e, keep_dummies=True, rank=r)
            now = keyed_rows(key, row_hashes(replay._collate(feats, dummy_pos)))
            if now is None or len(split(now)) != hi - lo:
                raise UnlearnError(f"microbatch {e.mb} (optimizer step {e.step}) no longer collates to one row per "
                                   "slot: the collator differs from the recording's; pass the collator the run was "
                                   "recorded with (data_collator= / --collator)")
            for i, (s, d) in enumerate(zip(e.slots[lo:hi], split(now))):
                if s is None or s in replay.forget_tag_set or s in replay._spans:
                    continue
                checked += 1
                if d != digests[lo + i]:
                    raise UnlearnError(
                        f"row {s} of microbatch {e.mb} (optimizer step {e.step}) is not the row the run trained on "
                        "(its keyed per-row digest differs from the recording's): the rows the program fed the model "
                        "changed (a dataset transform, a collator setting) or the store differs; a replay would train "
                        "on other tokens, so this deletion is refused")
    return checked


def output_rows(replay, e) -> list[str] | None:
    """The row digests the output run of a replay records for ``e``'s segment (``e`` its first entry): those of a
    microbatch the deletion touches are rebuilt from the rows the replay trained on, so a deleted row's digest does
    not survive into the output (its slot is a dummy there) and a later deletion checks the rows as they now are."""
    rows = e.extra.get("rows")
    if not rows:
        return None
    segments = replay.__dict__.get("_rows_segments")
    if segments is None:
        segments = replay.__dict__["_rows_segments"] = {}
        for x in replay.run.plan:
            segments.setdefault(x.step, []).append(x)
    world, out = replay.accelerator.num_processes, []
    for j, packed in enumerate(rows):
        seg = segments.get(e.step, [])
        x = seg[j] if j < len(seg) else None
        if x is not None and replay._hit(x):
            rebuilt = [keyed_rows(replay.run.key, row_hashes(replay._collate(*replay._rows(x, True, rank=r))))
                       for r in range(world)]
            packed = "".join(rebuilt) if None not in rebuilt else "0" * len(packed)
        out.append(packed)
    return out
