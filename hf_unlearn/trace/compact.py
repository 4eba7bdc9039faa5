"""The sealed compact provenance: ``provenance.bin``, one file that decodes to the run's plan, WAL and manifest.

While a run records, ``plan.bin``, ``wal.bin`` and ``manifest.bin`` are appended ahead of every segment (crash-safe,
the paper's format). :func:`compact_run` (``hf-unlearn trace compact RUN``) replaces them in a sealed run with one
xz-compressed file holding the same records column by column, with what is implied not stored:

* slot tags as indices into a table of the distinct rows' 8-byte tags; when every epoch's order is the permutation
  that accelerate's ``SeedableRandomSampler`` (what ``Trainer`` uses) draws, ``torch.randperm(N)`` seeded with
  ``seed + epoch``, only the seeds are stored (checked at compaction by drawing them; readers draw them again);
* seeds as the recorder's rule ``microbatch_seed(base, step, j)`` when they follow it; steps, positions,
  accumulation ends and the WAL flags from the segment sizes; lengths per distinct row when a row always has one;
  learning rates as second differences of their float64 bit patterns; normalisers as their difference to the
  segment's token count;
* the keyed digests folded: the WAL's per-microbatch digest is recomputed from the decoded records (the key holder
  gets the same WAL); the chained MAC per segment becomes one per block of :data:`BLOCK_SEGMENTS` segments over the
  same canonical controls (a forged control is still named, to its block's steps, before any compute); the 8-byte
  keyed batch digests per microbatch become one :data:`BATCH_MAC_BYTES`-byte keyed MAC per group of whole segments
  of at least :data:`BATCH_GROUP_MIN` microbatches, checked by replays before compute.

Compaction decodes what it wrote and compares it with the append-only files before removing them, and the header
records the file's SHA-256 under the run key's seal (``controls_mac``), so any edit of it without the key (a byte, a
seed claim, the tag table) is refused. Lower bound: one 8-byte tag per distinct row (deletion lookup and third-party
tag checks need them), so the file is at least 8 bytes times the rows the run trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import lzma
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UnlearnError
from .plan import COMPACT_FILE, PlanEntry
from .seeds import microbatch_seed
from .tags import NULL_TAG, TAG_BYTES, _mac, record_digester
from .wal import FLAG_ACCUM_END, FLAG_DUMMY, WalRecord

MAGIC = b"HFUSEAL1"
FORMAT = "hf_unlearn.provenance.v1"
BLOCK_SEGMENTS = 256  # segments per chained controls MAC
BATCH_GROUP_MIN = 16  # microbatches (whole segments) per batch MAC
BATCH_MAC_BYTES = 4
_COLUMNS = ("seg_n", "seg_step", "seg_accum", "seg_epoch", "lr", "norm_kind", "norm_dtype", "norm_int", "norm_f64", "mb_slots",
            "seeds", "lens", "tags", "order", "block_macs", "batch_macs")


class CompactError(UnlearnError):
    """A provenance.bin that does not decode to a run's records."""


# ---- columns: fixed-width little-endian integers (xz squeezes the unused high bytes and the runs) --------------
def _ints(values) -> bytes:
    a = np.asarray(values, dtype=np.uint64)
    top = int(a.max()) if a.size else 0
    width = next(w for w in (1, 2, 4, 8) if top < 1 << (8 * w))
    return bytes([width]) + a.astype(f"<u{width}").tobytes()


def _unints(raw: bytes) -> np.ndarray:
    if not raw:
        raise ValueError("empty column")
    width = raw[0]
    if width not in (1, 2, 4, 8) or (len(raw) - 1) % width:
        raise ValueError("bad column width")
    return np.frombuffer(raw[1:], dtype=f"<u{width}").astype(np.uint64)


def _zigzag(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.int64)
    return ((a << 1) ^ (a >> 63)).view(np.uint64)


def _unzigzag(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.uint64)
    return ((a >> np.uint64(1)).view(np.int64) ^ -(a & np.uint64(1)).view(np.int64))


def _lr_column(lrs: list[float]) -> bytes:
    """Second differences of the float64 bit patterns: a constant or linear schedule becomes (nearly) all zeros."""
    bits = np.frombuffer(struct.pack(f"<{len(lrs)}d", *lrs), dtype="<i8")
    with np.errstate(over="ignore"):
        d1 = np.diff(bits, prepend=np.int64(0))
        d2 = np.diff(d1, prepend=np.int64(0))
    return _ints(_zigzag(d2))


