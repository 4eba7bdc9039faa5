"""Whether code a replay does not run read tensor values: the evidence that its behaviour may follow the data.

A watched callback (one replays do not run) that edits gradients or parameters only when they are not what it expects
changes nothing on the recorded run, so the guards see no change and the proof, which replays without it, matches
every step; a deletion trains on other values, where the same callback acts (issue #41, wave 5). Whether it *would*
act cannot be shown without running it; that it *looked* can: any torch function applied to a tensor inside its
event, other than reading metadata (shape, dtype, ``.grad``, ``requires_grad``, ``numel()``, ...) or taking a view
(``view``, ``reshape``, ``t()``, ``detach()``, ``p[0]``, a DTensor's ``to_local()``, ...), is a read of values (or a
write). A view holds no value of its own: what reads it later (``.item()``, a comparison, ``repr``, ``.numpy()``,
``.tolist()``) is a torch function seen then, in whichever watched event runs it; a copy (``clone``, ``deepcopy``,
``.to`` another dtype, a ``reshape`` that cannot view) reads. A callback that never touches a tensor's values (a
logging callback reading ``logs`` or counting parameters, an early stopping callback reading ``metrics``) cannot
decide from them.

The numbers a watched callback is given that follow the data (``logs["loss"]``, ``grad_norm``, an evaluation's
``metrics``; not the learning rate, the epoch or timings) are handed to it as :class:`LoggedNumber`, a float that
notes a comparison or a truth test: printing, formatting or storing one is not a decision, comparing it is (a callback
that acted only when the logged loss was one no recorded step logged was VERIFIED off the counterfactual).

Operators that reach a tensor's data are also seen below torch functions (a dispatch mode), so code run under
``torch._C.DisableTorchFunction`` is seen too; ``state.log_history`` is handed over marked too. A watched callback
holding a numpy view of a tensor's memory (``tensor.numpy()``, taken outside its events; in its attributes,
globals or closure) or a ``memoryview`` reads values through it with no torch function: its events count as reads
(:func:`held_view`). Leaving the monitor is a read too (``DisableTorchFunction`` with ``_DisableTorchDispatch``,
a mode popped off its stack, the read run in another thread: :mod:`hf_unlearn.trace.mode_escapes`, which says what
it does not see). Not seen: decisions from logged numbers through C functions (``math.isfinite``) or by a callback
whose code cannot reach the tensors (its decision is then only what the run's record keeps: when to stop, a learning
rate), and from what a callback reads elsewhere (the dataset's rows, a file).
"""

from __future__ import annotations

import functools

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# methods that read a tensor's metadata, not its values (properties such as .shape, .grad, .data are descriptors'
# __get__, also metadata)
METADATA = frozenset({"size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
                      "is_contiguous", "stride", "storage_offset", "get_device", "__len__", "__hash__", "ndimension",
                      "is_signed", "has_names", "is_inference", "is_set_to", "requires_grad_"})
# torch functions that return views of a tensor (or the tensor itself): no value is read by taking one, and what
# the view reaches later is seen as it is read. They are let through here and the operators they run are judged
# below (:func:`operator_reads`): a ``reshape`` or ``.to`` that copies is a read there. ``numpy``, ``tolist``,
# ``data_ptr``, ``untyped_storage``, ``__repr__``, ``clone`` and ``__deepcopy__`` stay reads (their values leave
# the tensor, or a pointer to them does).
TENSOR_VIEWS = ("view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "t",
                "transpose", "permute", "swapaxes", "swapdims", "movedim", "moveaxis", "narrow", "select",
                "__getitem__", "expand", "expand_as", "split", "split_with_sizes", "chunk", "unbind", "diagonal",
                "detach", "contiguous", "cpu", "to", "conj")
_VIEWS = frozenset([getattr(torch.Tensor, n) for n in TENSOR_VIEWS] +
                   [getattr(torch, n) for n in TENSOR_VIEWS if callable(getattr(torch, n, None)) and n[0] != "_"])


def _is_view(func) -> bool:
    try:
        return func in _VIEWS
    except TypeError:  # unhashable: not one of them
        return False
