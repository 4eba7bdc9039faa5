"""The records a run's plan and WAL decode to, whatever their file: a plan entry and a WAL record.

``plan.bin`` (:mod:`hf_unlearn.trace.plan`), ``wal.bin`` (:mod:`hf_unlearn.trace.wal`) and a compacted run's
``provenance.bin`` (:mod:`hf_unlearn.trace.compact`) are three encodings of the same records; the records and the
files' names live here, below the three, so each reader can decode the others' files.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field, fields

from ..errors import UnlearnError

PLAN_FILE = "plan.bin"
LEGACY_PLAN_FILE = "plan.jsonl"  # runs recorded before keyed controls
COMPACT_FILE = "provenance.bin"  # a compacted sealed run: plan, WAL and manifest in one file (trace.compact)


@dataclass
class PlanEntry:
    mb: int
    step: int
    j: int
    end: bool
    seed: int
    lr: float
    norm: float | None
    norm_dtype: str | None
    accum: int
    slots: list[str | None]
    lens: list[int]
    epoch: int = 0
    group_lrs: list[float] | None = None
    ranks: list[int] | None = None
    batch: list[str] | None = None
    extra: dict = field(default_factory=dict)

    def to_line(self, sort_keys: bool = False) -> str:
        d = {f: getattr(self, f) for f in _FIELDS}  # not asdict: its deep copy dominated writing a plan
        for optional in ("group_lrs", "ranks", "batch"):
            if not d[optional]:
                d.pop(optional)
        if not d["extra"]:
            d.pop("extra")
        return json.dumps(d, separators=(",", ":"), sort_keys=sort_keys) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> PlanEntry:
        return cls(**d)

    def rank_slots(self, rank: int, world: int) -> tuple[int, int]:
        """``(start, stop)`` of the slots process ``rank`` ran (all of them in a single-process run)."""
        counts = self.ranks or [len(self.slots)]
        if len(counts) != world:
            raise UnlearnError(f"plan entry {self.mb} was run by {len(counts)} process(es), not {world}")
        start = sum(counts[:rank])
        return start, start + counts[rank]


_FIELDS = tuple(f.name for f in fields(PlanEntry))


RECORD = struct.Struct("<QQfIHHI")
RECORD_SIZE = RECORD.size  # 32
FLAG_ACCUM_END = 1
FLAG_DUMMY = 2
assert RECORD_SIZE == 32


@dataclass(frozen=True)
class WalRecord:
    digest: int
    seed: int
    lr: float
    step: int
    length: int
    flags: int

    @property
    def accumulation_end(self) -> bool:
        return bool(self.flags & FLAG_ACCUM_END)

    def pack(self) -> bytes:
        body = RECORD.pack(self.digest, self.seed, self.lr, self.step, self.length, self.flags, 0)[:28]
        return body + struct.pack("<I", zlib.crc32(body))
