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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UnlearnError


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

    def to_line(self) -> str:
        d = asdict(self)
        for optional in ("group_lrs", "ranks", "batch"):
            if not d[optional]:
                d.pop(optional)
        if not d["extra"]:
            d.pop("extra")
        return json.dumps(d, separators=(",", ":")) + "\n"

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


def read_plan(path: str | Path) -> list[PlanEntry]:
    """Parse a plan; a torn last line (crash mid-write) is dropped, any other bad line is an error."""
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
