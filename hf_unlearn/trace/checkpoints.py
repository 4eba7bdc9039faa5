"""A recorded run's checkpoints: what is saved, how each is bound to its run, how it is loaded and checked.

```
RUN/checkpoints/step-00000040/  model.safetensors  optimizer.safetensors  checkpoint.json  hashes.json(.sha256)
RUN/checkpoints/frozen/         model.safetensors  hashes.json   (tensors that do not train, saved once)
RUN/checkpoints/index.json      every kept checkpoint's roots, MAC'd with the run key: the checkpoints' binding
```

* **What trains is checkpointed.** Parameters with ``requires_grad=False`` (a PEFT base, frozen layers) are saved
  once in ``frozen/``; a checkpoint references them as long as they are the same tensor, unmodified (same storage,
  same in-place version counter), and saves any that changed. A loaded checkpoint is the full state again.
* **Safetensors.** Model tensors and the optimizer state (flattened to ``state.<index>.<key>``, with a small JSON
  index in ``checkpoint.json`` of its param groups and non-tensor entries) are safetensors files: safe to open,
  memory-mappable, written from the live tensors without a copy and verified one tensor at a time.
* **Bound to the run.** ``hashes.json`` holds the SHA-256 of every tensor (frozen ones included) and the parameter
  and optimizer roots; as a checkpoint is saved its roots and the hash of its ``hashes.json`` go into
  ``index.json``, whose MAC (HMAC-SHA256 under the run key, over the run id and every entry) an editor without the
  key cannot recompute. A checkpoint folder copied from another run carries its own consistent ``hashes.json`` but
  not this run's roots: refused, named. A checkpoint the index lists and the disk lacks is reported.

An FSDP2 run's checkpoints are sharded: every process writes its own ``model-rank{r}-of-{N}.safetensors`` and
``optimizer-rank{r}-of-{N}.safetensors``, hashed as the full logical tensors (:mod:`hf_unlearn.trace.shards`).

Runs recorded before this format (``step-N/state.pt``, no index) still load; their checkpoints are checked
against their own ``hashes.json`` only, and against the header's cadence for missing ones.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import json
import os
import shutil
from pathlib import Path

from ..errors import UnlearnError
from ..utils import atomic_write_text
from . import base_source
from .base_source import load as load_referenced
from .base_source import stamp
from .checkpoint_files import (  # noqa: F401 - re-exported: they lived here
    CHECKPOINT_FORMAT,
    _flatten_optimizer,
    _save_safetensors,
    checkpoint_dir,
    tied_aliases,
)
from .dtensors import full_optimizer_state, full_tensors, is_sharded, local, model_is_sharded
from .files import check_sidecar, file_sha256, write_sidecar
from .hashing import (
    NAMES_KEY,
    PLAIN,
    checkpoint_hashes,
    hash_name,
    names_field,
    optimizer_param_names,
    plain_names,
    root_hash,
    tensor_hash,
    tensor_hashes,
    uses_plain_names,
)
from .peft_names import base_key
from .shards import check as check_shards
from .shards import is_complete as shards_complete
from .shards import is_sharded_checkpoint, local_keys, verify_files
from .shards import load as load_sharded
from .shards import save as save_sharded

INDEX_FORMAT = "hf_unlearn.checkpoint_index.v1"
INDEX_NAME = "index.json"
FROZEN_DIR = "frozen"
TRASH_PREFIX = ".thinned-"  # a checkpoint being deleted is renamed first: a crash leaves no half-deleted step-N


def _step_of(d: Path) -> int:
    return int(d.name.split("-")[1])


def is_complete(d: Path) -> bool:
    """A checkpoint folder whose state and ``hashes.json`` are all there (either format)."""
    d = Path(d)
    if not (d / "hashes.json").exists():
        return False
    if (d / "state.pt").exists():
        return True
    if not (d / "checkpoint.json").exists():
        return False
    meta = json.loads((d / "checkpoint.json").read_text())
    if is_sharded_checkpoint(meta):  # an FSDP2 run's: every process's shard files (hf_unlearn.trace.shards)
        return shards_complete(d, meta)
    return all((d / f).exists() for f in ("model.safetensors", "optimizer.safetensors"))


def list_checkpoints(run: Path) -> dict[int, Path]:
    """Complete checkpoints by optimizer step: those the run's index lists (all of them in runs without one)."""
    run = Path(run)
    listed = read_index_steps(run)
    out = {}
    for d in sorted((run / "checkpoints").glob("step-*")):
        if is_complete(d) and (listed is None or _step_of(d) in listed):
            out[_step_of(d)] = d
    return out


# ---- capture ----------------------------------------------------------------------------------------------


