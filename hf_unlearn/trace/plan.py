"""The execution plan: one JSON line per microbatch, the controls a replay must reproduce.

Fields: ``mb`` (microbatch index in the run), ``step`` (logical optimizer step the microbatch contributes to),
``j`` (position in its accumulation segment), ``end`` (accumulation end), ``seed`` (RNG seed of the microbatch),
``lr`` (the learning rate of that step, float64 as the scheduler produced it; ``group_lrs`` when param groups
differ), ``norm`` (the loss normaliser ``num_items_in_batch`` of the segment, or null) and ``norm_dtype``,
``accum`` (microbatches in the segment), ``slots`` (keyed tags of the ids, null = dummy slot), ``lens`` (token
length of every slot: the dummy of a deleted slot has the same shape), ``epoch``; in a data-parallel run
``ranks`` (how many of the slots each process ran, in process order); ``batch`` (per process, 16 hex digits of
the collated batch, which a replay must rebuild exactly); ``extra.groups`` (optimizer param-group settings other
than the learning rate, written when a scheduler changed them, e.g. cycled momentum).

On disk (since keyed controls) the plan is ``plan.bin``: one binary frame per accumulation segment, appended before
the segment runs, holding only what the WAL and the id manifest do not (the WAL has each microbatch's seed, step,
length and flags, the manifest its slot tags), so a plan costs a few bytes per microbatch instead of ~360 of JSON:

```
plan.bin  = b"HFUPLAN1" frame*
frame     = varint(len(body)) mac[8] body crc32(le, of everything before it in the frame)[4]
body      = varint(flags) varint(microbatches) [varint(accum)] [lr f64] [group lrs] [norm dtype, norm] [epoch]
            [extra JSON] then per microbatch: varint(slots) varint(len)*slots [ranks] [batch digests 8 B each]
mac       = HMAC(run key, previous frame's mac, the segment's entries as canonical JSON)[:8]  (tags.segment_mac)
```

A torn last frame (crash mid-write) is reported like a torn WAL tail; a frame whose CRC fails is damage. Runs
recorded before it keep ``plan.jsonl`` (one JSON line per microbatch, all fields, no MAC): they still read and
replay, and are reported as having unkeyed controls.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import UnlearnError
from ..utils import atomic_write_bytes
from .compact_format import read_compact
from .records import COMPACT_FILE, LEGACY_PLAN_FILE, PLAN_FILE, PlanEntry  # noqa: F401 - they lived here
from .tags import controls_chain_start, segment_mac
from .wal import read_manifest, read_wal

MAGIC = b"HFUPLAN1"


def read_plan(path: str | Path) -> list[PlanEntry]:
    """The plan of a run folder (``plan.bin`` joined with the WAL and manifest, or a legacy ``plan.jsonl``), or of a
    ``plan.jsonl`` file. Unchecked: :func:`hf_unlearn.trace.run.check_run` checks it; cut to whole records."""
    path = Path(path)
    if path.is_dir() and plan_file(path).name == COMPACT_FILE:
        return read_compact(path / COMPACT_FILE).entries
    if path.is_dir() and (path / PLAN_FILE).exists():
        plan, _ = join_plan(read_compact_plan(path / PLAN_FILE).segments, read_wal(path / "wal.bin").records,
                            read_manifest(path / "manifest.bin"))
        return plan
    return read_plan_jsonl(path / LEGACY_PLAN_FILE if path.is_dir() else path)


def plan_file(run: str | Path) -> Path:
    """The run's plan file: ``plan.bin``, ``plan.jsonl`` for a run recorded before keyed controls, or
    ``provenance.bin`` for a compacted run (which holds the WAL and the manifest too)."""
    run = Path(run)
    if (run / COMPACT_FILE).exists() and not (run / PLAN_FILE).exists():
        return run / COMPACT_FILE
    return run / LEGACY_PLAN_FILE if (run / LEGACY_PLAN_FILE).exists() and not (run / PLAN_FILE).exists() \
        else run / PLAN_FILE


def has_plan(run: str | Path) -> bool:
    """True when the folder already holds recorded plan entries (in either format)."""
    f = plan_file(run)
    return f.exists() and f.stat().st_size > (len(MAGIC) if f.name == PLAN_FILE else 0)


def read_plan_jsonl(path: str | Path) -> list[PlanEntry]:
    """Parse a legacy plan; a torn last line (crash mid-write) is dropped, any other bad line is an error."""
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    out = []
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(PlanEntry.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TypeError) as e:
            if n >= len(lines) - 1:  # unterminated last line
                break
            raise UnlearnError(f"{path}: line {n + 1} is not a plan entry ({e}); the plan is corrupt") from None
    return out


def segments(plan: list[PlanEntry]) -> list[list[PlanEntry]]:
    """Group the plan into accumulation segments (one per logical optimizer step)."""
    out, cur = [], []
    for e in plan:
        cur.append(e)
        if e.end:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


# ---- the compact plan: plan.bin ----------------------------------------------------------------------------
_F_ACCUM, _F_LR, _F_GROUP_LRS, _F_NORM, _F_NORM_INT, _F_EPOCH, _F_EXTRA, _F_RANKS, _F_BATCH = (1 << i for i in range(9))
_DTYPES = (None, "float32", "int64", "int32", "python", "float64", "bfloat16", "float16")  # codes 1..; 0: by name
_F64 = struct.Struct("<d")


def canonical_controls(entries: list[PlanEntry]) -> bytes:
    """What a segment MAC covers: every field of every entry, as sorted-key JSON (the same in both formats)."""
    return "".join(e.to_line(sort_keys=True) for e in entries).encode()


def _varint(n: int) -> bytes:
    if n < 0:
        raise ValueError(f"varint of a negative number {n}")
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


class _Reader:
    def __init__(self, data: bytes, pos: int = 0):
        self.data, self.pos = data, pos

    def varint(self) -> int:
        n = shift = 0
        while True:
            if self.pos >= len(self.data) or shift > 63:
                raise ValueError("truncated varint")
            b = self.data[self.pos]
            self.pos += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return n

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("truncated field")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def f64(self) -> float:
        return _F64.unpack(self.take(8))[0]

    def text(self) -> str:
        return self.take(self.varint()).decode("utf-8")


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _varint(len(raw)) + raw


@dataclass
class PlanSegment:
    """One decoded frame: the segment's own controls (the WAL and the manifest hold the rest) and its MAC."""

    mac: bytes
    lr: float
    norm: float | None
    norm_dtype: str | None
    accum: int
    epoch: int
    group_lrs: list[float] | None
    extra: dict
    lens: list[list[int]]  # per microbatch, per slot
    ranks: list[list[int] | None]
    batch: list[list[str] | None]
    offset: int = 0  # byte offset of the frame in plan.bin


def encode_segment(entries: list[PlanEntry], previous: PlanSegment | None) -> bytes:
    """The body of one frame (``previous``: the segment before it, whose lr and epoch repeat for free)."""
    first = entries[0]
    if [e.end for e in entries] != [False] * (len(entries) - 1) + [True] or [e.j for e in entries] != \
            list(range(len(entries))) or any((e.lr, e.norm, e.epoch) != (first.lr, first.norm, first.epoch)
                                             for e in entries):
        raise UnlearnError(f"internal: plan entries {first.mb}..{entries[-1].mb} are not one accumulation segment")
    flags, body = 0, _varint(len(entries))
    if first.accum != len(entries):
        flags |= _F_ACCUM
        body += _varint(first.accum)
    if previous is None or _F64.pack(previous.lr) != _F64.pack(first.lr):
        flags |= _F_LR
        body += _F64.pack(first.lr)
    if first.group_lrs:
        flags |= _F_GROUP_LRS
        body += _varint(len(first.group_lrs)) + b"".join(_F64.pack(v) for v in first.group_lrs)
    if first.norm is not None or first.norm_dtype is not None:
        flags |= _F_NORM
        code = _DTYPES.index(first.norm_dtype) + 1 if first.norm_dtype in _DTYPES else 0
        body += _varint(code) + (_text(first.norm_dtype) if code == 0 else b"")
        norm = first.norm
        if norm is not None and float(norm).is_integer() and 0 <= norm < 2 ** 63 and isinstance(norm, float):
            flags |= _F_NORM_INT
            body += _varint(int(norm))
        else:
            body += _F64.pack(float("nan") if norm is None else norm) + bytes([norm is None])
    if previous is None or previous.epoch != first.epoch:
        flags |= _F_EPOCH
        body += _varint(first.epoch)
    if first.extra:
        flags |= _F_EXTRA
        body += _text(json.dumps(first.extra, separators=(",", ":")))
    if any(e.extra for e in entries[1:]):
        raise UnlearnError(f"internal: plan entry extra settings belong to a segment's first entry ({first.mb})")
    if any(e.ranks for e in entries):
        flags |= _F_RANKS
    if any(e.batch for e in entries):
        flags |= _F_BATCH
    for e in entries:
        body += _varint(len(e.slots)) + b"".join(_varint(n) for n in e.lens)
        if len(e.lens) != len(e.slots):
            raise UnlearnError(f"internal: plan entry {e.mb} has {len(e.slots)} slots and {len(e.lens)} lengths")
        if flags & _F_RANKS:
            body += _varint(len(e.ranks or [])) + b"".join(_varint(n) for n in e.ranks or [])
        if flags & _F_BATCH:
            body += _varint(len(e.batch or [])) + b"".join(bytes.fromhex(b) for b in e.batch or [])
    return _varint(flags) + body