def _un_lr(raw: bytes) -> list[float]:
    d2 = _unzigzag(_unints(raw))
    with np.errstate(over="ignore"):
        bits = np.cumsum(np.cumsum(d2, dtype=np.int64), dtype=np.int64)
    return np.ascontiguousarray(bits, dtype="<i8").view("<f8").tolist()


def sampler_order(n: int, seed: int) -> np.ndarray:
    """The order accelerate's ``SeedableRandomSampler`` serves ``n`` rows in for the epoch seeded with ``seed``
    (``initial_seed + epoch``): ``torch.randperm`` with a CPU generator seeded so."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(int(seed))).numpy()


# ---- what a reader gets --------------------------------------------------------------------------------------
@dataclass
class CompactRun:
    """A decoded provenance.bin: the run's plan entries (``batch`` is None: see ``batch_groups``), WAL records
    (digests recomputed when the key is given, else 0) and manifest, and the folded MACs."""

    entries: list[PlanEntry]
    records: list[WalRecord]
    manifest: list[str | None]
    blocks: list[tuple[int, int, bytes]]  # (first segment, stop segment, chained controls MAC)
    batch_groups: list[tuple[int, int, bytes | None]]  # (first microbatch, stop, keyed MAC or None: not recorded)
    meta: dict = field(default_factory=dict)

    @property
    def last_mac(self) -> bytes:
        return self.blocks[-1][2] if self.blocks else b""


def _segments_of(entries: list[PlanEntry]) -> list[tuple[int, int]]:
    out, start = [], 0
    for i, e in enumerate(entries):
        if e.end:
            out.append((start, i + 1))
            start = i + 1
    if start != len(entries):
        raise UnlearnError("internal: a sealed run's plan ends inside an accumulation segment")
    return out


def block_ranges(n_segments: int) -> list[tuple[int, int]]:
    return [(s, min(s + BLOCK_SEGMENTS, n_segments)) for s in range(0, n_segments, BLOCK_SEGMENTS)]


def batch_group_ranges(segs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Microbatch ranges of the batch MACs: whole segments, at least BATCH_GROUP_MIN microbatches (the last may be
    shorter)."""
    out, start = [], None
    for a, b in segs:
        start = a if start is None else start
        if b - start >= BATCH_GROUP_MIN:
            out.append((start, b))
            start = None
    if start is not None:
        out.append((start, segs[-1][1]))
    return out


def block_mac(key: bytes, previous: bytes, controls: bytes) -> bytes:
    return _mac(key, b"provenance.block.v1", previous, controls)[:8]


def batch_mac(key: bytes, entries: list[PlanEntry]) -> bytes:
    """The keyed MAC of a group's batch digests (each microbatch's per-process digests)."""
    h = hmac.new(key, b"hf_unlearn.provenance.batch.v1\0", hashlib.sha256)
    for e in entries:
        h.update(len(e.batch).to_bytes(2, "little"))
        h.update(b"".join(bytes.fromhex(b) for b in e.batch))
    return h.digest()[:BATCH_MAC_BYTES]


_CONTROL_FIELDS = tuple(f.name for f in dataclasses.fields(PlanEntry) if f.name != "batch")


def _controls_line(e: PlanEntry) -> str:
    """One entry's controls as sorted-key JSON, every field but the batch digests (plan.canonical_controls less
    ``batch``: the batch MACs cover those)."""
    d = {f: getattr(e, f) for f in _CONTROL_FIELDS}
    for optional in ("group_lrs", "ranks", "extra"):
        if not d[optional]:
            d.pop(optional)
    return json.dumps(d, separators=(",", ":"), sort_keys=True)


def controls_chain(key: bytes, run_id: str, entries: list[PlanEntry], segs) -> list[bytes]:
    """The chained block MACs over the entries' canonical controls (without batch digests: those have their own)."""
    from .tags import controls_chain_start

    previous, out = controls_chain_start(key, run_id), []
    for s, t in block_ranges(len(segs)):
        chunk = entries[segs[s][0]:segs[t - 1][1]]
        previous = block_mac(key, previous, "\n".join(map(_controls_line, chunk)).encode())
        out.append(previous)
    return out


