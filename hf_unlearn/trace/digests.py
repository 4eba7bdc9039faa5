"""Whole-program digests: every object that decides an optimizer step, read whole, not through a list of fields.

The per-step guards (:mod:`hf_unlearn.trace.guards`) used to compare picked fields (the learning rate, public plain
module attributes, ``config.to_dict()``): a callback that set ``args.max_grad_norm``, or
``model.set_attn_implementation("eager")`` (``config._attn_implementation``, which ``to_dict()`` drops), changed the
run and no list named it. Here every object is flattened into ``path -> value`` entries, all of its attributes
included (private and callable ones), so a change anywhere is a difference with a path that names it:

* ``args.*``: every field of the ``TrainingArguments`` (transformers reads them live at every step);
* ``config.*``: every attribute of the model config, private ones (``_attn_implementation``) included, and
  ``generation_config.*``;
* ``module <name>.*``: every attribute of every module (``training`` aside: the Trainer sets it each microbatch,
  the step fingerprint holds it as the forward used it), parameters and buffers by name, dtype, shape and
  ``requires_grad`` (their values are the exact checksums' business), hooks by the code they run;
* ``code *``: the code of every function of every class the model's modules are made of, and of every function the
  modules' source modules (``modeling_llama``, ...) and ``torch.nn.functional`` hold (a monkeypatch changes it);
* ``trainer *``: methods set on the trainer instance, its class's code and the module globals the user's trainer
  code reads; ``callback *``: the code of every
  recorded callback and the module globals its code reads;
* ``optimizer *``: its class, defaults, every param group's keys (values other than the learning rate are the
  plan's ``groups``), the parameters of each group by name, the keys of every parameter's state, its hooks;
* ``data *``: the training dataset's format and transform (``set_transform``), the collator's attributes;
* ``torch *`` and ``environ *``: process-wide numeric switches and the environment variables known to change
  numbers.

Callables digest by ``module.qualname`` and a hash of their code, constants, defaults and closure, never by
``id()``: the same program gives the same digest in another process (processes of one launch are compared at every
step, :class:`ProcessComparison`).
"""

from __future__ import annotations

import collections
import collections.abc
import enum
import functools
import hashlib
import itertools
import operator
import os
import sys
import types

import torch

from . import module_tree
from .checksums import _own_state_tensors, exact_digest, state_tensors, tensor_checksums
from .environment_reads import is_user_code
from .stack import NUMERIC_ENV as STACK_ENV
from .stack import cudnn_allow_tf32, float32_matmul_precision, flush_denormal, fp32_precision, matmul_allow_tf32
from .trainers import own_functions, recorded_trainer_class

# config keys that say where a model came from, not what it computes
VOLATILE_CONFIG = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures",
                             "_attn_implementation_autoset", "use_cache"})
FRAMEWORK_HOOKS = ("hf_unlearn.", "transformers.", "accelerate.", "peft.", "trl.", "torch.")

PLAIN = (bool, int, float, str, type(None))
MAX_DEPTH = 4
MAX_ITEMS = 4096  # a longer container is digested whole (its entries still read)
_EXACT_PLAIN = frozenset(PLAIN)  # exact types: a subclass (an IntEnum, ...) takes the isinstance path
_HOOK_DICTS, _HOOK_KEYS = (dict, collections.OrderedDict), ("hooks", "_with_kwargs", "_always_called")
# an empty container as Digester._text writes it
_EMPTY = {dict: "{}", collections.OrderedDict: "{}", list: "[]", tuple: "()", set: "{}", frozenset: "{}"}
# attributes that change on their own while a program runs unchanged (caches, counters, one-time warnings)
SKIPPED_ARGS = frozenset({"_setup_devices", "distributed_state"})
SKIPPED_MODULE = frozenset({"training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                            # how a state dict is saved and loaded (FSDP2 registers these lazily), not what trains
                            "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                            "_load_state_dict_post_hooks",
                            # the kernels library's mode, which follows train() / eval() as `training` does
                            "_kernels_mode"})
# hash() of a string (differs between processes), and what says where a model came from, which saving a checkpoint
# sets (guards.VOLATILE_CONFIG; use_cache aside: a change of it is a change); parameters' dtypes are read elsewhere
SKIPPED_CONFIG = frozenset({"_original_object_hash", "_commit_hash"}) | (VOLATILE_CONFIG - {"use_cache"})
SKIPPED_OPTIMIZER = frozenset({"state", "param_groups", "defaults", "_warned_capturable_if_run_uncaptured",
                               "_zero_grad_profile_name", "_opt_called"})
# packages whose objects held as module attributes are a framework's running state (FSDP2's ``FSDPState``, held under
# ``__composable_api_state_key_<uuid>``, changes at every step): digested by class, their hooks by code
RUNTIME_STATE = ("torch.distributed",)
# fields a process of one launch legitimately holds for itself (left out when processes are compared)
PROCESS_LOCAL = ("args.local_rank", "args.output_dir", "args.logging_dir", "args.run_name", "args._n_gpu",
                 "environ LOCAL_RANK", "environ RANK")
# environment variables compared between the steps and processes of one run: the numeric stack's (recorded and
# compared across machines; the probe, not the list, is the guarantee) and, within a run, every torch setting
NUMERIC_ENV = (*STACK_ENV, "TORCH_", "PYTORCH_", "XLA_", "LOCAL_RANK", "RANK")
# modules whose functions a model's forward calls besides its own classes' methods
CODE_MODULES = ("torch.nn.functional", "transformers.activations", "transformers.masking_utils",
                "transformers.modeling_rope_utils", "transformers.integrations.sdpa_attention",
                "transformers.loss.loss_utils", "transformers.modeling_utils")
# the namespaces a training step looks functions up in by name when it calls them, besides its model's and optimizer's
# modules: torch's top level (``torch.rsqrt`` in a norm, ``torch._foreach_*`` in a step), autograd (``backward``),
# ``nn.Module``'s own module, gradient clipping, Accelerate's helpers (``send_to_device``, ``Accelerator``'s, its
# optimizer wrapper's), the optimizer base class's module, and torch's C namespaces that ``torch.nn.functional``
# calls into (``torch._C._nn.pad``: a builtin a ``sitecustomize`` can rebind in the deleting process only). The
# per-step digest reads them too (a function patched for one step and put back): kept between steps, about 0.3 ms.
STEP_MODULES = ("torch", "torch.autograd", "torch.nn.modules.module", "torch.nn.utils", "torch.nn.utils.clip_grad",
                "accelerate.utils.operations", "accelerate.accelerator", "accelerate.optimizer", "torch.optim.optimizer",
                "torch._C._nn", "torch._C._linalg", "torch._C._fft", "torch._C._special")


# ---- stable text of any object -----------------------------------------------------------------------------
_CODE: dict[int, tuple] = {}


def code_digest(code: types.CodeType) -> str:
    """16 hex digits over a code object's bytecode, constants (nested code included) and names: the same function
    in another process, or after a restart, gives the same digest."""
    hit = _CODE.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    h = hashlib.sha256(code.co_code)
    for c in code.co_consts:
        h.update(_const_text(c).encode())
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    digest = h.hexdigest()[:16]
    _CODE[id(code)] = (code, digest)  # keeps the code object alive: its id is not reused
    return digest


# function -> (function, its code, defaults, module and qualname, its text): a function's text read once, not at
# every snapshot, when it depends on nothing that can change unseen (and read above the depth limit, where its
# defaults are written out: the same text at every such depth). What it depends on is compared at each use:
# the code and the defaults tuple by identity (replaced, not changed in place: a tuple of plain values is
# immutable), the names by value; a function with a closure (a cell's contents can be replaced) or keyword-only
# defaults (a dict, changeable in place) is never cached, nor is one whose defaults hold anything but plain values.
# The entry holds the function: its id is not reused.
_FUNCTIONS: dict[int, tuple] = {}