def frame(body: bytes, mac: bytes) -> bytes:
    head = _varint(len(body)) + mac + body
    return head + struct.pack("<I", zlib.crc32(head))


def decode_segment(body: bytes, mac: bytes, previous: PlanSegment | None) -> PlanSegment:
    r = _Reader(body)
    flags = r.varint()
    n = r.varint()
    accum = r.varint() if flags & _F_ACCUM else n
    if flags & _F_LR:
        lr = r.f64()
    elif previous is None:
        raise ValueError("the first segment repeats a learning rate")
    else:
        lr = previous.lr
    group_lrs = [r.f64() for _ in range(r.varint())] if flags & _F_GROUP_LRS else None
    norm = norm_dtype = None
    if flags & _F_NORM:
        code = r.varint()
        norm_dtype = r.text() if code == 0 else _DTYPES[code - 1]
        if flags & _F_NORM_INT:
            norm = float(r.varint())
        else:
            value, missing = r.f64(), r.take(1)[0]
            norm = None if missing else value
    epoch = r.varint() if flags & _F_EPOCH else (previous.epoch if previous is not None else 0)
    extra = json.loads(r.text()) if flags & _F_EXTRA else {}
    lens, ranks, batch = [], [], []
    for _ in range(n):
        lens.append([r.varint() for _ in range(r.varint())])
        ranks.append([r.varint() for _ in range(r.varint())] or None if flags & _F_RANKS else None)
        batch.append([r.take(8).hex() for _ in range(r.varint())] or None if flags & _F_BATCH else None)
    if r.pos != len(body):
        raise ValueError(f"{len(body) - r.pos} unread bytes")
    return PlanSegment(mac, lr, norm, norm_dtype, accum, epoch, group_lrs, extra, lens, ranks, batch)


@dataclass
class PlanScan:
    """What reading ``plan.bin`` found: the whole, sound frames; the byte offset of a damaged frame (reading stops
    there); the bytes of a torn last frame (a crash mid-write)."""

    segments: list[PlanSegment]
    damaged_at: int | None = None
    damage: str = ""
    tail_bytes: int = 0