# ---- encoding ------------------------------------------------------------------------------------------------
def _sampler_claim(entries: list[PlanEntry], bases) -> tuple[list, list[int], dict] | None:
    """``(table, epoch seeds, permutations)`` when every epoch's served order is ``table[sampler_order(N, base +
    epoch)]`` for one of ``bases``, with ``table`` the first epoch's rows in dataset order (N = its length), else
    None. Epochs must come in order 0, 1, ...; a later epoch may be cut short (max_steps)."""
    by_epoch: dict[int, list] = {}
    for e in entries:
        by_epoch.setdefault(e.epoch, []).extend(e.slots)
    if list(by_epoch) != list(range(len(by_epoch))) or any(b.epoch < a.epoch for a, b in zip(entries, entries[1:])):
        return None
    first = by_epoch[0]
    named = [s for s in first if s is not None]
    known = set(named)
    if not first or len(known) != len(named) or any(s is not None and s not in known
                                                    for ep in by_epoch for s in by_epoch[ep]):
        return None
    n = len(first)
    for base in bases:
        perms = {0: sampler_order(n, base)}
        table: list = [None] * n
        for p, s in zip(perms[0].tolist(), first):
            table[p] = s
        for ep in range(1, len(by_epoch)):
            slots = by_epoch[ep]
            perms[ep] = sampler_order(n, base + ep)
            if len(slots) > n or [table[p] for p in perms[ep][:len(slots)].tolist()] != slots:
                break
        else:
            return table, [base + ep for ep in range(len(by_epoch))], perms
    return None


def encode(entries: list[PlanEntry], key: bytes, run_id: str, seed_base: int | None = None,
           sampler_seeds: tuple[int, ...] = (), batch_macs: dict | None = None) -> bytes:
    """provenance.bin for a sealed run's plan entries (joined from plan.bin, WAL and manifest). ``batch_macs``:
    ``{(first mb, stop): MAC}`` of groups whose entries carry no digests (a replay's unreplayed prefix keeps its
    compacted parent's MACs: same groups, same key)."""
    segs = _segments_of(entries)
    firsts = [entries[a] for a, _ in segs]
    meta: dict = {"format": FORMAT, "microbatches": len(entries), "segments": len(segs), "run_id": run_id}
    cols: dict[str, bytes] = {}
    cols["seg_n"] = _ints([b - a for a, b in segs])
    cols["seg_step"] = _ints(_zigzag(np.array([f.step - k for k, f in enumerate(firsts)], np.int64)))
    cols["seg_accum"] = _ints(_zigzag(np.array([f.accum - (b - a) for f, (a, b) in zip(firsts, segs)], np.int64)))
    cols["seg_epoch"] = _ints(_zigzag(np.diff(np.array([f.epoch for f in firsts], np.int64), prepend=0)))
    cols["lr"] = _lr_column([f.lr for f in firsts])
    dtypes = sorted({str(f.norm_dtype) for f in firsts if f.norm_dtype is not None})
    kinds, ints, floats = [], [], []
    for f, (a, b) in zip(firsts, segs):
        tokens = sum(sum(e.lens) for e in entries[a:b])
        if f.norm is None:
            kinds.append(0)
        elif isinstance(f.norm, float) and f.norm.is_integer() and abs(f.norm) < 2 ** 62:
            kinds.append(1)
            ints.append(int(f.norm) - tokens)
        else:
            kinds.append(2)
            floats.append(float(f.norm))
    meta["norm_dtypes"] = dtypes
    cols["norm_kind"] = _ints(kinds)
    cols["norm_dtype"] = _ints([0 if f.norm_dtype is None else 1 + dtypes.index(str(f.norm_dtype)) for f in firsts])
    cols["norm_int"] = _ints(_zigzag(np.array(ints, np.int64)))
    cols["norm_f64"] = struct.pack(f"<{len(floats)}d", *floats)
    cols["mb_slots"] = _ints([len(e.slots) for e in entries])
    seeds = [e.seed for e in entries]
    if seed_base is not None and all(e.seed == microbatch_seed(seed_base, e.step, e.j) for e in entries):
        meta["seeds"] = {"rule": "microbatch_seed", "base": seed_base}
        cols["seeds"] = b""
    else:
        meta["seeds"] = {"rule": "stored"}
        cols["seeds"] = np.asarray(seeds, dtype="<u8").tobytes()
    # rows: a table of distinct tags; the order by sampler claims or as table indices
    slots = [s for e in entries for s in e.slots]
    claim = _sampler_claim(entries, list(dict.fromkeys(sampler_seeds))) if sampler_seeds else None
    if claim is not None:
        table, epoch_seeds, perms = claim
        meta["order"] = {"rule": "seedable_sampler", "rows": len(table), "epoch_seeds": epoch_seeds}
        served = np.bincount([e.epoch for e in entries for _ in e.slots], minlength=len(epoch_seeds))
        row_of = np.concatenate([perms[ep][:served[ep]] for ep in range(len(epoch_seeds))]).astype(np.int64)
        cols["order"] = b""
    else:
        table, index = [], {}
        for s in slots:
            if s is not None and s not in index:
                index[s] = len(table)
                table.append(s)
        meta["order"] = {"rule": "indices", "rows": len(table)}
        row_of = np.array([index[s] if s is not None else -1 for s in slots], dtype=np.int64)
        cols["order"] = _ints(row_of + 1)  # 0: a dummy slot
    cols["tags"] = b"".join(bytes.fromhex(t) if t else NULL_TAG for t in table)
    lens = np.array([n for e in entries for n in e.lens], dtype=np.int64)
    per_row = None
    if meta["order"]["rule"] == "seedable_sampler" and len(lens):
        per_row = np.full(len(table), -1, np.int64)
        per_row[row_of] = lens
        if not np.array_equal(per_row[row_of], lens) or (per_row < 0).any():
            per_row = None
    meta["lens"] = "per_row" if per_row is not None else "per_slot"
    cols["lens"] = _ints(per_row if per_row is not None else lens)
    # the rare fields, sparse
    exceptions = {"group_lrs": {k: f.group_lrs for k, f in enumerate(firsts) if f.group_lrs},
                  "extra": {k: f.extra for k, f in enumerate(firsts) if f.extra},
                  "ranks": {i: e.ranks for i, e in enumerate(entries) if e.ranks is not None}}
    meta["exceptions"] = {k: v for k, v in exceptions.items() if v}
    # MACs
    cols["block_macs"] = b"".join(controls_chain(key, run_id, entries, segs))
    groups = batch_group_ranges(segs)
    inherited = batch_macs or {}
    macs = [batch_mac(key, entries[a:b]) if all(entries[i].batch for i in range(a, b)) else inherited.get((a, b))
            for a, b in groups]
    present = [m is not None for m in macs]
    meta["batch_groups"] = "all" if all(present) else ("none" if not any(present) else "some")
    cols["batch_macs"] = b"".join(m if m is not None else b"\0" * BATCH_MAC_BYTES for m in macs)
    if meta["batch_groups"] == "some":
        cols["batch_macs"] += bytes(present)
    meta["batch_per_mb"] = sorted({len(e.batch) for e in entries if e.batch}) or [0]
    payload = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    body = _len(payload) + payload + b"".join(_len(cols[c]) + cols[c] for c in _COLUMNS)
    return MAGIC + lzma.compress(body, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9)