def capture_state(model, optimizer, step: int, clone: bool = False) -> dict:
    """A checkpoint dict: model tensors (each tied tensor once), the tie map, optimizer state, parameter names."""
    sd = model.state_dict()
    tied = tied_aliases({k: local(v) for k, v in sd.items()})
    # sharded (FSDP2): the full logical tensors, gathered on every process (the checkpoint is the unsharded state)
    tensors = {k: v.detach().to("cpu") for k, v in full_tensors({k: v for k, v in sd.items() if k not in tied}).items()}
    osd = full_optimizer_state(optimizer.state_dict())
    if clone:
        import copy

        tensors = {k: v.clone() for k, v in tensors.items()}
        osd = copy.deepcopy(osd)
    return {"step": step, "model": tensors, "tied": tied, "optimizer": osd,
            "param_names": optimizer_param_names(model, optimizer)}


def full_model_state(state: dict) -> dict:
    """The checkpoint's model tensors with the tied aliases restored, for ``model.load_state_dict``."""
    return {**state["model"], **{alias: state["model"][name] for alias, name in state.get("tied", {}).items()}}


# ---- frozen tensors, referenced where they were loaded from, else saved once ---------------------------------
class FrozenTensors:
    """The run's parameters that do not train: referenced in the model folder, Hugging Face cache snapshot or GGUF
    file they were loaded from (:mod:`hf_unlearn.trace.base_source`), else saved once in ``checkpoints/frozen/``;
    checkpoints reference them afterwards."""

    def __init__(self, run: Path):
        self.dir = Path(run) / "checkpoints" / FROZEN_DIR
        self.source = None  # a model folder to reference frozen tensors in (trace_frozen_source); default: found
        self.hashes: dict[str, str] = {}
        self.plain = True  # its hashes (and the run's checkpoints') name tensors as the plain model (hashing.PLAIN)
        # {plain name: (stamp, hash, tensor)} of the weights the lineage hashed as training started
        # (lineage.start_hashes, set by the recorder; dropped once the store is saved): see save()
        self.start: dict | None = None
        self._stamps: dict[str, tuple] = {}
        self._params: dict = {}
        self.saved_step: int | None = None  # the checkpoint step this recording saved the store at

    def unchanged(self, model) -> set[str]:
        """Names of the frozen store's tensors that ``model`` still holds unmodified."""
        return set(self.unchanged_stamps(model))

    def unchanged_stamps(self, model) -> dict[str, tuple]:
        """``{name: stamp}`` of the frozen store's tensors that ``model`` still holds unmodified (the same tensor, in
        the same in-place version as when the store was saved): those a checkpoint references in the store."""
        params = dict(model.named_parameters(remove_duplicate=False))
        return {n: s for n, s in self._stamps.items() if n in params and stamp(params[n]) == s}

    def save(self, model, tensors: dict, source: str | os.PathLike | None = None, start: dict | None = None) -> None:
        """Save the tensors among ``tensors`` that are parameters with ``requires_grad=False`` (once).

        With ``source`` (the model folder the frozen weights were loaded from), a frozen tensor whose dtype, shape
        and bytes equal a tensor of that folder's safetensors files is referenced there instead of copied. Without
        it, the folder, cache snapshot or GGUF file the model was loaded from (``base_source.loaded_from``) is
        referenced the same way; nothing to reference: saved. The referenced files' SHA-256 and the checkpoints'
        per-tensor hashes (frozen tensors included) are checked at every load.

        ``start`` (:attr:`start`, given when the store is saved with the step-0 checkpoint: in the same call as the
        lineage hashed the starting weights, with only the recorder's code, which writes no weight, between): a
        frozen tensor's hash is the lineage's when the model still holds it in the stamp the lineage hashed it in
        (:meth:`_start_hashes`), so a LoRA recording hashes its frozen base once.
        """
        params = dict(model.named_parameters(remove_duplicate=False))
        frozen = {n: t for n, t in tensors.items() if n in params and not params[n].requires_grad}
        if not frozen:
            return
        if source is not None:
            where = {"kind": "safetensors", "path": str(Path(source).resolve()), "revision": None}
            refs = _match_source(frozen, source)
        else:
            where = base_source.loaded_from(model)
            refs = base_source.match(frozen, model, where) if where is not None else {}
        self.dir.mkdir(parents=True, exist_ok=True)
        _save_safetensors({n: t for n, t in frozen.items() if n not in refs}, self.dir / "model.safetensors")
        reuse = self._start_hashes(params, frozen, start)
        self.start = None  # the starting tensors are not held for the store any longer
        # the rest on every core torch may use (without the start's hashes: the frozen base, most of the bytes)
        fresh = tensor_hashes({n: t for n, t in frozen.items() if n not in reuse}, self.plain)
        self.hashes = {n: reuse[n] if n in reuse else fresh[n] for n in frozen}
        record = {"params": self.hashes, "root": root_hash(self.hashes), **names_field(frozen, self.plain)}
        if refs:
            record["source"] = base_source.describe(where, refs)
            if where["kind"] == "gguf":
                base_source.remember_live(record["source"], model, refs)
        atomic_write_text(self.dir / "hashes.json", json.dumps(record, indent=1, sort_keys=True))
        self._stamps = {n: base_source.stamp(params[n]) for n in frozen}

    def _start_hashes(self, params: dict, frozen: dict, start: dict | None) -> dict[str, str]:
        """The hashes of ``frozen`` tensors the lineage took as training started (``start``): each where the
        model's parameter is still in the stamp the lineage hashed it in (same storage, offset, shape, in-place
        version; so the bytes this store saves or references are the ones hashed) and its hash name is the name the
        lineage hashed it under (the plain rule). Each store's hash is checked again at every load: a tensor changed
        where a stamp cannot see (a ``.data`` write) is refused there, never passed."""
        if not self.plain or not start:
            return {}
        return {n: start[base_key(n)][1] for n in frozen
                if base_key(n) in start and not is_sharded(params[n]) and stamp(params[n]) == start[base_key(n)][0]}

    def start_hashes_of(self, tensors: dict) -> dict[str, str]:
        """The step-0 checkpoint's tensors whose hash the lineage took as training started (:attr:`start`, still held
        when no frozen store took it: a full fine-tune), by the same rule as :meth:`_start_hashes`: a full fine-tune's
        starting weights are hashed once, not again for its step-0 checkpoint."""
        return self._start_hashes(tensors, tensors, self.start)

    def _read(self) -> dict:
        record = json.loads((self.dir / "hashes.json").read_text())
        self.hashes, self.plain = record["params"], uses_plain_names(record)
        return record

    def adopt(self, model, names) -> None:
        """Take over an existing frozen store (a replay's output links its parent's) for the tensors ``names``
        that ``model`` was just loaded with from it (and its hash rule: the output's checkpoints follow it)."""
        if not (self.dir / "hashes.json").exists():
            return
        self._read()
        params = dict(model.named_parameters(remove_duplicate=False))
        self._stamps = {n: stamp(params[n]) for n in names if n in params and n in self.hashes}

    def adopt_matching(self, model) -> None:
        """Take over the saved frozen tensors that ``model`` holds with the same hashes (a resumed recording; its
        checkpoints keep the store's hash rule)."""
        self._read()
        params = dict(model.named_parameters(remove_duplicate=False))
        self._stamps = {n: stamp(params[n]) for n, h in self.hashes.items() if n in params and
                        not params[n].requires_grad and tensor_hash(hash_name(n, self.plain), params[n]) == h}

    @property
    def exists(self) -> bool:
        return bool(self._stamps)


def _content_digest(t) -> str:
    return tensor_hash("", t)  # dtype, shape and bytes, without the name


def _match_source(frozen: dict, source) -> dict[str, list[str]]:
    """``frozen name -> [file, key]`` for the frozen tensors a model folder's safetensors files hold bit for bit."""
    from safetensors import safe_open

    files = sorted(Path(source).glob("*.safetensors"))
    if not files:
        raise UnlearnError(f"trace_frozen_source={source!s} holds no .safetensors files: pass the model folder the "
                           "frozen weights were loaded from (from_pretrained), or leave it out to save them in the run")
    wanted: dict[str, list[str]] = {}
    for n, t in frozen.items():
        wanted.setdefault(_content_digest(t), []).append(n)
    refs = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                for n in wanted.pop(_content_digest(h.get_tensor(key)), []):
                    refs[n] = [f.name, key]
    return refs


def check_frozen_source(run: Path) -> None:
    """Before any compute: the base files the run's frozen tensors are referenced in (a LoRA run's base) are where
    the recording found them, unchanged (else the replay refused them once built, after the redaction)."""
    record = Path(run) / "checkpoints" / FROZEN_DIR / "hashes.json"
    source = json.loads(record.read_text()).get("source") if record.is_file() else None
    if source and "kind" in source:
        base_source.check_files(source)


