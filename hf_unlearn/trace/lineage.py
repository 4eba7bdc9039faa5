"""Lineage: which model a recorded run started from, recorded by its weights, and a pipeline of runs checked.

A run's **starting weights** are hashed when training starts (:func:`weights_root`: the state-hash root of the base
model's tensors, named as the plain model names them: a PEFT wrapper's ``base_model.model.`` prefix and
``.base_layer`` dropped, adapter tensors left out, each tied tensor once). Where the model was loaded from (``config._name_or_path``, the
frozen base's folder) and an optional ``trace_parent=`` hint name candidate parents: a recorded run (its folder, the
folder the user saved its model to next to or above its ``trace/``) or a ``forget`` output (``OUT/model`` with
``OUT/receipt.json``). A candidate is the parent only if its **output weights** (the final (kept) checkpoint's, a
LoRA run's merged into its base) have the same root; a declared hint whose weights differ is refused. Otherwise the
start is an external base named by its source and the SHA-256 of its weight files.

``header.json`` ``lineage`` (sealed under the run key with the controls; no local path): ``start_root``, and
``parent`` (``kind: "run"``, ``run_id``, ``origin_run_id``, ``output_root``, ``via``: ``"run"`` or ``"forget"``) or
``external`` (``source``, ``repo_id`` for a Hub cache snapshot, ``files``: name -> SHA-256). The parent's local
folder, which is the user's file system and never published, is kept in ``private/lineage.json``.

A **pipeline** is runs in training order, each starting from the previous one's output. :func:`check_pipeline`
refuses, before any compute and naming the stage: a stage whose parent is not the previous stage, a missing stage,
runs given out of order, and a parent whose output weights are no longer the ones the child started from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..errors import UnlearnError
from ..utils import atomic_write_text, private_dir
from .base_source import base_key, file_sha256, loaded_from, stamp
from .checkpoints import full_model_state, load_checkpoint, tied_aliases
from .dtensors import is_sharded, local
from .fidelity import restore_layout
from .hashing import root_hash, tensor_hashes
from .model_info import peft_and_base
from .run import open_run
from .run_model import model_from_run
from .stack import pinned_stack

PRIVATE_FILE = Path("private") / "lineage.json"
RECEIPT = "receipt.json"
ADAPTER = re.compile(r"(^|\.)(lora_[A-Za-z_]+|modules_to_save|original_module)(\.|$)")


# ---- the weights a run starts from and ends with ----------------------------------------------------------------
def weights_root(state: dict, known: dict | None = None) -> str:
    """The state-hash root of a model's base weights, named as the plain model names them (adapters left out), each
    tied tensor once under its first name, as a checkpoint's ``hashes.json`` computes ``params_root``: a plain run's
    output root is its final checkpoint's ``params_root``, and a DPO reference's root
    (:func:`hf_unlearn.trace.reference.reference_root`) is comparable with it. ``known``: see :func:`weights_hashes`."""
    return root_hash(weights_hashes(state, known))


def weights_hashes(state: dict, known: dict | None = None) -> dict[str, str]:
    """The per-tensor hashes :func:`weights_root` is the root of. ``known``: ``{plain name: (stamp, hash, ...)}`` of
    tensors hashed before (:func:`start_hashes`, which keeps them allocated); a tensor's hash is taken from there only when the tensor ``state``
    holds under that name has that stamp (:func:`~hf_unlearn.trace.base_source.stamp`: the same storage, offset and
    shape, and the same in-place version counter, which every in-place write through the tensor or a view of it
    increments), so a tensor replaced or written in place since is hashed again; what a stamp cannot see (a write
    through ``.data``) the caller excludes (:func:`live_output_root`)."""
    plain = base_weights(state)
    tied = tied_aliases({n: local(t) for n, t in plain.items()})
    named = {n: t for n, t in plain.items() if n not in tied}
    reuse = {n: known[n][1] for n, t in named.items()
             if known and n in known and not is_sharded(t) and stamp(t) == known[n][0]}
    # an FSDP2 model's DTensors: each full logical tensor gathered (a collective every process joins) and hashed
    # one at a time, so the root is the unsharded model's and no process holds the whole model (tensor_hashes);
    # local tensors are hashed on torch's threads
    fresh = tensor_hashes({n: t for n, t in named.items() if n not in reuse})
    return {n: reuse[n] if n in reuse else fresh[n] for n in named}


def start_hashes(state: dict, hashes: dict[str, str]) -> dict[str, tuple]:
    """``{plain name: (stamp, hash, tensor)}`` of :func:`weights_hashes`' ``hashes`` of ``state`` (unsharded). The
    tensor is held so its storage stays allocated while the hashes are kept: no other tensor can be given its address
    and match its stamp."""
    plain = base_weights(state)
    return {n: (stamp(plain[n]), h, plain[n]) for n, h in hashes.items() if not is_sharded(plain[n])}


def base_weights(state: dict) -> dict:
    """``{plain name: tensor}`` of a (PEFT) model state, adapters left out."""
    return {base_key(n): t for n, t in state.items() if not ADAPTER.search(n)}


def output_checkpoint(run) -> Path:
    """The checkpoint of the model a run's user kept (its final step, or the recorded best step)."""
    kept = run.kept()
    cps = run.checkpoints()
    if kept.total_steps not in cps:
        raise UnlearnError(f"{run.path} has no checkpoint at its last step {kept.total_steps}: the run did not finish, "
                           "so it is no stage's parent")
    return cps[kept.total_steps]


def output_model(run, state: dict | None = None):
    """A run's output as a plain model: its kept checkpoint (or ``state``) loaded into the recorded architecture, a
    PEFT adapter merged into the base with the recorded numeric stack, as ``merge_and_unload`` does in the training
    script."""
    model = model_from_run(run, weights_follow=True)
    restore_layout(model, run.path, run.header)
    model.load_state_dict(state if state is not None else full_model_state(load_checkpoint(output_checkpoint(run))))
    if (run.header.get("model") or {}).get("peft"):
        with pinned_stack(run.header):
            model = model.merge_and_unload()
    model.config._name_or_path = ""  # built in memory: no folder holds these weights (RUN/model has the config only)
    return model


def output_weights(run) -> dict:
    """The base weights a run produced: its kept checkpoint's model (a PEFT adapter merged into its base)."""
    if (run.header.get("model") or {}).get("peft"):
        return dict(output_model(run).state_dict())
    return base_weights(full_model_state(load_checkpoint(output_checkpoint(run))))


def final_is_output(header: dict) -> bool:
    """Whether the final checkpoint's ``params_root``, just written from the model as training ends, is the run's
    output root (a plain model: its weights are the checkpoint's parameters, named alike); a PEFT run's output is the
    merged model, hashed by :func:`live_output_root`. Reading it saves hashing every weight a second time."""
    return not (header.get("model") or {}).get("peft")


def live_output_root(model, header: dict, start: dict | None = None, frozen: dict | None = None) -> str:
    """:func:`output_root` of a run that just finished, from its model in memory (a PEFT adapter merged into a copy,
    with the recorded numeric stack): sealed into the header's ``lineage.output_root`` so a later stage's recording
    finds its parent without loading (or de-quantising) anything.

    ``start`` (:func:`start_hashes`, taken by the lineage as training started) and ``frozen`` (``{name: stamp}`` of
    the frozen tensors the final checkpoint references in the run's frozen store, stamped when the store was saved:
    :meth:`~hf_unlearn.trace.checkpoints.FrozenTensors.unchanged_stamps`): a frozen base tensor's hash is the start's,
    not computed again, when the store holds it in the stamp the start hashed it in and the merged model still holds
    that tensor (:func:`weights_hashes`). Its hash then binds the bytes the store holds, which are what the final
    checkpoint, and so :func:`output_root`, holds for that name, even after a write a stamp cannot see (``.data``):
    the sealed root is the run's output root whatever the live model went through. Every other tensor (the merged
    adapted layers, a buffer, a tensor replaced or trained) is hashed."""
    if not (header.get("model") or {}).get("peft"):
        return weights_root(model.state_dict())
    known = None
    if start and frozen:
        known = {base_key(n): start[base_key(n)] for n, s in frozen.items()
                 if not ADAPTER.search(n) and start.get(base_key(n), (None,))[0] == s}
    with pinned_stack(header):
        return weights_root(merged_state(model), known)