def _len(b: bytes) -> bytes:
    return struct.pack("<Q", len(b))


# ---- decoding ------------------------------------------------------------------------------------------------
def _sections(body: bytes) -> tuple[dict, dict[str, bytes]]:
    pos, parts = 0, []
    for _ in range(1 + len(_COLUMNS)):
        if pos + 8 > len(body):
            raise ValueError("a column is missing")
        n = struct.unpack_from("<Q", body, pos)[0]
        pos += 8
        if pos + n > len(body):
            raise ValueError("a column is cut short")
        parts.append(body[pos:pos + n])
        pos += n
    if pos != len(body):
        raise ValueError(f"{len(body) - pos} bytes after the last column")
    return json.loads(parts[0]), dict(zip(_COLUMNS, parts[1:]))


def _unpack(data: bytes) -> tuple[dict, dict[str, bytes]]:
    if data[:len(MAGIC)] != MAGIC:
        raise CompactError(f"it is not a sealed compact provenance (it does not start with {MAGIC!r})")
    d = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    try:
        body = d.decompress(data[len(MAGIC):])
    except lzma.LZMAError as e:
        raise CompactError(f"it does not decompress ({e}): the file was damaged or edited") from None
    if not d.eof:
        raise CompactError("it is cut short (truncated): the file was damaged or edited")
    if d.unused_data:
        raise CompactError(f"it has {len(d.unused_data)} bytes after its end: the file was damaged or edited")
    try:
        meta, cols = _sections(body)
    except (ValueError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CompactError(f"its columns do not parse ({e})") from None
    if meta.get("format") != FORMAT:
        raise CompactError(f"it has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta, cols


def decode(data: bytes, key: bytes | None = None) -> CompactRun:
    """The records a provenance.bin holds; with ``key`` the WAL digests are recomputed (the key holder's WAL is
    the recorded one). Raises :class:`CompactError` naming what does not decode."""
    meta, cols = _unpack(data)
    try:
        return _decode(meta, cols, key)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise CompactError(f"its columns do not decode to a plan ({e.__class__.__name__}: {e})") from None


def _decode(meta: dict, cols: dict[str, bytes], key: bytes | None) -> CompactRun:
    seg_n = _unints(cols["seg_n"]).tolist()
    n_seg, n_mb = meta["segments"], meta["microbatches"]
    if len(seg_n) != n_seg or sum(seg_n) != n_mb or min(seg_n, default=1) < 1:
        raise ValueError("segment sizes do not add up")
    accum = (np.array(seg_n, np.int64) + _unzigzag(_unints(cols["seg_accum"]))).tolist()
    epochs = np.cumsum(_unzigzag(_unints(cols["seg_epoch"]))).tolist()
    steps = (np.arange(n_seg) + _unzigzag(_unints(cols["seg_step"]))).tolist()
    lrs = _un_lr(cols["lr"])
    kinds = _unints(cols["norm_kind"]).tolist()
    dcodes = _unints(cols["norm_dtype"]).tolist()
    ints = iter(_unzigzag(_unints(cols["norm_int"])).tolist())
    floats = iter(struct.unpack(f"<{len(cols['norm_f64']) // 8}d", cols["norm_f64"]))
    mb_slots = _unints(cols["mb_slots"]).tolist()
    if not (len(accum) == len(epochs) == len(steps) == len(lrs) == len(kinds) == len(dcodes) == n_seg) or len(mb_slots) != n_mb:
        raise ValueError("column lengths disagree")
    n_slots = sum(mb_slots)
    table_raw = cols["tags"]
    if len(table_raw) % TAG_BYTES:
        raise ValueError("the tag table is not whole tags")
    table = [None if table_raw[i:i + TAG_BYTES] == NULL_TAG else table_raw[i:i + TAG_BYTES].hex()
             for i in range(0, len(table_raw), TAG_BYTES)]
    order = meta["order"]
    if order["rows"] != len(table):
        raise ValueError("the tag table's length disagrees with the order")
    # the slots' rows, in plan order
    if order["rule"] == "seedable_sampler":
        per_epoch: dict[int, int] = {}
        bounds = np.cumsum([0] + seg_n)
        for k in range(n_seg):
            per_epoch[epochs[k]] = per_epoch.get(epochs[k], 0) + sum(mb_slots[bounds[k]:bounds[k + 1]])
        seeds_by_epoch = order["epoch_seeds"]
        if sorted(per_epoch) != list(range(len(seeds_by_epoch))) or per_epoch.get(0) != len(table):
            raise ValueError("the epochs disagree with the sampler claims")
        parts = []
        for ep, s in enumerate(seeds_by_epoch):
            if per_epoch[ep] > len(table):
                raise ValueError(f"epoch {ep} serves more rows than the table has")
            parts.append(sampler_order(len(table), s)[:per_epoch[ep]])
        row_of = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    elif order["rule"] == "indices":
        row_of = _unints(cols["order"]).astype(np.int64) - 1
        if len(row_of) != n_slots or (row_of >= len(table)).any():
            raise ValueError("slot indices outside the tag table")
    else:
        raise ValueError(f"unknown order rule {order['rule']!r}")
    if len(row_of) != n_slots:
        raise ValueError("the order does not cover every slot")
    slot_tags = [table[r] if r >= 0 else None for r in row_of.tolist()]
    lens_col = _unints(cols["lens"]).astype(np.int64)
    if meta["lens"] == "per_row":
        if len(lens_col) != len(table):
            raise ValueError("per-row lengths disagree with the table")
        lens = lens_col[row_of].tolist()
    else:
        if len(lens_col) != n_slots:
            raise ValueError("per-slot lengths disagree with the slots")
        lens = lens_col.tolist()
    seed_rule = meta["seeds"]
    stored_seeds = np.frombuffer(cols["seeds"], dtype="<u8").tolist() if seed_rule["rule"] == "stored" else None
    if stored_seeds is not None and len(stored_seeds) != n_mb:
        raise ValueError("seeds disagree with the microbatches")
    exc = meta.get("exceptions", {})
    group_lrs, extra, ranks = exc.get("group_lrs", {}), exc.get("extra", {}), exc.get("ranks", {})
    dtypes = meta["norm_dtypes"]
    entries, records, pos, mb = [], [], 0, 0
    digester = record_digester(key) if key is not None else None
    for k in range(n_seg):
        step, kind, norm = steps[k], kinds[k], None
        dtype = None if dcodes[k] == 0 else dtypes[dcodes[k] - 1]
        seg_lens = []
        p = pos
        for j in range(seg_n[k]):
            seg_lens.append(lens[p:p + mb_slots[mb + j]])
            p += mb_slots[mb + j]
        if kind == 1:
            norm = float(next(ints) + sum(sum(x) for x in seg_lens))
        elif kind == 2:
            norm = next(floats)
        elif kind != 0:
            raise ValueError(f"normaliser kind {kind}")
        lr32 = float(np.float32(lrs[k]))
        for j in range(seg_n[k]):
            count = mb_slots[mb]
            slots = slot_tags[pos:pos + count]
            seed = microbatch_seed(seed_rule["base"], step, j) if stored_seeds is None else stored_seeds[mb]
            end = j == seg_n[k] - 1
            e = PlanEntry(mb=mb, step=step, j=j, end=end, seed=seed, lr=lrs[k], norm=norm, norm_dtype=dtype,
                          accum=accum[k], slots=slots, lens=seg_lens[j], epoch=epochs[k],
                          group_lrs=group_lrs.get(str(k)), ranks=ranks.get(str(mb)),
                          extra=extra.get(str(k), {}) if j == 0 else {})
            flags = (FLAG_ACCUM_END if end else 0) | (FLAG_DUMMY if None in slots else 0)
            digest = digester(slots, seed, lr32, step, count, flags) if digester is not None else 0
            entries.append(e)
            records.append(WalRecord(digest, seed, lr32, step, count, flags))
            pos += count
            mb += 1
    macs = cols["block_macs"]
    ranges = block_ranges(n_seg)
    if len(macs) != 8 * len(ranges):
        raise ValueError("the block MACs disagree with the segments")
    blocks = [(a, b, macs[8 * i:8 * i + 8]) for i, (a, b) in enumerate(ranges)]
    seg_bounds = [(int(a), int(b)) for a, b in zip(np.cumsum([0] + seg_n)[:-1], np.cumsum(seg_n))]
    groups = batch_group_ranges(seg_bounds) if seg_bounds else []
    raw = cols["batch_macs"]
    size = BATCH_MAC_BYTES * len(groups)
    present = {"all": [True] * len(groups), "none": [False] * len(groups)}.get(meta["batch_groups"])
    if present is None:
        present = [bool(b) for b in raw[size:]]
    elif len(raw) != size:
        raise ValueError("the batch MACs disagree with the groups")
    if len(present) != len(groups) or len(raw) < size:
        raise ValueError("the batch MACs disagree with the groups")
    batch_groups = [(a, b, raw[BATCH_MAC_BYTES * i:BATCH_MAC_BYTES * (i + 1)] if present[i] else None)
                    for i, (a, b) in enumerate(groups)]
    return CompactRun(entries, records, [s for s in slot_tags], blocks, batch_groups, meta)


def read_compact(path: str | Path, key: bytes | None = None) -> CompactRun:
    return decode(Path(path).read_bytes(), key)


def texts(path: str | Path) -> dict:
    """The free texts a provenance.bin holds (param-group settings, dtype names), for the Hub's id scan; also
    checks that it decodes (raises :class:`CompactError`)."""
    meta = decode(Path(path).read_bytes()).meta
    return {"extra": (meta.get("exceptions") or {}).get("extra", {}), "norm_dtypes": meta.get("norm_dtypes", []),
            "run_id": meta.get("run_id")}


# ---- checks a reader with the key makes ---------------------------------------------------------------------
def forged_blocks(key: bytes, run_id: str, c: CompactRun) -> list[str]:
    """The blocks whose chained controls MAC fails (``"optimizer steps a-b (plan entries x-y, provenance.bin block
    k)"``), recomputed from the decoded entries."""
    segs = _segments_of(c.entries) if c.entries else []
    out = []
    for k, (mac, (a, b, stored)) in enumerate(zip(controls_chain(key, run_id, c.entries, segs), c.blocks)):
        if mac != stored:
            first, last = c.entries[segs[a][0]], c.entries[segs[b - 1][1] - 1]
            out.append(f"optimizer steps {first.step}-{last.step} (plan entries {first.mb}-{last.mb}, "
                       f"provenance.bin block {k})")
            break  # the chain: every later block fails with it
    return out


# ---- compaction ----------------------------------------------------------------------------------------------
APPEND_ONLY = ("plan.bin", "wal.bin", "manifest.bin")


def is_compact(run: str | Path, header: dict | None = None) -> bool:
    run = Path(run)
    if header is None:
        try:
            header = json.loads((run / "header.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False
    return bool(header.get("provenance"))


def compact_run(run_dir: str | Path, batch_macs: dict | None = None) -> dict:
    """Replace a sealed run's plan.bin, wal.bin and manifest.bin by provenance.bin (see the module docstring).

    Refuses, before writing anything, a run that is not sealed, fails its check, or has unkeyed controls (a
    plan.jsonl run has no MACs to fold). Crash-safe: provenance.bin is written, then the header that names it (with
    its SHA-256 under the keyed seal), then the append-only files are removed; running it again finishes an
    interrupted compaction. Returns what was replaced and the sizes."""
    from ..utils import atomic_write_bytes
    from .run import check_run, controls_seal, file_sha256, write_sidecar
    from .tags import run_key

    run = Path(run_dir)
    header = json.loads((run / "header.json").read_text()) if (run / "header.json").is_file() else None
    if header is None:
        raise UnlearnError(f"{run} is not a recorded run (no header.json)")
    key = run_key(run, header)
    if is_compact(run, header):
        _remove_append_only(run)  # an interrupted compaction, or a second call
        return dict(header["provenance"])
    if not header.get("sealed"):
        raise UnlearnError(f"{run} is not sealed (training did not finish): only a sealed run can be compacted")
    rep, header, plan = check_run(run, key=key, check_checkpoints=False)
    if rep.errors:
        raise UnlearnError(f"{run} fails its integrity check, so it is not compacted: {rep.errors[0]}")
    if rep.summary.get("controls") != "keyed":
        raise UnlearnError(f"{run} has {rep.summary.get('controls')} controls (a plan.jsonl run): it has no keyed MACs "
                           "to fold, so it stays in its recorded format (it still replays)")
    det = header.get("determinism") or {}
    seed = (header.get("training_args") or {}).get("seed", det.get("seed"))
    bases = [s for s in (det.get("data_seed"), det.get("seed"), seed) if isinstance(s, int)]
    data = encode(plan, key, header["run_id"], seed_base=seed if isinstance(seed, int) else None,
                  sampler_seeds=tuple(bases), batch_macs=batch_macs)
    decoded = decode(data)  # the WAL digests were checked against these very records by check_run above
    from .wal import read_manifest, read_wal

    wal = [dataclasses.replace(r, digest=0) for r in read_wal(run / "wal.bin").records]
    if decoded.entries != [dataclasses.replace(e, batch=None) for e in plan] or decoded.records != wal or \
            decoded.manifest != read_manifest(run / "manifest.bin") or forged_blocks(key, header["run_id"], decoded):
        raise UnlearnError(f"internal: {run}'s compact provenance does not decode to its records; the run is left "
                           "as recorded (please report this)")
    sizes = {n: (run / n).stat().st_size for n in APPEND_ONLY}
    atomic_write_bytes(run / COMPACT_FILE, data)
    header["provenance"] = {"format": FORMAT, "file": COMPACT_FILE, "sha256": file_sha256(run / COMPACT_FILE),
                            "bytes": len(data), "replaced_bytes": sizes, "order": decoded.meta["order"]["rule"],
                            "seeds": decoded.meta["seeds"]["rule"], "lens": decoded.meta["lens"]}
    header["controls_mac"] = controls_seal(key, decoded.last_mac, header)
    write_sidecar(run / COMPACT_FILE)
    from ..utils import atomic_write_text

    atomic_write_text(run / "header.json", json.dumps(header, indent=1, sort_keys=True))
    write_sidecar(run / "header.json")
    _remove_append_only(run)
    return dict(header["provenance"])


def _remove_append_only(run: Path) -> None:
    for name in APPEND_ONLY:
        for f in (run / name, run / f"{name}.sha256"):
            f.unlink(missing_ok=True)
