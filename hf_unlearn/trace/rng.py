"""Running a block under a seed, or with the caller's RNG streams given back after it, without disturbing them: how a
recording and its replays draw each microbatch's dropout and NEFTune noise (from its recorded seed,
:mod:`hf_unlearn.trace.seeds`), and how the end-of-recording self-check runs a nested Trainer."""

from __future__ import annotations

import random
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def rng_kept():
    """Run a block (a nested Trainer seeds everything) and give the caller its Python, numpy and torch RNGs back."""
    py, npy = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


@contextmanager
def all_seeded(seed: int):
    """Run a block with Python's, numpy's and torch's RNGs all seeded with ``seed`` and give the caller's streams back
    after it: a check that runs the user's code twice compares the two calls, not two draws."""
    with rng_kept():
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        yield


@contextmanager
def seeded(seed: int):
    """Run a block under ``seed`` without disturbing the caller's RNG streams."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