# children by which PEFT's tuner layers and wrappers (whose tensors a merge writes or replaces) are found
_MERGED_CHILDREN = ("base_layer", "original_module", "modules_to_save")


def merged_copy(model):
    """``copy.deepcopy(model).merge_and_unload()`` without copying what the merge only reads: every parameter and
    buffer outside PEFT's tuner layers and wrappers (the frozen base, most of a LoRA model's bytes) is shared with
    ``model``; the merge writes the tuner layers' base weights (copied) and replaces wrappers in the copy's tree."""
    import copy

    from peft.tuners.tuners_utils import BaseTunerLayer

    written = {id(t) for _, m in model.named_modules()
               if isinstance(m, BaseTunerLayer) or any(c in m._modules for c in _MERGED_CHILDREN)
               for t in (*m.parameters(), *m.buffers())}
    shared = {id(t): t for t in (*model.parameters(), *model.buffers()) if id(t) not in written}
    return copy.deepcopy(model, shared).merge_and_unload()


def merged_state(model) -> dict:
    """``merged_copy(model).state_dict()``, bit for bit, without copying the model's module tree (about 1,000
    modules for a LoRA model of 135M parameters) where PEFT's merge writes only its tuner layers' base tensors: each
    tuner layer is copied alone (its base layer's tensors copied, the adapter's shared) and merged by PEFT's own
    ``merge``, as ``merge_and_unload`` merges it, and every other tensor is the model's own under the plain model's
    name. Any other layout takes :func:`merged_copy`: a wrapper saving a module whole (``modules_to_save``), a tuner
    layer nested in another, whose base layer has children or a tensor another module shares (a tied head), or that
    unloads itself."""
    import copy
    from collections import Counter

    from peft.tuners.tuners_utils import BaseTunerLayer

    modules = dict(model.named_modules())
    tuners = {k: m for k, m in modules.items() if isinstance(m, BaseTunerLayer)}
    owners = Counter(id(t) for _, t in (*model.named_parameters(remove_duplicate=False),
                                        *model.named_buffers(remove_duplicate=False)))
    if not tuners or any(c in m._modules for m in modules.values() for c in _MERGED_CHILDREN[1:]) or any(
            hasattr(m, "unload_and_optionally_merge_module") or not isinstance(getattr(m, "base_layer", None),
                                                                                 torch.nn.Module)
            or isinstance(m.base_layer, BaseTunerLayer) or next(m.base_layer.children(), None) is not None
            or any(owners[id(t)] > 1 for t in (*m.base_layer.parameters(), *m.base_layer.buffers()))
            for m in tuners.values()):
        return merged_copy(model).state_dict()
    check = getattr(getattr(model, "base_model", None), "_check_merge_allowed", None)
    if check is not None:  # merge_and_unload's own refusals
        check()
    merged = {}
    for name, m in tuners.items():
        base = {id(t) for t in (*m.base_layer.parameters(), *m.base_layer.buffers())}
        copied = copy.deepcopy(m, {id(t): t for t in (*m.parameters(), *m.buffers()) if id(t) not in base})
        copied.merge(safe_merge=False, adapter_names=None)
        merged.update({f"{name}.base_layer.{k}": t for k, t in copied.base_layer.state_dict().items()})
    prefixes = tuple(f"{name}." for name in tuners)
    return {base_key(k): merged.get(k, t) for k, t in model.state_dict().items()
            if not k.startswith(prefixes) or k in merged}


def reference_is_parent(run) -> bool:
    """A preference stage (DPO) whose reference model was its parent's output (``ref_model=None`` reloading the
    policy's folder, or the parent's output given as ``ref_model``): a new parent replaces the reference too. A
    reference that is the policy with its adapter disabled follows the base by itself."""
    ref = run.header.get("reference_model") or {}
    return ref.get("kind") in ("initial", "model") and ref.get("params_root") == lineage_of(run).get("start_root")


def output_root(run) -> str:
    return weights_root(output_weights(run))