# operators that answer a tensor subclass's metadata query (sizes, strides): no values
METADATA_OPERATORS = frozenset({"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride",
                                "numel", "dim", "storage_offset", "is_contiguous"})


@functools.lru_cache(maxsize=None)
def operator_reads(func) -> bool:
    """Whether an aten operator reads (or writes) a tensor's values: every one but a view and a metadata query. A
    view is told by its schema's alias annotations: each output aliases an input (``Tensor(a)``) and nothing is
    written (no ``(a!)``), as ``view``, ``select``, ``t``, ``detach``, ``split``; a copy (``clone``,
    ``_to_copy``, ``_unsafe_view``), a reduction, ``_local_scalar_dense`` (``.item()``) or an in-place edit is a
    read."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return True
    if schema.name.split("::")[-1] in METADATA_OPERATORS:
        return False
    written = any(a.alias_info is not None and a.alias_info.is_write for a in (*schema.arguments, *schema.returns))
    return written or not schema.returns or any(r.alias_info is None for r in schema.returns)


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


# logged entries that are the run's controls or the clock, not numbers a deletion changes
CONTROL_LOGS = frozenset({"learning_rate", "epoch", "step", "total_flos", "train_runtime", "train_samples_per_second",
                          "train_steps_per_second", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"})
_ACTIVE: list[ValueReads] = []


class LoggedNumber(float):
    """A logged number that follows the data; a comparison or truth test of it while a :class:`ValueReads` is on
    is noted as a read (arithmetic keeps the mark)."""

    __hash__ = float.__hash__

    def __new__(cls, value, key: str):
        out = super().__new__(cls, value)
        out.key = key
        return out

    def _note(self):
        if _ACTIVE and _ACTIVE[-1].first is None:
            _ACTIVE[-1].first = f"a comparison of the logged {self.key}"

    def _compare(op):
        def compare(self, other):
            self._note()
            return getattr(float, op)(self, other)
        return compare

    def _keep(op):
        def keep(self, *other):
            out = getattr(float, op)(self, *other)
            return LoggedNumber(out, self.key) if isinstance(out, float) else out
        return keep

    for _op in ("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__bool__"):
        locals()[_op] = _compare(_op)
    for _op in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
                "__neg__", "__abs__", "__pow__"):
        locals()[_op] = _keep(_op)
    del _op, _compare, _keep


def _marked_entry(entry):
    if not isinstance(entry, dict):
        return entry
    return {k: LoggedNumber(v, k) if type(v) is float and k not in CONTROL_LOGS else v for k, v in entry.items()}


class MarkedHistory(list):
    """``state.log_history`` as a watched callback sees it: the same entries, each read as a copy whose
    data-following numbers are :class:`LoggedNumber` (saving it with ``json`` reads the plain entries)."""

    def __getitem__(self, i):
        out = list.__getitem__(self, i)
        return MarkedHistory(out) if isinstance(i, slice) else _marked_entry(out)

    def __iter__(self):
        return (_marked_entry(e) for e in list.__iter__(self))

    def __reversed__(self):
        return (_marked_entry(e) for e in list.__reversed__(self))


# what a callback's event is handed that leads to tensors (the model, the optimizer, ...), and ``kwargs``, which holds them
REACHING_ARGUMENTS = frozenset({"model", "optimizer", "lr_scheduler", "kwargs", "train_dataloader", "eval_dataloader",
                                "processing_class"})


def _reaches(value) -> bool:
    """A global or closure value through which code can reach the training's tensors."""
    import types

    if isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
        return True
    if isinstance(value, types.ModuleType):
        return value.__name__.split(".")[0] in ("sys", "gc", "inspect", "torch", "ctypes", "builtins")
    if isinstance(value, (types.FunctionType, types.MethodType)):
        return not getattr(value, "__module__", "").startswith(("transformers.", "hf_unlearn."))
    return type(value).__module__.split(".")[0] in ("transformers", "trl", "accelerate", "peft")


