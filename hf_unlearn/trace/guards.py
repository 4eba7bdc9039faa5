"""Per-step program guards: everything that decides a recorded state is in the record and replayed, or refused.

A replay re-executes the recorded plan. What the plan does not hold (a callback that raises the learning rate at
step 3, freezes a layer, edits the weights under ``no_grad`` or sets every dropout ``p`` to 0; a user's own code
doing the same) would be silently dropped, and a deletion VERIFIED against an oracle that is not the counterfactual
of the run the user trained. So the recording closes the program:

* **callbacks** are sorted when training starts. transformers' own (printer, progress, logging and integration
  callbacks, ``EarlyStoppingCallback``, whose stop is a recorded control: the run's length and kept model) and the
  library's are observers. Any other callback is part of the program: an importable class whose attributes are JSON
  and which overrides only the events a replay runs (:data:`REPLAYED_EVENTS`, plus the set-up events whose effects
  the step-0 checkpoint holds) is **recorded** (its class in the header, its attributes whenever they change in the
  plan, both under the run key) and **run again** by replays and the oracle at the same points of every step. Any
  other is **watched**: the first thing it changes marks the run, naming it, the event and the step.
* **a live guard**, in memory: the storage and version counter of every parameter, buffer, gradient and
  optimizer-state tensor (an in-place edit through the tensor), an exact checksum of every such tensor's bytes
  (:func:`tensor_checksums`: an edit of any element through ``.data``, which bumps no version counter), every param
  group's settings (the learning rate ``optimizer.step()`` uses, not only the scheduler's), the trainable set, every
  module's ``training`` flag and plain attributes (dropout ``p``, ...), the model config, the user's hooks
  (:func:`program_hooks`) and the process-wide numeric settings. Exact checks right before and after
  ``optimizer.step()`` and around each non-observer callback's events; a cheap one (no checksums) when a step's
  batches are fetched. Observers are decided by where their code lives (:func:`is_observer`), and a recorded
  callback reads the ``TrainerState`` through a :class:`StateView` (a field replays do not set refuses the run). A change no recorded callback made is a **program change**:
  written to the plan (keyed) with its step; a replay that would pass the step (start at or before it) is refused
  before any compute (:class:`ProgramChangedError`).
* **per-step fingerprints**: for every optimizer step, a digest of the program controls as ``optimizer.step()``
  runs (learning rates, trainable set, modes, attributes, hooks), the exact digest of the trainable parameters and
  buffers right after it and of the gradients it used, written to the plan (keyed); the whole state, frozen
  weights and optimizer moments included, is bound by SHA-256 at every kept checkpoint
  (:func:`~hf_unlearn.trace.checksums.step_state_tensors` says why that leaves nothing unproven). Every replay and
  the oracle compute the same fingerprint at the same points and compare: the controls at every step they replay
  (a deletion does not change them), the state at every step before the first affected one. A mismatch stops the
  replay, naming the step and what differs (and whether the gradients already differed).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import types
from typing import NamedTuple

import torch

from ..errors import UnlearnError
from . import digests, module_tree  # called through the module: a test may stand in for digests.program_state
from .checksums import (  # noqa: F401 - re-exported: they lived here
    STEP_SCOPE,
    device_checksum,
    exact_digest,
    gradient_tensors,
    state_digest,
    state_tensors,
    step_state_tensors,
    tensor_checksums,
)
from .digests import FRAMEWORK_HOOKS, VOLATILE_CONFIG  # noqa: F401 - re-exported: they lived here
from .dtensors import all_shards
from .fidelity import FidelityError
from .program_code import sealed_code
from .proven import unproven_steps
from .stack import cudnn_allow_tf32, float32_matmul_precision, flush_denormal, fp32_precision, matmul_allow_tf32
from .trainers import _import, importable_name
from .value_reads import ValueReads, held_view

# the events a replay runs, at the points of a step where Trainer runs them
REPLAYED_EVENTS = ("on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end")
# events whose effects the step-0 checkpoint holds (before the first step) or that run after the run is sealed
SETUP_EVENTS = ("on_init_end", "on_train_begin", "on_train_end")
SAMPLES = 16  # sampled values per tensor (the cheap check; the exact checksums run at optimizer.step())
# the TrainerState fields a replay sets as the recording's Trainer did (a recorded callback may read only these)
REPRODUCED_STATE = frozenset({"global_step", "max_steps", "epoch", "is_world_process_zero", "is_local_process_zero"})
PLAIN = (bool, int, float, str, type(None))
VOLATILE_ATTRIBUTES = frozenset({"name_or_path"})  # a PreTrainedModel's: where it was loaded from
_FUNCTION_TYPES = (types.FunctionType, types.MethodType, functools.partial)
_EXACT_PLAIN = frozenset(PLAIN)


class ProgramChangedError(FidelityError):
    """The run changed outside its record (a callback or code the replay does not run) in the range a replay needs."""


# ---- callbacks ---------------------------------------------------------------------------------------------
def is_observer(callback) -> bool:
    """transformers' own callbacks and the library's: they log, print, report or stop (a recorded control).

    Decided by where the code of every event the class overrides lives (transformers' or this library's package
    files), not by the names a class can set for itself: a user's callback that sets ``__module__ =
    "transformers.x"`` or ``_trace_observer = True`` is still the user's (watched, or recorded)."""
    cls = type(callback)
    module = cls.__module__ or ""
    if not (module.startswith("transformers.") or (module.startswith("hf_unlearn.")
                                                    and getattr(cls, "_trace_observer", False))):
        return False
    homes = _observer_homes()
    for name in overridden_events(callback):
        code = getattr(getattr(cls, name), "__code__", None)
        if code is None or not os.path.abspath(code.co_filename).startswith(homes):
            return False
    return True


