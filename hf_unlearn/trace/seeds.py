"""The seed of every microbatch: a function of the run's seed, the optimizer step and the position, nothing else.

The recorder writes these seeds into the WAL, a replay draws the same ones, and a compacted run stores only the rule
(:mod:`hf_unlearn.trace.compact`): so they sit at the ground of the engine, below all three.
"""

from __future__ import annotations

import hashlib


def _hashed_seed(text: str) -> int:
    """63 bits of SHA-256(text): a seed that depends on nothing but the text."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def microbatch_seed(base: int, step: int, j: int) -> int:
    """The seed of microbatch ``j`` of optimizer step ``step`` (63 bits, independent of resumes)."""
    return _hashed_seed(f"{base}:{step}:{j}")


def rank_seed(seed: int, rank: int) -> int:
    """The seed process ``rank`` uses for a microbatch whose recorded seed is ``seed`` (rank 0: the seed itself)."""
    return seed if rank == 0 else _hashed_seed(f"{seed}:rank{rank}")