def _const_text(c) -> str:
    """A code constant as text that does not depend on the process (a frozenset's order follows string hashing,
    which differs between processes)."""
    if isinstance(c, types.CodeType):
        return code_digest(c)
    if isinstance(c, (frozenset, set)):
        return "{" + ", ".join(sorted(_const_text(x) for x in c)) + "}"
    if isinstance(c, tuple):
        return "(" + ", ".join(_const_text(x) for x in c) + ")"
    return repr(c)


def _name(obj) -> str:
    return f"{getattr(obj, '__module__', None) or type(obj).__module__}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _short(text: str) -> str:
    return text if len(text) <= 200 else f"sha256:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


class Digester:
    """Stable text for objects, memoised for one snapshot (an object met twice at one depth is read once)."""

    def __init__(self, roots: dict | None = None, model=None):
        self.memo: dict[tuple, tuple] = {}
        self.roots = {id(v): k for k, v in (roots or {}).items()}  # objects digested under their own path
        self.model = model  # whose parameters and buffers, held as attributes, are digested by name
        self._own: dict | None = None
        self._classes: dict[type, bytes] = {}  # class -> its own functions' lines (class_lines)

    def leaf(self, value):
        """A plain value as itself (NaN as text, so equal runs compare equal), anything else as stable text."""
        if type(value) in _EXACT_PLAIN:  # the common case, without the isinstance chain (subclasses go below)
            return "nan" if value != value else value
        if isinstance(value, float) and value != value:
            return "nan"
        if isinstance(value, PLAIN):
            return value
        kind = type(value)
        if (kind is dict or kind is list) and len(value) <= MAX_ITEMS and id(value) not in self.roots and all(
                type(x) in _EXACT_PLAIN for x in (itertools.chain(value, value.values()) if kind is dict else value)):
            return _short(repr(value))  # what text() writes of plain items (PEFT's ~700 {'default': 8}), at once
        return _short(self.text(value, 0))

    def text(self, obj, depth: int) -> str:
        if type(obj) is types.FunctionType:  # most of a snapshot's objects: the code of classes and modules
            hit = _FUNCTIONS.get(id(obj))
            if hit is not None and hit[0] is obj and hit[1] is obj.__code__ and hit[2] is obj.__defaults__ \
                    and obj.__kwdefaults__ is None and obj.__closure__ is None and hit[3] == obj.__module__ \
                    and hit[4] == obj.__qualname__ and depth < MAX_DEPTH:
                return hit[5]
        if isinstance(obj, PLAIN):
            return repr(obj)
        if id(obj) in self.roots:
            return f"<{self.roots[id(obj)]}>"
        if type(obj) in _EMPTY and depth <= MAX_DEPTH and not obj:  # an empty container, as _text writes it
            return _EMPTY[type(obj)]
        key = (id(obj), depth)  # the text depends on the depth it is read at (MAX_DEPTH cuts it): never the order
        if key in self.memo:
            return self.memo[key][1]
        self.memo[key] = (obj, f"<cycle {type(obj).__qualname__}>")  # holds obj: a temporary's id is not reused
        out = self._text(obj, depth)
        self.memo[key] = (obj, out)
        return out

    def _text(self, obj, depth: int) -> str:
        if isinstance(obj, (torch.dtype, torch.device, torch.Size)):
            return str(obj)
        if isinstance(obj, torch.utils.hooks.RemovableHandle):  # a handle's id counts registrations
            return "<hook handle>"
        if isinstance(obj, enum.Enum):
            return f"{_name(type(obj))}.{obj.name}"
        if torch.is_tensor(obj):
            own = self.own_tensor(obj)
            return tensor_text(obj) if own is None else own
        if isinstance(obj, types.CodeType):
            return f"code:{code_digest(obj)}"
        if callable(obj) and not isinstance(obj, (type, torch.nn.Module)) and depth <= MAX_DEPTH:
            fn = self.callable_text(obj, depth)
            if fn is not None:
                return fn
        if isinstance(obj, type):
            return f"class {_name(obj)}"
        if isinstance(obj, types.ModuleType):
            return f"module {obj.__name__}"
        if isinstance(obj, torch.nn.Module):
            return f"module-object {_name(type(obj))}"
        if depth > MAX_DEPTH:
            return f"<{_name(type(obj))}>"
        if isinstance(obj, dict):
            items = list(obj.items())
            return "{" + ", ".join(f"{self.text(k, depth + 1)}: {self.text(v, depth + 1)}"
                                   for k, v in items[:MAX_ITEMS]) + ("..." if len(items) > MAX_ITEMS else "") + "}"
        if isinstance(obj, (list, tuple)):
            inner = ", ".join(self.text(v, depth + 1) for v in obj[:MAX_ITEMS])
            return f"({inner})" if isinstance(obj, tuple) else f"[{inner}]"
        if isinstance(obj, (set, frozenset)):
            return "{" + ", ".join(sorted(self.text(v, depth + 1) for v in obj)) + "}"
        if hasattr(obj, "__dict__"):
            return f"{_name(type(obj))}({self.text(dict(vars(obj)), depth + 1)})"
        if type(obj).__repr__ is object.__repr__:
            return f"<{_name(type(obj))}>"
        return _short(repr(obj))

    def class_lines(self, c: type) -> bytes:
        """``Class.name=<function text>`` of every function ``c`` itself defines, read once per snapshot: the
        module classes of a model share their bases (``nn.Module``'s ~200 functions), which each class's
        :func:`_class_code` used to read again; and between snapshots while nothing it depends on moved
        (:func:`_kept_namespace`)."""
        hit = self._classes.get(c)
        if hit is None:
            hit = self._classes[c] = _kept_namespace(c, vars(c), lambda: self._class_lines(c), self.roots)
        return hit

    def _class_lines(self, c: type) -> tuple[bytes, list | None, list]:
        lines, deps, watch = [], [], []
        for k, v in sorted(vars(c).items()):
            if (c.__module__, c.__qualname__, k) in SIDE_EFFECT_ATTRIBUTES:
                continue
            fn = _unwrapped(c, c, k, v)
            if fn is not v and deps is not None:  # torch's profiling wrapper: what it digests depends on what it
                # wraps (its attributes) and on the bases' namespaces
                attrs = getattr(v, "__dict__", None)
                deps = None if attrs is None else deps + [v, attrs, *(vars(b) for b in c.__mro__[1:])]
            fn = getattr(fn, "__func__", fn)
            if isinstance(fn, (types.FunctionType, types.MethodType, functools.partial)):
                lines.append(f"{c.__qualname__}.{k}={self.text(fn, 1)}\n")
                if deps is not None and type(v) in _WRAPPERS:
                    deps.append(fn)
                else:
                    deps = None
            elif type(v) not in _INERT:  # an object or class that may be given a __func__ later
                watch.append(v)
        return "".join(lines).encode(), deps, watch

    def own_tensor(self, t: torch.Tensor) -> str | None:
        """``tensor <dtype><shape> parameter <name>`` when ``t`` is one of the model's own parameters or buffers (the
        very object): its values are the exact checksums' business at every step, as for the parameters the modules
        hold, and a ``GGUFOrigin`` holding every weight made each snapshot read all of them again. None otherwise
        (the tensor is digested by its bytes)."""
        if self.model is None:
            return None
        if self._own is None:
            self._own = {}
            for kind, named in (("parameter", self.model.named_parameters), ("buffer", self.model.named_buffers)):
                for n, x in named(remove_duplicate=False):
                    self._own.setdefault(id(x), (x, f"{kind} {n}"))
        held = self._own.get(id(t))
        if held is None or held[0] is not t:
            return None
        return f"tensor {str(t.dtype).removeprefix('torch.')}{list(t.shape)} {held[1]}"

    def callable_text(self, fn, depth: int) -> str | None:
        """``module.qualname#code`` of a function (and its defaults and closure), a bound method (its function, the
        class it is bound to), a ``functools.partial`` (its function and arguments); None for other callables."""
        if isinstance(fn, types.MethodType):
            return f"method {self.text(fn.__func__, depth)} of {_name(type(fn.__self__))}"
        if isinstance(fn, functools.partial):
            return (f"partial({self.text(fn.func, depth + 1)}, {self.text(fn.args, depth + 1)}, "
                    f"{self.text(fn.keywords, depth + 1)})")
        if isinstance(fn, types.FunctionType):
            extra = ""
            if fn.__defaults__ or fn.__kwdefaults__:
                extra += f" defaults {self.text(fn.__defaults__, depth + 1)} {self.text(fn.__kwdefaults__, depth + 1)}"
            if fn.__closure__:
                cells = []
                for c in fn.__closure__:
                    try:  # captured objects by type: their state is read where they live (a guard, a trainer)
                        cells.append(self.text(c.cell_contents, MAX_DEPTH))
                    except ValueError:  # an empty cell
                        cells.append("<empty>")
                extra += f" closure [{', '.join(cells)}]"
            text = f"function {_name(fn)}#{code_digest(fn.__code__)}{extra}"
            if depth < MAX_DEPTH and fn.__closure__ is None and fn.__kwdefaults__ is None and \
                    all(type(v) in _EXACT_PLAIN for v in fn.__defaults__ or ()):
                _FUNCTIONS[id(fn)] = (fn, fn.__code__, fn.__defaults__, fn.__module__, fn.__qualname__, text)
            return text
        if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
                           types.MethodWrapperType, types.MethodDescriptorType)):
            owner = getattr(fn, "__self__", None)
            bound = f" of {_name(type(owner))}" if owner is not None and not isinstance(owner, types.ModuleType) else ""
            return f"builtin {_name(fn)}{bound}"
        return None