def _observer_homes() -> tuple[str, ...]:
    import transformers

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hf_unlearn/ (no import of the root)
    return os.path.dirname(os.path.abspath(transformers.__file__)) + os.sep, package + os.sep


def overridden_events(callback) -> list[str]:
    from transformers import TrainerCallback

    return sorted(name for name in vars(TrainerCallback) if name.startswith("on_")
                  and getattr(type(callback), name) is not getattr(TrainerCallback, name))


def callback_attributes(callback) -> dict:
    """The callback's attributes as JSON; raises ValueError when they are not JSON (or do not survive it)."""
    state = vars(callback)
    try:
        text = json.dumps(state, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"its attributes are not JSON ({e})") from None
    if json.loads(text) != state:
        raise ValueError("its attributes do not survive JSON (tuples or non-string keys)")
    return json.loads(text)


def callback_spec(callback) -> dict:
    """How a replay runs ``callback`` again: ``{"class", "events", "replayable"}`` and ``why`` when it cannot."""
    cls = type(callback)
    name = importable_name(cls)
    events = overridden_events(callback)
    spec = {"class": name or f"{cls.__module__}:{cls.__qualname__}", "events": events}
    why = None
    other = [e for e in events if e not in REPLAYED_EVENTS + SETUP_EVENTS]
    if name is None:
        why = "it is defined in __main__ or inside a function, so a replay cannot import it"
    elif other:
        why = f"it overrides {', '.join(other)}, which replays do not run (they run {', '.join(REPLAYED_EVENTS)})"
    else:
        try:
            callback_attributes(callback)
        except ValueError as e:
            why = str(e)
    return {**spec, "replayable": why is None, **({"why": why} if why else {})}


def rebuild_callback(spec: dict, attributes: dict):
    """The recorded callback with the recorded attributes (its constructor is not run: the attributes are its state)."""
    import copy

    cls = _import(spec["class"], "callback class")
    obj = cls.__new__(cls)
    obj.__dict__.update(copy.deepcopy(attributes))
    return obj


class StateView:
    """A recorded callback's view of the ``TrainerState``: reads of fields a replay does not reproduce are noted
    (the recording refuses the run's replays), writes go through."""

    def __init__(self, state):
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "unreproduced", set())

    def __getattr__(self, name):
        if name not in REPRODUCED_STATE and not name.startswith("__"):
            self.unreproduced.add(name)
        return getattr(self._state, name)

    def __setattr__(self, name, value):
        setattr(self._state, name, value)


def run_event(callbacks, event: str, args, state, control, **kwargs) -> None:
    """Call ``event`` on each callback as transformers' CallbackHandler does."""
    for cb in callbacks:
        result = getattr(cb, event)(args, state, control, **kwargs)
        if result is not None:
            control = result


# ---- state and controls ------------------------------------------------------------------------------------
def _plain(value):
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, PLAIN) else type(value).__name__


def program_controls(model, optimizer) -> dict:
    """What decides a step besides the data and the state: every param group's settings (learning rate included),
    the trainable parameters, every module's ``training`` flag and plain public attributes, and the model config."""
    inner = getattr(optimizer, "optimizer", optimizer)
    groups = [{k: _plain(v) for k, v in g.items() if k not in ("params", "initial_lr")} for g in inner.param_groups]
    walk = _walk(model)
    config = getattr(model, "config", None)
    config = {k: v for k, v in (config.to_dict() if hasattr(config, "to_dict") else {}).items()
              if k not in VOLATILE_CONFIG}
    return {"groups": groups, "trainable": walk["trainable"], "modules": walk["modules"], "config": config,
            "hooks": walk["hooks"], "code": walk["code"], "numerics": numeric_settings()}


# packages whose hooks are the frameworks' own (NEFTune, gradient checkpointing, accelerate's device and precision
# wrappers, this library's checks): a replay sets them up the same way from the recorded arguments
MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _hook_name(fn) -> str | None:
    """``module:qualname`` of a hook function, None when it is a framework's own."""
    while hasattr(fn, "func") or hasattr(fn, "__func__"):  # functools.partial, bound methods
        fn = getattr(fn, "func", None) or fn.__func__
    module = getattr(fn, "__module__", None) or type(fn).__module__ or "?"
    if module.startswith(FRAMEWORK_HOOKS):
        return None
    return f"{module}:{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def program_hooks(model) -> list[str]:
    """The user's hooks, which a replay does not run (it rebuilds the model from files): forward and backward hooks
    of every module (and torch's global module hooks), a replaced ``forward``, and gradient hooks of every
    parameter (``register_hook``, ``register_post_accumulate_grad_hook``). Framework hooks are left out."""
    return _walk(model)["hooks"]


