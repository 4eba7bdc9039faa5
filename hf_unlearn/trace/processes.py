"""The processes of a multi-process launch (DDP, FSDP2) agreeing on a verdict: a check that one process fails must
stop every process, naming where it failed.

A replay checks its state after every step on every process (each holds its own: a DDP process's parameters, an
FSDP2 process's shards and buffers). A process that stopped alone would leave the others waiting in the next step's
collective, and a verdict taken on the main process alone would miss a difference only another process holds.
"""

from __future__ import annotations

import os
import pickle

from ..errors import UnlearnError


def world_size() -> int:
    """The processes of this launch (1 without torch.distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def rank() -> int:
    """This process's rank in its launch (0 without torch.distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def gathered(obj) -> list:
    """``obj`` of every process, in rank order (a collective: every process calls it at the same point)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agreed(check, *args) -> None:
    """Run ``check(*args)`` on every process; when it raised an :class:`UnlearnError` on any, every process raises the
    first such error, naming the processes that found it (``... (on process(es) 1 of 2)``, ``error.processes``)."""
    error = None
    try:
        check(*args)
    except UnlearnError as e:
        error = e
    try:
        sent = None if error is None else pickle.loads(pickle.dumps(error))
    except Exception:  # an error that does not travel: its words do
        sent = UnlearnError(str(error))
    everyone = gathered(sent)
    failed = [(rank, e) for rank, e in enumerate(everyone) if e is not None]
    if not failed:
        return
    if len(everyone) == 1:
        raise error
    ranks = [rank for rank, _ in failed]
    first = failed[0][1]
    first.args = (f"{first} (on process(es) {', '.join(map(str, ranks))} of {len(everyone)})",)
    first.processes = ranks
    raise first from error


def agreed_value(fn, *args):
    """``fn(*args)`` on every process, its value returned; any failure on any process (an :class:`UnlearnError` or
    another exception: a file one process cannot read) raised on every process as one :class:`UnlearnError` naming
    the processes (:func:`agreed`). For the process-local work before a phase's first collective: a process failing
    alone would leave the others in a collective it never joins (a hang, or objects of another collective mixed in)."""
    if world_size() == 1:  # one process: its failure as it is
        return fn(*args)
    out = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except UnlearnError:
            raise
        except Exception as e:  # noqa: BLE001 - any local failure must be told to the other processes
            raise UnlearnError(f"{type(e).__name__}: {e}") from e

    agreed(run)
    return out[0]