def tensor_text(t: torch.Tensor) -> str:
    """dtype, shape and an exact checksum of a tensor held as an attribute (not a parameter or buffer)."""
    try:
        local = t.to_local() if hasattr(t, "to_local") else t
        return f"tensor {str(t.dtype).removeprefix('torch.')}{list(t.shape)} " \
               f"{tensor_checksums([('t', local.detach())])['t']:016x}"
    except (RuntimeError, TypeError):  # a meta or otherwise unreadable tensor
        return f"tensor {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


# ---- the whole program, flattened --------------------------------------------------------------------------
# The code digests of classes and modules are computed at every snapshot: their namespaces are read whole each time
# (a function added, removed or replaced shows). A function's own text is kept between snapshots only while its code,
# defaults and names are the same objects and it has nothing changeable in place (``_FUNCTIONS``): a function's
# ``__code__`` or defaults replaced in place (the function stays the same object) is read again. Code objects are
# immutable: :func:`code_digest` caches them.
# Functions frameworks set on classes as a side effect of ordinary use, not code a step runs: transformers'
# ``PreTrainedModel.initialize_weights`` sets ``torch.nn.Module.smart_apply`` (a function local to it) the first time
# any model is initialised, so every module class's digest differed between a process that built a model with random
# weights (a recording) and one that loaded it skipping initialisation (a replay in a fresh ``hf-unlearn forget``).
SIDE_EFFECT_ATTRIBUTES = frozenset({("torch.nn.modules.module", "Module", "smart_apply")})
# torch.optim.Optimizer.__init__ wraps its class's ``step`` in a profiling wrapper the first time an optimizer of that
# class is built (``step.hooked``), setting it on the class itself (``AdamW.step``, which AdamW inherits otherwise): a
# process that built an AdamW and one that did not yet differ there. The code digested is what the wrapper wraps, and
# nothing where that is the step the class inherits.
PROFILE_WRAPPER = "Optimizer.profile_hook_step.<locals>.wrapper"


def _unwrapped(cls, owner: type, name: str, fn):
    """``fn`` as :func:`_class_code` digests it (None: left out; see :data:`PROFILE_WRAPPER`)."""
    code = getattr(fn, "__code__", None)  # the wrapper's own name (functools.wraps gave it the wrapped one's)
    if getattr(code, "co_qualname", None) != PROFILE_WRAPPER or not hasattr(fn, "__wrapped__"):
        return fn
    inner = fn.__wrapped__
    for base in cls.__mro__[cls.__mro__.index(owner) + 1:]:
        if name in vars(base):
            above = vars(base)[name]
            return None if inner is above or inner is getattr(above, "__wrapped__", None) else inner
    return inner


def _class_code(cls, digester: Digester) -> str:
    """The code of every function defined by ``cls`` and its bases (a method patched on any of them changes it)."""
    h = hashlib.sha256()
    for c in cls.__mro__:
        if c is not object:
            h.update(digester.class_lines(c))
    return h.hexdigest()[:16]


def _class_values(cls) -> dict:
    """The plain class attributes of the user's own classes in ``cls``'s bases, by ``Class.name`` (a weight a user's
    ``compute_loss`` reads as ``self.unlabelled_weight``, set on the class by a callback)."""
    return {f"{c.__qualname__}.{k}": ("nan" if v != v else v) for c in cls.__mro__
            if c is not object and not c.__module__.startswith((*FRAMEWORK_HOOKS, "builtins"))
            for k, v in sorted(vars(c).items()) if type(v) in _EXACT_PLAIN and not k.startswith("__")}


def _module_code(mod, digester: Digester) -> str:
    """Every function and class a source module holds (what a monkeypatch of a module-level function changes), and
    every registry of functions it holds (:func:`_registry_dicts`: an entry replaced changes what a forward calls)."""
    return _kept_namespace(mod, vars(mod), lambda: _module_lines(mod, digester), digester.roots)


def _registry_dicts(v) -> list | None:
    """The dicts a module-level registry of functions keeps its entries in, or None: not a registry. A registry is
    a dict, or a transformers ``GeneralInterface`` (``ALL_ATTENTION_FUNCTIONS``, ``ALL_MASK_ATTENTION_FUNCTIONS``:
    a class-wide mapping and the instance's own overrides), holding at least one function. Code looks a function up
    in it by name at call time (``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation)``,
    ``LOSS_MAPPING[loss_type]``), so an entry a training script replaced is code the run ran, and no class or
    module-level function shows it."""
    if type(v) is dict:
        dicts = [v]
    elif isinstance(v, collections.abc.Mapping):  # not any object: a module attribute's getattr may run code
        own = (getattr(v, "__dict__", None) or {}).get("_local_mapping")
        shared = next((c.__dict__["_global_mapping"] for c in type(v).__mro__ if "_global_mapping" in c.__dict__), None)
        if type(own) is not dict or type(shared) is not dict:
            return None
        dicts = [shared, own]
    else:
        return None
    if len(dicts[0]) > _REGISTRY_MAX or not any(type(f) is types.FunctionType for d in dicts for f in d.values()):
        return None
    return dicts


_REGISTRY_MAX = 256  # a module-level dict larger than this is data, not a registry of functions


def _registry_entry_pins(v, deps: list, depth: int = 0) -> bool:
    """Add to ``deps`` what a registry entry's text depends on (functions, bound methods, the dicts of a
    ``functools.partial``'s keywords or of a nested mapping: their items compared by identity); False where identity
    cannot pin it (the module's text is then read again at every snapshot). A partial's function and arguments
    cannot be rebound: only its keywords, a dict, can change in place."""
    t = type(v)
    if t in _EXACT_PLAIN or t is types.BuiltinFunctionType or isinstance(v, type):
        return True
    if t in (types.FunctionType, types.MethodType):
        deps.append(v)
        return True
    if depth >= 2:
        return False
    if t is functools.partial:
        deps.append(v.keywords)
        return all(_registry_entry_pins(x, deps, depth + 1) for x in (v.func, *v.args, *v.keywords.values()))
    if t is dict:
        deps.append(v)
        return all(_registry_entry_pins(x, deps, depth + 1) for x in v.values())
    return False


