"""The seeds of a run's microbatches: each microbatch of each optimizer step runs under its own recorded seed, so
dropout and NEFTune noise are reproduced microbatch by microbatch without touching the global RNG stream."""

from __future__ import annotations

import hashlib
import random
from contextlib import contextmanager

import numpy as np


def _hashed_seed(text: str) -> int:
    """63 bits of SHA-256(text): a seed that depends on nothing but the text."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def microbatch_seed(base: int, step: int, j: int) -> int:
    """The seed of microbatch ``j`` of optimizer step ``step`` (63 bits, independent of resumes)."""
    return _hashed_seed(f"{base}:{step}:{j}")


def rank_seed(seed: int, rank: int) -> int:
    """The seed process ``rank`` uses for a microbatch whose recorded seed is ``seed`` (rank 0: the seed itself)."""
    return seed if rank == 0 else _hashed_seed(f"{seed}:rank{rank}")


@contextmanager
def rng_kept():
    """Run a block (a nested Trainer seeds everything) and give the caller its Python, numpy and torch RNGs back."""
    import torch  # heavy: imported when a block runs, so the plan codecs (compact) stay light

    py, npy = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


@contextmanager
def seeded(seed: int):
    """Run a block under ``seed`` without disturbing the caller's RNG streams."""
    import torch  # heavy: imported when a microbatch runs, so the plan codecs (compact) stay light

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield

