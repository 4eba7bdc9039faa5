"""The code the recorded run ran, compared in the deleting process before any compute.

A replay rebuilds the model, the trainer and the recorded callbacks by name in the deleting process and runs the
code those names hold *there*. A function the training script monkeypatched before ``train()`` (one of
``torch.nn.functional``, ``transformers.loss.loss_utils.fixed_cross_entropy``, a model class's method) is code the
deleting process may lack. The per-step guards digest it in the recording process only, and the environment probe and
the proof compare numbers on the recorded rows only: a patch that changes nothing on them (it acts only on a row
whose labels are all -100, which a deletion makes) left every check equal, and a deletion VERIFIED against the
counterfactual of a program the user never ran.

So the recording seals, at its first optimizer step, a digest of the code of every class its model is made of (the
unsharded classes under FSDP2, and ``FSDPModule``), of ``torch.Tensor``, of the modules those classes come from and
the modules a forward calls (:data:`~hf_unlearn.trace.digests.CODE_MODULES`), of the optimizer's class and the
modules its classes come from (``torch.optim.adam``: the function ``Adam.step`` calls), of the recorded trainer
class (the user's, e.g. ``trl.SFTTrainer``, which replays compose with their own classes: not the recording's
subclass) and the modules of its classes, of ``Accelerator``, of the recorded callbacks' classes (replays run them
again), of a DPO reference model's classes, and of the namespaces a step looks functions up in by name
(:data:`STEP_MODULES`: ``torch.rsqrt``, ``torch._foreach_*``, ``torch.autograd.backward``), the registries of
functions those modules hold included (``ALL_ATTENTION_FUNCTIONS``, ``LOSS_MAPPING``: looked up by name at every call);
each by an importable
``module:qualname`` (the header's ``fidelity.guards.code``). Every deleting process recomputes them by name (a digest of code objects: milliseconds)
and refuses, before any compute, naming the first entries that differ.

What is left out, and why: the training script's own module (``__main__``, which is the ``hf-unlearn`` command in a
deleting process; a class it defines is compared where the deleting process defines it, and named as missing where
not); classes defined inside a function (no name to find them by); and what frameworks set on classes as a side
effect of ordinary use (:data:`~hf_unlearn.trace.digests.SIDE_EFFECT_ATTRIBUTES`: transformers' ``smart_apply``;
:data:`~hf_unlearn.trace.digests.PROFILE_WRAPPER`: torch's wrapper of an optimizer class's ``step``). The processes of a launch
are compared with each other at every recorded step by the guards (a rank-local patch is a change). The seal is
compared again when the recording ends (:func:`code_changed`: a patch applied while training) and when it is resumed
(:func:`resumed_code_checked`, on every process of the launch: one seal covers every launch of a run). It is written
into the run's header as soon as the first optimizer step ends, so a launch killed afterwards leaves it for its resume
to compare with; a resume of a launch that left none (it ran without guards, or was killed under a release that
sealed only at the end) seals from the resume step on, and a deletion whose rows first train before it is refused
(:func:`unsealed_code_refusal`).
"""

from __future__ import annotations

import importlib
import os
import re
import sys

import torch

from ..errors import UnlearnError
from .digests import CODE_MODULES, STEP_MODULES, Digester, _class_code, _module_code  # noqa: F401 - re-exported
from .stack import recorded_default_dtype
from .trainers import recorded_trainer, recorded_trainer_class

SCRIPT = "__main__"
# What a code digest covers, numbered: a run sealed under another number is compared by what it covered, which this
# release cannot recompute (2: the registries of functions a module holds, and the kernels of torch's operators
# registered from Python). Bumped with every such change.
CODE_FORMAT = 2
# The seal's entry for kernels of torch's own operators registered through ``torch.library`` from outside torch
KERNELS = "kernels torch.library"
# The seal's entry for autograd's process-wide saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``)
SAVED_TENSOR_HOOKS = "hooks torch.autograd.graph.saved_tensors_hooks"