def _module_lines(mod, digester: Digester) -> tuple[str, list | None, list]:
    h, deps, named, kept = hashlib.sha256(), [], [], True
    for k, v in sorted(vars(mod).items()):
        if isinstance(v, (types.FunctionType, functools.partial)) or (
                isinstance(v, types.BuiltinFunctionType) and not k.startswith("__")):
            h.update(f"{k}={digester.text(v, 1)}\n".encode())
            if type(v) is not types.BuiltinFunctionType:  # a builtin's text is its name and owner: fixed
                kept = kept and type(v) is types.FunctionType
                deps.append(v)
        elif isinstance(v, type):
            h.update(f"{k}={_name(v)}\n".encode())
            named.append(v)
        elif not k.startswith("__") and (dicts := _registry_dicts(v)) is not None:
            entries = {}
            for d in dicts:  # the instance's overrides last: they win, as GeneralInterface.__getitem__ decides
                entries.update(d)
            for name, f in sorted(entries.items(), key=lambda kv: str(kv[0])):
                h.update(f"{k}[{name!r}]={digester.text(f, 1)}\n".encode())
                kept = _registry_entry_pins(f, deps) and kept  # else: read again at every snapshot
            deps += dicts  # pinned by keys, values and size: an entry replaced in place is seen
    return h.hexdigest()[:16], deps if kept else None, named


# ---- code digests kept between snapshots -------------------------------------------------------------------
# A class's or module's namespace is read whole at every snapshot; what :meth:`Digester.class_lines` and
# :func:`_module_code` make of it is kept while nothing it depends on can have moved, compared by identity: the same
# keys bound to the same objects, and everything the functions it wrote out depend on (:class:`_Pins`: their code,
# defaults, closures, and what those hold, at any depth), and each object that could be given a ``__func__`` without
# being rebound (a class, a user object) still without one. The entry holds every object compared, so no id is reused
# while it is kept. A namespace whose text depends on anything identity cannot pin (a tensor or a list in a closure,
# a ``functools.partial``, whose keywords are a dict, a bound method as a class attribute, torch's profiling wrapper)
# is read again at every snapshot, as before.
_NAMESPACES: dict[int, tuple] = {}
# a class's namespace entries whose function, if any, cannot change while the entry is the same object
_WRAPPERS = frozenset({types.FunctionType, staticmethod, classmethod})
# built-in types whose instances cannot be given a ``__func__`` (nor another class)
_INERT = frozenset({*PLAIN, types.FunctionType, staticmethod, classmethod, property, dict, list, tuple, set,
                    frozenset, types.GetSetDescriptorType, types.MemberDescriptorType, types.MethodDescriptorType,
                    types.WrapperDescriptorType, types.BuiltinFunctionType, types.ClassMethodDescriptorType,
                    types.MappingProxyType})
_FIXED_TEXT = frozenset({torch.dtype, torch.device})  # immutable, written as str()
_CALLABLES = frozenset({types.BuiltinFunctionType, types.WrapperDescriptorType, types.MethodWrapperType,
                        types.MethodDescriptorType})  # written by Digester.callable_text


class _Pins:
    """The objects a kept namespace's text depends on, by kind, so that :meth:`now` reads them all again with
    C-level ``map`` calls (a snapshot reads some 900 functions this way): each function's code, defaults, keyword-only
    defaults, module and qualname; each closure cell's contents; each dict's (keyword-only defaults, an object's
    attributes) keys, values and size; each object's class and attribute dict; each class's and module's name
    (interned); each bound method's object's class; each watched object's ``__func__``. What is pinned follows the
    depth :meth:`Digester.text` reads a value at: below :data:`MAX_DEPTH` an object is written as its class alone,
    at it an object with attributes too, and a container's items only above it."""

    def __init__(self):
        self.fns, self.cells, self.dicts, self.objs, self.classes, self.methods, self.watch = [], [], [], [], [], [], []
        self.modules: list = []
        self.seen: set[tuple[int, int]] = set()

    def function(self, fn, depth: int = 1) -> bool:
        """Pin a function read at ``depth`` (False: its text depends on something identity does not pin; nothing is
        kept): its defaults are read one level down (their items two), its closure at :data:`MAX_DEPTH`."""
        if type(fn) is not types.FunctionType:
            return False
        if (id(fn), depth) in self.seen:  # a decorator's closure may hold the function that holds it
            return True
        self.seen.add((id(fn), depth))
        self.fns.append(fn)
        kw, cells = fn.__kwdefaults__, fn.__closure__
        inner = [*(fn.__defaults__ or ())]
        if kw:
            self.dicts.append(kw)
            inner += [*kw, *kw.values()]
        if not all(self.value(v, depth + 2) for v in inner):
            return False
        if cells:
            try:
                contents = [c.cell_contents for c in cells]
            except ValueError:  # an empty cell
                return False
            self.cells += cells
            return all(self.value(v, MAX_DEPTH) for v in contents)
        return True

    def value(self, v, depth: int) -> bool:
        """Pin a value read at ``depth`` (as :meth:`Digester.text` writes it): a plain value, a dtype, device, size or
        code object, a built-in function, a class or module (by name), a function or bound method, a
        ``torch.nn.Module`` or any object below the depth limit (by class), a tuple or frozenset of such, an object
        with attributes (by class and attributes, each one level further down). Not pinned: a tensor (its values
        are read), a ``functools.partial`` (its keywords are a dict), and a list, dict or set above the depth limit
        (their items are read and can change in place)."""
        t = type(v)
        if t in _EXACT_PLAIN or t in _FIXED_TEXT or t in _CALLABLES:
            return True
        if torch.is_tensor(v):
            return False
        if isinstance(v, type):
            self.classes.append(v)
            return True
        if isinstance(v, types.ModuleType):
            self.modules.append(v)
            return True
        if depth > MAX_DEPTH and not isinstance(v, PLAIN):  # written as its class ("<torch.Size>" ...)
            self.objs.append(v)
            self.classes.append(t)
            return True
        if t is types.MethodType:  # its function, and the class of what it is bound to
            self.methods.append(v)
            return self.function(v.__func__, depth)
        if t is types.FunctionType:
            return self.function(v, depth)
        if isinstance(v, (functools.partial, types.CodeType)):
            return t is types.CodeType
        if t in (tuple, frozenset):  # immutable: its items are the same objects
            return all(self.value(x, depth + 1) for x in v)
        if isinstance(v, (dict, list, tuple, set, frozenset)):
            return False
        if isinstance(v, torch.nn.Module):  # written as its class
            self.objs.append(v)
            self.classes.append(t)
            return True
        attrs = getattr(v, "__dict__", None)
        if type(attrs) is not dict:
            return False
        self.objs.append(v)
        self.classes.append(t)
        if depth >= MAX_DEPTH and not isinstance(v, (PLAIN, enum.Enum)):  # "Class(<builtins.dict>)"
            return True
        if (id(v), depth) in self.seen:
            return True
        self.seen.add((id(v), depth))
        self.dicts.append(attrs)
        return all(self.value(x, depth + 2) for x in (*attrs, *attrs.values()))

    def now(self) -> list | None:
        """Everything pinned, read again (None: an empty cell, a name deleted or not a string: never kept)."""
        try:
            return [*map(_CODE_OF, self.fns), *map(_DEFAULTS, self.fns), *map(_KWDEFAULTS, self.fns),
                    *map(_MODULE, self.fns), *map(_QUALNAME, self.fns), *map(_CONTENTS, self.cells),
                    *map(type, self.objs), *map(_vars_or_none, self.objs), *map(len, self.dicts),
                    *itertools.chain.from_iterable(self.dicts), *itertools.chain.from_iterable(map(_VALUES, self.dicts)),
                    *map(sys.intern, map(_MODULE, self.classes)), *map(sys.intern, map(_QUALNAME, self.classes)),
                    *map(sys.intern, map(_NAME, self.modules)),
                    *map(type, map(_SELF, self.methods)), *map(getattr, self.watch, itertools.repeat("__func__"),
                                                                itertools.repeat(None))]
        except (ValueError, TypeError, AttributeError):  # an empty cell, a name deleted or not a string
            return None