def can_reach_tensors(cls) -> bool:
    """Whether the code of a callback class (its own methods, nested functions included) loads what leads to the
    training's tensors: an event's ``model`` / ``optimizer`` / ``kwargs`` argument, or a global or closure value
    that is (or can find) them: the model, the trainer, ``sys``, a user function. A callback that cannot reach them
    decides from a logged number only what the run's record keeps (when to stop, a learning rate)."""
    import dis
    import types

    for c in cls.__mro__:
        if c is object or c.__module__.startswith(("transformers.", "hf_unlearn.")):
            continue
        for v in vars(c).values():
            fn = getattr(v, "__func__", v)
            if not isinstance(fn, types.FunctionType):
                continue
            cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
            todo = [fn.__code__]
            while todo:
                code = todo.pop()
                todo += [k for k in code.co_consts if isinstance(k, types.CodeType)]
                for ins in dis.get_instructions(code):
                    if ins.opname.startswith(("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE")) and \
                            ins.argval in REACHING_ARGUMENTS:
                        return True
                    if ins.opname.startswith(("LOAD_DEREF", "LOAD_CLASSDEREF")) and ins.argval in cells:
                        try:
                            if _reaches(cells[ins.argval].cell_contents):
                                return True
                        except ValueError:  # an empty cell
                            pass
                    if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and _reaches(fn.__globals__.get(ins.argval)):
                        return True
    return False


def mark_logged(kwargs: dict, state=None) -> list:
    """Hand a watched callback the data-following numbers of ``logs`` / ``metrics`` and ``state.log_history`` as
    :class:`LoggedNumber` (in place); returns what :func:`unmark_logged` restores."""
    marked = []
    history = getattr(state, "log_history", None)
    if type(history) is list and history:
        state.log_history = MarkedHistory(history)
        marked.append((state, "log_history", history))
    for name in ("logs", "metrics"):
        d = kwargs.get(name)
        if isinstance(d, dict):
            for k, v in list(d.items()):
                if type(v) is float and k not in CONTROL_LOGS:
                    d[k] = LoggedNumber(v, k)
                    marked.append((d, k, v))
    return marked


def unmark_logged(marked: list) -> None:
    """The plain numbers back, for the callbacks after it (what the watched callback replaced stays replaced)."""
    for d, k, v in marked:
        if isinstance(d, dict):
            if isinstance(d.get(k), LoggedNumber):
                d[k] = v
            continue
        now = getattr(d, k)  # the state's history: the original list back, with what the callback did to it
        if isinstance(now, MarkedHistory):
            if len(now) != len(v) or any(a is not b for a, b in zip(list.__iter__(now), v)):
                v[:] = list(list.__iter__(now))
            setattr(d, k, v)


def held_view(callback) -> str | None:
    """Where ``callback`` holds a numpy array or ``memoryview`` over a tensor's memory (what ``tensor.numpy()``
    returns, a slice of it): an attribute of it, a module global or closure cell its class's code names, or an item of a
    list, tuple or dict held there. Reads and writes through it reach a tensor's values with no torch function, so
    its events are value reads whether or not the monitor saw one. None: it holds none."""
    import sys
    import types

    np = sys.modules.get("numpy")

    def over_tensor(x) -> bool:  # the array's (or memoryview's) memory is a tensor's: .base leads to it
        for _ in range(8):
            x = x.obj if isinstance(x, memoryview) else x.base if np is not None and isinstance(x, np.ndarray) else x
            if isinstance(x, torch.Tensor):
                return True
            if x is None or not isinstance(x, (memoryview, *((np.ndarray,) if np is not None else ()))):
                return False
        return False

    def view(v) -> bool:
        return any((isinstance(x, memoryview) or (np is not None and isinstance(x, np.ndarray))) and over_tensor(x)
                   for x in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)))

    places = [(f"{type(callback).__qualname__}.{k}", v) for k, v in getattr(callback, "__dict__", {}).items()]
    for c in type(callback).__mro__:
        if c is object or c.__module__.startswith(("transformers.", "hf_unlearn.")):
            continue
        for fn in (getattr(v, "__func__", v) for v in vars(c).values()):
            if isinstance(fn, types.FunctionType):
                places += [(f"{fn.__module__}.{n}", fn.__globals__[n]) for n in fn.__code__.co_names
                           if n in fn.__globals__]
                places += [(f"{fn.__qualname__} closure {n}", cell.cell_contents)
                           for n, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()) if _cell_has(cell)]
    return next((where for where, v in places if view(v)), None)


