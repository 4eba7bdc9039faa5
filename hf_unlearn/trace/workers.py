"""Hash many tensors on the cores torch may use: the per-step checksums and the checkpoint hashes read gigabytes at
memory speed, and xxhash and hashlib release the GIL on large buffers, so one thread per tensor (largest first)
divides that time by the thread count. Results are identical to hashing one tensor after the other."""

from __future__ import annotations

import heapq
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

MIN_BYTES = 1 << 22  # below ~4 MB in all, threads cost more than they save

_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}
os.register_at_fork(after_in_child=_pools.clear)  # a forked child (a DataLoader worker) has none of the threads


def threads() -> int:
    """How many threads may hash at once: torch's intra-op thread count (what the user allows training to use;
    hashing runs between steps, when those threads are idle)."""
    return max(1, torch.get_num_threads())


def map_tensors(fn, items: list, nbytes: list[int], workers: int | None = None) -> list:
    """``[fn(x) for x in items]``, computed by up to ``workers`` threads (default :func:`threads`) when the items
    are large enough; ``nbytes``: each item's size, to start the largest first."""
    workers = threads() if workers is None else workers
    if workers <= 1 or len(items) < 2 or sum(nbytes) < MIN_BYTES:
        return [fn(x) for x in items]
    with _lock:
        pool = _pools.get(workers) or _pools.setdefault(
            workers, ThreadPoolExecutor(workers, thread_name_prefix="hf_unlearn-hash"))
    # a few bins per thread, filled largest first onto the lightest: one task per bin, not per tensor (a state holds
    # a thousand tensors, and a task costs more than hashing a small one)
    bins: list[tuple[int, int, list[int]]] = [(0, b, []) for b in range(2 * workers)]
    for i in sorted(range(len(items)), key=lambda i: -nbytes[i]):
        load, b, members = heapq.heappop(bins)
        members.append(i)
        heapq.heappush(bins, (load + nbytes[i], b, members))
    tasks = [pool.submit(lambda members: [(i, fn(items[i])) for i in members], members) for _, _, members in bins]
    out = [None] * len(items)
    for task in tasks:
        for i, value in task.result():
            out[i] = value
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
