"""An FSDP2 run's checkpoints, sharded on disk: every process writes the shards it holds, nobody the full state.

```
RUN/checkpoints/step-00000040/  model-rank0-of-2.safetensors      optimizer-rank0-of-2.safetensors
                                model-rank1-of-2.safetensors      optimizer-rank1-of-2.safetensors
                                checkpoint.json (+ "sharding")    hashes.json(.sha256) (+ "files")
```

* **Written by every process.** Each process writes this process's dim-0 shard (``DTensor.to_local()``) of every
  sharded model and optimizer tensor into its own safetensors files; tensors that are not sharded (buffers, the
  optimizer's step counts) are written once, by process 0. ``checkpoint.json`` records the sharding: the world size,
  the placement (``Shard(0)`` on a 1-D mesh, FSDP2's) and, per sharded tensor, its full shape and the rows each
  process holds. No process ever holds the full state to write a checkpoint.
* **Hashed as the full logical tensors.** ``hashes.json`` holds the same per-tensor SHA-256 over (name, dtype, shape,
  bytes of the *full* tensor) and the same roots as an unsharded checkpoint of the same state
  (:func:`hf_unlearn.trace.hashing.checkpoint_hashes`): each sharded tensor is gathered on its own, hashed and
  dropped (peak memory: the largest tensor, never the model). A SHA-256 over the full tensor's bytes is
  sharding-independent by construction, which per-shard hashes (or a hash per dim-0 chunk) are not: the chunks
  depend on the world size. So a run's roots do not depend on how it was sharded, and ``trace verify`` compares
  them with any unsharded run's.
* **Bound and checked as today.** ``hashes.json`` also holds the SHA-256 of every shard file and of
  ``checkpoint.json`` (each process hashes the files it wrote); the run's checkpoint index binds ``hashes.json``.
  Every load checks the files it reads against those hashes and recomputes the model's per-tensor hashes; a deep
  check (``trace inspect --deep``) assembles every tensor, one at a time, and checks its hash.
* **Loaded at the recorded world size.** A replay's processes each read the model's full tensors (a ``Trainer``
  builds the full model on every process before FSDP2 shards it) and only their own optimizer shards
  (:func:`hf_unlearn.trace.sharding.load_optimizer_state` makes DTensors of them); one process (``trace verify``,
  a deep check) assembles the full state.
* **Retention** removes a whole checkpoint folder at once (every process's files are in it: renamed, then deleted).
* **Not done:** tensors that do not train are written with each checkpoint (no ``frozen/`` store for sharded runs);
  the folder must be on a file system every process writes to (one machine, or a shared one).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UnlearnError
from ..utils import atomic_write_text
from .checkpoint_files import CHECKPOINT_FORMAT, _flatten_optimizer, _save_safetensors, checkpoint_dir, tied_aliases
from .dtensors import is_sharded, local
from .files import file_sha256, write_sidecar
from .hashing import checkpoint_hashes, hash_name, optimizer_param_names, plain_names, tensor_hash

PLACEMENT = "Shard(0)"
KINDS = ("model", "optimizer")


def shard_file(kind: str, rank: int, world: int) -> str:
    return f"{kind}-rank{rank}-of-{world}.safetensors"


def is_sharded_checkpoint(meta: dict) -> bool:
    return "sharding" in meta


def _mine(tensors: dict, rank: int) -> tuple[dict, dict]:
    """(what this process writes, rows of each sharded tensor it holds): its shards, and on process 0 the tensors
    that are not sharded."""
    from torch.distributed.tensor import Shard

    out, rows = {}, {}
    for name, t in tensors.items():
        if is_sharded(t):
            if tuple(t.placements) != (Shard(0),):
                raise UnlearnError(f"{name} is sharded as {t.placements}, not {PLACEMENT} on one mesh dimension "
                                   "(FSDP2's): a sharded checkpoint cannot hold it")
            out[name] = local(t).detach().to("cpu").contiguous()
            rows[name] = int(out[name].shape[0])
        elif rank == 0:
            out[name] = t.detach().to("cpu")
    return out, rows


def save(run: Path | None, step: int, model, optimizer, plain: bool = True) -> tuple[Path | None, dict]:
    """Every process of a sharded run calls it (collectives): writes its shard files into ``run``'s checkpoint at
    ``step`` (nothing written when ``run`` is None), then the main process writes ``checkpoint.json``, ``hashes.json``
    and its sidecar. Returns (the folder on the main process else None, the checkpoint's hashes on every process).
    ``plain``: the run's hash rule (:data:`hf_unlearn.trace.hashing.TENSOR_NAMES`)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    sd = model.state_dict()
    tied = tied_aliases({k: local(v) for k, v in sd.items()})
    tensors = {k: v.detach() for k, v in sd.items() if k not in tied}
    osd = optimizer.state_dict()
    flat = _flatten_optimizer(osd)
    if flat is None:
        raise UnlearnError("the optimizer's state is not tensors and JSON values: a sharded checkpoint cannot hold it "
                           "(use a torch.optim optimizer)")
    files, rows = {}, {}
    d = checkpoint_dir(run, step) if run is not None else None
    for kind, part in zip(KINDS, (tensors, flat[0])):
        mine, rows[kind] = _mine(part, rank)
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
            path = d / shard_file(kind, rank, world)
            _save_safetensors(mine, path)
            files[path.name] = file_sha256(path)
        del mine
    everyone = [None] * world
    dist.all_gather_object(everyone, {"files": files, "rows": rows})
    state = {"step": step, "model": tensors, "tied": tied, "optimizer": osd,
             "param_names": optimizer_param_names(model, optimizer)}
    hashes = checkpoint_hashes(state, plain=plain)  # full logical tensors, gathered one at a time (hashing.tensor_hash)
    if d is None or rank != 0:
        return None, hashes
    sharding = {"world_size": world, "placement": PLACEMENT,
                "files": {kind: [shard_file(kind, r, world) for r in range(world)] for kind in KINDS},
                "rows": {kind: {n: [e["rows"][kind][n] for e in everyone] for n in rows[kind]} for kind in KINDS},
                "shapes": {n: list(t.shape) for n, t in tensors.items() if is_sharded(t)}}
    meta = {"format": CHECKPOINT_FORMAT, "step": step, "tied": tied, "param_names": state["param_names"],
            "frozen": [], "optimizer": flat[1], "sharding": sharding}
    atomic_write_text(d / "checkpoint.json", json.dumps(meta, indent=1, sort_keys=True))
    hashes["files"] = {k: v for e in everyone for k, v in e["files"].items()}
    hashes["files"]["checkpoint.json"] = file_sha256(d / "checkpoint.json")
    atomic_write_text(d / "hashes.json", json.dumps(hashes, indent=1, sort_keys=True))  # last: the checkpoint is whole
    write_sidecar(d / "hashes.json")
    return d, hashes


def is_complete(d: Path, meta: dict) -> bool:
    return all((Path(d) / f).exists() for kind in KINDS for f in meta["sharding"]["files"][kind])


def _check_files(path: Path, names) -> None:
    """Refuse the checkpoint unless each of ``names`` has the SHA-256 its ``hashes.json`` recorded."""

    recorded = json.loads((path / "hashes.json").read_text()).get("files", {})
    for name in names:
        f = path / name
        if not f.exists():
            raise UnlearnError(f"checkpoint {path} lacks its shard file {name}: restore the run's own checkpoint")
        if recorded.get(name) != file_sha256(f):
            raise UnlearnError(f"checkpoint {path}: {name} does not match the SHA-256 its hashes.json recorded: "
                               "modified after it was saved; restore the run's own checkpoint")


def _assemble(path: Path, files: list[str], rows: dict, only=None) -> dict:
    """The full tensors of one kind: each sharded tensor concatenated from every process's file (dim 0), the others
    from process 0's; ``only``: the names to read."""
    import torch
    from safetensors import safe_open

    handles = [safe_open(str(path / f), framework="pt") for f in files]
    names = [n for n in dict.fromkeys(k for h in handles for k in h.keys()) if only is None or n in only]
    out = {}
    for n in names:
        out[n] = torch.cat([h.get_tensor(n) for h in handles]) if n in rows else handles[0].get_tensor(n)
    return out


def load(path: Path, meta: dict, rank: int | None = None) -> tuple[dict, dict]:
    """(model tensors, flattened optimizer tensors) of a sharded checkpoint: the model's full tensors; the optimizer's
    full tensors, or with ``rank`` (a replay at the recorded world size) this process's shards of the sharded ones
    (and the others). Every file read is checked against ``hashes.json``."""
    from safetensors.torch import load_file

    sh = meta["sharding"]
    model_files, opt_files = sh["files"]["model"], sh["files"]["optimizer"]
    if rank is not None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world != sh["world_size"]:
            raise UnlearnError(f"checkpoint {path} is sharded over {sh['world_size']} processes and this replay has "
                               f"{world}: run it with torchrun --nproc_per_node {sh['world_size']}")
        opt_files = [opt_files[rank]] if rank == 0 else [opt_files[0], opt_files[rank]]
    _check_files(path, ["checkpoint.json", *model_files, *opt_files])
    model = _assemble(path, model_files, sh["rows"]["model"])
    if rank is None:
        return model, _assemble(path, opt_files, sh["rows"]["optimizer"])
    own = load_file(path / opt_files[-1])
    if rank != 0:  # the tensors that are not sharded, from process 0's file
        own.update(_assemble(path, opt_files[:1], {}, only=set(load_file_keys(path / opt_files[0]))
                             - set(sh["rows"]["optimizer"])))
    return model, own


def load_file_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as h:
        return list(h.keys())


def local_keys(meta: dict) -> list[list]:
    """``[index, key]`` of the optimizer entries a replay's process holds as its shard (flattened ``state.i.key``)."""
    return [[int(k.split(".", 2)[1]), k.split(".", 2)[2]] for k in meta["sharding"]["rows"]["optimizer"]]


def check(path: Path, state: dict) -> None:
    """The model's per-tensor hashes and the metadata hash of a checkpoint loaded with this process's optimizer
    shards (the shards were checked by their files' SHA-256 as they were read)."""
    recorded = json.loads((Path(path) / "hashes.json").read_text())
    actual = checkpoint_hashes({**state, "optimizer": {"state": {}, "param_groups": state["optimizer"]["param_groups"]}},
                               plain=plain_names(recorded))
    bad = sorted(n for n in set(recorded["params"]) | set(actual["params"])
                 if recorded["params"].get(n) != actual["params"].get(n))
    if recorded.get("meta_sha256") != actual["meta_sha256"]:
        bad.append("step/tie map/parameter names/optimizer hyperparameters")
    if bad:
        raise UnlearnError(f"checkpoint {path} does not match its hashes.json (it differs in {', '.join(bad[:3])}"
                           f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}): modified after it was saved")