def load_frozen(run: Path, names) -> dict:
    """The frozen tensors ``names`` (from the run's frozen store, or the model folder it references)."""
    from safetensors import safe_open

    folder = Path(run) / "checkpoints" / FROZEN_DIR
    if not (folder / "hashes.json").exists():
        raise UnlearnError(f"{folder} is missing: the run's checkpoints reference frozen tensors saved there")
    source = json.loads((folder / "hashes.json").read_text()).get("source") or {"tensors": {}}
    where: dict[Path, list[tuple[str, str]]] = {}
    referenced = []
    for n in names:
        if n in source["tensors"]:
            file, key = source["tensors"][n]
            if "kind" in source:  # recorded with the files' SHA-256: checked, GGUF de-quantised (base_source)
                referenced.append((n, file, key))
            else:
                where.setdefault(Path(source["path"]) / file, []).append((n, key))
        else:
            where.setdefault(folder / "model.safetensors", []).append((n, n))
    out = load_referenced(source, referenced) if referenced else {}
    for path, items in where.items():
        if not path.exists():
            raise UnlearnError(f"{path} is missing: the run's checkpoints reference frozen tensors there (restore it)")
        with safe_open(str(path), framework="pt") as h:
            keys = set(h.keys())
            for n, key in items:
                if key not in keys:
                    raise UnlearnError(f"{path} lacks the frozen tensor {key!r} a checkpoint references")
                out[n] = h.get_tensor(key)
    return out


# ---- save / load -----------------------------------------------------------------------------------------


def save_checkpoint(run: Path, step: int, model, optimizer, frozen: FrozenTensors | None = None,
                    state: dict | None = None) -> Path:
    """Write ``checkpoints/step-N/`` (safetensors; frozen tensors referenced), then ``hashes.json`` and its sidecar.

    ``hashes.json`` is written last: a folder without it is an incomplete checkpoint, never used. ``state``: the
    :func:`capture_state` already taken (a sharded run gathers it on every process, the main process writes it).
    """
    if state is None and model_is_sharded(model):  # FSDP2: every process writes its shards (hf_unlearn.trace.shards)
        return save_sharded(run, step, model, optimizer, frozen.plain if frozen is not None else True)[0]
    d = checkpoint_dir(run, step)
    d.mkdir(parents=True, exist_ok=True)
    state = state if state is not None else capture_state(model, optimizer, step)
    if frozen is not None and not frozen.exists and not (frozen.dir / "hashes.json").exists():
        frozen.save(model, state["model"], source=frozen.source, start=frozen.start if step == 0 else None)
        frozen.saved_step = step
    referenced = frozen.unchanged(model) & set(state["model"]) if frozen is not None else set()
    known = {n: frozen.hashes[n] for n in referenced}
    if step == 0 and frozen is not None:
        known.update(frozen.start_hashes_of(state["model"]))
    # hashed while the files are written (safetensors writes without the GIL): the same bytes, read in memory, about
    # half the wall time of one after the other; nothing can change them meanwhile (training waits for this call)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        hashes = pool.submit(checkpoint_hashes, state, known, frozen.plain if frozen is not None else True)
        _write_state(d, step, state, referenced)
        hashes = hashes.result()
    atomic_write_text(d / "hashes.json", json.dumps(hashes, indent=1, sort_keys=True))
    write_sidecar(d / "hashes.json")
    return d


def _write_state(d: Path, step: int, state: dict, referenced: set) -> None:
    """The checkpoint's files (safetensors and ``checkpoint.json``; ``state.pt`` when safetensors cannot hold it)."""
    flat = _flatten_optimizer(state["optimizer"])
    try:
        if flat is None:
            raise ValueError("optimizer state is not flat tensors and JSON")
        stored = {n: t for n, t in state["model"].items() if n not in referenced}
        _save_safetensors(stored, d / "model.safetensors")
        _save_safetensors(flat[0], d / "optimizer.safetensors")
        meta = {"format": CHECKPOINT_FORMAT, "step": step, "tied": state["tied"], "param_names": state["param_names"],
                "frozen": sorted(referenced), "optimizer": flat[1]}
        atomic_write_text(d / "checkpoint.json", json.dumps(meta, indent=1, sort_keys=True))
    except ValueError:  # an optimizer (or tensor layout) safetensors cannot hold: the whole state with torch.save
        import torch

        for f in ("model.safetensors", "optimizer.safetensors", "checkpoint.json"):
            (d / f).unlink(missing_ok=True)
        torch.save(state, d / "state.pt.tmp")
        os.replace(d / "state.pt.tmp", d / "state.pt")


