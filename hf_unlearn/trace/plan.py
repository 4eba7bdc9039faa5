"""The execution plan: one JSON line per microbatch, the controls a replay must reproduce.

Fields: ``mb`` (microbatch index in the run), ``step`` (logical optimizer step the microbatch contributes to),
``j`` (position in its accumulation segment), ``end`` (accumulation end), ``seed`` (RNG seed of the microbatch),
``lr`` (the learning rate of that step, float64 as the scheduler produced it; ``group_lrs`` when param groups
differ), ``norm`` (the loss normaliser ``num_items_in_batch`` of the segment, or null) and ``norm_dtype``,
``accum`` (microbatches in the segment), ``slots`` (keyed tags of the ids, null = dummy slot), ``lens`` (token
length of every slot: the dummy of a deleted slot has the same shape), ``epoch``.
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
    extra: dict = field(default_factory=dict)

    def to_line(self) -> str:
        d = asdict(self)
        if not d["group_lrs"]:
            d.pop("group_lrs")
        if not d["extra"]:
            d.pop("extra")
        return json.dumps(d, separators=(",", ":")) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> PlanEntry:
        return cls(**d)


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