def verify_files(path: Path, meta: dict, by_idx: dict, plain: bool = False) -> tuple[list[str], set, set]:
    """A deep check of a sharded checkpoint's tensors: every file's SHA-256, then each full tensor assembled on its
    own and hashed (memory: the largest tensor; ``plain``: the ``hashes.json``'s rule). Returns (names that differ
    from ``hashes.json``, model and optimizer names seen)."""
    sh = meta["sharding"]
    _check_files(path, ["checkpoint.json", *(f for kind in KINDS for f in sh["files"][kind])])
    recorded = json.loads((path / "hashes.json").read_text())
    bad, seen = [], {"params": set(), "optimizer": set()}
    for kind, part in (("model", "params"), ("optimizer", "optimizer")):
        for key in load_file_keys(path / sh["files"][kind][0]):
            t = _assemble(path, sh["files"][kind], sh["rows"][kind], only={key})[key]
            if kind == "model":
                name, hashed = key, hash_name(key, plain)
            else:
                _, idx, entry = key.split(".", 2)
                name = hashed = f"{by_idx.get(int(idx), idx)}.{entry}"
            seen[part].add(name)
            if tensor_hash(hashed, t) != recorded[part].get(name):
                bad.append(name)
    return bad, seen["params"], seen["optimizer"]