def _load_v2(path: Path, rank: int | None = None) -> dict:
    from safetensors.torch import load_file

    meta = json.loads((path / "checkpoint.json").read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise UnlearnError(f"{path}/checkpoint.json has format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    if is_sharded_checkpoint(meta):  # an FSDP2 run's shard files (hf_unlearn.trace.shards)
        model, flat = load_sharded(path, meta, rank)
    else:
        model, flat = load_file(path / "model.safetensors"), load_file(path / "optimizer.safetensors")
    if meta.get("frozen"):
        model.update(load_frozen(path.parent.parent, meta["frozen"]))
    opt = meta["optimizer"]
    state: dict = {}
    for idx in opt["indices"]:
        entries = {k.split(".", 2)[2]: v for k, v in flat.items() if k.split(".", 2)[1] == str(idx)}
        entries.update(opt["scalars"].get(str(idx), {}))
        state[idx] = entries
    groups = []
    for i, g in enumerate(opt["param_groups"]):
        tuples = set(opt["tuples"].get(str(i), []))
        groups.append({k: tuple(v) if k in tuples else v for k, v in g.items()})
    out = {"step": meta["step"], "model": model, "tied": meta["tied"], "param_names": meta["param_names"],
           "optimizer": {"state": state, "param_groups": groups}, "frozen": meta.get("frozen", [])}
    if is_sharded_checkpoint(meta) and rank is not None:  # this process's optimizer shards (sharding.load_optimizer_state)
        out["optimizer"]["local_shards"] = local_keys(meta)
    return out


def load_checkpoint(path: Path, verify: bool = True, rank: int | None = None) -> dict:
    """Load a checkpoint (either format); with ``verify`` recompute its hashes and refuse it unless they equal
    ``hashes.json``, and that ``hashes.json`` is the one the run's index recorded for this step. ``rank``: a sharded
    (FSDP2) checkpoint's optimizer state as that process's shards (a replay at the recorded world size), checked by
    its files' SHA-256; without it, the full state."""
    path = Path(path)
    if (path / "state.pt").exists():
        import torch

        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    elif (path / "checkpoint.json").exists():
        state = _load_v2(path, rank)
    else:
        raise UnlearnError(f"{path} holds no checkpoint (no checkpoint.json or state.pt)")
    if (path / "hashes.json").is_file():  # its hash rule: what hashes it again (checkpoint_hashes) follows
        state[NAMES_KEY] = PLAIN if plain_names(json.loads((path / "hashes.json").read_text())) else "own"
    if verify:
        check_binding(path)
        if "local_shards" in state["optimizer"]:
            if check_sidecar(path / "hashes.json") is False:
                raise UnlearnError(f"{path / 'hashes.json'} does not match its SHA-256 sidecar: modified after it "
                                   "was written")
            check_shards(path, state)
        else:
            check_checkpoint_state(path, state)
    return state


def check_checkpoint_state(path: Path, state: dict) -> None:
    path = Path(path)
    recorded_file = path / "hashes.json"
    if not recorded_file.exists():
        raise UnlearnError(f"checkpoint {path} has no hashes.json: it cannot be checked, refusing to use it")
    if check_sidecar(recorded_file) is False:
        raise UnlearnError(f"{recorded_file} does not match its SHA-256 sidecar: modified after it was written")
    recorded = json.loads(recorded_file.read_text())
    actual = checkpoint_hashes(state, plain=plain_names(recorded))
    bad = [n for part in ("params", "optimizer") for n in sorted(set(recorded[part]) | set(actual[part]))
           if recorded[part].get(n) != actual[part].get(n)]
    if recorded.get("meta_sha256") != actual["meta_sha256"]:
        bad.append("step/tie map/parameter names/optimizer hyperparameters")
    if bad:
        raise UnlearnError(f"checkpoint {path} does not match its hashes.json (it differs in {', '.join(bad[:3])}"
                           f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}): modified after it was saved")


def verify_checkpoint_files(path: Path) -> None:
    """Check a checkpoint against its ``hashes.json`` reading one tensor at a time (memory: the largest tensor).

    Old ``state.pt`` checkpoints are loaded whole (pickles cannot be read piecewise).
    """
    from safetensors import safe_open

    path = Path(path)
    if (path / "state.pt").exists() or not (path / "checkpoint.json").exists():
        check_checkpoint_state(path, load_checkpoint(path, verify=False))
        return
    check_binding(path)
    recorded = json.loads((path / "hashes.json").read_text())
    plain = plain_names(recorded)
    meta = json.loads((path / "checkpoint.json").read_text())
    names = meta["param_names"]
    opt = meta["optimizer"]
    order = [i for g in opt["param_groups"] for i in g["params"]]
    by_idx = {idx: names[pos] for pos, idx in enumerate(order) if pos < len(names)}
    bad = []
    seen = set()
    seen_opt = set()
    if is_sharded_checkpoint(meta):  # every shard file's SHA-256, each full tensor assembled and hashed
        bad, seen, seen_opt = verify_files(path, meta, by_idx, plain)
    else:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            for n in f.keys():
                seen.add(n)
                if tensor_hash(hash_name(n, plain), f.get_tensor(n)) != recorded["params"].get(n):
                    bad.append(n)
        with safe_open(str(path / "optimizer.safetensors"), framework="pt") as f:
            for k in f.keys():
                _, idx, key = k.split(".", 2)
                name = f"{by_idx.get(int(idx), idx)}.{key}"
                seen_opt.add(name)
                if tensor_hash(name, f.get_tensor(k)) != recorded["optimizer"].get(name):
                    bad.append(name)
    for n in meta.get("frozen", []):  # one at a time (from the run's frozen store or the model folder)
        seen.add(n)
        if tensor_hash(hash_name(n, plain), load_frozen(path.parent.parent, [n])[n]) != recorded["params"].get(n):
            bad.append(n)
    bad += sorted(set(recorded["params"]) - seen)
    import torch

    for idx, entries in opt["scalars"].items():
        for key, value in entries.items():
            name = f"{by_idx.get(int(idx), idx)}.{key}"
            seen_opt.add(name)
            if tensor_hash(name, torch.tensor(float(value), dtype=torch.float64)) != recorded["optimizer"].get(name):
                bad.append(name)
    bad += sorted(set(recorded["optimizer"]) - seen_opt)
    if bad:
        raise UnlearnError(f"checkpoint {path} does not match its hashes.json (it differs in {', '.join(bad[:3])}"
                           f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}): modified after it was saved")


