"""State hashes: SHA-256 over (name, dtype, shape, raw bytes) of every tensor, per tensor and as roots.

One function for the whole library: trace verification, the Hub manifest and ``hub verify`` all call
:func:`state_hashes`, so a hash printed anywhere can be compared with a hash printed anywhere else.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..errors import UnlearnError
from ..utils import atomic_write_text
from .dtensors import full, is_sharded
from .peft_names import base_key
from .workers import map_tensors, nbytes

HASH_FORMAT = "hf_unlearn.state_hash.v1"
# A checkpoint's ``hashes.json`` (and the frozen store's) with ``"tensor_names": "plain"`` hashes each model tensor under
# the name the plain model gives it (:func:`~hf_unlearn.trace.peft_names.base_key`: a PEFT base tensor
# ``base_model.model.X.base_layer.weight`` as ``X.weight``), its keys staying the tensors' own: the same hash the
# lineage's start root takes of that tensor, so a LoRA recording hashes its frozen base once. Written only where a
# name differs (a PEFT model); without the field each tensor is hashed under its own name (every run recorded before,
# and every model whose names are the plain ones, where both rules are one). A mix-up of the two rules can only
# refuse a checkpoint (the hashes differ), never pass one: each hash still covers the tensor's bytes.
TENSOR_NAMES = "tensor_names"
PLAIN = "plain"
NAMES_KEY = "hash_names"  # a loaded checkpoint state's rule (load_checkpoint sets it): checkpoint_hashes follows it


def tensor_hash(name: str, tensor: torch.Tensor) -> str:
    """SHA-256 of one named tensor: its name, dtype, shape and raw little-endian bytes. A sharded tensor (FSDP2's
    DTensor) is hashed as its full logical tensor, gathered for this hash only (a collective: every process calls it
    for the same tensors in the same order), so the hash does not depend on the sharding."""
    t = full(tensor.detach()).to("cpu").contiguous()
    h = hashlib.sha256()
    h.update(name.encode("utf-8") + b"\0")
    h.update(str(t.dtype).removeprefix("torch.").encode() + b"\0")
    h.update(json.dumps(list(t.shape)).encode() + b"\0")
    h.update(_raw_bytes(t))
    return h.hexdigest()


def tensor_hashes(named: Mapping[str, torch.Tensor], plain: bool = False) -> dict[str, str]:
    """:func:`tensor_hash` of every named tensor, on every core torch may use when each is a local CPU tensor (a
    sharded one is gathered by a collective, which must run in the same order on every process: one at a time).
    ``plain``: each hashed under :func:`hash_name` (keys unchanged)."""
    items = [(n, hash_name(n, plain), t) for n, t in named.items()]
    if any(is_sharded(t) or t.device.type != "cpu" for _, _, t in items):
        return {n: tensor_hash(h, t) for n, h, t in items}
    hashes = map_tensors(lambda item: tensor_hash(*item[1:]), items, [nbytes(t) for _, _, t in items])
    return {n: h for (n, _, _), h in zip(items, hashes)}


def hash_name(name: str, plain: bool) -> str:
    """The name a model tensor is hashed under: the plain model's (``plain``, see :data:`TENSOR_NAMES`) or its own."""
    return base_key(name) if plain else name


def plain_names(hashes: Mapping[str, Any] | None) -> bool:
    """Whether a ``hashes.json`` dict (a checkpoint's, the frozen store's) hashes model tensors under plain names."""
    return (hashes or {}).get(TENSOR_NAMES) == PLAIN


def uses_plain_names(hashes: Mapping[str, Any]) -> bool:
    """Whether a ``hashes.json`` dict's model hashes follow the plain rule: it says so, or its names are all plain ones
    (both rules are one). False: a PEFT run recorded before the rule (its later checkpoints keep its rule)."""
    return plain_names(hashes) or not names_field(hashes.get("params", {}), True)


def names_field(names, plain: bool) -> dict[str, str]:
    """The ``tensor_names`` entry of a ``hashes.json`` over model tensors ``names``: only where the rule changes one."""
    return {TENSOR_NAMES: PLAIN} if plain and any(base_key(n) != n for n in names) else {}


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (hashing a 1.6 GB checkpoint must not copy it first)."""
    flat = t.reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def batch_digest(batch: Mapping[str, Any]) -> str:
    """SHA-256 over a collated batch (every key, tensor dtype, shape and bytes): what a replay must rebuild.

    It hashes private content: the plan stores it keyed (:func:`hf_unlearn.trace.recording.keyed_batch_digest`).
    """
    h = hashlib.sha256(b"hf_unlearn.batch.v1")
    for key in sorted(batch):
        value = batch[key]
        if torch.is_tensor(value):
            h.update(tensor_hash(key, value).encode())
        else:
            h.update(key.encode() + b"\0" + json.dumps(value, default=repr, sort_keys=True).encode())
    return h.hexdigest()


def root_hash(per_tensor: Mapping[str, str]) -> str:
    """One hash over the sorted (name, tensor hash) pairs."""
    h = hashlib.sha256(HASH_FORMAT.encode())
    for name in sorted(per_tensor):
        h.update(name.encode("utf-8") + b"\0" + per_tensor[name].encode() + b"\n")
    return h.hexdigest()


def optimizer_tensors(optimizer_or_state: Any, param_names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Flatten an optimizer's state into named tensors (``<param name>.<key>``, e.g. ``lm_head.weight.exp_avg``).

    ``param_names`` gives the names of the optimizer's parameters in ``param_groups`` order; without it the
    optimizer's integer indices are used. Scalar entries (like a float ``step``) become 0-dim float64 tensors.
    """
    state_dict = optimizer_or_state.state_dict() if hasattr(optimizer_or_state, "state_dict") else optimizer_or_state
    order = [i for group in state_dict.get("param_groups", []) for i in group["params"]]
    names = {}
    if param_names is not None:
        names = {idx: param_names[pos] for pos, idx in enumerate(order) if pos < len(param_names)}
    out: dict[str, torch.Tensor] = {}
    for idx, entries in state_dict.get("state", {}).items():
        _flatten_entries(out, names.get(idx, str(idx)), entries)
    return out