def _walk(model) -> dict:
    """One pass over the module tree for what :func:`program_controls` reads: the trainable parameters (every name,
    as ``named_parameters(remove_duplicate=False)`` lists them), each module's plain public attributes, the user's
    hooks (:func:`program_hooks`) and which function each module class runs as ``forward`` (``module:qualname``: a
    class patched in the recording process and not in a replay's differs there), each module and parameter once
    under its first name as ``named_modules()``/``named_parameters()`` give them. A LoRA model has about 1,000 modules:
    five walks of them were most of a snapshot's Python."""
    from torch.nn.modules import module as torch_module

    trainable, modules, found = [], {}, []
    for attr in MODULE_HOOKS:
        for fn in (getattr(torch_module, f"_global{attr}", None) or {}).values():
            found.append(("torch.nn (global)", attr, fn))
    seen_params, forwards = set(), {}
    for name, m, first in module_tree.walk(model).every:
        for k, p in m._parameters.items():
            if p is None:
                continue
            full = f"{name}.{k}" if name else k
            if p.requires_grad:
                trainable.append(full)
            if first and id(p) not in seen_params:
                seen_params.add(id(p))
                for attr in TENSOR_HOOKS:
                    found += [(full, attr, fn) for fn in (getattr(p, attr, None) or {}).values()]
        if not first:
            continue
        where = name or "(the model)"
        own = vars(m)
        # one pass over the module's attributes (a LoRA model has ~1,000 modules): its plain public ones
        plain = {k: v for k, v in own.items() if k[:1] != "_" and (type(v) in _EXACT_PLAIN or isinstance(v, PLAIN))
                 and k not in VOLATILE_ATTRIBUTES}
        # a function held by the module instance (a replaced forward, model.loss_function = ...): a replay
        # rebuilds the model from its config, without it
        found += [(where, k, v) for k, v in own.items()
                  if k == "forward" or (type(v) not in _EXACT_PLAIN and isinstance(v, _FUNCTION_TYPES))]
        for attr in MODULE_HOOKS:
            hooks = own[attr] if attr in own else getattr(m, attr, None)
            if hooks:
                found += [(where, attr, fn) for fn in hooks.values()]
        modules[name] = plain
        cls = type(m)
        if cls not in forwards:  # the function each class runs as forward, read once per walk
            fn = getattr(cls, "forward", None)
            fn = getattr(fn, "__func__", fn)
            forwards[cls] = (f"{cls.__module__}.{cls.__qualname__}: {getattr(fn, '__module__', '?')}:"
                             f"{getattr(fn, '__qualname__', type(fn).__qualname__)}")
    code = set(forwards.values())
    hooks = sorted(f"{where}.{attr.strip('_')}: {n}" for where, attr, fn in found if (n := _hook_name(fn)))
    return {"trainable": trainable, "modules": modules, "hooks": hooks, "code": sorted(code)}


