"""Ways out of the value-read monitor while a watched event runs (:mod:`hf_unlearn.trace.value_reads`).

The monitor is a torch function mode and a dispatch mode; both are thread-local and can be switched off:
``torch._C.DisableTorchFunction`` (and ``_DisableTorchDispatch`` with it), popping a mode off its stack
(``torch._C._pop_torch_function_stack``, ``torch.utils._python_dispatch._pop_mode_temporarily``), skipping the next
torch function, excluding the Python dispatch key, or running the read in another thread. Under them
``float(p.sum())`` or ``p.tolist()`` reads a weight and no mode sees it (issue #41). Which value was read cannot
be told there; that the monitor was left can. A trace hook checks that both modes are in force at every bytecode of
code that is neither torch's, this package's, the standard library's nor transformers' (the callback's own code,
another installed package's: ``with DisableTorchFunction(), _DisableTorchDispatch(): v = float(p)`` makes no call
inside the block, and ``list(map(DisableTorchFunction.__enter__, [d]))`` none the hooks see), and a profile hook at
every call, return and C call of such code and every return into it; both on this thread only, only while a watched
event runs, quiet once a read is noted. Torch's own code pops a mode while it hands an operator to it (through
``contextlib`` too), so it is not checked until it returns into the callback's. The C functions that switch modes
or hooks off (``_pop_torch_function_stack``, ``_set_skip_next_torch_function``, ``_unset_dispatch_mode``,
``_disabled_torch_dispatch_impl``, ``sys.settrace``/``setprofile``) are reads even when the state is back by the
next check.

A thread the event starts through ``threading`` runs its whole life under a monitor of its own that notes to the
event's, and so do the threads it starts (a read after the event ended is noted by the next watched event); work
handed from the callback's code to a thread already running (``Executor.submit``, ``queue.Queue.put``,
``Event.set``, ``Condition.notify``, ``SimpleQueue.put``) or a thread started with ``_thread.start_new_thread`` is a
read, since what that thread does is not seen. (A ``torch.jit.script`` or ``torch.compile``d function's operators
are seen as any other's.)

Not seen: a read done entirely inside torch's, the standard library's or transformers' code with the modes off and
no code of the callback's running meanwhile (a torch function that turned both off and returned values: torch's own
``repr`` turns only the dispatch mode off, and the function mode sees its reads); another installed package's code
run by the monitor's own handler (a packaged tensor subclass's ``__torch_function__``); a thread already running
before the event woken otherwise than above (a lock released by ``with``, a pipe, a file, ``asyncio.to_thread``'s
running pool) or started by such a thread after the event; another process (``multiprocessing``, shared memory); a
C extension reading a tensor's memory itself, not through aten operators (which the dispatch mode sees), or
``ctypes`` at an address taken outside the watched events; code that tampers with the monitor itself (its objects
found through ``gc``, its frames' ``f_trace`` cleared, a code object's file name forged as torch's). A thread the
event started that reads once the event is over is named at the next watched event, a later step than its read.
While a watched event runs, a debugger's or coverage tool's trace and profile functions are set aside (back after
it); a callback that sets its own is a read. Cost: only watched events run the hooks, about 30 us per parameter a
callback's own loop visits (``benchmarks/bench_value_reads.py``).
"""

from __future__ import annotations

import _thread
import concurrent.futures
import os
import queue
import sys
import sysconfig
import threading

import torch

_C = torch._C
_SELF = os.path.dirname(os.path.dirname(__file__)) + os.sep
_OWN = (os.path.dirname(torch.__file__) + os.sep, _SELF)
_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep
_LIBRARIES = ("transformers", "accelerate")

# C functions that leave the monitor or blind its hooks (by identity; a read even if the state is back at once)
ESCAPES = {f: f"{getattr(f, '__module__', None) or 'torch._C'}.{f.__name__}" for f in (
    _C._pop_torch_function_stack, _C._pop_torch_dispatch_stack, _C._set_torch_function_state,
    _C._set_skip_next_torch_function, _C._skip_one_hop_torch_function, _C._unset_dispatch_mode,
    _C._set_dispatch_mode, _C._disabled_torch_dispatch_impl, sys.settrace, sys.setprofile)}
# C functions that start a thread or hand work to one: reads when the callback's own code calls them
HANDOFFS = {_thread.start_new_thread: "_thread.start_new_thread", queue.SimpleQueue.put: "queue.SimpleQueue.put",
            queue.SimpleQueue.put_nowait: "queue.SimpleQueue.put_nowait",
            **({_thread.start_joinable_thread: "_thread.start_joinable_thread"}  # Python 3.13
               if hasattr(_thread, "start_joinable_thread") else {})}
# Python functions that hand work to a thread already running: reads when the callback's own code calls them
_THREAD_START = threading.Thread.start.__code__
HANDOFF_CODE = {f.__code__: f.__qualname__ for f in (
    concurrent.futures.ThreadPoolExecutor.submit, concurrent.futures.Executor.map, queue.Queue.put,
    threading.Event.set, threading.Condition.notify, threading.Condition.notify_all, threading.Semaphore.release,
    threading.Barrier.wait)}