def checkpoint_bytes(d: Path, with_frozen: bool = False) -> int:
    """Bytes of a checkpoint folder; ``with_frozen``: plus the frozen store it references (the full state's size)."""
    d = Path(d)
    size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    frozen = d.parent / FROZEN_DIR
    if with_frozen and (d / "checkpoint.json").exists() and json.loads((d / "checkpoint.json").read_text())["frozen"]:
        size += sum(f.stat().st_size for f in frozen.iterdir() if f.is_file())
    return size


# ---- the index: every kept checkpoint's roots, bound to the run ------------------------------------------
def _entry(d: Path) -> dict:
    h = json.loads((Path(d) / "hashes.json").read_text())
    return {"params_root": h["params_root"], "optimizer_root": h["optimizer_root"],
            "meta_sha256": h.get("meta_sha256"), "hashes_sha256": file_sha256(Path(d) / "hashes.json")}


def _mac(key: bytes, body: dict) -> str:
    payload = json.dumps({k: body.get(k) for k in ("format", "run_id", "checkpoints", "frozen", "retention")},
                         sort_keys=True).encode()
    return hmac.new(key, b"hf_unlearn.checkpoint_index\0" + payload, hashlib.sha256).hexdigest()


class CheckpointIndex:
    """``checkpoints/index.json``: the roots of every kept checkpoint as it was saved, MAC'd under the run key."""

    def __init__(self, run: Path, run_id: str, key: bytes, retention: dict | None = None):
        self.run, self.run_id, self.key = Path(run), run_id, key
        self.entries: dict[int, dict] = {}
        self.frozen: dict | None = None
        self.retention = retention

    @property
    def path(self) -> Path:
        return self.run / "checkpoints" / INDEX_NAME

    def add(self, step: int) -> None:
        """Record the checkpoint just saved at ``step`` (and the frozen store, the first time)."""
        self.entries[step] = _entry(checkpoint_dir(self.run, step))
        if self.frozen is None:
            self.frozen = _frozen_entry(self.run)
        self.save()

    def adopt(self, step: int, entry: dict) -> None:
        self.entries[step] = dict(entry)

    def save(self) -> None:
        body = {"format": INDEX_FORMAT, "run_id": self.run_id, "retention": self.retention, "frozen": self.frozen,
                "checkpoints": {str(s): self.entries[s] for s in sorted(self.entries)}}
        body["mac"] = _mac(self.key, body)
        atomic_write_text(self.path, json.dumps(body, indent=1, sort_keys=True))

    @classmethod
    def load(cls, run: Path, run_id: str, key: bytes) -> CheckpointIndex:
        """The run's index (to extend it on resume); refused if its MAC or run id is not this run's."""
        data = json.loads((Path(run) / "checkpoints" / INDEX_NAME).read_text())
        if data.get("run_id") != run_id or not hmac.compare_digest(data.get("mac", ""), _mac(key, data)):
            raise UnlearnError(f"{run}/checkpoints/{INDEX_NAME} is not this run's checkpoint index (its MAC or run id "
                               "does not match); it was edited or copied from another run")
        index = cls(run, run_id, key, data.get("retention"))
        index.entries = {int(s): e for s, e in data["checkpoints"].items()}
        index.frozen = data.get("frozen")
        return index

    def thin(self, keep) -> list[int]:
        """Delete every checkpoint not in ``keep``, crash-safely: the index drops it first (atomically), then the
        folder is renamed out of ``step-*`` and removed. A crash at any point leaves a run that checks clean."""
        drop = sorted(s for s in self.entries if s not in set(keep))
        if not drop:
            return []
        for s in drop:
            del self.entries[s]
        self.save()
        for s in drop:
            remove_checkpoint_dir(checkpoint_dir(self.run, s))
        return drop