def numeric_settings() -> dict:
    """Process-wide torch settings that change the numbers (thread count, deterministic algorithms, TF32, matmul
    precision, cuDNN/oneDNN switches, default dtype): a change during the recording is a program change. (Whether
    a replay runs with the recorded values is the numeric stack's record, not compared here.)"""
    b = torch.backends
    return {"threads": torch.get_num_threads(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "matmul_precision": float32_matmul_precision(), "default_dtype": str(torch.get_default_dtype()),
            "fp32_precision": fp32_precision(), "flush_denormal": flush_denormal(),
            "cuda_matmul_tf32": matmul_allow_tf32(), "cudnn": [b.cudnn.enabled, b.cudnn.deterministic,
                                                               b.cudnn.benchmark, cudnn_allow_tf32()],
            "reduced_precision": [b.cuda.matmul.allow_fp16_reduced_precision_reduction,
                                  b.cuda.matmul.allow_bf16_reduced_precision_reduction],
            "mkldnn": b.mkldnn.enabled}


def controls_digest(controls: dict) -> str:
    """What a replay must reproduce of the controls (the numeric settings and the whole-program state are compared
    only within the recording: :mod:`hf_unlearn.trace.digests`)."""
    kept = {k: v for k, v in controls.items() if k not in ("numerics", "whole")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def describe_controls_change(before: dict, after: dict, modes: bool = True) -> str | None:
    """The first difference between two :func:`program_controls` dicts, in words (None when they agree).

    ``modes=False`` leaves the ``training`` flags out: between steps they say where evaluation left the model
    (``training_step`` sets them again), so they count as the forward used them (in the step fingerprint)."""
    for i, (a, b) in enumerate(zip(before["groups"], after["groups"])):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return f"param group {i}'s {k} {a.get(k)!r} -> {b.get(k)!r}"
    if len(before["groups"]) != len(after["groups"]):
        return f"the optimizer's param groups {len(before['groups'])} -> {len(after['groups'])}"
    a, b = set(before["trainable"]), set(after["trainable"])
    if a != b:
        name = sorted(a ^ b)[0]
        return f"requires_grad of {name} {name in a} -> {name in b} ({len(a ^ b)} parameter(s))"
    for name in before["modules"]:
        x, y = before["modules"][name], after["modules"].get(name, {})
        if x == y:  # most modules (compared key by key below only when they differ)
            continue
        for k in sorted(set(x) | set(y)):
            if x.get(k) != y.get(k) and (modes or k != "training"):
                return f"{name or '(the model)'}.{k} {x.get(k)!r} -> {y.get(k)!r}"
    if set(before["modules"]) != set(after["modules"]):
        return f"the model's modules ({len(before['modules'])} -> {len(after['modules'])})"
    for k in sorted(set(before["config"]) | set(after["config"])):
        if before["config"].get(k) != after["config"].get(k):
            return f"config.{k} {before['config'].get(k)!r} -> {after['config'].get(k)!r}"
    a, b = before.get("hooks", []), after.get("hooks", [])
    if a != b:
        added, removed = sorted(set(b) - set(a)), sorted(set(a) - set(b))
        return (f"a hook a replay does not run was {'registered' if added else 'removed'}: "
                f"{(added or removed)[0]}")
    a, b = before.get("code", []), after.get("code", [])
    if a != b:
        return f"a module class's forward was replaced: {sorted(set(b) - set(a) or set(a) - set(b))[0]}"
    x, y = before.get("numerics", {}), after.get("numerics", {})
    for k in sorted(set(x) | set(y)):
        if x.get(k) != y.get(k):
            return f"torch's {k} setting {x.get(k)!r} -> {y.get(k)!r} (process-wide numerics)"
    if "whole" in before and "whole" in after:  # every object read whole (hf_unlearn.trace.digests)
        what = digests.describe_difference(before["whole"], after["whole"])
        if what:
            return ("the " + what) if what.startswith("optimizer") else what
    return None


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of a floating tensor is finite, exactly, at the cost of one read: a NaN or an infinity
    makes the sum non-finite (NaN propagates, an infinity stays one or meets its opposite as NaN), so a finite sum
    proves every element finite; a non-finite sum (an overflow of finite values included) is settled element by
    element. ``torch.isfinite(t).all()`` writes a boolean tensor as large as ``t``: 20x the time on the CPU."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    if bool(torch.isfinite(t.detach().sum())):
        return True
    return bool(torch.isfinite(t).all())


def sample_values(tensors) -> dict:
    """A strided sample of every tensor's values, concatenated per dtype."""
    groups: dict = {}
    with torch.no_grad():  # one strided view per tensor, no autograd view tracking: 3x cheaper, the same values
        for _, t in tensors:
            n = t.numel()
            step = max(1, n // SAMPLES)
            if t.is_contiguous():
                part = t.as_strided((min(SAMPLES, -(-n // step)),), (step,))
            else:
                part = t.detach().reshape(-1)[::step][:SAMPLES]
            groups.setdefault(t.dtype, []).append(part)
    return {dtype: torch.cat(parts) for dtype, parts in groups.items()}


class Snapshot(NamedTuple):
    storage: dict  # name -> (data_ptr, version)
    samples: dict
    controls: dict
    exact: dict | None = None  # name -> exact checksum (tensor_checksums), when taken


def snapshot(model, optimizer, grads: bool = False, buffers: bool = True, exact: bool | str = False,
             controls: dict | None = None) -> Snapshot:
    """``exact``: True, exact checksums of every tensor; ``"step"``, of what a step's fingerprint reads
    (:func:`~hf_unlearn.trace.checksums.step_state_tensors`). ``controls``: already computed at this point."""
    tensors = state_tensors(model, optimizer, grads)
    if not buffers:
        names = {n for n, _ in module_tree.walk(model).buffers}
        tensors = [(n, t) for n, t in tensors if n not in names]
    kept = [(n, t) for n, t in tensors if not n.endswith("(gradient)")]  # the same set at every point
    if exact == "step":
        sums = tensor_checksums(step_state_tensors(model))
    else:
        sums = tensor_checksums(tensors) if exact else None
    controls = program_controls(model, optimizer) if controls is None else {**controls}
    return Snapshot({n: (t.data_ptr(), t._version) for n, t in tensors}, sample_values(kept), controls, sums)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality: a NaN a run trained to is unchanged when its bits are (``torch.equal`` says NaN != NaN,
    which made every step after a divergence look like an edit through ``.data``)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def describe_change(before: Snapshot, after: Snapshot) -> str | None:
    """The first difference between two snapshots, in words (None when they agree; ``training`` flags aside)."""
    what = describe_controls_change(before.controls, after.controls, modes=False)
    if what:
        return what
    for name, (ptr, version) in (() if before.storage == after.storage else before.storage.items()):
        now = after.storage.get(name)
        if now is not None and now[0] != ptr:
            return f"{name} was replaced (new storage)"
        if now is not None and now[1] != version:
            return f"{name} was edited in place"
    new = [n for n in after.storage if n not in before.storage and "(gradient)" not in n]
    if new:
        return f"{new[0]} appeared"
    if before.exact is not None and after.exact is not None:
        for name, value in (() if before.exact == after.exact else before.exact.items()):
            if name in after.exact and after.exact[name] != value:
                return f"the values of {name} changed (an edit through .data, which bumps no version counter)"
        return None
    for dtype, values in before.samples.items():
        now = after.samples.get(dtype)
        if now is None or now.shape != values.shape or not _same_bits(now, values):
            return f"the values of the {str(dtype).removeprefix('torch.')} tensors changed (an edit through .data)"
    return None


def step_fingerprint(controls: dict, state: str, plan_lrs: list[float], scope: str = STEP_SCOPE) -> dict:
    """What the plan keeps of optimizer step s: the controls digest as ``optimizer.step()`` ran (and the learning
    rates when they are not the plan's), and the exact digest of the state right after it (:func:`state_digest`,
    over ``scope``: :data:`~hf_unlearn.trace.checksums.STEP_SCOPE`, kept as ``"k"``)."""
    fp = {"c": controls_digest(controls), "s": state}
    if scope != "all":
        fp["k"] = scope
    if "whole" in controls:
        fp["w"] = digests.state_digest_of(controls["whole"])  # the whole program as the step ran (hf_unlearn.trace.digests)
    lrs = [g.get("lr") for g in controls["groups"]]
    if lrs != plan_lrs:
        fp["lr"] = lrs
    return fp


def plan_lrs(entry, groups: int) -> list[float]:
    """The learning rates the plan records for a segment, one per param group."""
    return list(entry.group_lrs) if entry.group_lrs else [entry.lr] * groups


def compare_fingerprint(step: int, recorded: dict, actual: dict | None, state: bool, who: str) -> None:
    """Refuse (:class:`FidelityError`) when a replay's fingerprint of ``step`` differs from the recorded one
    (``state``: compare the state digest and the gradients' too, i.e. the step is before the first affected one;
    the gradients' where both sides computed it: the main process, a run recorded with it)."""
    if actual is None or "c" not in recorded or "c" not in actual:
        return  # a step that took no optimizer step (every slot deleted)
    what = side = None
    if recorded.get("lr") != actual.get("lr"):
        what = (f"learning rates at optimizer.step() ({actual.get('lr') or 'the plan’s'} vs recorded "
                f"{recorded.get('lr') or 'the plan’s'})")
    elif recorded.get("c") != actual.get("c"):
        what = ("program controls as optimizer.step() ran (param-group settings, trainable parameters, module "
                "modes or attributes, config, hooks the replay does not run, the functions module classes run as "
                "forward)")
    elif state and recorded.get("s") != actual.get("s"):
        what = ("state after the optimizer step (exact digest of the trainable parameters and buffers; a frozen "
                "weight or an optimizer moment shows here at the first step that reads it)" if
                recorded.get("k") == STEP_SCOPE else
                "state after the optimizer step (exact digest of parameters, buffers and optimizer state)")
        if "g" in recorded and "g" in actual:  # the gradients optimizer.step() used: which side of it differs
            side = ("the gradients optimizer.step() used already differ (the forward or the backward)"
                    if recorded["g"] != actual["g"] else
                    "the gradients optimizer.step() used are the recording's (the optimizer's update differs: "
                    "its settings, state or code)")
    elif state and "g" in recorded and "g" in actual and recorded["g"] != actual["g"]:
        # the parameters can match while the gradients do not: a learning rate of 0 (a warmup's first step) writes
        # only the moments, which the state digest reads at the next step; the gradients say it at this one
        what = ("gradients optimizer.step() used (exact digest; the trainable parameters matched: the step wrote "
                "only what later steps read, e.g. a learning rate of 0)")
    if what:
        raise FidelityError(f"the replay engine does not reproduce the recorded run at optimizer step {step}: {who}'s "
                            f"{what} differ from the recording's per-step fingerprint{f'; {side}' if side else ''}; "
                            "stopped, a deletion from this engine would not be this run's counterfactual")


# ---- what the record says -----------------------------------------------------------------------------------
def _final(header: dict) -> dict:
    return ((header.get("fidelity") or {}).get("guards") or {}).get("final") or {}


def recorded_fingerprints(plan, header: dict) -> dict[int, dict]:
    """Step -> the recording's fingerprint of that step (the plan keeps step s's in step s + 1's first entry, the
    header the last step's). ``plan``: the whole plan (a run cut at its kept step keeps it as ``served_plan``)."""
    out = {e.step - 1: e.extra["fp"] for e in plan if e.j == 0 and "fp" in e.extra}
    final = _final(header)
    if final.get("fp") is not None:
        out[final["step"]] = final["fp"]
    return out


def fingerprint_scope(fps: dict[int, dict]) -> str:
    """What the state digests of a run's fingerprints cover (:data:`~hf_unlearn.trace.checksums.STEP_SCOPE`, or
    "all" for a run recorded before it): a replay computes its own over the same tensors."""
    return next((fp.get("k", "all") for fp in fps.values() if "s" in fp), STEP_SCOPE)


def program_changes(plan, header: dict) -> list[dict]:
    """Every change the recording found outside its record: ``{"step", "what", "by"}``, in step order."""
    out = [c for e in plan if e.j == 0 for c in e.extra.get("changed", [])] + _final(header).get("changed", [])
    return sorted(out, key=lambda c: c["step"])


def describe_program_change(change: dict) -> str:
    by = f" by {change['by']}" if change.get("by") else " by code outside the recorded callbacks"
    return f"at optimizer step {change['step']}{by}: {change['what']}"


def program_refusal(run, start_step: int) -> str | None:
    """Why a replay from ``start_step`` cannot reproduce the run (a program change at or after it), or None."""
    changes = program_changes(run.served_plan or run.plan, run.header)
    late = [c for c in changes if c["step"] < run.total_steps and (c["step"] >= start_step or c.get("persistent"))]
    if not unproven_steps(run.header, start_step, run.total_steps, fresh_start=False):
        # the proof shows the engine reproduces the run with the change, at every step the replay runs; a fresh
        # start at start_step is proven by the replay itself before any deleted row trains (else it is refused, or,
        # not proven, never VERIFIED: hf_unlearn.trace.proven.replay_start). On the recorded rows only, unless the
        # replay makes the change too or it is neutral on any rows
        doubtful = unproven_changes(late, run.header, start_step, run.total_steps)
        if not doubtful:
            return None
        return (f"the run changed outside its record {describe_program_change(doubtful[0])}"
                + (f" (and {len(doubtful) - 1} more change(s))" if len(doubtful) > 1 else "")
                + "; the proof shows the engine reproduces the run without it on the rows the run trained on, not on "
                "a deletion's (the change may act on other rows: a loss that differs on a row whose labels are all "
                "-100, a clipping threshold only a counterfactual step reaches), so a replay without it is not "
                "proven to be the counterfactual of the run that trained; record the run again without the change, "
                "or with the callback importable, its attributes JSON and its events among those replays run")
    if not late:  # steps the proof does not cover: no deletion passing them is VERIFIED (hf_unlearn.trace.proven)
        return None
    return (f"the run changed outside its record {describe_program_change(late[0])}"
            + (f" (and at {len(late) - 1} later step(s), the last {late[-1]['step']})" if len(late) > 1 else "")
            + (f"; a replay from step {start_step} would run without it (no checkpoint holds a trainable set or a "
               "module attribute), so its result is not the counterfactual of the run that trained"
               if late[0].get("persistent") else
               f"; a replay from step {start_step} would pass it without the change, so its result is not the "
               f"counterfactual of the run that trained: a deletion needs a kept checkpoint after step "
               f"{late[-1]['step']} (only deletions of rows served after it)")
            + "; or record the run again with the callback importable, its attributes JSON and its events among "
            "those replays run")


def guard_coverage(plan, header: dict, total: int | None = None) -> str | None:
    """What the recording's per-step guards did not cover of steps ``0..total - 1`` (None when they covered every
    one); ``plan``: the whole plan."""
    guards = (header.get("fidelity") or {}).get("guards")
    total = (plan[-1].step + 1 if plan else 0) if total is None else total
    if not guards:
        return ("the recording ran no per-step guards (trace_guards=False, or recorded before them): that nothing "
                "outside the record changed the run after the self-check's steps is not proven")
    missing = sorted(set(range(total)) - set(recorded_fingerprints(plan, header)))
    if missing:
        return (f"the recording's per-step guards did not cover optimizer step(s) {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''} (a resumed recording?): that nothing outside the record changed "
                "the run there is not proven")
    return None


# ---- what a proof shows of a change ---------------------------------------------------------------------------
# Attributes whose change computes the same numbers on any rows (activation checkpointing recomputes the same forward):
# an allowlist, so what is not on it, when a replay does not make it, is shown neutral only on the rows the run
# trained on (the proof's), not on a deletion's (a loss that differs only on a row whose labels are all -100).
NEUTRAL_ON_ANY_ROWS = frozenset({"gradient_checkpointing", "_gradient_checkpointing_func", "_require_grads_hook",
                                 "_require_grads_hooks"})


def _attribute(path: str) -> str:
    return path.rsplit(": ", 1)[-1].split(".", 1)[0]


def _scope(before: Snapshot, after: Snapshot) -> dict:
    """How a proof can show a change reproduced (written into the change record): ``seen`` says where the guards saw
    it (``tensors``: the state, which the proof's fingerprints compare; ``controls``: the controls digest, also
    compared; ``program``: the whole-program digest only, which replays do not compute), ``any_rows`` that every
    difference is on :data:`NEUTRAL_ON_ANY_ROWS` and no tensor changed."""
    a, b = before.controls, after.controls
    plain = describe_controls_change({k: v for k, v in a.items() if k != "whole"},
                                     {k: v for k, v in b.items() if k != "whole"}, modes=False)
    wa, wb = a.get("whole") or {}, b.get("whole") or {}
    seen = "controls" if plain else "program" if wa != wb else "tensors"
    if seen == "tensors" or before.storage != after.storage or (
            before.exact is not None and after.exact is not None and before.exact != after.exact):
        return {"seen": seen}
    same = all(a.get(k) == b.get(k) for k in set(a) | set(b) if k not in ("modules", "whole"))
    mods = [(n, k) for n in set(a.get("modules", {})) | set(b.get("modules", {}))
            for k in set(a["modules"].get(n, {})) | set(b["modules"].get(n, {}))
            if a["modules"].get(n, {}).get(k) != b["modules"].get(n, {}).get(k) and k != "training"]
    whole = [k for k in set(wa) | set(wb) if wa.get(k) != wb.get(k)]
    ok = same and all(k in NEUTRAL_ON_ANY_ROWS for _, k in mods) and all(_attribute(k) in NEUTRAL_ON_ANY_ROWS
                                                                         for k in whole)
    return {"seen": seen, **({"any_rows": True} if ok else {})}


def unproven_changes(changes: list[dict], header: dict, start: int, total: int) -> list[dict]:
    """Of the program changes a replay from ``start`` to ``total`` passes, those a proof does not show it reproduces
    on a deletion's rows. The proof replays the recorded rows: a change the replay does not make (a watched callback's,
    one only the whole-program digest saw, or one at a step where the proof's controls differed from the recording's)
    that still matched every step was neutral on those rows only, and a deletion trains on others. Reproduced: a
    change on :data:`NEUTRAL_ON_ANY_ROWS` alone, or one made while the step ran (between the batches' fetch and
    ``optimizer.step()``: the recorded trainer's own ``compute_loss``, which replays run; not a dataset's
    ``__getitem__``, which they do not) and seen in the state or the controls, which the proof's replay matched (a
    controls change the proof's replay did not make shows as other controls at its step: ``neutral_controls``); or
    one process's tensors written otherwise than process 0's, which the proof's replay, gathering every process's
    state, matched (a recorded callback acting on one process, which replays run there too)."""
    from .proven import neutral_controls, ranges

    neutral = {s for s in neutral_controls(header) if start <= s < total}
    out = [c for c in changes if not c.get("any_rows") and
           (c.get("by") or not (c.get("in_step") or c.get("across_processes"))
            or c.get("seen") not in ("tensors", "controls")
            or (c["seen"] == "controls" and c["step"] in neutral))]
    # the proof's replay ran other controls than the recording where no change on the allowlist explains it: a
    # difference only a replay makes (code that behaves otherwise in a replay), neutral on the recorded rows only
    explained = [c["step"] for c in changes if c.get("any_rows")]
    unexplained = sorted(s for s in neutral if not any(e <= s for e in explained))
    if unexplained:
        out.append({"step": unexplained[0], "what": "the proof's replay ran other program controls than the "
                    f"recording while its state matched (at optimizer step(s) {ranges(unexplained)}: a difference only "
                    "a replay makes)"})
    return out


# ---- the recording's live guard -------------------------------------------------------------------------------
def _plain_numbers(trainer) -> dict:
    """The trainer instance's plain numbers and strings (its counters included: compared only around one event)."""
    if trainer is None:
        return {}
    return {k: v for k, v in vars(trainer).items() if type(v) in (int, float, str) and not k.startswith("_trace")}


def _persistence(before: Snapshot, after: Snapshot, what: str) -> dict:
    """A change of the trainable set, a module attribute or the config stays in the model, and no checkpoint holds
    it (a replay rebuilds the model as it was when training started): no replay start after it helps."""
    if describe_controls_change(before.controls, after.controls, modes=False) == what and \
            not what.startswith(("param group", "the optimizer")):
        return {"persistent": True}
    return {}


def _one_walk(method):
    """A guard check, which runs no user code: one walk of the module tree for all it reads
    (:func:`hf_unlearn.trace.module_tree.held`)."""

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        with module_tree.held(self.model):
            return method(self, *args, **kwargs)

    return checked


class ProgramGuard:
    """Watches a recording: compares the live state and controls at the points the module docstring names, keeps
    each step's fingerprint and every program change until the recorder writes them into the plan."""

    def __init__(self, model, optimizer, watched: dict, context=None):
        self.model, self.optimizer = model, optimizer
        self.context = context  # () -> program_state's other objects (args, trainer, callbacks, data, collator)
        self.watched = watched  # id(callback) -> its callback_spec (recorded or watched)
        self.step = 0
        self.ref: Snapshot | None = None
        self.controls: dict | None = None
        self.fps: dict[int, dict] = {}
        self.pending: list[dict] = []
        self.recorded: list[dict] = []  # every change written to the plan (said when training ends)
        self.plan_lrs: list[float] | None = None
        self.last_read: str | None = None  # what the last watched event run by around() read of tensor values
        self.code: dict | None = None  # the code the first step ran, sealed (hf_unlearn.trace.program_code)
        inner = getattr(optimizer, "optimizer", optimizer)
        self._hooks = [inner.register_step_pre_hook(lambda *a: self.before_step()),
                       inner.register_step_post_hook(lambda *a: self.after_step())]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    @_one_walk
    def _snapshot(self, grads: bool = False, exact: bool = False, whole: bool = True) -> Snapshot:
        """``whole=False``: the whole-program state is carried over from the reference (read once per step)."""
        now = snapshot(self.model, self.optimizer, grads=grads, exact=exact)
        if self.context is not None:
            if whole or self.ref is None or "whole" not in self.ref.controls:
                now.controls["whole"] = digests.program_state(self.model, self.optimizer, **self.context())
            else:
                now.controls["whole"] = self.ref.controls["whole"]
        return now

    def _compare(self, now: Snapshot, step: int, in_step: bool = False) -> bool:
        """``in_step``: the check right before ``optimizer.step()``, so a change since the batches were fetched was
        made by code that runs the step (the recorded trainer's ``compute_loss``, which replays run too)."""
        what = describe_change(self.ref, now) if self.ref is not None else None
        if what:
            self.pending.append({"step": step, "what": what, **_persistence(self.ref, now, what),
                                 **_scope(self.ref, now), **({"in_step": True} if in_step else {})})
        return bool(what)

    def start(self) -> None:
        """Before the first step: a user hook already registered is code a replay does not run."""
        hooks = program_hooks(self.model) + digests.unreplayed_methods(
            (self.context() if self.context is not None else {}).get("trainer"), self.optimizer)
        if hooks:
            self.pending.append({"step": 0, "what": f"a hook or function a replay does not run is set: {hooks[0]}"
                                 + (f" (and {len(hooks) - 1} more)" if len(hooks) > 1 else ""), "persistent": True})

    def resume(self, step: int, carried: dict, where) -> None:
        """A recording resumed at ``step``: the fingerprint and program changes of step ``step - 1`` that the first
        process wrote into the plan (``carried``: the dropped first entry of ``step``'s) are kept, once the state the
        resume loaded is the one that fingerprint digested (an edited or foreign Trainer checkpoint is refused here,
        whether or not the trace kept its own checkpoint at ``step``)."""
        fp = carried.get("fp")
        if fp is not None and fp.get("k") == STEP_SCOPE and "s" in fp:
            now = exact_digest(all_shards(tensor_checksums(step_state_tensors(self.model)), self.model))
            if now != fp["s"]:
                raise UnlearnError(f"the state resumed from {where} at step {step} is not the recorded state after "
                                   f"optimizer step {step - 1} (the trainable parameters or buffers differ from the "
                                   "recording's fingerprint): the trace cannot continue from it; resume from the "
                                   "checkpoint the run saved at that step")
            self.fps[step - 1] = fp
        self.pending += carried.get("changed", [])

    @_one_walk
    def between_steps(self, step: int, lrs: list[float]) -> None:
        """When step ``step``'s batches are fetched (before its checkpoint): a change since the last step is step
        ``step - 1``'s (the checkpoint at ``step`` holds it). The param groups' settings are the scheduler's here
        and the plan records them, so they are the reference ``optimizer.step()`` is compared with. A cheap check
        (storage, version counters, sampled values, controls); the exact one runs at ``optimizer.step()``."""
        now = self._snapshot(exact=self.ref is None, whole=False)  # the first reference is exact
        if self.ref is not None:
            self.ref = self.ref._replace(controls={**self.ref.controls, "groups": now.controls["groups"]})
        if self._compare(now, step - 1):
            now = self._snapshot(exact=True, whole=False)  # the change is step - 1's: the exact reference from here
        elif self.ref is not None:
            now = now._replace(exact=self.ref.exact)
        self.ref = now
        self.step, self.plan_lrs = step, lrs

    @_one_walk
    def before_step(self) -> None:
        """Right before ``optimizer.step()``: the whole program (read once per step), a cheap check of the state
        (storage, version counters, samples: the exact checksums of the trainable parameters are read once per
        step, after it; a watched callback's edits are checked exactly around its events) and the exact
        checksums of the gradients ``optimizer.step()`` is about to use."""
        now = self._snapshot()
        if self.code is None:
            ctx = self.context() if self.context is not None else {}
            self.code = sealed_code(self.model, ctx.get("trainer"), ctx.get("callbacks") or (), self.optimizer)
        self.grads = tensor_checksums(gradient_tensors(self.model))
        self._compare(now, self.step, in_step=True)
        self.ref = now
        self.controls = now.controls

    @_one_walk
    def after_step(self) -> None:
        """Right after ``optimizer.step()``: the step's fingerprint (the exact checksums of what the step wrote:
        :func:`~hf_unlearn.trace.checksums.step_state_tensors`) and the reference for the next check; its controls
        are the ones ``optimizer.step()`` ran with (a change the step made shows at the next check, as this
        step's)."""
        now = snapshot(self.model, self.optimizer, exact="step", controls=self.controls)  # "whole" read before
        if "whole" in now.controls:  # the optimizer's structure after its step (state keys appear at the first)
            now.controls["whole"] = {**now.controls["whole"],
                                     **digests.optimizer_structure(self.model, self.optimizer, digests.Digester())}
        sums = all_shards(now.exact, self.model)  # FSDP2: with every process's shards (they join in, see sharding)
        grads = getattr(self, "grads", {})  # this process's (under FSDP2: its shards; the others' are not gathered)
        if self.controls is not None:
            fp = step_fingerprint(self.controls, exact_digest(sums), self.plan_lrs or [], STEP_SCOPE)
            if grads:
                fp["g"] = exact_digest(grads)  # the gradients optimizer.step() used
            self.fps[self.step] = fp
        self.ref = now

    def around(self, callback, event: str, call, state_view=None):
        """Run one watched callback's event; a change it makes is the program's if it is recorded, else a change
        (exact checksums before and after, gradients included); a change before it, since the last check, is code
        outside the recorded callbacks (an observer's event, a hook). ``state_view``: the recorded callback's
        :class:`StateView`, whose reads of fields a replay does not set refuse the run's replays."""
        spec = self.watched[id(callback)]
        before = self._snapshot(grads=True, exact=True)
        if self.ref is not None:  # the scheduler sets the param groups between steps: the plan records them
            self.ref = self.ref._replace(controls={**self.ref.controls, "groups": before.controls["groups"]})
            self._compare(before, self.step)
        reads = None if spec["replayable"] else ValueReads()
        self.last_read = None
        trainer = (self.context() or {}).get("trainer") if self.context is not None else None
        numbers = _plain_numbers(trainer)  # the trainer's counters move between events, never inside one
        if reads is None:
            result = call()
        else:
            with reads:
                result = call()
        after = self._snapshot(grads=True, exact=True)
        what = describe_change(before, after)
        now = _plain_numbers(trainer)
        moved = [k for k in sorted(set(numbers) | set(now)) if numbers.get(k) != now.get(k)]
        by = f"{type(callback).__qualname__}.{event} ({spec.get('why')})"
        if what and not spec["replayable"]:
            self.pending.append({"step": self.step, "what": what, "by": by, **_persistence(before, after, what),
                                 **_scope(before, after)})
        elif moved and not spec["replayable"]:  # a number on the trainer its code may read (a loss weight): it stays
            # on the trainer, which a replay builds afresh
            k = moved[0]
            what = f"trainer.{k} {numbers.get(k)!r} -> {now.get(k)!r} (a number the trainer's code may read)"
            self.pending.append({"step": self.step, "what": what, "by": by, "persistent": True, "seen": "program"})
        if reads is not None:
            view = None if reads.first else held_view(callback)
            if view:  # reads and writes through it run no torch function
                reads.first = f"a numpy view of a tensor's memory it holds, {view}"
            self.last_read = reads.first
        if not what and reads is not None and reads.first and not any(c["step"] == self.step and c.get("by") == by
                                                           for c in self.pending):
            # a no-op here, on the recorded values; on a deletion's it may act, and replays do not run it
            self.pending.append({"step": self.step, "by": by, "read": True, "what": (
                f"it read values a deletion changes ({reads.first}) and changed nothing; replays do not run it, so "
                "what it does with a deletion's values (an edit only of values it did not expect) is not shown")})
        read = sorted(state_view.unreproduced) if state_view is not None else []
        if read:
            self.pending.append({"step": self.step, "by": f"{type(callback).__qualname__}.{event}", "persistent": True,
                                 "what": f"it read state.{read[0]}, which replays do not reproduce (they set "
                                         f"{', '.join(sorted(REPRODUCED_STATE))})"})
        self.ref = after
        return result

    def flush(self, step: int) -> dict:
        """Step ``step``'s fingerprint and the changes found up to it, for the plan (or the header's final entry)."""
        out = {}
        if step in self.fps:
            out["fp"] = self.fps.pop(step)
        changed = [c for c in self.pending if c["step"] <= step]
        if changed:
            out["changed"] = changed
            self.recorded += changed
            self.pending = [c for c in self.pending if c["step"] > step]
        return out

    def warn_changes(self, where) -> None:
        """Say when training ends what will block deletions (the plan holds every change; this is the first)."""
        if self.recorded:
            import warnings

            first = sorted(self.recorded, key=lambda c: c["step"])[0]
            more = f" (and {len(self.recorded) - 1} more)" if len(self.recorded) > 1 else ""
            warnings.warn(f"{where}: the run changed outside its record {describe_program_change(first)}{more}; "
                          "deletions whose replay passes such a step will be refused (see the plan's program "
                          "changes: hf_unlearn.trace.guards.program_changes)", stacklevel=3)
