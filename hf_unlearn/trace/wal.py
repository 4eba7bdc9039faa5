"""The binary write-ahead log: one 32-byte record per microbatch, written before the microbatch runs.

Record layout (little-endian ``<QQfIHHI``): ordered-id digest (keyed, 8 bytes), seed, learning rate (float32),
logical optimizer step, microbatch length (slots), flags (bit 0 = accumulation end, bit 1 = holds a dummy slot),
CRC32 of the first 28 bytes. The digest is :func:`~hf_unlearn.trace.tags.record_digest` (the slot tags and the
record's own controls under the run key) in runs with a ``plan.bin``, and
:func:`~hf_unlearn.trace.tags.ids_digest` (the slot tags only) in runs recorded with a ``plan.jsonl``. The id
manifest lists every slot's 8-byte tag in WAL order (zeros = dummy slot).

A compacted run (:mod:`hf_unlearn.trace.compact`) has neither file: :func:`read_wal` and :func:`read_manifest`
decode its ``provenance.bin`` instead (WAL digests read as 0 there: the key holder recomputes them).

A tail shorter than one record is what a crash mid-write leaves; :func:`read_wal` reports it and the readers
decide (an unsealed run is recovered to its last whole record, a sealed one is refused).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

from .compact_format import read_compact
from .records import COMPACT_FILE, FLAG_ACCUM_END, FLAG_DUMMY, RECORD, RECORD_SIZE, WalRecord  # noqa: F401 - they lived here
from .tags import NULL_TAG, TAG_BYTES


@dataclass
class WalScan:
    """What reading a WAL found: whole records, records whose CRC failed (index), and a torn tail (bytes)."""

    records: list[WalRecord]
    bad_crc: list[int]
    tail_bytes: int


def _compacted(path: Path):
    """The decoded provenance.bin of a compacted run, when ``path`` is its (removed) wal.bin or manifest.bin."""
    if not path.exists() and (path.parent / COMPACT_FILE).exists():
        return read_compact(path.parent / COMPACT_FILE)
    return None


def read_wal(path: str | Path) -> WalScan:
    compact = _compacted(Path(path))
    if compact is not None:
        return WalScan(compact.records, [], 0)
    data = Path(path).read_bytes()
    whole = len(data) // RECORD_SIZE
    records, bad = [], []
    for i in range(whole):
        chunk = data[i * RECORD_SIZE:(i + 1) * RECORD_SIZE]
        digest, seed, lr, step, length, flags, crc = RECORD.unpack(chunk)
        if zlib.crc32(chunk[:28]) != crc:
            bad.append(i)
        records.append(WalRecord(digest, seed, lr, step, length, flags))
    return WalScan(records, bad, len(data) - whole * RECORD_SIZE)


def manifest_bytes(tags: list[str | None]) -> bytes:
    return b"".join(bytes.fromhex(t) if t else NULL_TAG for t in tags)


def read_manifest(path: str | Path) -> list[str | None]:
    compact = _compacted(Path(path))
    if compact is not None:
        return compact.manifest
    data = Path(path).read_bytes()
    out = []
    for i in range(0, len(data) - len(data) % TAG_BYTES, TAG_BYTES):
        chunk = data[i:i + TAG_BYTES]
        out.append(None if chunk == NULL_TAG else chunk.hex())
    return out
