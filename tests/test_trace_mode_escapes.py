"""Leaving the value-read monitor is a read (issue #41): a watched callback that switches the torch function or
dispatch mode off, pops it, or reads in another thread (:mod:`hf_unlearn.trace.mode_escapes`).

Before, under ``torch._C.DisableTorchFunction`` a read that runs no operator (``tolist()``, ``untyped_storage()``,
``data_ptr()`` and ``ctypes``) was not seen, nothing was seen with ``torch._C._DisableTorchDispatch`` beside it
(``float(p.sum())``) nor with either mode popped off its stack, and modes are thread-local, so a read in a thread
the callback started (or handed to a pool) was not seen either: a callback shrinking a weight only when it was not
the recorded value was VERIFIED off the counterfactual. A callback that starts a thread touching no tensor, logs,
stops early or logs shapes is still not a reader.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import TrainerCallback

from .test_trace_instep_attacks import AT, _record, _refused_or_counterfactual

DF, DD = torch._C.DisableTorchFunction, torch._C._DisableTorchDispatch


def _both_off_one_line(p):
    with DF(), DD(): v = float(p.sum())  # noqa: E701 (no call inside the block: only bytecodes can see it)
    return v


def _in_thread(p):
    out = []
    t = threading.Thread(target=lambda: out.append(float(p.sum())))
    t.start()
    t.join()
    return out[0]


def _in_pool(p):
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: float(p.sum())).result()


_POOL = ThreadPoolExecutor(1)  # started before any event: its thread is already running
_POOL.submit(int).result()


def _popped(p):
    mode = torch._C._pop_torch_function_stack()
    try:
        with torch.utils._python_dispatch._pop_mode_temporarily():
            return float(p.sum())
    finally:
        torch._C._push_on_torch_function_stack(mode)


def _excluded(p):
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)), DF():
        return float(p.sum())


def _blinded(p):
    sys.setprofile(None)
    sys.settrace(None)
    with DF(), DD():
        return float(p.sum())


def _exit_stack(p):
    with contextlib.ExitStack() as stack:
        stack.enter_context(DF())
        stack.enter_context(DD())
        return float(p.sum())


def _entered_by_map(p):
    """Both switched off by C calls no profile hook sees (``list`` and ``map`` are types): only bytecodes show it."""
    a, b = DF(), DD()
    list(map(DF.__enter__, [a]))
    list(map(DD.__enter__, [b]))
    v = float(p.detach()[0, 0])
    list(map(DD.__exit__, [b], [None], [None], [None]))
    list(map(DF.__exit__, [a], [None], [None], [None]))
    return v


def _popped_by_torch(p):
    """Both modes popped through torch's own Python helpers, which return into the callback with them off."""
    from torch.overrides import _pop_mode, _push_mode
    from torch.utils import _python_dispatch

    f = _pop_mode()
    d = _python_dispatch._pop_mode()
    v = float(p.detach()[0, 0])
    _python_dispatch._push_mode(d)
    _push_mode(f)
    return v


def _subclass_disabled(p):
    with torch._C.DisableTorchFunctionSubclass():
        return p.tolist()


def _disabled(f):
    def run(p):
        with DF():
            return f(p)
    return run


ESCAPES = {
    "tolist under DisableTorchFunction": _disabled(lambda p: p.tolist()),
    "untyped_storage under DisableTorchFunction": _disabled(lambda p: bytes(p.untyped_storage()[:4])),
    "data_ptr and ctypes under DisableTorchFunction": _disabled(
        lambda p: ctypes.c_float.from_address(p.data_ptr()).value),
    "numpy under DisableTorchFunction": _disabled(lambda p: p.detach().numpy()[0, 0]),
    "tolist under DisableTorchFunctionSubclass": _subclass_disabled,
    "both off, one line": _both_off_one_line,
    "both off through an ExitStack": _exit_stack,
    "function mode popped, dispatch mode popped": _popped,
    "Python dispatch key excluded": _excluded,
    "both entered through map, no with": _entered_by_map,
    "both popped by torch's helpers": _popped_by_torch,
    "profile and trace hooks removed first": _blinded,
    "skip the next torch function": lambda p: torch._C._set_skip_next_torch_function(True) or p.tolist(),
    "a thread started and joined": _in_thread,
    "a thread started by a thread it started": lambda p: _joined(threading.Thread(target=_in_thread, args=(p,))),
    "a thread pool made in the event": _in_pool,
    "a thread pool already running": lambda p: _POOL.submit(lambda: float(p.sum())).result(),
    "a queue to a running thread": lambda p: queue.Queue().put(p),
    "a torch.jit.script function": lambda p: float(torch.jit.script(_jit_sum)(p.detach())),
}
NOT_READS = {
    "a thread touching no tensor": lambda p: _joined(threading.Thread(target=time.sleep, args=(0.001,))),
    "shapes and counts": lambda p: ([q.shape for q in [p]], p.numel(), p.view(-1).shape, p.grad is None),
    "logging a dict": lambda p: warnings.warn(str({"loss": 1.0, "n": p.numel()}), stacklevel=2),
    "a lock and a format": lambda p: _locked(f"{p.shape}"),
}