def _cell_has(cell) -> bool:
    """Whether a closure cell holds a value (an empty one raises on reading)."""
    try:
        return cell.cell_contents is not _EMPTY_CELL
    except ValueError:
        return False


_EMPTY_CELL = object()


class _DispatchReads(TorchDispatchMode):
    """Every operator that reaches a tensor's data (``.numpy()`` of ``.data`` included), also under
    ``torch._C.DisableTorchFunction``, which turns the function mode off: there every operator is a read, views
    included (a view taken where the function mode does not see what follows may be read by ``numpy()`` or
    ``tolist()``, which run no operator)."""

    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.owner.first is None and (operator_reads(func) or torch._C._is_torch_function_all_disabled()):
            self.owner.note(str(func))
        self.owner.handling += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.owner.handling -= 1


# what a thread a watched event started read after the event ended: noted by the next watched event
LATE: list[str] = []


class ValueReads(TorchFunctionMode):
    """A torch function mode that notes the first function applied to a tensor's values (``first``) while it is on:
    not a metadata read nor a view (whose operators the dispatch mode below judges). Leaving either mode, or running
    code in another thread, while it is on is a read too (:mod:`hf_unlearn.trace.mode_escapes`). ``owner``: the
    monitor of the watched event that started this thread, to which this one notes."""

    def __init__(self, owner: ValueReads | None = None):
        super().__init__()
        self.first: str | None = None
        self.owner = owner
        self.handling = 0  # inside this monitor's own handlers, where torch pops its mode
        self.closed = False

    def note(self, what: str) -> None:
        if self.owner is not None:
            self.first = self.first or what
            self.owner.note(f"a thread it started: {what}")
        elif self.closed:
            LATE.append(what)
        elif self.first is None:
            self.first = what

    def child(self) -> ValueReads:
        return ValueReads(owner=self)

    def on(self) -> bool:
        """Both modes in force: torch function modes enabled, no torch function set to be skipped and ours on its
        stack where it was pushed, ours on the dispatch stack and the Python dispatch keys not excluded (checked at
        every bytecode of a watched callback's code: direct calls only)."""
        try:
            return _mode_enabled() and not _skip_next() and not _excluded(_PYTHON) and not _excluded(_SNAPSHOT) \
                and _function_at(self._at) is self and _dispatch_at(self._dat) is self._dispatch
        except (IndexError, RuntimeError):
            return False

    def __enter__(self):
        from .mode_escapes import EscapeWatch

        if self.owner is None:
            _ACTIVE.append(self)
            if LATE:
                self.first = f"a thread an earlier watched event started: {LATE.pop(0)}"
        out = super().__enter__()
        self._at = torch._C._len_torch_function_stack() - 1
        self._dispatch = _DispatchReads(self)  # below torch functions: what DisableTorchFunction hides
        self._dispatch.__enter__()
        self._dat = torch._C._len_torch_dispatch_stack() - 1
        self._watch = EscapeWatch(self, nested=self.owner is not None)
        self._watch.start()
        return out

    def __exit__(self, *exc):
        self._watch.stop()
        self.closed = True
        self._dispatch.__exit__(*exc)
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.first is None:
            name = _name(func)
            short = name.rsplit(".", 1)[-1]
            if name != "getset_descriptor.__get__" and short not in METADATA and not _is_view(func) and any(
                    isinstance(x, torch.Tensor) for x in tree_flatten((args, kwargs))[0]):
                self.note(name.replace("TensorBase.", "Tensor.").replace("getset_descriptor.__set__",
                                                                         "a tensor attribute set"))
        self.handling += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.handling -= 1


_PYTHON, _SNAPSHOT = torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot
_mode_enabled, _skip_next = torch._C._is_torch_function_mode_enabled, torch._C._peek_should_skip_torch_function
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_function_at, _dispatch_at = torch._C._get_function_stack_at, torch._C._get_dispatch_stack_at