_CODE_OF, _DEFAULTS, _KWDEFAULTS = (operator.attrgetter(a) for a in ("__code__", "__defaults__", "__kwdefaults__"))
_MODULE, _QUALNAME, _SELF, _NAME = (operator.attrgetter(a) for a in ("__module__", "__qualname__", "__self__",
                                                                       "__name__"))
_CONTENTS, _VALUES = operator.attrgetter("cell_contents"), operator.methodcaller("values")


def _vars_or_none(obj):
    return getattr(obj, "__dict__", None)


def _pins(deps: list, watch: list) -> _Pins | None:
    """``deps``: the functions a namespace's text read, and mappings (an attribute dict, a class namespace) whose
    entries it depends on."""
    pins = _Pins()
    mappings = [d for d in deps if isinstance(d, (dict, types.MappingProxyType))]
    if not all(pins.function(fn) if type(fn) is types.FunctionType else pins.value(fn, 1)
               for fn in deps if not isinstance(fn, (dict, types.MappingProxyType))):
        return None
    pins.dicts += mappings
    pins.watch = list(watch)
    pins.classes += [v for v in watch if isinstance(v, type)]
    return pins


def _kept_namespace(owner, ns, compute, roots: dict):
    """``compute()``'s result for ``owner``'s namespace ``ns``, reused from the last snapshot while nothing it depends
    on moved (:data:`_NAMESPACES`), under the digester's ``roots`` (objects it writes by their path: a function holding
    one is written otherwise by a digester without them). ``compute`` returns ``(result, functions or None, watched
    objects)``: the functions its text read (None: not kept), and the classes it named or objects it must see gain a
    ``__func__``."""
    keys, values = tuple(ns), tuple(ns.values())
    held = sorted(roots.items())  # one entry per namespace (the last digester's): memory stays bounded
    hit = _NAMESPACES.get(id(owner))
    if hit is not None and hit[0] is owner and hit[8] == held and hit[1] == keys and hit[3] == tuple(map(id, values)):
        now = hit[4].now()
        if now is not None and hit[6] == list(map(id, now)):
            return hit[7]
    result, deps, watch = compute()
    pins = _pins(deps, watch) if deps is not None else None
    now = pins.now() if pins is not None else None
    if now is None:
        _NAMESPACES.pop(id(owner), None)
    else:  # the entry holds every object read (``now``): their ids are not reused while it is kept
        _NAMESPACES[id(owner)] = (owner, keys, values, tuple(map(id, values)), pins, now, list(map(id, now)), result,
                                  held)
    return result


def _globals_of(cls, frameworks=("transformers.", "builtins")):
    """``(module, name, value)`` of each module global the code of ``cls``'s own methods (and its bases' outside
    ``frameworks``) reads."""
    for c, _, fn in own_functions(cls, frameworks):
        glob = fn.__globals__
        for name in fn.__code__.co_names:
            if name in glob:
                yield c.__module__, name, glob[name]


def _globals_read(cls, digester: Digester, skip=("transformers.", "builtins")) -> dict:
    """The module globals the code of ``cls``'s own methods reads (plain values and callables), by name; classes
    from the ``skip`` packages aside."""
    return {f"{module}.{name}": digester.leaf(value) for module, name, value in _globals_of(cls, skip)
            if not isinstance(value, (types.ModuleType, type))}


def _fixed_at_import(value) -> bool:
    """A value a module global holds as its module set it up when imported: a plain value, a tuple or frozenset of
    them, a function, or a ``functools.partial`` of a function with such arguments. Not an object (a logger's cache
    fills as a process runs) nor a list, dict or set (a history the code appends to), which running code changes in
    place."""
    if type(value) in _EXACT_PLAIN or isinstance(value, types.FunctionType):
        return True
    if isinstance(value, functools.partial):
        return isinstance(value.func, types.FunctionType) and all(
            _fixed_at_import(v) for v in (*value.args, *value.keywords.values()))
    return type(value) in (tuple, frozenset) and all(type(v) in _EXACT_PLAIN for v in value)


def replayed_classes(callbacks, trainer_class, collator) -> dict:
    """``{where: class}`` of the code a replay runs again besides the model's: the recorded callbacks (in their
    recorded order), the run's trainer class (without the trace machinery) and its collator's class."""
    out = {f"callback {i} {_name(type(cb))}": type(cb) for i, cb in enumerate(callbacks or ())}
    out["trainer"] = recorded_trainer_class(trainer_class)
    inner = collator
    while hasattr(inner, "collator") and inner.collator is not inner:  # the id-carrying wrapper
        inner = inner.collator
    if inner is not None and not isinstance(inner, (types.FunctionType, functools.partial)):
        out["collator"] = type(inner)
    return out


def replayed_globals(classes: dict) -> dict[str, str]:
    """``"<where> global <what>" -> stable text`` of the values fixed when their module was imported
    (:func:`_fixed_at_import`) that the code of the classes a replay runs again (``{where: class}``: the recorded
    callbacks, the run's trainer class, its collator) reads: a constant read from the environment or a file at import
    takes another value in a deleting process that imports the module again. Read by every route that code reaches
    (:func:`_import_time_reads`), not only the globals its methods name."""
    d = Digester()
    return {f"{where} global {what}": _short(repr(d.leaf(value)))
            for where, cls in classes.items()
            for what, value in _import_time_reads(cls, ("transformers.", "trl.", "builtins", "hf_unlearn."),
                                                  constructed=not where.startswith("callback")).items()}


_MISSING = object()