def _frozen_entry(run: Path) -> dict | None:
    f = Path(run) / "checkpoints" / FROZEN_DIR / "hashes.json"
    return {"root": json.loads(f.read_text())["root"], "hashes_sha256": file_sha256(f)} if f.exists() else None


def run_uses_plain_names(run: Path) -> bool:
    """The hash rule of a run's checkpoints (:func:`~hf_unlearn.trace.hashing.uses_plain_names`): its frozen store's,
    else its last checkpoint's; True for a run with neither (what a recording writes)."""
    run = Path(run)
    frozen = run / "checkpoints" / FROZEN_DIR / "hashes.json"
    cps = list_checkpoints(run)
    f = frozen if frozen.is_file() else cps[max(cps)] / "hashes.json" if cps else None
    return uses_plain_names(json.loads(f.read_text())) if f is not None else True


def _link_tree(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)


def link_checkpoints(src: Path, writer, steps, model, frozen_names) -> None:
    """Start a replay's output run with its parent's checkpoints at ``steps`` (hard links, index entries adopted)
    and its frozen tensors (``model`` was just loaded with ``frozen_names`` from them)."""
    src = Path(src)
    index = read_index(src)
    for step in steps:
        d = checkpoint_dir(src, step)
        _link_tree(d, checkpoint_dir(writer.run, step))
        writer.index.adopt(step, index["checkpoints"][str(step)] if index else _entry(d))
    if steps:  # the output's checkpoints hash as the run's did (a run recorded before the plain rule keeps its own)
        writer.frozen.plain = uses_plain_names(json.loads((checkpoint_dir(src, max(steps)) / "hashes.json").read_text()))
    if (src / "checkpoints" / FROZEN_DIR).exists():
        _link_tree(src / "checkpoints" / FROZEN_DIR, writer.frozen.dir)
        writer.frozen.adopt(model, frozen_names)
        writer.index.frozen = _frozen_entry(writer.run)
    writer.index.save()


def remove_checkpoint_dir(d: Path) -> None:
    """Rename to ``.thinned-step-N`` (atomic), then delete: no half-deleted folder ever looks like a checkpoint."""
    d = Path(d)
    if not d.exists():
        return
    trash = d.with_name(TRASH_PREFIX + d.name)
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(d, trash)
    shutil.rmtree(trash)


def read_index_steps(run: Path) -> set[int] | None:
    f = Path(run) / "checkpoints" / INDEX_NAME
    if not f.exists():
        return None
    try:
        return {int(s) for s in json.loads(f.read_text()).get("checkpoints", {})}
    except (ValueError, AttributeError):
        return set()


def read_index(run: Path) -> dict | None:
    f = Path(run) / "checkpoints" / INDEX_NAME
    return json.loads(f.read_text()) if f.exists() else None


def check_binding(path: Path, index: dict | None = None) -> None:
    """Refuse a checkpoint folder whose ``hashes.json`` is not the one the run's index recorded for its step."""
    path = Path(path)
    run = path.parent.parent
    index = index if index is not None else read_index(run)
    if index is None or not path.name.startswith("step-"):
        return
    step = _step_of(path)
    entry = index.get("checkpoints", {}).get(str(step))
    if entry is None:
        raise UnlearnError(f"checkpoint step {step} ({path}) is not in the run's checkpoint index: it is not one "
                           "this run saved (or a thinning removed it); refusing to use it")
    problem = binding_problem(path, entry)
    if problem:
        raise UnlearnError(problem)


def binding_problem(d: Path, entry: dict) -> str | None:
    """Why the checkpoint folder ``d`` is not the one recorded as ``entry`` (None if it is)."""
    try:
        actual = _entry(d)
    except (OSError, ValueError, KeyError) as e:
        return f"checkpoint step {_step_of(d)}: its hashes.json cannot be read ({e})"
    for part, what in (("params_root", "parameter"), ("optimizer_root", "optimizer")):
        if actual[part] != entry.get(part):
            return (f"checkpoint step {_step_of(d)} is not this run's: its {what} root {actual[part][:16]}... differs "
                    f"from the root the run recorded when it saved that checkpoint ({str(entry.get(part))[:16]}...); "
                    "the folder was replaced (copied from another run?): restore the run's own checkpoint")
    if actual["hashes_sha256"] != entry.get("hashes_sha256") or actual["meta_sha256"] != entry.get("meta_sha256"):
        return (f"checkpoint step {_step_of(d)}: its hashes.json is not the one the run recorded (same roots, other "
                "contents): it was edited; restore the run's own checkpoint")
    return None