def saved_tensor_hooks() -> str:
    """The text of the saved-tensor hooks autograd applies to every tensor a forward saves for the backward
    (``with torch.autograd.graph.saved_tensors_hooks(pack, unpack):`` around training: activation offloading or
    compression), ``"none"`` without them. They live in autograd's C++ state, where no Python namespace shows them,
    and change what every backward computes with: a training script that set them ran code a deleting process
    without them does not."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    if hooks is None:
        return "none"
    d = Digester()
    return " ".join(d.text(f, 1) for f in hooks)


_OPERATOR_PREFIXES = ("aten::",)  # not prims: torch registers its own through torch.library as it imports them


def user_kernels() -> str:
    """The kernels of torch's own operators (``aten``) that code outside torch registered with the dispatcher
    (``Library("aten", "IMPL").impl("neg", ...)``, ``@torch.library.impl``, ``torch._C._dispatch_library``, on a
    backend key or an alias such as ``CompositeImplicitAutograd``), as ``ns::op/DispatchKey`` joined by spaces
    (``"none"``: none). Such a kernel replaces what every call of the operator runs, below any Python namespace a
    digest reads (Llama's ``rotate_half`` calls ``aten::neg``), so a training script that registered one ran code a
    deleting process without it does not. Read from the dispatcher itself, every ``aten`` operator (about 3,000,
    about 0.1 s: torch's own registrations counted in C), which says where each kernel was registered: torch's own
    (its C++ sources, its package's files except the user-facing ``torch.library`` modules) are not the program's;
    Meta kernels (shapes, no numbers) aside. The file a kernel names is the registering code's word
    (``torch._C._dispatch_library(..., file, line)``): a kernel registered over another (the other kept inactive,
    which torch's own never are) is the program's whatever file it names, and one that names torch's own Python files
    on a key that computes on the CPU or for every backend too (torch registers none there)."""
    own = os.path.dirname(torch.__file__) + os.sep
    built = [f"registered at {root}" for root in _build_roots()]
    found = []
    for op in sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(_OPERATOR_PREFIXES)):
        dump = torch._C._dispatch_dump(op)
        if dump.count("registered at ") == sum(map(dump.count, built)) and " (inactive)" not in dump:
            continue  # every kernel torch's own C++ (counted in C: most operators, parsed no further)
        for line in dump.splitlines():
            m = _REGISTERED.match(line)
            if m is None or m.group(1) == "Meta":
                continue
            where, key = m.group(2), m.group(1)
            if " (inactive)" in line.split(":", 1)[0]:  # a kernel registered over this one, whatever file it names:
                found.append(f"{op}/{key}")  # torch registers none over its own (no inactive kernel in a clean one)
                continue
            if any(part in where for part in _TORCH_SOURCES) or (
                    where.startswith(own) and os.path.basename(where) != "library.py"
                    and f"{os.sep}_library{os.sep}" not in where and not _COMPUTES_HERE.match(key)):
                continue
            found.append(f"{op}/{key}")
    return " ".join(sorted(set(found))) or "none"


# a dispatcher dump's kernel line: "CPU: registered at FILE:LINE :: ...", "CompositeImplicitAutograd[alias]: ...",
# "CPU (inactive): ..." (a kernel registered over another keeps the other, inactive)
_REGISTERED = re.compile(r"^(\w+)(?:\[alias\])?(?: \(inactive\))?: registered at (.+?):\d+(?: ::|$)")
# the keys of kernels that compute on the CPU, or for every backend: torch registers none of them from its own Python
# files (only CUDA and MPS ones, 2.13), so such a kernel that names one of those files as where it was registered (a
# name the registering code gives itself: torch._C._dispatch_library(..., file, line)) is the program's
_COMPUTES_HERE = re.compile(r"^(CPU|Composite\w*|Autograd\w*|Math|Default\w*)$")
# where torch's own C++ registrations say they were made (its source tree at build time)
_TORCH_SOURCES = (f"{os.sep}aten{os.sep}src{os.sep}", f"{os.sep}torch{os.sep}csrc{os.sep}")


def _build_roots() -> list[str]:
    """The source-tree roots torch's own C++ kernels were registered from (``/__w/pytorch/pytorch/`` for a wheel
    built on GitHub's runners), read from the dispatcher's entries of one operator: the fast path of
    :func:`user_kernels` counts registrations under them without parsing each line."""
    roots = set()
    for line in torch._C._dispatch_dump("aten::add.Tensor").splitlines():
        m = _REGISTERED.match(line)
        if m is None:
            continue
        for part in _TORCH_SOURCES:
            if part in m.group(2):
                roots.add(m.group(2).split(part, 1)[0] + os.sep)
    return sorted(r for r in roots if not any(r != o and r.startswith(o) for o in roots))  # counted once each
# the seal's entries read from process-wide state rather than found by name
_PROCESS_WIDE = {KERNELS: user_kernels, SAVED_TENSOR_HOOKS: saved_tensor_hooks}


def _unsharded(cls: type) -> list[type]:
    """``cls``, or for a class FSDP2's ``fully_shard`` made (``FSDPLlamaDecoderLayer``, created at run time under no
    importable name) the class it subclassed and ``FSDPModule``, which a replay's sharding makes again."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without torch.distributed
        return [cls]
    if not issubclass(cls, FSDPModule):
        return [cls]
    return [next(b for b in cls.__mro__[1:] if not issubclass(b, FSDPModule)), FSDPModule]


def _reference_modules(trainer) -> list:
    """The modules of a preference trainer's reference model (DPO's ``ref_model``, unwrapped), whose forward every
    step runs: a class the policy does not use (a reference of another architecture) is code the run ran too."""
    ref = getattr(trainer, "ref_model", None)
    if not isinstance(ref, torch.nn.Module):
        return []
    unwrap = getattr(getattr(trainer, "accelerator", None), "unwrap_model", None)
    return list((unwrap(ref) if unwrap is not None else ref).modules())


def _named(cls: type) -> str | None:
    """``module:qualname`` of a class a process can find again by name (None: defined inside a function)."""
    if "<" in cls.__qualname__:
        return None
    return f"{cls.__module__}:{cls.__qualname__}"


def sealed_code(model, trainer=None, callbacks=(), optimizer=None) -> dict[str, str]:
    """``{"class module:qualname" | "module name": digest}`` of the code this process runs for ``model`` (see the
    module docstring); what the recording seals at its first optimizer step."""
    classes: dict[type, None] = {}
    for m in (*model.modules(), *_reference_modules(trainer)):
        classes.update(dict.fromkeys(_unsharded(type(m))))
    classes[torch.Tensor] = None  # a method patched on it runs in every forward
    # the optimizer's class, and the modules of its classes (``Adam.step`` calls ``torch.optim.adam.adam``)
    opt = [c for c in type(getattr(optimizer, "optimizer", optimizer)).__mro__ if c is not object] if optimizer else []
    classes.update(dict.fromkeys(opt[:1]))
    # the trainer's classes' modules (the functions its step calls), not the recording's own subclass's
    steps = [c for c in recorded_trainer_class(type(trainer)).__mro__ if c is not object] if trainer is not None else []
    classes.update(dict.fromkeys(steps[:1]))
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        classes[type(accelerator)] = None  # its backward and clip_grad_norm_ run every step
    classes.update(dict.fromkeys(type(cb) for cb in callbacks))
    names = [n for n in (_named(c) for c in classes) if n is not None]
    # the modules a model's classes come from (the functions their forward calls), not the callbacks'
    modules = {c.__module__ for c in [*classes, *opt] if (issubclass(c, torch.nn.Module) or c in opt)
               and c.__module__ != SCRIPT}
    modules |= {c.__module__ for c in steps if c.__module__ != SCRIPT and not c.__module__.startswith("hf_unlearn.")}
    modules |= {*CODE_MODULES, *STEP_MODULES}
    return code_now([f"class {n}" for n in names] + [f"module {m}" for m in sorted(modules) if m in sys.modules]
                    + [KERNELS, SAVED_TENSOR_HOOKS])


def _find(name: str):
    """The class or module an entry names, in this process; a string saying why not where it cannot be found."""
    kind, _, what = name.partition(" ")
    module, _, qual = what.partition(":")
    if module == SCRIPT:  # never imported: this process's __main__ is its own
        found = sys.modules.get(SCRIPT)
    else:
        try:
            found = sys.modules.get(module) or importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - not importable here: a difference, named
            return f"not importable here ({type(e).__name__})"
    if kind == "module":
        return found
    for part in qual.split("."):
        found = getattr(found, part, None)
        if found is None:
            return "not defined here" + (" (a class of the training script: run the deletion from it)"
                                         if module == SCRIPT else "")
    return found if isinstance(found, type) else "not a class here"


def code_now(names) -> dict[str, str]:
    """The digests of the entries ``names`` (as :func:`sealed_code` writes them) in this process; an entry that cannot
    be found here gets the reason instead of a digest."""
    d = Digester()
    out = {}
    for name in names:
        if name in _PROCESS_WIDE:
            out[name] = _PROCESS_WIDE[name]()
            continue
        found = _find(name)
        if isinstance(found, str):
            out[name] = found
        elif name.startswith("module "):
            out[name] = _module_code(found, d)
        else:
            out[name] = _class_code(found, d)
    return out


def code_differences(header: dict) -> list[str] | None:
    """The sealed code entries whose digest differs in this process (``[]``: none), or None: the run seals none (it
    was recorded before this release, or without guards)."""
    guards = (header.get("fidelity") or {}).get("guards") or {}
    recorded = guards.get("code")
    if not recorded:
        return None
    if int(guards.get("code_format") or 1) != CODE_FORMAT:
        raise UnlearnError(
            f"the run's code seal was written by another hf_unlearn release (code digest format "
            f"{int(guards.get('code_format') or 1)}, this release computes format {CODE_FORMAT}; recorded with "
            f"hf_unlearn {(header.get('versions') or {}).get('hf_unlearn', 'unknown')}): its digests cannot be "
            "recomputed here, so the code this process runs cannot be compared with the recording's; delete with the "
            "release that recorded the run, or record it again with this one")
    with recorded_default_dtype(header):  # what a replay, which runs with it, runs
        now = code_now(recorded)
    return [k for k, v in recorded.items() if now.get(k) != v]


def check_code(run) -> dict:
    """Refuse in one line, before any compute, when this process's code differs from the recording's; returns what
    the receipt records (``{"compared": n}``, or ``{"compared": 0, "why": ...}`` for a run that seals none)."""
    header = run.header
    recorded_trainer(header)  # a trainer class not installed here: named with what to install, as replays name it
    differ = code_differences(header)
    if differ is None:
        return {"compared": 0, "why": "the run seals no code digests (recorded before they were sealed, or without "
                                      "guards): code the training script patched that changed nothing on the "
                                      "recorded rows is not compared with this process's"}
    if differ:
        code = header["fidelity"]["guards"]["code"]
        shown = ", ".join(_short(k, code) for k in differ[:3]) + (f" (and {len(differ) - 3} more)"
                                                                   if len(differ) > 3 else "")
        versions = _version_changes(header.get("versions") or {})
        raise UnlearnError(
            f"{run.path}: this process runs other code than the recorded run did: {shown}"
            + (f" (package versions differ: {versions})" if versions else "")
            + "; a replay here would compute what the training script never ran, and a patch that changes nothing on "
            "the recorded rows is invisible to the probe; refusing before any compute (run the deletion in an "
            "environment with the same code: the same package versions and the same patches applied, e.g. import "
            "the training script's patch module before the deletion, or delete from the training script itself)")
    return {"compared": len(header["fidelity"]["guards"]["code"])}


def code_changed(sealed: dict | None) -> str | None:
    """Why the code the first step ran (``sealed``) is not the code the run ended with (a callback patched
    ``torch.rsqrt`` at step 2 and left it): a replay runs one code over the whole run; None when the same."""
    if not sealed:
        return None
    now = code_now(sealed)
    differ = [k for k, v in sealed.items() if now.get(k) != v]
    if not differ:
        return None
    return (f"the code the run's first step ran changed while it trained ({_short(differ[0], sealed)}"
            f"{f' and {len(differ) - 1} more' if len(differ) > 1 else ''}): replays run one code over the whole run; "
            "apply patches before train()")


def check_resumed_code(run_path, previous: dict) -> dict:
    """A recording resumed in this process: refuse in one line when its code differs from the code the steps before
    the stop ran (the previous launch's seal, ``previous``: its header). One seal covers the whole run, so the steps
    before the resume must have run the code every deleting process is compared with. Returns those entries, for the
    final seal to keep (``{}``: the previous launch sealed none: :func:`resumed_code_checked`)."""
    differ = code_differences(previous) or []
    if differ:
        code = previous["fidelity"]["guards"]["code"]
        shown = ", ".join(_short(k, code) for k in differ[:3]) + (f" (and {len(differ) - 3} more)"
                                                                   if len(differ) > 3 else "")
        raise UnlearnError(f"{run_path} cannot be resumed in this process: it runs other code than the steps before "
                           f"the stop did: {shown}; a deletion replays both parts with one code, so resume with the "
                           "code it was recorded with (the same package versions and patches applied)")
    return dict(((previous.get("fidelity") or {}).get("guards") or {}).get("code") or {})


def resumed_code_checked(run_path, previous: dict | None, resume_step: int) -> tuple[dict, int]:
    """:func:`check_resumed_code` on every process of a resumed launch, one verdict before any compute (a difference
    on any process, a patch applied on process 1 alone, refuses on all, naming it: a refusal on process 0 alone left
    the others waiting in the next collective). ``previous``: the earlier launch's header, on the main process (the
    others get its seal from it). Returns the earlier seal's entries and the first step the run's seal covers
    (:func:`sealed_from`): ``resume_step`` when the earlier launch sealed no code (it ran without guards, or was
    killed under a release that sealed only at the end): the code of the steps before the stop is unknown, and a
    deletion whose rows first train there is refused (:func:`unsealed_code_refusal`)."""
    from .processes import agreed, gathered

    guards = ((previous or {}).get("fidelity") or {}).get("guards") or {}
    mine = {"code": guards.get("code") or {}, "from": int(guards.get("code_from") or 0),
            "format": guards.get("code_format")} if previous is not None else None
    sent = gathered(mine)[0] or {"code": {}, "from": 0}
    earlier: dict = {}
    seal = {"fidelity": {"guards": {"code": sent["code"], "code_format": sent.get("format")}},
            "versions": (previous or {}).get("versions") or {}}
    agreed(lambda: earlier.update(check_resumed_code(run_path, seal)))
    return earlier, (sent["from"] if sent["code"] else resume_step)


def sealed_from(header: dict) -> int:
    """The first optimizer step the run's code seal covers (0: all of them; later when a launch that sealed no code
    was resumed: :func:`resumed_code_checked`)."""
    return int((((header.get("fidelity") or {}).get("guards") or {}).get("code_from")) or 0)


def code_record(code: dict, earlier: dict | None, code_from: int) -> dict:
    """The header's code seal (``fidelity.guards``): this launch's first step's code, the earlier launch's entries
    kept (they ran first), and from which step it covers the run."""
    return {"code": {**code, **(earlier or {})}, "code_format": CODE_FORMAT,
            **({"code_from": code_from} if code_from else {})}


def unsealed_code_refusal(run, first_affected: int | None) -> str | None:
    """Why a deletion whose first deleted row trains at ``first_affected`` cannot be shown to be the counterfactual:
    that step ran code no seal covers (before :func:`sealed_from`), so a patch neutral on the recorded rows could
    have run there; None otherwise (a deletion of rows first trained from that step on replays sealed code only;
    the steps before it train the recorded rows, which the replay's state checks compare)."""
    start = sealed_from(run.header)
    if first_affected is None or first_affected >= start:
        return None
    return (f"{run.path}: these ids are first trained at optimizer step {first_affected}, and the code optimizer "
            f"steps 0..{start - 1} ran is not sealed (the launch that ran them left no code seal, and the run was "
            f"resumed at step {start}): a patch that changes nothing on the recorded rows may have run "
            "there, so a replay is not shown to be the counterfactual; refusing before any compute (rows first "
            f"trained at step {start} or later can be deleted; record the run again to delete these)")


def _short(entry: str, recorded: dict | None = None) -> str:
    if entry == KERNELS:
        return (f"the kernels of torch's operators registered through torch.library (recorded: "
                f"{(recorded or {}).get(KERNELS, '?')}; here: {user_kernels()})")
    if entry == SAVED_TENSOR_HOOKS:
        was = "set" if (recorded or {}).get(entry, "none") != "none" else "none"
        now = saved_tensor_hooks()
        return (f"autograd's saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks; recorded: {was}, here: "
                f"{'none' if now == 'none' else 'set' if was == 'none' else 'other hooks'})")
    name = entry.replace(":", ".")
    found = _find(entry)
    return f"{name} ({found})" if isinstance(found, str) else name


def _version_changes(recorded: dict) -> str:
    out = []
    for mod, was in recorded.items():
        if mod in ("python", "hf_unlearn"):
            continue
        now = getattr(sys.modules.get(mod), "__version__", None)
        if now is not None and now != was:
            out.append(f"{mod} {was} -> {now}")
    return ", ".join(out)


def code_checked(run) -> dict:
    """:func:`check_code` on every process of a launch, one verdict (a difference on any process refuses on all,
    naming it: :func:`~hf_unlearn.trace.processes.agreed`)."""
    from .processes import agreed

    out: dict = {}
    agreed(lambda: out.update(check_code(run)))
    return out