SELF, OWN, LIBRARY, PACKAGE, USER = -1, 0, 1, 2, 3


_KINDS: dict[str, int] = {}


def _file_kind(filename: str) -> int:
    if filename.startswith(_SELF):
        return SELF
    if filename.startswith(_OWN):
        return OWN
    if filename.startswith("<frozen") or any(f"{os.sep}{n}{os.sep}" in filename for n in _LIBRARIES):
        return LIBRARY
    path = os.path.realpath(filename) if filename.startswith(os.sep) else filename
    if f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path:
        return PACKAGE
    return LIBRARY if path.startswith(_STDLIB) else USER


def _kind(code) -> int:
    """Whose code this is: this package's (SELF: the monitor's handlers) or torch's (OWN: they pop a mode while
    handling an operator), the standard library's or transformers' (LIBRARY), another installed package's (PACKAGE:
    checked, but not while the monitor's own handler runs, where an import torch starts runs finders such as
    setuptools'), or anyone else's (USER: a callback's, a script's). Keyed by file name, whose hash a string keeps
    (a code object's is computed at every lookup)."""
    kind = _KINDS.get(code.co_filename)
    if kind is None:
        kind = _KINDS[code.co_filename] = _file_kind(code.co_filename)
    return kind


def _builtin_name(func) -> str | None:
    """What a C call leaves the monitor by, or hands to a thread (None: neither)."""
    try:
        return ESCAPES.get(func) or HANDOFFS.get(func)
    except TypeError:  # unhashable
        return None


class EscapeWatch:
    """The hooks above, on the current thread, for ``monitor``: its ``on()`` (both its modes in force),
    ``note(what)``, ``first`` (once a read is noted the hooks go quiet), ``handling`` (inside its own handler, where
    torch pops its mode) and ``child()`` (a monitor to enter in a thread the event starts). ``nested``: the watch
    of such a thread (which may run for the whole training), where an installed package's code is not traced
    bytecode by bytecode."""

    def __init__(self, monitor, nested: bool = False):
        self.monitor, self.nested = monitor, nested
        self.saved = None

    def start(self) -> None:
        self.saved = (sys.gettrace(), sys.getprofile())
        sys.setprofile(self._profile)
        sys.settrace(self._trace)

    def stop(self) -> None:
        if self.saved is None:
            return
        trace, profile = self.saved
        self.saved = None
        sys.settrace(trace)
        sys.setprofile(profile)

    def _left(self, frame, kind: int) -> bool:
        """Whether the monitor is off where code of ``kind`` runs (noted as a read)."""
        if kind < PACKAGE or (kind == PACKAGE and self.monitor.handling) or self.monitor.on():
            return False
        self.monitor.note("the value-read monitor switched off (a torch function or dispatch mode disabled or "
                          f"popped) in {getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)} "
                          f"({os.path.basename(frame.f_code.co_filename)})")
        return True

    def _profile(self, frame, event, arg):
        monitor = self.monitor
        if monitor.first is not None:
            return
        code = frame.f_code
        kind = _KINDS.get(code.co_filename)
        if kind is None:
            kind = _kind(code)
        if event == "return":  # the state the caller resumes in (the monitor's own handlers return into C code
            back = frame.f_back  # that restores its mode after them)
            if kind == SELF or back is None:
                return
            if kind != USER:
                kind, frame = _kind(back.f_code), back
        elif kind <= OWN:
            return
        elif event == "call" and code is _THREAD_START:
            self._watch_thread(frame.f_locals.get("self"))
        elif event == "c_call":
            name = _builtin_name(arg)
            if name is not None and (name in ESCAPES.values() or kind == USER):
                monitor.note(f"a call of {name}, which leaves the value-read monitor")
                return
        elif event == "call" and code in HANDOFF_CODE and frame.f_back is not None and \
                _kind(frame.f_back.f_code) == USER:
            monitor.note(f"work handed to another thread ({HANDOFF_CODE[code]}), which the value-read "
                         "monitor does not follow")
            return
        if kind >= PACKAGE:
            self._left(frame, kind)

    def _trace(self, frame, event, arg):
        code = frame.f_code
        kind = _kind(code)
        if self.monitor.first is not None or kind < PACKAGE or (self.nested and kind == PACKAGE):
            return None  # a thread the event started: an installed package's code there (a logging service's
        frame.f_trace_opcodes = True  # threads, which run for the whole training) is not traced bytecode by bytecode

        monitor, on = self.monitor, self.monitor.on

        def opcode(frame, event, arg):
            if monitor.first is None and (on() or not self._left(frame, kind)):
                return opcode
            return None
        return opcode

    def _watch_thread(self, thread) -> None:
        """A thread started here (``threading.Thread.start``) runs under a monitor of its own from its first line
        to its end (modes are thread-local), noting to this one's; so do the threads it starts."""
        run = getattr(thread, "run", None)
        if run is None:
            return

        def watched_run():
            self.monitor.child().__enter__()
            return run()
        try:
            thread.run = watched_run
        except (AttributeError, TypeError):  # a run that cannot be replaced: what the thread does is not seen
            self.monitor.note(f"a thread started ({type(thread).__qualname__}) whose run cannot be watched")