def _import_time_reads(cls, frameworks, constructed: bool = True) -> dict:
    """``{what: value}`` of every value fixed at import that the code of ``cls`` (its bases outside ``frameworks``)
    reaches: its class attributes, its methods' default arguments and closure cells, the module globals they and
    their nested functions (lambdas, inner functions) name, another module's attributes they name (``cfg.CLIP``), and
    the same, transitively, for the program's own functions they call (a helper reading a constant, a
    ``functools.partial``'s function). A global the code assigns (``global N; N += 1``) and an attribute it assigns
    (``self.ON = ...``, ``cfg.CLIP = ...``) are running state, not compared. ``constructed=False``: a replay does not
    run the class's constructor (a recorded callback, rebuilt with its recorded attributes): what only ``__init__``
    reads is not compared."""
    import dis

    found: dict = {}  # what -> (kind, name, value): kind "global" (by STORE_GLOBAL) or "attr" (by STORE_ATTR)
    stores = {"global": set(), "attr": set()}
    todo, seen, stores_only = [], set(), set()
    for c in cls.__mro__:
        if c is object or c.__module__.startswith(frameworks):
            continue
        for k, v in vars(c).items():
            fn = getattr(v, "__func__", v)
            if isinstance(v, property):
                todo += [f for f in (v.fget, v.fset) if isinstance(f, types.FunctionType)]
            elif isinstance(fn, types.FunctionType):
                todo.append(fn)
                if k == "__init__" and not constructed:
                    stores_only.add(id(fn))
            elif not k.startswith("__") and _fixed_at_import(v):
                found[f"{c.__module__}.{c.__qualname__}.{k}"] = ("attr", k, v)
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        where, glob, code = f"{fn.__module__}.{fn.__qualname__}", fn.__globals__, fn.__code__
        if id(fn) in stores_only:
            stores["attr"].update(i.argval for i in dis.get_instructions(code) if i.opname == "STORE_ATTR")
            continue
        named = code.co_varnames[code.co_posonlyargcount + code.co_argcount - len(fn.__defaults__ or ()):]
        for name, v in (*zip(named, fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).items()):
            if _fixed_at_import(v):
                found[f"{where} default {name}"] = ("default", name, v)
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                if _fixed_at_import(cell.cell_contents):
                    found[f"{where} closure {name}"] = ("default", name, cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        codes = [code]
        while codes:
            co = codes.pop()
            codes += [c for c in co.co_consts if isinstance(c, types.CodeType)]
            for i in dis.get_instructions(co):
                if i.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                    stores["global"].add(i.argval)
                elif i.opname in ("STORE_ATTR", "DELETE_ATTR"):
                    stores["attr"].add(i.argval)
            for name in co.co_names:
                if name not in glob:
                    continue
                v = glob[name]
                if _fixed_at_import(v):
                    found[f"{fn.__module__}.{name}"] = ("global", name, v)
                inner = v.func if isinstance(v, functools.partial) else v
                if isinstance(inner, types.FunctionType) and is_user_code(inner.__module__, inner.__code__.co_filename):
                    todo.append(inner)
                if isinstance(v, types.ModuleType) and is_user_code(v.__name__, getattr(v, "__file__", None)):
                    for attr in co.co_names:
                        a = getattr(v, attr, _MISSING)
                        if a is not _MISSING and _fixed_at_import(a):
                            found[f"{v.__name__}.{attr}"] = ("attr", attr, a)
                        if isinstance(a, types.FunctionType) and is_user_code(a.__module__, a.__code__.co_filename):
                            todo.append(a)
    return {what: v for what, (kind, name, v) in found.items() if kind == "default" or name not in stores[kind]}


def program_state(model, optimizer=None, args=None, trainer=None, callbacks=(), datasets=(), collator=None) -> dict:
    """``path -> value`` of the whole program (see the module docstring); values are plain or stable text."""
    config = getattr(model, "config", None)
    gen = getattr(model, "generation_config", None)
    d = Digester({"config": config, "generation_config": gen, "args": args}, model=model)
    out: dict = {}
    if args is not None:
        out.update((f"args.{k}", d.leaf(v)) for k, v in vars(args).items() if k not in SKIPPED_ARGS)
    for root, obj in (("config", config), ("generation_config", gen)):
        if obj is not None:
            out.update((f"{root}.{k}", d.leaf(v)) for k, v in vars(obj).items() if k not in SKIPPED_CONFIG)
    classes, sources = {}, set()
    for name, m in module_tree.walk(model).modules:
        where = f"module {name or '(the model)'}:"
        for k, v in vars(m).items():
            if k in SKIPPED_MODULE:
                continue
            if type(v) in _EXACT_PLAIN and not k.startswith("__composable_api_"):  # most attributes: as leaf() gives
                out[f"{where} {k}"] = "nan" if v != v else v
            elif type(v) in _HOOK_DICTS and not v and k.endswith(_HOOK_KEYS):  # no hook: the empty list of the
                out[f"{where} {k}"] = "[]"  # branches below
            elif k.startswith("__composable_api_"):  # FSDP2's per-module state, under a key with a random uuid
                out[f"{where} {k.split('_key_')[0]}"] = _short(repr(sorted(
                    _name(type(x)) for x in (v.values() if isinstance(v, dict) else [v]))))
            elif type(v).__module__.startswith(RUNTIME_STATE):
                out[f"{where} {k}"] = _name(type(v))
            elif k.endswith(("_with_kwargs", "_always_called")) and isinstance(v, dict):  # keyed by handle id,
                # which a process that registered other hooks before (the main one's guards) numbers otherwise
                hooks = vars(m).get(k.rsplit("_with_kwargs", 1)[0].rsplit("_always_called", 1)[0]) or {}
                out[f"{where} {k}"] = d.leaf([fn for i, fn in hooks.items() if i in v
                                              and not _module_of(fn).startswith(FRAMEWORK_HOOKS)])
            elif k.endswith("hooks") and isinstance(v, dict):  # by the code they run, not their handles' ids;
                # the frameworks' own (NEFTune, input require-grads, ...) come and go as they run, as in replays
                out[f"{where} {k}"] = d.leaf([fn for fn in v.values() if not _module_of(fn).startswith(FRAMEWORK_HOOKS)])
            else:
                out[f"{where} {k}"] = d.leaf(v)
        # "[]" without building it for the many modules with none (what repr of the empty list writes)
        out[f"{where} parameters"] = _short(repr([(n, str(p.dtype), list(p.shape), p.requires_grad)
                                                  for n, p in m._parameters.items() if p is not None])) \
            if m._parameters else "[]"
        out[f"{where} buffers"] = _short(repr([(n, str(b.dtype), list(b.shape), n in m._non_persistent_buffers_set)
                                               for n, b in m._buffers.items() if b is not None])) \
            if m._buffers else "[]"
        out[f"{where} children"] = _short(repr([(n, _name(type(c))) for n, c in m._modules.items()])) \
            if m._modules else "[]"
        classes[type(m)] = None
        sources.add(type(m).__module__)
    for cls in (*classes, torch.Tensor):  # torch.Tensor: a method patched on it runs in every forward
        out[f"code class {_name(cls)}"] = _class_code(cls, d)
        out.update((f"code class {_name(cls)} value {k}", v) for k, v in _class_values(cls).items())
    for mod_name in sorted(sources | set(CODE_MODULES) | set(STEP_MODULES)):
        mod = sys.modules.get(mod_name)
        if mod is not None:
            out[f"code module {mod_name}"] = _module_code(mod, d)
    if trainer is not None:
        out[f"trainer class {_name(recorded_trainer_class(type(trainer)))}"] = _class_code(type(trainer), d)
        out.update((f"trainer class value {k}", v) for k, v in _class_values(type(trainer)).items())
        out.update((f"trainer.{k}", d.leaf(v)) for k, v in vars(trainer).items() if _trainer_setting(k, v))
        accelerator = getattr(trainer, "accelerator", None)  # a method patched on it (``backward``,
        if accelerator is not None:  # ``clip_grad_norm_``) runs in every step; it has no instance callables else
            out.update((f"accelerator.{k}", _patched_text(d, v)) for k, v in _patched_methods(accelerator))
        # a global the user's trainer code reads (a flag its compute_loss follows), which replays run in their process
        out.update((f"trainer global {k}", v) for k, v in _globals_read(
            type(trainer), d, skip=(*FRAMEWORK_HOOKS, "builtins")).items())
    for i, cb in enumerate(callbacks):
        out[f"callback {i} {_name(type(cb))} code"] = _class_code(type(cb), d)
        out.update((f"callback {i} global {k}", v) for k, v in _globals_read(type(cb), d).items())
    if optimizer is not None:
        out.update(optimizer_structure(model, optimizer, d))
    for where, ds in (datasets.items() if isinstance(datasets, dict) else enumerate(datasets)):
        fmt = getattr(ds, "format", None)  # a datasets.Dataset's format and transform (set_format, set_transform)
        if isinstance(fmt, dict):
            out.update((f"data {where} format {k}", d.leaf(v)) for k, v in fmt.items())
        for k in ("transform", "_transform", "transforms"):  # torch / torchvision style datasets
            if getattr(ds, k, None) is not None:
                out[f"data {where} {k}"] = d.leaf(getattr(ds, k))
    if collator is not None:
        inner = collator
        while hasattr(inner, "collator") and inner.collator is not inner:  # the id-carrying wrapper
            inner = inner.collator
        if hasattr(inner, "__dict__") and not isinstance(inner, types.FunctionType):
            out["data collator class"] = _name(type(inner))
            out.update((f"data collator {k}", d.leaf(v)) for k, v in vars(inner).items())
        else:
            out["data collator"] = d.leaf(inner)
    out.update(torch_state())
    return out


# the trainer's attributes that are objects digested elsewhere (args, the collator, the model), its running state, or
# what only evaluation reads and sets (gather_function)
SKIPPED_TRAINER = frozenset({"args", "data_collator", "processing_class", "model", "model_wrapped", "accelerator",
                             "optimizer", "lr_scheduler", "callback_handler", "state", "control", "train_dataset",
                             "eval_dataset", "_mixed_mesh_grads", "gather_function"})


def _trainer_setting(name: str, value) -> bool:
    """An attribute of the trainer instance that decides how it computes a step: a flag (``model_accepts_loss_kwargs``,
    which says whether the model divides by the recorded normaliser), an unset hook (None) or a callable
    (``compute_loss_func``, ``label_smoother``, a method patched on the instance). Counters (ints, floats) and running
    state change every step and are left out, as is the recorder's own state."""
    if name.startswith("_trace") or name in SKIPPED_TRAINER:
        return False
    return value is None or type(value) is bool or (callable(value) and not isinstance(value, (type, torch.nn.Module)))


def optimizer_structure(model, optimizer, d: Digester) -> dict:
    """The optimizer's whole structure: class, defaults, every group's keys and parameters (by name), the keys of
    every parameter's state, and every other attribute (its hooks included)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    names = {id(p): n for n, p in module_tree.walk(model).parameters}
    out = {"optimizer class": _name(type(inner)), "optimizer class code": _class_code(type(inner), d),
           "optimizer defaults": d.leaf(inner.defaults)}
    for i, g in enumerate(inner.param_groups):
        out[f"optimizer group {i} keys"] = ",".join(sorted(g))
        out[f"optimizer group {i} params"] = _short(",".join(names.get(id(p), "?") for p in g["params"]))
        out[f"optimizer group {i} state keys"] = _short(repr(sorted({",".join(sorted(inner.state[p]))
                                                                     for p in g["params"] if p in inner.state})))
    if inner is not optimizer:  # accelerate's wrapper: a ``step`` patched on it runs in every step
        out.update((f"optimizer wrapper.{k}", _patched_text(d, v)) for k, v in _patched_methods(optimizer))
    from torch.optim import optimizer as torch_optimizer

    for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):  # run by every optimizer's step
        hooks = getattr(torch_optimizer, name, None) or {}
        out[f"optimizer global {name.strip('_').removeprefix('global_')}"] = d.leaf(
            [fn for fn in hooks.values() if not _module_of(fn).startswith("hf_unlearn.")])
    for k, v in vars(inner).items():
        if k in SKIPPED_OPTIMIZER:
            continue
        if k.endswith("_hooks") and isinstance(v, dict):  # this library's own (its guards, per process) left out
            v = [fn for fn in v.values() if not _module_of(fn).startswith("hf_unlearn.")]
        out[f"optimizer.{k}"] = d.leaf(v)
    return out


def _patched_methods(obj) -> list:
    """The callables set on an instance that has none of its own (accelerate's ``Accelerator`` and optimizer
    wrapper): a method patched on it, which a replay building its own does not have; this library's left out."""
    return [(k, v) for k, v in vars(obj).items() if callable(v) and not isinstance(v, (type, torch.nn.Module))
            and not _module_of(v).startswith("hf_unlearn.")]


def unreplayed_methods(trainer, optimizer) -> list[str]:
    """Code set on the objects a replay builds afresh, which it therefore does not run: methods patched on the
    accelerator or on accelerate's optimizer wrapper, methods and step hooks set on the torch optimizer, torch's
    global optimizer hooks (``register_optimizer_step_pre_hook``), and a torch function or dispatch mode the
    program entered around ``train()`` (a replay runs in no mode of the user's); the frameworks' own left out. Set before training,
    such code never shows as a change, and code that acts only on a deletion's rows passes the proof."""
    from torch.optim import optimizer as torch_optimizer

    def users(pairs):  # the frameworks' own (accelerate sets the wrapper's ``step``) are set up by a replay too
        return [(k, fn) for k, fn in pairs if not _module_of(fn).startswith(FRAMEWORK_HOOKS)]

    out = []
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        out += [f"accelerator.{k} = {_name_of(v)}" for k, v in users(_patched_methods(accelerator))]
    inner = getattr(optimizer, "optimizer", optimizer)
    if optimizer is not None and inner is not optimizer:
        out += [f"the optimizer wrapper's {k} = {_name_of(v)}" for k, v in users(_patched_methods(optimizer))]
    if inner is not None:
        out += [f"optimizer.{k} = {_name_of(v)}" for k, v in users(_patched_methods(inner))]
        for k in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
            out += [f"an optimizer step hook {_name_of(fn)}" for _, fn in users(
                (k, fn) for fn in (getattr(inner, k, None) or {}).values())]
    for k in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        out += [f"a global optimizer hook {_name_of(fn)}" for _, fn in users(
            (k, fn) for fn in (getattr(torch_optimizer, k, None) or {}).values())]
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    out += [f"a torch mode active around train(), {_name(type(m))}" for m in
            (*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack())
            if not type(m).__module__.startswith("hf_unlearn.")]
    return out


def _name_of(fn) -> str:
    fn = _function_of(fn)
    return f"{_module_of(fn) or '?'}:{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _function_of(fn):
    """The function under ``functools.partial`` and bound-method layers."""
    while hasattr(fn, "func") or hasattr(fn, "__func__"):
        fn = getattr(fn, "func", None) or fn.__func__
    return fn


def _module_of(fn) -> str:
    """The module whose code ``fn`` is: a function's by the globals its code runs in, which ``functools.wraps``
    does not copy (a wrapper of the program's own named like accelerate's method is the program's)."""
    fn = _function_of(fn)
    if isinstance(fn, types.FunctionType):
        return fn.__globals__.get("__name__") or ""
    return getattr(fn, "__module__", None) or ""


def _patched_text(d: Digester, fn):
    """What the digests keep of a method set on an instance: a framework's own (torch's step wrapper on accelerate's
    optimizer wrapper) by its code and the code it wraps, not its closure, which holds per-process objects (each
    process of a launch read otherwise, and every FSDP2 run was refused as changed on some processes only); the
    program's own whole."""
    if not _module_of(fn).startswith(FRAMEWORK_HOOKS):
        return d.leaf(fn)
    parts = []
    while fn is not None and len(parts) < MAX_DEPTH:
        inner = _function_of(fn)
        code = getattr(inner, "__code__", None)
        if not _module_of(inner).startswith(FRAMEWORK_HOOKS):
            parts.append(str(d.leaf(inner)))
            break
        parts.append(f"{_name_of(inner)}:{code_digest(code) if code is not None else type(inner).__qualname__}")
        fn = getattr(inner, "__wrapped__", None)
    return " <- ".join(parts)


def torch_state() -> dict:
    """Process-wide switches that change numbers (torch's settings and the numeric environment variables)."""
    b = torch.backends
    out = {"torch default_dtype": str(torch.get_default_dtype()), "torch threads": torch.get_num_threads(),
           "torch interop_threads": torch.get_num_interop_threads(),
           "torch deterministic": torch.are_deterministic_algorithms_enabled(),
           "torch matmul_precision": float32_matmul_precision(), "torch fp32_precision": fp32_precision(),
           "torch flush_denormal": flush_denormal(),
           "torch grad_enabled": torch.is_grad_enabled(), "torch anomaly": torch.is_anomaly_enabled(),
           "torch mkldnn": b.mkldnn.enabled, "torch opt_einsum": b.opt_einsum.enabled,
           "torch cpu capability": b.cpu.get_cpu_capability(),
           "torch sdp": [b.cuda.flash_sdp_enabled(), b.cuda.mem_efficient_sdp_enabled(), b.cuda.math_sdp_enabled()],
           "torch mha fastpath": b.mha.get_fastpath_enabled(),
           "torch cuda matmul": [matmul_allow_tf32(), b.cuda.matmul.allow_fp16_reduced_precision_reduction,
                                 b.cuda.matmul.allow_bf16_reduced_precision_reduction],
           "torch cudnn": [b.cudnn.enabled, b.cudnn.deterministic, b.cudnn.benchmark, cudnn_allow_tf32()]}
    out.update((f"environ {k}", v) for k, v in sorted(os.environ.items()) if k.startswith(NUMERIC_ENV))
    return out


def describe_difference(before: dict, after: dict) -> str | None:
    """The first path whose value differs, in words (None when the two states agree)."""
    if before == after:
        return None
    for k in list(before) + [k for k in after if k not in before]:
        a, b = before.get(k, _ABSENT), after.get(k, _ABSENT)
        if a != b:
            return f"{k} {_show(a)} -> {_show(b)}"
    return None


_ABSENT = object()


def _show(value) -> str:
    text = "(absent)" if value is _ABSENT else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def state_digest_of(state: dict) -> str:
    """16 hex digits over a :func:`program_state` (the last one's kept: a step's program is mostly the last
    step's, and writing out its ~14,000 entries of a LoRA model was about a tenth of a recorded step's checks)."""
    last, digest = _LAST_DIGEST
    if last is not None and _written_alike(state, last):
        return digest
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(f"{k}\0{state[k]!r}\n".encode())
    _LAST_DIGEST[:] = [dict(state), h.hexdigest()[:16]]
    return _LAST_DIGEST[1]


_LAST_DIGEST: list = [None, ""]  # the last state state_digest_of wrote out (a copy) and its digest
_SCALARS = frozenset({str, int, bool, type(None)})  # equal values of one of these types have equal reprs


def _written_alike(a: dict, b: dict) -> bool:
    """Whether :func:`state_digest_of` writes ``a`` and ``b`` out alike: the same keys, each value of the same type
    and equal, and where equality does not settle the text (a float's zero sign, a list's items) the same repr."""
    if a.keys() != b.keys():
        return False
    va, vb = list(a.values()), list(map(b.__getitem__, a))
    if list(map(type, va)) != list(map(type, vb)) or va != vb:
        return False
    return all(repr(x) == repr(y) for x, y in zip(va, vb) if type(x) not in _SCALARS)


def components(state: dict, drop=PROCESS_LOCAL) -> dict[str, str]:
    """Per component (``args``, ``config``, a module, the code, ...), a digest: what processes compare."""
    groups: dict[str, list] = {}
    for k, v in state.items():
        if k in drop:
            continue
        head = k.split(".", 1)[0] if k.startswith(("args.", "config.", "generation_config.", "trainer.")) else \
            k.split(":", 1)[0] if k.startswith("module ") else k if k.startswith("code ") else \
            " ".join(k.split(" ", 2)[:2])
        groups.setdefault(head, []).append(f"{k}\0{v!r}")
    return {g: hashlib.sha256("\n".join(items).encode()).hexdigest()[:16] for g, items in groups.items()}


class ProcessComparison:
    """On every process of a multi-process recording, after every ``optimizer.step()``: the whole program's
    components (:func:`components`, process-local fields aside) and an exact digest of the tensors every process
    holds whole (all of them under DDP; buffers and unsharded tensors under FSDP2), gathered; on the main process a
    process that differs from process 0 is a program change of that step (a rank-local change is a change, and no
    replay reproduces it). Every process must build one (the gather is a collective)."""

    def __init__(self, model, optimizer, context, guard=None, step=None):
        self.model, self.optimizer, self.context, self.guard, self.step = model, optimizer, context, guard, step
        self.reported: set[str] = set()
        self.reads: set[str] = set()  # watched callbacks' events that read tensor values on this process (program)
        self._versions: dict | None = None  # this process's tensors as the last optimizer step left them
        self._edited: list[str] = []
        inner = getattr(optimizer, "optimizer", optimizer)
        self._hooks = [inner.register_step_pre_hook(lambda *a: self._check_versions()),
                       inner.register_step_post_hook(lambda *a: self.compare())]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def _local_versions(self) -> dict:
        """Each parameter's and optimizer state tensor's storage and in-place version on this process (its own shard
        under FSDP2; buffers aside: DDP rewrites them at every forward). Between two optimizer steps nothing of a
        program that trains as recorded writes them; a write is an edit (a callback, a hook) on this process."""
        out = {}
        for n, t in _own_tensors(self.model, self.optimizer):
            if n in self._buffers:
                continue
            local = t.to_local() if hasattr(t, "to_local") else t
            out[n] = (local.data_ptr(), local._version)
        return out

    def _check_versions(self) -> None:
        if self._versions is not None:
            now = self._local_versions()
            self._edited = sorted(n for n, v in now.items() if self._versions.get(n, v) != v)

    @property
    def _buffers(self) -> set:
        return {n for n, _ in self.model.named_buffers()}

    def local(self) -> dict:
        whole = [(n, t) for n, t in _own_tensors(self.model, self.optimizer) if not hasattr(t, "to_local")]
        names = {n for n, _ in whole}
        ref = self.guard.ref if self.guard is not None else None  # the main process: its guard read them just now
        if ref is not None and ref.exact is not None and "whole" in ref.controls:
            # the guard read the tensors its step wrote (trace.checksums.STEP_SCOPE); the rest (frozen weights,
            # optimizer moments) are read here, as every other process reads them all
            sums, state = {n: v for n, v in ref.exact.items() if n in names}, ref.controls["whole"]
            sums.update(tensor_checksums([(n, t) for n, t in state_tensors(self.model, self.optimizer)
                                          if n in names and n not in sums]))
        else:
            sums = tensor_checksums([(n, t) for n, t in state_tensors(self.model, self.optimizer) if n in names])
            state = program_state(self.model, self.optimizer, **self.context())
        parts = components(state)
        parts["tensors held whole (parameters, buffers, optimizer state)"] = exact_digest(sums)
        if self.reads:  # a callback replays do not run that looked at values on some processes only
            parts["watched callbacks' reads of tensor values"] = ", ".join(sorted(self.reads))
        if self._edited:  # on this process, between the last optimizer step and this one (its own shards too)
            parts["tensors written between optimizer steps"] = ", ".join(self._edited[:3]) + (
                f" and {len(self._edited) - 3} more" if len(self._edited) > 3 else "")
        return parts

    def compare(self) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.local())
        self._edited, self._versions, self.reads = [], self._local_versions(), set()
        if self.guard is None:
            return
        step = self.step() if self.step is not None else self.guard.step
        first = gathered[0]
        for rank, other in enumerate(gathered[1:], 1):
            written = other.get("tensors written between optimizer steps")
            if written and f"written {rank}" not in self.reported:  # the main process's own: its guard's business
                self.reported.add(f"written {rank}")
                self.guard.pending.append({"step": step, "what": f"process {rank} wrote {written} in place between "
                                                                 f"optimizer steps {step - 1} and {step} (a change "
                                                                 "made on that process, outside the optimizer)",
                                           "seen": "tensors", "across_processes": True})
            for part in sorted(set(first) | set(other)):
                if part == "tensors written between optimizer steps":
                    continue
                if first.get(part) != other.get(part) and part not in self.reported:
                    self.reported.add(part)
                    self.guard.pending.append({"step": step, "persistent": True, "across_processes": True,
                                               "seen": "tensors" if part.startswith("tensors held whole") else "program",
                                               "what": f"process {rank}'s {part} differs from process 0's (a change "
                                                       "made on some processes only; no replay reproduces it)"})


def _own_tensors(model, optimizer):
    return _own_state_tensors(model, optimizer, False)
