"""Which trace checkpoints a run keeps: pure functions of the run length ``T``, the dense spacing ``K`` and a factor.

A deletion whose first affected step is ``s`` replays from the latest kept checkpoint ``c <= s``: ``T - c`` steps
against a physical minimum of ``T - s``. *Geometric* retention writes a checkpoint every ``K`` steps (counted back
from the planned end, plus step 0) and thins them so that every step ``s`` has a kept ``c <= s`` with
``T - c <= factor * (T - s) + K`` (factor 2 by default). The kept distances from the end then grow like
``K, 3K, 7K, ...``, so about ``log2(T / K) + 1`` checkpoints are kept (11 for ``T / K`` up to 1,023 when ``K``
divides ``T``). *Even* retention is the older rule: every ``K`` steps from step 0, all kept.

Thinning is online: after each write the recorder keeps :func:`thin`'s answer, which is always a subset of what
exists (nothing deleted comes back) and always satisfies the bound for the run as if it ended now, while never
dropping a checkpoint the planned end needs. When the run ends, :func:`geometric_keep` over what is left gives the
final set (the planned one if the run reached its planned length).
"""

from __future__ import annotations

MODES = ("geometric", "even")
FACTORS = (2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256, 1024)  # tried in turn when a byte budget caps the count


def default_every(total: int, mode: str) -> int:
    """The dense spacing ``K`` when none is given: ``T // 32`` (geometric) or ``ceil(T / 10)`` (even)."""
    total = max(int(total), 1)
    return max(1, total // 32) if mode == "geometric" else max(1, -(-total // 10))


def dense_steps(total: int, every: int, mode: str = "geometric") -> list[int]:
    """Every step a checkpoint is written at: step 0, every ``K`` steps (from the end when geometric), the end."""
    if mode == "even":
        return sorted({0, total, *range(0, total, every)})
    return sorted({0, total, *range(total, -1, -every)})


def is_due(step: int, total: int, every: int, mode: str = "geometric") -> bool:
    """Whether a checkpoint is written before optimizer step ``step`` of a run planned for ``total`` steps."""
    if step == 0 or step == total:
        return True
    return (total - step) % every == 0 if mode == "geometric" else step % every == 0


def geometric_keep(total: int, available, every: int, factor: float = 2) -> list[int]:
    """The fewest of ``available`` checkpoints (steps <= ``total``, containing 0 and ``total``) that keep every step
    ``s`` within ``T - c <= factor * (T - s) + K`` of a kept ``c <= s`` (greedy from the end: each next checkpoint
    is the earliest one the bound allows, which is optimal for this covering problem).

    If ``available`` has a gap the bound cannot bridge, the checkpoint just before the gap is kept anyway (the bound
    then fails there; :func:`worst_excess` measures by how much).
    """
    steps = sorted({int(c) for c in available if 0 <= c <= total})
    if not steps or steps[-1] != total or steps[0] != 0:
        raise ValueError(f"available checkpoints must include step 0 and the end ({total}): got {steps[:3]}...")
    kept = [total]
    while kept[-1] > 0:
        c = kept[-1]
        # the worst step before c is s = c - 1: its checkpoint must satisfy T - c' <= factor * (T - c + 1) + K
        lowest = total - factor * (total - c + 1) - every
        candidates = [x for x in steps if x < c and x >= lowest]
        kept.append(min(candidates) if candidates else max(x for x in steps if x < c))
    return sorted(kept)


def thin(now: int, available, planned_total: int, every: int, factor: float = 2,
         mode: str = "geometric") -> list[int]:
    """What to keep after writing the checkpoint at step ``now``: the planned run's final set up to ``now``, plus
    the fewest checkpoints that bound every deletion if the run ended at ``now``. Always a subset of ``available``."""
    available = sorted({int(c) for c in available if c <= now})
    if mode == "even":
        return available
    planned = set(geometric_keep(planned_total, dense_steps(planned_total, every), every, factor))
    now_set = set(geometric_keep(now, available, every, factor)) if now > 0 else {0}
    return sorted(({c for c in planned if c <= now} | now_set) & set(available))


def final_keep(total: int, available, every: int, factor: float = 2, mode: str = "geometric") -> list[int]:
    """What a finished run keeps (geometric: the fewest of ``available`` meeting the bound; even: all of them)."""
    return sorted(set(available)) if mode == "even" else geometric_keep(total, available, every, factor)


def start_for(step: int, kept) -> int | None:
    """The checkpoint a deletion whose first affected step is ``step`` replays from (None if there is none)."""
    return max((c for c in kept if c <= step), default=None)


def worst_excess(total: int, kept, every: int, factor: float = 2) -> float:
    """max over steps s of ``(T - start_for(s)) - (factor * (T - s) + K)``: <= 0 means the bound holds.

    Within each gap between kept checkpoints the excess is largest at the step just before the next one, so only
    those steps (and ``T``) are evaluated.
    """
    kept = sorted(set(kept))
    if not kept or kept[0] != 0:
        raise ValueError("the kept checkpoints must include step 0")
    nxt = kept[1:] + [total + 1]
    return max((total - c) - (factor * (total - (n - 1)) + every) for c, n in zip(kept, nxt))


def factor_for_budget(total: int, every: int, max_count: int) -> float | None:
    """The smallest factor of :data:`FACTORS` whose planned set has at most ``max_count`` checkpoints (None: even
    ``{0, T}`` does not fit, or a single factor-1024 set still does not)."""
    if max_count < 2:
        return None
    for f in FACTORS:
        if len(geometric_keep(total, dense_steps(total, every), every, f)) <= max_count:
            return f
    return None


def describe(retention: dict) -> str:
    """One line: the rule a run's checkpoints follow and what it costs a deletion in replay."""
    mode, k = retention.get("mode"), retention.get("every")
    if mode == "even":
        return (f"even retention: a checkpoint every {k} steps, all kept; a deletion at step s replays up to "
                f"T - s + {k} - 1 steps")
    f = retention.get("factor", 2)
    budget = retention.get("budget")
    extra = f" (capped by trace_checkpoint_budget={budget} bytes)" if budget else ""
    return (f"geometric retention{extra}: dense every {k} steps, thinned; a deletion at step s replays at most "
            f"{f:g} x (T - s) + {k} steps")