def _jit_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


def _joined(t):
    t.start()
    t.join()


_LOCK = threading.Lock()


def _locked(s):
    with _LOCK:
        return s


@pytest.mark.parametrize("read,how", [(True, k) for k in ESCAPES] + [(False, k) for k in NOT_READS],
                         ids=lambda x: x if isinstance(x, str) else ("read" if x else "not"))
def test_leaving_the_monitor_is_a_read(read, how):
    from hf_unlearn.trace.value_reads import ValueReads

    p = torch.nn.Parameter(torch.arange(12.0).view(4, 3))
    p.grad = torch.ones(4, 3)
    saved = sys.gettrace(), sys.getprofile()
    state = torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()
    with contextlib.ExitStack() as undo:  # what a case left switched off is switched on again after the monitor
        undo.callback(torch._C._set_torch_function_state, torch._C._get_torch_function_state())
        with ValueReads() as reads, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (ESCAPES if read else NOT_READS)[how](p)
    assert (reads.first is not None) == read, (how, reads.first)
    assert (sys.gettrace(), sys.getprofile()) == saved  # its hooks are gone, the ones before it back
    assert (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()) == state


def test_a_read_by_a_thread_after_its_event_ended_is_noted_by_the_next_watched_event():
    """A thread a watched event started that reads once the event is over: the next watched event is a read."""
    from hf_unlearn.trace import value_reads

    p = torch.arange(4.0)
    go = threading.Event()
    out: list = []
    with value_reads.ValueReads() as first:
        t = threading.Thread(target=lambda: (go.wait(), out.append(float(p.sum()))), daemon=True)
        t.start()
    assert first.first is None
    go.set()
    t.join()
    with value_reads.ValueReads() as later:
        pass
    assert later.first and "a thread an earlier watched event started" in later.first, later.first
    assert not value_reads.LATE


# ---- real runs ---------------------------------------------------------------------------------------------------
ROUTES = {  # how a watched callback reads the final norm weight past the monitor
    "both modes off, one line": lambda w: _both_off_one_line(w),
    "tolist under DisableTorchFunction": lambda w: _disabled(lambda p: p.tolist()[0])(w),
    "a thread started and joined": _in_thread,
}


def _escaping_guard(seen: dict, route: str):
    """A watched callback that reads the final norm weight by ``route`` after each optimizer step and shrinks it
    when the value is not the one it saw at that step first: a no-op on every recorded step, active on a deletion's
    (the plain Trainer's counterfactual runs it with what the recording saw)."""

    class EscapingGuard(TrainerCallback):
        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            value = ROUTES[route](model.model.norm.weight)
            if seen.setdefault(state.global_step, value) != value:
                with torch.no_grad():
                    model.model.norm.weight.mul_(0.99)

    return EscapingGuard()


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_read_past_the_monitor_is_refused(tmp_path, route):
    """ATTACK: each way past the monitor, in a callback that edits the weight only when it is not what it saw on the
    recorded run; the deletion is refused before any compute, naming the callback's event (else it is VERIFIED and
    must equal the plain Trainer's counterfactual, which the edit moves off)."""
    seen: dict = {}
    tok, data, run = _record(tmp_path, "llama", [_escaping_guard(seen, route)])
    assert seen  # it ran at every step
    assert _refused_or_counterfactual(tmp_path, "llama", run, tok, data, AT, lambda: [_escaping_guard(seen, route)],
                                      "EscapingGuard.on_optimizer_step") == "refused"


def _thread_logger():
    """A script's logging callback (watched) that writes its logs from a thread it starts at every log, as an async
    writer does, and logs parameter counts: no value read."""

    class ThreadLogger(TrainerCallback):
        def __init__(self):
            self.lines = []

        def on_log(self, args, state, control, model=None, logs=None, **kwargs):
            n = sum(p.numel() for p in model.parameters() if p.requires_grad)
            _joined(threading.Thread(target=self.lines.append, args=(f"{state.global_step} {n} {logs}",)))

    return ThreadLogger()


def test_a_callback_logging_from_a_thread_it_starts_verifies(tmp_path):
    logger = _thread_logger()
    tok, data, run = _record(tmp_path, "llama", [logger], logging_steps=1)
    assert logger.lines
    assert _refused_or_counterfactual(tmp_path, "llama", run, tok, data, AT, lambda: [_thread_logger()], "",
                                      logging_steps=1) == "verified"