def check_checkpoints(run: Path, header: dict, key: bytes | None, sealed: bool, total_steps: int,
                      check_sidecars: bool = True, deep: bool = False) -> tuple[dict[int, Path], list[str], list[str]]:
    """Every check of a run's checkpoints: complete, bound to the run (index roots and MAC), none missing that the
    index (or, in runs without one, the header's cadence) says exists; ``deep`` also checks every tensor.

    Returns (usable checkpoints by step, errors, warnings).
    """
    run = Path(run)
    errors, warns = [], []
    severe = errors if sealed else warns
    index = read_index(run)
    cps = list_checkpoints(run)
    on_disk = {_step_of(d): d for d in sorted((run / "checkpoints").glob("step-*"))}
    for d in sorted((run / "checkpoints").glob(TRASH_PREFIX + "step-*")):
        warns.append(f"{d.name} is left from an interrupted checkpoint thinning (not a checkpoint; safe to delete)")
    if index is None:
        if header.get("checkpoint_index"):
            errors.append(f"checkpoints/{INDEX_NAME} is missing: the run recorded its checkpoints' roots there, so its "
                          "checkpoints cannot be bound to it")
            return {}, errors, warns
        warns.append("this run has no checkpoint index (recorded by an older hf_unlearn): its checkpoints are checked "
                     "against their own hashes.json only, not bound to the run by roots")
        every = header.get("checkpoint_steps")
        if every and total_steps:
            start = (header.get("parent") or {}).get("start_step")
            expected = sorted(s for s in {0, total_steps, *range(0, total_steps, int(every))}
                              if start is None or s > start or s == 0 and 0 in on_disk)
            missing = [s for s in expected if s not in cps and (sealed or s < total_steps)]
            if missing:
                severe.append(f"checkpoint step(s) {missing} are missing: the header's cadence (every {every} steps) "
                              "says the run saved them")
        for s, d in on_disk.items():
            if not is_complete(d):
                severe.append(f"checkpoint step {s} is incomplete" + ("" if sealed else ": it is not used"))
    else:
        if key is not None and not hmac.compare_digest(str(index.get("mac", "")), _mac(key, index)):
            errors.append(f"checkpoints/{INDEX_NAME} does not verify under the run key: edited after it was written")
        elif key is None:
            warns.append(f"checkpoints/{INDEX_NAME}'s MAC was not checked (the run key is not available here)")
        if index.get("run_id") != header.get("run_id"):
            errors.append(f"checkpoints/{INDEX_NAME} belongs to run {index.get('run_id')}, not to this run "
                          f"({header.get('run_id')}): copied from another run")
        listed = {int(s): e for s, e in index.get("checkpoints", {}).items()}
        for s, entry in sorted(listed.items()):
            d = on_disk.get(s)
            if d is None or not is_complete(d):
                severe.append(f"checkpoint step {s} is listed in the run's checkpoint index but "
                              + ("missing" if d is None else "incomplete") + ": it was deleted or moved")
                continue
            problem = binding_problem(d, entry)
            if problem:
                errors.append(problem)
                cps.pop(s, None)  # reported; not checked further
        for s in sorted(set(on_disk) - set(listed)):
            warns.append(f"checkpoint folder step {s} is not in the run's checkpoint index (an interrupted save or "
                         "thinning left it, or it was added): it is not used")
        frozen = run / "checkpoints" / FROZEN_DIR / "hashes.json"
        if index.get("frozen"):
            if not frozen.exists():
                errors.append("checkpoints/frozen/ is missing: the run's checkpoints reference the frozen tensors "
                              "saved there")
            elif file_sha256(frozen) != index["frozen"].get("hashes_sha256"):
                errors.append("checkpoints/frozen/hashes.json is not the one the run recorded: the frozen tensors were "
                              "replaced (copied from another run?)")
    for step, d in cps.items():
        if not check_sidecars:
            break
        ok = check_sidecar(d / "hashes.json")
        if ok is False:
            errors.append(f"checkpoint step {step}: hashes.json does not match its SHA-256 sidecar")
        elif ok is None:
            severe.append(f"checkpoint step {step} has no hashes.json.sha256 sidecar" + (" in a sealed run" if sealed
                                                                                          else ""))
        if deep and ok is not False:
            try:
                verify_checkpoint_files(d)
            except UnlearnError as e:
                errors.append(str(e))
    return cps, errors, warns