def _flatten_entries(out: dict, prefix: str, entries: dict) -> None:
    """One parameter's optimizer state into ``out``: nested dicts as dotted names (bitsandbytes keeps its quantised
    state under ``__bnb_optimizer_quant_state__``), numbers as 0-dim float64, text as its UTF-8 bytes; None skipped."""
    for key, value in entries.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            _flatten_entries(out, name, value)
        elif torch.is_tensor(value):
            out[name] = value
        elif isinstance(value, (bool, int, float)):
            out[name] = torch.tensor(float(value), dtype=torch.float64)
        elif isinstance(value, str):
            out[name] = torch.tensor(list(value.encode("utf-8")), dtype=torch.uint8)
        elif value is not None:
            raise UnlearnError(f"optimizer state {name} holds a {type(value).__name__} object, which the trace cannot hash; use a "
                               "torch or bitsandbytes optimizer whose state holds tensors and numbers")


def optimizer_param_names(model: torch.nn.Module, optimizer) -> list[str]:
    """Names of ``optimizer``'s parameters in ``param_groups`` order (via the model's named parameters)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id.get(id(p), f"param{i}") for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])]


@dataclass
class StateHashes:
    """Per-tensor hashes and roots of a model state (and optionally of its optimizer state)."""

    params: dict[str, str]
    optimizer: dict[str, str] = field(default_factory=dict)
    params_root: str = ""
    optimizer_root: str = ""
    format: str = HASH_FORMAT

    def __post_init__(self):
        self.params_root = self.params_root or root_hash(self.params)
        self.optimizer_root = self.optimizer_root or (root_hash(self.optimizer) if self.optimizer else "")

    @property
    def root(self) -> str:
        """One hash over both roots."""
        return hashlib.sha256(f"{self.params_root}:{self.optimizer_root}".encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "root": self.root}

    def to_json(self, path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, sort_keys=True))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StateHashes:
        return cls(
            params=dict(data["params"]),
            optimizer=dict(data.get("optimizer", {})),
            params_root=data.get("params_root", ""),
            optimizer_root=data.get("optimizer_root", ""),
            format=data.get("format", HASH_FORMAT),
        )

    @classmethod
    def from_json(cls, path) -> StateHashes:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def state_hashes(model_or_state_dict, optimizer=None) -> StateHashes:
    """Hash a model (or a state dict) and, optionally, an optimizer (or its state dict).

    Tied weights appear under each of their state-dict names, as ``state_dict()`` lists them.
    """
    if isinstance(model_or_state_dict, torch.nn.Module):
        tensors = model_or_state_dict.state_dict()
    else:
        tensors = model_or_state_dict
    params = tensor_hashes(tensors)
    opt: dict[str, str] = {}
    if optimizer is not None:
        names = None
        if isinstance(model_or_state_dict, torch.nn.Module) and hasattr(optimizer, "param_groups"):
            names = optimizer_param_names(model_or_state_dict, optimizer)
        opt = tensor_hashes(optimizer_tensors(optimizer, names))
    return StateHashes(params=params, optimizer=opt)


def checkpoint_hashes(state: Mapping[str, Any], known: Mapping[str, str] | None = None,
                      plain: bool | None = None) -> dict[str, Any]:
    """The ``hashes.json`` of a checkpoint dict (``model``, ``optimizer``, ``param_names``, ``tied``, ``step``).

    Per-tensor hashes and roots of the parameters (each tied tensor once, under its first name) and of the
    optimizer state (named by parameter), plus ``meta_sha256`` over everything else a replay loads from the
    checkpoint (the step, the tie map, the parameter names and the optimizer's param-group hyperparameters).
    Recomputing it from a loaded checkpoint and comparing checks the checkpoint against what was saved.
    ``known`` gives hashes already computed (frozen tensors, hashed once when they were saved). ``plain``: model
    tensors hashed under the plain model's names (:data:`TENSOR_NAMES`); None: as the state was loaded
    (:data:`NAMES_KEY`), a state captured live under plain names (what a recording writes).
    """
    known = known or {}
    plain = state.get(NAMES_KEY, PLAIN) == PLAIN if plain is None else plain
    fresh = tensor_hashes({n: t for n, t in state["model"].items() if n not in known}, plain)
    params = {n: known[n] if n in known else fresh[n] for n in state["model"]}
    opt = tensor_hashes(optimizer_tensors(state["optimizer"], state.get("param_names")))
    meta = {"step": state.get("step"), "tied": state.get("tied", {}), "param_names": state.get("param_names"),
            "param_groups": state["optimizer"].get("param_groups", [])}
    meta_sha = hashlib.sha256(json.dumps(meta, sort_keys=True, default=repr).encode()).hexdigest()
    hashes = StateHashes(params=params, optimizer=opt).to_dict()
    hashes.update(meta_sha256=meta_sha, tied=dict(state.get("tied", {})),
                  elements={"params": sum(t.numel() for t in state["model"].values())},
                  **names_field(state["model"], plain))
    return hashes


def diff_hashes(a: StateHashes, b: StateHashes) -> dict[str, list[str]]:
    """Names whose hashes differ, or that exist on one side only, for params and optimizer state."""
    out = {}
    for part in ("params", "optimizer"):
        x, y = getattr(a, part), getattr(b, part)
        out[part] = sorted(n for n in set(x) | set(y) if x.get(n) != y.get(n))
    return out
