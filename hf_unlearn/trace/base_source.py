"""Where a recording's frozen tensors (a LoRA's base, frozen layers) can be referenced instead of copied.

A partly frozen model's frozen tensors never change during the run, and they already exist on disk: in the model
folder or the Hugging Face cache snapshot ``from_pretrained`` read, or in the GGUF file :func:`hf_unlearn.load_model`
de-quantised. By default a recording references them there (:func:`loaded_from` finds the source on its own) and
stores in the run only what there is nothing to reference for (a model built from a config in memory, a tensor
changed after loading).

What is recorded (``checkpoints/frozen/hashes.json`` ``source``): the kind, the path, the Hub revision when the
folder is a cache snapshot, every referenced file's size and SHA-256, and for each frozen tensor the file and key it
is in. Every load checks the files' size and SHA-256 first (once per process per file) and refuses in one line when
a file has moved or changed; the tensors' own SHA-256, recorded in each checkpoint, are checked as before.

GGUF: the tensors are the de-quantised ones, so a reference is the GGUF file (its SHA-256) plus the
de-quantisation, which is deterministic (same file, same transformers/gguf code, same dtype: the same bits; the
tests check it, and the per-tensor hashes check it again at every load). A tensor is referenced only if it is still
the one loading produced: the same tensor object (or its ``copy.deepcopy``), not changed in place since.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..errors import UnlearnError
from ..models import GGUF_MARK, GGUFOrigin, load_model, mark_gguf  # noqa: F401 - GGUFOrigin, mark_gguf lived here
from .files import file_sha256 as sha256
from .peft_names import base_key  # noqa: F401 - lived here

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # what from_pretrained reads, one or sharded


def stamp(t) -> tuple:
    """Identity and in-place version of a tensor: equal stamps mean the tensor was not replaced nor modified."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t._version)


def _base_model(model):
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def loaded_from(model) -> dict | None:
    """``{"kind": "safetensors"|"gguf", "path": ..., "revision": ...}`` for where ``model``'s weights were loaded
    from, or None (built from a config, or loaded from somewhere with nothing to reference)."""
    base = _base_model(model)
    gguf = getattr(base, GGUF_MARK, None) or getattr(model, GGUF_MARK, None)
    if gguf is not None and Path(gguf.path).is_file():
        return {"kind": "gguf", "path": gguf.path, "dtype": gguf.dtype}
    name = getattr(getattr(base, "config", None), "_name_or_path", "") or ""
    if not name:
        return None
    folder = Path(name).expanduser()
    if folder.is_dir():  # the files from_pretrained reads (a run's model/ holds only buffers.safetensors: not weights)
        return {"kind": "safetensors", "path": str(folder.resolve()), "revision": None} \
            if any((folder / f).is_file() for f in WEIGHT_FILES) else None
    return _cache_snapshot(name, getattr(base.config, "_commit_hash", None))


def _cache_snapshot(repo_id: str, revision: str | None) -> dict | None:
    """The Hugging Face cache snapshot of ``repo_id`` holding safetensors weights (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency
        return None
    for filename in WEIGHT_FILES:
        try:
            found = try_to_load_from_cache(repo_id, filename, revision=revision)
        except Exception:  # noqa: BLE001 - not a repo id (a path that does not exist): nothing to reference
            return None
        if isinstance(found, str):
            snapshot = Path(found).parent
            return {"kind": "safetensors", "path": str(snapshot), "revision": snapshot.name}
    return None


def match(frozen: dict, model, source: dict) -> dict[str, list[str]]:
    """``frozen name -> [file, key]`` for the frozen tensors that ``source`` holds bit for bit (safetensors: the
    bytes compared; GGUF: the tensor is still the one loading produced)."""
    if source["kind"] == "gguf":
        origin = getattr(_base_model(model), GGUF_MARK, None) or getattr(model, GGUF_MARK)
        params = dict(model.named_parameters(remove_duplicate=False))
        file = Path(source["path"]).name
        return {n: [file, base_key(n)] for n in frozen if n in params and origin.unchanged(base_key(n), params[n])}
    import torch
    from safetensors import safe_open

    refs = {}
    wanted = {base_key(n): n for n in frozen}
    for f in sorted(Path(source["path"]).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for key in set(h.keys()) & set(wanted):
                t, mine = h.get_slice(key), frozen[wanted[key]]
                if tuple(t.get_shape()) != tuple(mine.shape):
                    continue
                theirs = h.get_tensor(key)
                # the dtype too: torch.equal compares values, and a model loaded with another dtype than the file's
                # holds equal values in other bytes wherever the cast is exact (ones, zeros; every value of a bf16
                # file loaded as fp32): referenced, they load back in the file's dtype and fail the run's hashes
                if theirs.dtype == mine.dtype and torch.equal(theirs, mine):
                    refs[wanted[key]] = [f.name, key]
    return refs


def describe(source: dict, refs: dict) -> dict:
    """The record written to hashes.json: the source, its referenced files' size and SHA-256, and ``refs``."""
    folder = Path(source["path"]) if source["kind"] == "safetensors" else Path(source["path"]).parent
    files = sorted({file for file, _ in refs.values()})
    return {**source, "path": str(folder), "tensors": refs,
            "files": {f: {"size": (folder / f).stat().st_size, "sha256": file_sha256(folder / f)} for f in files}}