def read_compact_plan(path: str | Path) -> PlanScan:
    data = Path(path).read_bytes()
    if data[:len(MAGIC)] != MAGIC:
        if MAGIC.startswith(data):  # a crash right after creating the file
            return PlanScan([], tail_bytes=len(data))
        raise UnlearnError(f"{path} is not a compact plan (it does not start with {MAGIC!r})")
    scan, pos, previous = PlanScan([]), len(MAGIC), None
    while pos < len(data):
        r = _Reader(data, pos)
        try:
            size = r.varint()
            end = r.pos + 8 + size + 4
        except ValueError:
            end = len(data) + 1
        if end > len(data):  # a frame cut short: only a crash mid-append leaves that
            scan.tail_bytes = len(data) - pos
            break
        mac, body = data[r.pos:r.pos + 8], data[r.pos + 8:end - 4]
        why = ""
        if zlib.crc32(data[pos:end - 4]) != struct.unpack("<I", data[end - 4:end])[0]:
            why = "fails its CRC32 check"
        else:
            try:
                seg = decode_segment(body, mac, previous)
            except (ValueError, IndexError, UnicodeDecodeError, json.JSONDecodeError) as e:
                why = f"does not decode ({e})"
        if why:
            scan.damaged_at, scan.damage = pos, why
            break
        seg.offset = pos
        scan.segments.append(seg)
        previous, pos = seg, end
    return scan


def segment_entries(seg: PlanSegment, heads: list[tuple[int, int, int, list]]) -> list[PlanEntry]:
    """The plan entries of a decoded segment, given each microbatch's ``(mb, step, seed, slots)``."""
    n = len(seg.lens)
    return [PlanEntry(mb=mb, step=step, j=j, end=j == n - 1, seed=seed, lr=seg.lr, norm=seg.norm,
                      norm_dtype=seg.norm_dtype, accum=seg.accum, slots=list(slots), lens=seg.lens[j],
                      epoch=seg.epoch, group_lrs=seg.group_lrs, ranks=seg.ranks[j], batch=seg.batch[j],
                      extra=seg.extra if j == 0 else {})
            for j, (mb, step, seed, slots) in enumerate(heads)]


def join_plan(segs: list[PlanSegment], records: list, manifest: list) -> tuple[list[PlanEntry], int]:
    """Plan entries from plan.bin segments, WAL records (seed, step) and the manifest (slot tags), up to the
    shorter of plan and WAL. Returns the entries and how many microbatches the segments describe."""
    out, pos, total = [], 0, 0
    for seg in segs:
        heads = []
        for counts in seg.lens[:max(0, len(records) - total)]:
            rec = records[total + len(heads)]
            heads.append((total + len(heads), rec.step, rec.seed, manifest[pos:pos + len(counts)]))
            pos += len(counts)
        out += segment_entries(seg, heads)
        total += len(seg.lens)
    return out, total


class CompactPlanWriter:
    """Appends one frame per segment to ``plan.bin`` and chains the segment MACs (see the module docstring)."""

    def __init__(self, path: Path, key: bytes, run_id: str, entries: list[PlanEntry] = ()):
        """Start ``path`` afresh holding ``entries`` (whole segments: what a resumed run keeps), atomically."""

        self.key, self.path = key, Path(path)
        self.mac, self._previous = controls_chain_start(key, run_id), None
        data = MAGIC + b"".join(self._frame(seg) for seg in segments(list(entries)))
        atomic_write_bytes(self.path, data)
        self._f = open(self.path, "ab")

    def _frame(self, entries: list[PlanEntry]) -> bytes:

        body = encode_segment(entries, self._previous)
        decoded = decode_segment(body, b"", self._previous)  # the MAC covers the entries as a reader gets them
        read_back = segment_entries(decoded, [(e.mb, int(e.step), int(e.seed), e.slots) for e in entries])
        self.mac = decoded.mac = segment_mac(self.key, self.mac, canonical_controls(read_back))
        self._previous = decoded
        return frame(body, self.mac)

    def append(self, entries: list[PlanEntry]) -> None:
        self._f.write(self._frame(entries))

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()