# ---- a stage loaded in another dtype than its parent saved (from_pretrained(parent, dtype=torch.bfloat16)) ----------
def float_dtype(state: dict) -> str | None:
    """The one floating dtype of a model's weights (``"bfloat16"``), None if they mix dtypes or hold none."""
    dtypes = {str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def cast_weights(weights: dict, dtype: str | None) -> dict:
    """``weights`` with every floating tensor cast to ``dtype`` (as ``from_pretrained(..., dtype=)`` loads them)."""
    if not dtype:
        return weights
    import torch

    to = getattr(torch, dtype)
    return {n: t.to(to) if t.is_floating_point() else t for n, t in weights.items()}


def start_root_from(parent_run, cast: str | None = None) -> str:
    """The root a child starts from when it loads ``parent_run``'s output (cast to ``cast``, the dtype the child
    loaded it in, when that is recorded in its lineage's parent)."""
    return output_root(parent_run) if not cast else weights_root(cast_weights(output_weights(parent_run), cast))


# ---- finding a parent -------------------------------------------------------------------------------------------
def open_quietly(path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return open_run(path)


def forget_output_run(folder: Path) -> Path | None:
    """The run folder whose final state a ``forget`` output's model is: ``OUT/replay``, or a pipeline's last stage."""
    receipt = folder / RECEIPT
    if not receipt.is_file():
        return None
    try:
        data = json.loads(receipt.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    stages = (data.get("evidence") or {}).get("pipeline") or []
    for st in reversed(stages):
        if st.get("replay", {}).get("output"):
            return Path(st["replay"]["output"])
    return folder / "replay" if (folder / "replay" / "header.json").is_file() else None


def resolve_run_folder(path) -> tuple[Path, str] | None:
    """``(run folder, via)`` for a run folder (``via="run"``) or a forget output folder (``via="forget"``)."""
    p = Path(path)
    if (p / "header.json").is_file():
        return p, "run"
    found = forget_output_run(p)
    return (found, "forget") if found is not None and (found / "header.json").is_file() else None


def candidate_folders(model) -> list[Path]:
    """Where ``model`` may have come from: the folder it was loaded from and around it (a run's ``trace/`` inside
    the training's output folder, a forget output above ``OUT/model``)."""
    names = []
    src = loaded_from(model)
    if src and src.get("kind") == "safetensors":
        names.append(src["path"])
    _, base = peft_and_base(model)
    for attr in (getattr(getattr(base, "config", None), "_name_or_path", None), getattr(base, "name_or_path", None)):
        if attr:
            names.append(attr)
    out: list[Path] = []
    for name in names:
        folder = Path(name).expanduser()
        if not folder.is_dir():
            continue
        for c in (folder, folder / "trace", folder.parent, folder.parent / "trace"):
            if c not in out:
                out.append(c)
    return out


def _external(model) -> dict:
    src = loaded_from(model)
    if src is None:
        return {"source": "memory"}  # built from a config: no file holds it
    folder = Path(src["path"]) if src["kind"] == "safetensors" else Path(src["path"]).parent
    files = sorted(folder.glob("*.safetensors")) if src["kind"] == "safetensors" else [Path(src["path"])]
    out = {"source": src["kind"], "files": {f.name: file_sha256(f) for f in files}}
    if src.get("revision"):  # a Hub cache snapshot: the repo id is public, the local path is not written
        parts = folder.parts
        repo = next((p for p in parts if p.startswith("models--")), None)
        if repo:
            out["repo_id"] = repo.removeprefix("models--").replace("--", "/")
        out["revision"] = src["revision"]
    return out


def record_lineage(model, run_dir, hint=None, hashes_out: dict | None = None) -> dict:
    """The ``lineage`` entry of a run starting from ``model`` (weights as training starts); writes the parent's local
    folder to ``run_dir/private/lineage.json``. ``hint`` (``trace_parent=``): a run or forget output folder the
    model was declared to come from; refused when its output weights are not the model's. ``hashes_out``: filled with
    the starting weights' :func:`start_hashes` (for :func:`live_output_root`)."""
    state = model.state_dict()
    hashes = weights_hashes(state)
    start = root_hash(hashes)
    if hashes_out is not None:
        hashes_out.update(start_hashes(state, hashes))
    candidates = []
    if hint is not None:
        resolved = resolve_run_folder(hint)
        if resolved is None:
            raise UnlearnError(f"trace_parent={hint}: not a recorded run (no header.json) nor a forget output folder "
                               "(receipt.json with a replayed run); pass the run the model was trained by")
        candidates.append((*resolved, True))
    for folder in candidate_folders(model):
        resolved = resolve_run_folder(folder)
        if resolved is not None and Path(run_dir).resolve() != resolved[0].resolve() and \
                all(resolved[0].resolve() != c[0].resolve() for c in candidates):
            candidates.append((*resolved, False))
    for folder, via, declared in candidates:
        try:
            run = open_quietly(folder)  # its sealed output root (keyed with the controls), else computed
            root = lineage_of(run).get("output_root") if not run.header.get("kept_model") else None
            root = root or output_root(run)
        except UnlearnError as e:
            if declared:
                raise UnlearnError(f"trace_parent={hint}: {e}") from None
            continue
        cast = None
        if root != start and float_dtype(state):  # loaded in another dtype than the parent saved (bf16 from fp32)?
            cast = float_dtype(state)
            if weights_root(cast_weights(output_weights(run), cast)) != start:
                cast = None
        if root == start or cast:
            parent = {"kind": "run", "run_id": run.header["run_id"],
                      "origin_run_id": run.header.get("origin_run_id", run.header["run_id"]),
                      "output_root": root, "via": via, "steps": run.kept().total_steps,
                      "trainer": (run.header.get("trainer") or {}).get("class", "transformers.trainer:Trainer")}
            if cast:  # the parent's output weights, each floating tensor cast to this dtype, are the start
                parent["cast"] = cast
            private = private_dir(run_dir) / PRIVATE_FILE.name
            atomic_write_text(private, json.dumps({"parent_path": str(Path(folder).resolve())}, indent=1), private=True)
            return {"start_root": start, "parent": parent}
        if declared:
            raise UnlearnError(f"trace_parent={hint}: the model this run starts from (weights root {start[:16]}...) is "
                               f"not that run's output (root {root[:16]}...): a declared parent must be the weights "
                               "the model holds; load the run's output model (or drop trace_parent)")
    return {"start_root": start, "parent": None, "external": _external(model)}


def parent_path(run) -> Path | None:
    """The local folder of a run's recorded parent (``private/lineage.json``), or None."""
    f = Path(run.path) / PRIVATE_FILE
    try:
        return Path(json.loads(f.read_text())["parent_path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def lineage_of(run) -> dict:
    """A run's (or a header dict's) recorded lineage, ``{}`` for a run recorded before lineage."""
    header = run if isinstance(run, dict) else run.header
    return header.get("lineage") or {}


def parent_run_id(run) -> str | None:
    p = lineage_of(run).get("parent") or {}
    return p.get("run_id") if p.get("kind") == "run" else None


# ---- a pipeline -----------------------------------------------------------------------------------------------
def find_pipeline(last) -> list:
    """The stages of the pipeline ending with run ``last`` (a folder or opened run), first stage first, found from
    each run's recorded parent folder (``private/lineage.json``)."""
    run = last if hasattr(last, "header") else open_quietly(last)
    stages = [run]
    seen = {run.header["run_id"]}
    while parent_run_id(stages[0]):
        stage = len(stages)
        folder = parent_path(stages[0])
        want = parent_run_id(stages[0])
        if folder is None or not (folder / "header.json").is_file():
            raise UnlearnError(f"{stages[0].path} starts from recorded run {want} whose folder "
                               f"{folder or '(not recorded)'} is missing: a stage of the pipeline is missing; pass "
                               f"every stage's run in order")
        parent = open_quietly(folder)
        if parent.header["run_id"] != want or want in seen:
            raise UnlearnError(f"{folder} (recorded as the parent of {stages[0].path}) is run "
                               f"{parent.header['run_id']}, not {want}: the parent folder was replaced; pass every "
                               f"stage's run in order")
        seen.add(want)
        stages.insert(0, parent)
        if stage > 64:
            raise UnlearnError("a pipeline of more than 64 stages: the lineage loops")
    return stages


def check_pipeline(runs, check_roots: bool = True) -> list[dict]:
    """Check that ``runs`` (opened, in training order) form a pipeline; returns one dict per stage (run, parent's
    output root as recorded and now). Refuses, before compute and naming the stage, a stage whose parent is not
    the previous stage's output, a missing stage, runs out of order, and a parent changed after the child recorded."""
    ids = [r.header["run_id"] for r in runs]
    where = {rid: k for k, rid in enumerate(ids)}
    if len(set(ids)) != len(ids):
        dup = next(r for r in ids if ids.count(r) > 1)
        raise UnlearnError(f"stage {ids.index(dup) + 1} and a later stage are the same run {dup}: give each stage once")
    stages = []
    for k, run in enumerate(runs):
        lin = lineage_of(run)
        name = f"stage {k + 1} ({run.path})"
        if not lin:
            if k:
                raise UnlearnError(f"{name} records no lineage (recorded before lineage was recorded): it cannot be "
                                   f"shown to start from stage {k}'s output; record it again")
            stages.append({"run": run, "parent": None})
            continue
        pid = parent_run_id(run)
        expected = runs[k - 1].header["run_id"] if k else None
        if pid != expected:
            if pid in where:
                order = " ".join(str(r.path) for r in _ordered(runs))
                raise UnlearnError(f"the runs are given out of order: {name} starts from the output of stage "
                                   f"{where[pid] + 1} ({runs[where[pid]].path}); in training order: {order}")
            if k == 0:
                raise UnlearnError(f"{name} starts from the output of recorded run {pid}, which is not given: a stage "
                                   f"is missing (its folder: {parent_path(run) or 'unknown'}); pass every stage from "
                                   "the first, or only the last run (the lineage is found from it)")
            prev = runs[k - 1]
            what = "an external base" if pid is None else f"recorded run {pid}"
            raise UnlearnError(f"{name} starts from {what}, not from stage {k}'s output ({prev.path}, run "
                               f"{prev.header['run_id']}): a stage is missing between them or it is from another "
                               "pipeline; pass the runs of one pipeline, in training order")
        if k == 0:
            stages.append({"run": run, "parent": None})
            continue
        prev = runs[k - 1]
        recorded = (lin.get("parent") or {}).get("output_root")
        if recorded != lin["start_root"] and not (lin.get("parent") or {}).get("cast"):
            raise UnlearnError(f"{name}: its lineage is inconsistent (start root and parent output root differ)")
        if check_roots:
            now = output_root(prev)
            if now != recorded:
                raise UnlearnError(f"{name} started from stage {k}'s output with weights root {recorded[:16]}..., but "
                                   f"stage {k} ({prev.path}) now ends with root {now[:16]}...: the parent changed after "
                                   "the child was recorded; restore it (or record the child again from it)")
        stages.append({"run": run, "parent": prev.header["run_id"]})
    return stages


def _ordered(runs) -> list:
    """``runs`` sorted by their recorded parents (for the out-of-order message)."""
    by_parent = {parent_run_id(r): r for r in runs}
    ids = {r.header["run_id"] for r in runs}
    first = [r for r in runs if parent_run_id(r) not in ids]
    out = first[:1]
    while out and out[-1].header["run_id"] in by_parent and len(out) < len(runs):
        out.append(by_parent[out[-1].header["run_id"]])
    return out if len(out) == len(runs) else runs


def describe(run) -> str:
    """One line on where a run (or a header dict) started from (``trace inspect``, ``trace lineage``)."""
    lin = lineage_of(run)
    if not lin:
        return "not recorded (the run was recorded before lineage)"
    p = lin.get("parent")
    if p:
        via = " (a forget output of it)" if p.get("via") == "forget" else ""
        return (f"starts from the output of recorded run {p['run_id']}{via}, weights root {lin['start_root'][:16]}... "
                f"({p.get('steps')} steps of {p.get('trainer')})")
    ext = lin.get("external") or {}
    if ext.get("source") == "memory":
        return f"starts from an external base built in memory (weights root {lin['start_root'][:16]}...)"
    name = ext.get("repo_id") or "a local folder"
    files = ", ".join(f"{n} {h[:12]}..." for n, h in (ext.get("files") or {}).items())
    return f"starts from an external base: {ext.get('source')} {name} ({files}), weights root {lin['start_root'][:16]}..."