@functools.lru_cache(maxsize=64)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    """The run's own file hash, once per file version (size and mtime) and process: a base is read in GBs."""
    return sha256(Path(path))


def file_sha256(path: Path) -> str:
    st = path.stat()
    return _sha256_cached(str(path), st.st_size, st.st_mtime_ns)


def check_files(source: dict) -> None:
    """Refuse, in one line, a referenced file that has moved or changed since the recording."""
    folder = Path(source["path"])
    what = f"revision {source['revision']} of " if source.get("revision") else ""
    for name, rec in (source.get("files") or {}).items():
        path = folder / name
        if not path.is_file():
            raise UnlearnError(f"{path} is missing: the run references its frozen base weights there ({what}the "
                               f"model it was loaded from); put that file back at this path to replay the run")
        if path.stat().st_size != rec["size"] or file_sha256(path) != rec["sha256"]:
            raise UnlearnError(f"{path} has changed since the run was recorded (SHA-256 {rec['sha256'][:12]}... "
                               f"expected): the run's frozen base weights are {what}that file as it was; restore it")


_LIVE: dict[tuple[str, str, str], dict] = {}  # (GGUF path, dtype, SHA-256) -> tensors of a model loaded from it


def remember_live(source: dict, model, refs: dict) -> None:
    """The recording process already holds the de-quantised tensors it references: its own replays (the
    end-of-recording self-check) read them from memory instead of de-quantising the file again. Other processes
    de-quantise; either way each tensor's recorded SHA-256 is checked when a checkpoint is verified."""
    params = dict(model.named_parameters(remove_duplicate=False))
    file, = {f for f, _ in refs.values()}
    key = (str(Path(source["path"]) / file), source["dtype"], source["files"][file]["sha256"])
    _LIVE.setdefault(key, {}).update({k: params[n].detach() for n, (_, k) in refs.items()})


def release_live() -> None:
    """Forget the live tensors :func:`remember_live` kept (called when a recording's ``train()`` returns): the model
    is the user's again and may be edited in place (``merge_and_unload`` adds a LoRA into the very base tensors), so a
    later load in this process de-quantises the file instead of reading them."""
    if _LIVE:
        _LIVE.clear()
        _dequantized.cache_clear()


@functools.lru_cache(maxsize=2)
def _dequantized(path: str, dtype: str, sha256: str) -> dict:
    """The state dict of the GGUF file at ``path``, de-quantised as load_model does (``sha256`` keys the cache)."""
    if (path, dtype, sha256) in _LIVE:
        return _LIVE[(path, dtype, sha256)]
    import torch

    return dict(load_model(path, dtype=getattr(torch, dtype)).state_dict())


def load(source: dict, items: list[tuple[str, str, str]]) -> dict:
    """``{name: tensor}`` for ``items`` = ``[(name, file, key)]`` referenced in ``source`` (files checked first)."""
    check_files(source)
    out = {}
    if source["kind"] == "gguf":
        for name, file, key in items:
            state = _dequantized(str(Path(source["path"]) / file), source["dtype"], source["files"][file]["sha256"])
            if key not in state:
                raise UnlearnError(f"{Path(source['path']) / file} de-quantises to no tensor {key!r}, which the run "
                                   "references")
            out[name] = state[key]
        return out
    from safetensors import safe_open

    by_file: dict[str, list[tuple[str, str]]] = {}
    for name, file, key in items:
        by_file.setdefault(file, []).append((name, key))
    for file, pairs in by_file.items():
        with safe_open(str(Path(source["path"]) / file), framework="pt") as h:
            keys = set(h.keys())
            for name, key in pairs:
                if key not in keys:
                    raise UnlearnError(f"{Path(source['path']) / file} lacks the frozen tensor {key!r} a checkpoint "
                                       "references")
                out[name] = h.get_tensor(key)
    return out
