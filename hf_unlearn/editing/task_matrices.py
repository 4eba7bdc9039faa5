"""Task matrices: what fine-tuning on a task added to each linear layer of a causal LM.

For a linear layer ``l`` the task matrix is ``T^l = W^l_task - W^l_base`` in the ``nn.Linear`` convention
(``out_features x in_features``: the layer computes ``y = W x``). GPT-2's ``Conv1D`` stores its weight transposed
(``in x out``, ``y = x W``); it is read (and edited) through its transpose, so the same formula means the same thing
on every architecture: the subspaces live in the layer's **output** space, and projecting a task matrix on the left
by ``I - Q_r Q_r^T`` removes the part of the update whose outputs the retain task also uses.

Sources (all computed lazily, one layer at a time, in float32 whatever the weights' dtype):

- a fully fine-tuned model (object or folder): ``W_finetuned - W_base``;
- a LoRA adapter (a folder with ``adapter_config.json`` or a ``PeftModel``): ``scaling * B @ A`` with peft's scaling
  (``lora_alpha / r``, ``lora_alpha / sqrt(r)`` with rsLoRA, per-module ``rank_pattern``/``alpha_pattern``);
  already low rank, so the rank rule caps at ``r``;
- a task-matrix folder written by ``hf-unlearn edit task-matrices`` (see :mod:`hf_unlearn.editing.finetune`).

The layers are the attention and MLP projections inside the transformer blocks (embeddings and the output head are
not task matrices); a block is one entry of the model's list of ``num_hidden_layers`` decoder layers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UnlearnError

ADAPTER_CONFIG = "adapter_config.json"
TASK_MANIFEST = "task_matrices.json"
_OTHER_SUFFIX = re.compile(r"(\.base_layer)?\.(weight|bias)$|\.lora_embedding_[AB](\.[^.]+)?$")
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")


@dataclass
class TargetLayer:
    """One editable linear layer: its name, decoder block, module, and whether its weight is stored ``in x out``."""

    name: str
    block: int
    module: torch.nn.Module
    transposed: bool

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        w = self.module.weight
        return (int(w.shape[1]), int(w.shape[0])) if self.transposed else (int(w.shape[0]), int(w.shape[1]))

    def weight(self) -> torch.Tensor:
        """The weight as ``out x in`` (a view for ``Conv1D``)."""
        w = self.module.weight
        return w.T if self.transposed else w


def _is_conv1d(module) -> bool:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, Conv1D)


def decoder_blocks(model) -> tuple[str, torch.nn.ModuleList]:
    """``(prefix, blocks)``: the model's list of decoder layers (``model.layers``, ``transformer.h``, ...)."""
    config = getattr(model, "config", None)
    count = getattr(config, "num_hidden_layers", None)
    candidates = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and (count is None or len(m) == count)]
    if not candidates:
        raise UnlearnError(f"cannot find the transformer blocks of {type(model).__name__} (a ModuleList of "
                           f"num_hidden_layers={count} layers); QR-Erase edits transformers causal LMs")
    return min(candidates, key=lambda c: c[0].count("."))


def target_layers(model, modules: Sequence[str] | None = None) -> list[TargetLayer]:
    """The editable linear layers of ``model`` in block order; ``modules`` keeps only names ending in one of them
    (``["q_proj", "v_proj"]``, ``["c_attn"]``, or full names)."""
    if _is_peft(model):
        raise UnlearnError("the model to edit is a PeftModel; merge it first (model.merge_and_unload()) or pass its "
                           "base model, and give the adapter as the task")
    prefix, blocks = decoder_blocks(model)
    layers = []
    for index, block in enumerate(blocks):
        for sub, module in block.named_modules():
            if isinstance(module, torch.nn.Linear) or _is_conv1d(module):
                name = f"{prefix}.{index}.{sub}" if prefix else f"{index}.{sub}"
                layers.append(TargetLayer(name, index, module, _is_conv1d(module)))
    if not layers:
        raise UnlearnError(f"{type(model).__name__} has no linear layers in its transformer blocks")
    if modules:
        wanted = [str(m) for m in modules]
        kept = [t for t in layers if any(t.name == w or t.name.endswith("." + w) for w in wanted)]
        if not kept:
            names = sorted({t.name.rsplit(".", 1)[-1] for t in layers})
            raise UnlearnError(f"no layer matches {', '.join(wanted)}; this model's block layers are "
                               f"{', '.join(names)}")
        layers = kept
    return layers


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PeftModel)


class TaskMatrices(Mapping):
    """Per-layer task matrices (``name -> out x in float32 tensor``), computed on access, never all in memory.

    ``kind`` is ``"full"``, ``"lora"`` or ``"dense"``; ``fingerprint`` a state-hash root of the source (the
    fine-tuned weights or the adapter tensors); ``source`` a readable description.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, int]], compute: Callable[[str], torch.Tensor], *, kind: str,
                 fingerprint: str = "", source: str = "", meta: Mapping[str, Any] | None = None):
        self.shapes = dict(shapes)
        self._compute = compute
        self.kind, self.fingerprint, self.source = kind, fingerprint, source
        self.meta = dict(meta or {})
        self._norms: dict[str, float] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return self._compute(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def norm(self, name: str) -> float:
        """Frobenius norm of one task matrix (cached)."""
        if name not in self._norms:
            self._norms[name] = float(torch.linalg.matrix_norm(self[name]))
        return self._norms[name]

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "fingerprint": self.fingerprint, "source": self.source, "layers": len(self)}

    @classmethod
    def from_dict(cls, matrices: Mapping[str, torch.Tensor], source: str = "tensors") -> TaskMatrices:
        """Task matrices given as tensors (``out x in``), e.g. computed elsewhere."""
        from ..trace.hashing import root_hash, tensor_hash

        tensors = {k: v.detach() for k, v in matrices.items()}
        for name, t in tensors.items():
            if t.dim() != 2:
                raise UnlearnError(f"task matrix {name} must be 2-D (out x in), got shape {tuple(t.shape)}")
        fingerprint = root_hash({k: tensor_hash(k, v) for k, v in tensors.items()})
        return cls({k: tuple(v.shape) for k, v in tensors.items()}, lambda n: tensors[n].float(), kind="dense",
                   fingerprint=fingerprint, source=source)


# -- from a fully fine-tuned model ------------------------------------------------------------------------------
def task_matrices_from_models(base, finetuned, layers: Sequence[TargetLayer] | None = None, *,
                              max_relative_change: float = 0.5) -> TaskMatrices:
    """``W_finetuned - W_base`` for every target layer of ``base``.

    Refused: another architecture, a layer missing or of another shape, and a "fine-tune" whose weights are not
    near the base (median ``||T||_F / ||W_base||_F`` above ``max_relative_change``: another pretrained or random
    model of the same architecture, not a fine-tune of this base).
    """
    from ..trace.hashing import state_hashes

    if _is_peft(finetuned):
        raise UnlearnError("got a PeftModel as a fine-tuned model; pass it as an adapter (task_matrices_from_adapter)")
    layers = list(layers) if layers is not None else target_layers(base)
    base_type = getattr(getattr(base, "config", None), "model_type", type(base).__name__)
    ft_type = getattr(getattr(finetuned, "config", None), "model_type", type(finetuned).__name__)
    if base_type != ft_type or type(base).__name__ != type(finetuned).__name__:
        raise UnlearnError(f"the fine-tuned model is a {type(finetuned).__name__} ({ft_type}) but the base is a "
                           f"{type(base).__name__} ({base_type}); task matrices need the same architecture")
    ft_modules = dict(finetuned.named_modules())
    pairs: dict[str, tuple[TargetLayer, torch.nn.Module]] = {}
    for layer in layers:
        other = ft_modules.get(layer.name)
        if other is None or not hasattr(other, "weight"):
            raise UnlearnError(f"the fine-tuned model has no layer {layer.name}; it is not a fine-tune of this base")
        if tuple(other.weight.shape) != tuple(layer.module.weight.shape):
            raise UnlearnError(f"layer {layer.name} has shape {tuple(other.weight.shape)} in the fine-tuned model but "
                               f"{tuple(layer.module.weight.shape)} in the base; shapes must match")
        pairs[layer.name] = (layer, other)

    def compute(name: str) -> torch.Tensor:
        layer, other = pairs[name]
        w = layer.weight()
        theirs = other.weight.T if layer.transposed else other.weight
        return theirs.detach().to(w.device, torch.float32) - w.detach().float()

    matrices = TaskMatrices({n: pairs[n][0].shape for n in pairs}, compute, kind="full",
                            fingerprint=state_hashes(finetuned).params_root,
                            source=str(getattr(finetuned.config, "_name_or_path", "") or type(finetuned).__name__))
    relative = sorted(matrices.norm(n) / max(float(torch.linalg.matrix_norm(pairs[n][0].weight().detach().float())), 1e-12)
                      for n in pairs)
    median = relative[len(relative) // 2]
    if median > max_relative_change:
        raise UnlearnError(f"the fine-tuned model does not look like a fine-tune of this base: its weights differ by "
                           f"{median:.2f} of the base's norm (median over layers; fine-tunes change a few percent). "
                           "Pass the base it was fine-tuned from")
    if all(matrices.norm(n) == 0.0 for n in pairs):
        raise UnlearnError("the fine-tuned model's weights equal the base's: its task matrices are all zero")
    return matrices


# -- from a LoRA adapter ----------------------------------------------------------------------------------------
def _adapter_config_and_state(adapter) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    if _is_peft(adapter):
        from peft import get_peft_model_state_dict

        name = adapter.active_adapter if isinstance(adapter.active_adapter, str) else adapter.active_adapters[0]
        config = adapter.peft_config[name].to_dict()
        state = get_peft_model_state_dict(adapter, adapter_name=name)
        return config, {k: v.detach() for k, v in state.items()}, f"PeftModel adapter {name!r}"
    path = Path(adapter)
    if not (path / ADAPTER_CONFIG).is_file():
        raise UnlearnError(f"{adapter} is not a PEFT adapter folder (no {ADAPTER_CONFIG})")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    weights = path / "adapter_model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        state = load_file(str(weights))
    elif (path / "adapter_model.bin").is_file():
        state = torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise UnlearnError(f"{adapter} has no adapter_model.safetensors (or .bin)")
    return config, state, str(path)


def task_matrices_from_adapter(base, adapter, layers: Sequence[TargetLayer] | None = None) -> TaskMatrices:
    """``scaling * B @ A`` (``out x in``) for every layer a LoRA adapter targets.

    Refused: a non-LoRA or DoRA adapter, LoRA bias terms, embedding adapters, and an adapter whose layers the base
    does not have (another architecture) or whose shapes differ.
    """
    from peft.utils.other import get_pattern_key

    from ..trace.hashing import root_hash, tensor_hash

    config, state, source = _adapter_config_and_state(adapter)
    peft_type = str(getattr(config.get("peft_type"), "value", config.get("peft_type") or "LORA"))
    if peft_type.upper() != "LORA":
        raise UnlearnError(f"{source} is a {peft_type} adapter; task matrices come from LoRA adapters")
    if config.get("use_dora"):
        raise UnlearnError(f"{source} is a DoRA adapter: its weight change is not B @ A; merge it and pass the merged "
                           "model as a full fine-tune")
    if config.get("lora_bias"):
        raise UnlearnError(f"{source} trains LoRA biases, which a task matrix cannot hold; retrain without lora_bias")
    if config.get("modules_to_save"):
        raise UnlearnError(f"{source} also fully trains {config['modules_to_save']} (modules_to_save); QR-Erase edits "
                           "only the LoRA layers, so it would miss that change: merge the adapter and pass the merged "
                           "model as a full fine-tune")
    layers = list(layers) if layers is not None else target_layers(base)
    by_name = {t.name: t for t in layers}
    all_names = {t.name for t in target_layers(base)}
    factors: dict[str, dict[str, torch.Tensor]] = {}
    others: list[str] = []
    for key, tensor in state.items():
        m = _LORA_KEY.match(key)
        if m is None:
            if "lora_magnitude" in key:
                raise UnlearnError(f"{source} is a DoRA adapter ({key}); merge it and pass the merged model")
            others.append(key)
            continue
        factors.setdefault(m["module"], {})[m["part"]] = tensor
    touched = set(factors) | {_OTHER_SUFFIX.sub("", k.removeprefix("base_model.model.")) for k in others}
    foreign = sorted(n for n in touched if n not in all_names)
    if others and not foreign:
        raise UnlearnError(f"{source} holds tensors that are not LoRA factors ({others[0]}); it cannot be read as "
                           "task matrices")
    if foreign:
        raise UnlearnError(f"{source} adapts layers this base does not have among its transformer-block linear layers "
                           f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); it was made for other "
                           "modules or another architecture")
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    entries: dict[str, tuple[TargetLayer, torch.Tensor, torch.Tensor, float]] = {}
    for name, parts in factors.items():
        if set(parts) != {"A", "B"}:
            raise UnlearnError(f"{source} has lora_{'A' if 'A' not in parts else 'B'} missing for {name}")
        if name not in by_name:
            continue  # a layer outside the requested modules
        layer = by_name[name]
        a, b = parts["A"], parts["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != layer.shape:
            raise UnlearnError(f"{source}: the LoRA factors of {name} give a {b.shape[0]} x {a.shape[1]} update but "
                               f"the base layer is {layer.shape[0]} x {layer.shape[1]} (out x in)")
        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), name), config.get("r", a.shape[0]))
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), name), config.get("lora_alpha", r))
        if int(r) != a.shape[0]:
            raise UnlearnError(f"{source}: layer {name} has rank {a.shape[0]} but the config says r={r}")
        scaling = float(alpha) / (float(r) ** 0.5 if config.get("use_rslora") else float(r))
        entries[name] = (layer, a, b, scaling)
    if not entries:
        raise UnlearnError(f"{source} adapts none of the selected layers")

    def compute(name: str) -> torch.Tensor:
        layer, a, b, scaling = entries[name]
        device = layer.module.weight.device
        return (b.to(device, torch.float32) @ a.to(device, torch.float32)) * scaling

    fingerprint = root_hash({k: tensor_hash(k, v) for k, v in state.items()})
    ordered = [t.name for t in layers if t.name in entries]
    return TaskMatrices({n: entries[n][0].shape for n in ordered}, compute, kind="lora", fingerprint=fingerprint,
                        source=source, meta={"r": config.get("r"), "lora_alpha": config.get("lora_alpha"),
                                             "use_rslora": bool(config.get("use_rslora"))})


# -- dispatch ---------------------------------------------------------------------------------------------------
def load_task_matrices(base, source, layers: Sequence[TargetLayer] | None = None) -> TaskMatrices:
    """Task matrices of ``base`` from a :class:`TaskMatrices`, a dict of tensors, a ``PeftModel``, an adapter
    folder, a fine-tuned model, or a model folder / Hub id / GGUF file."""
    if isinstance(source, TaskMatrices):
        return _restrict(source, layers, base)
    if isinstance(source, Mapping):
        return _restrict(TaskMatrices.from_dict(source), layers, base)
    if _is_peft(source):
        return task_matrices_from_adapter(base, source, layers)
    if isinstance(source, torch.nn.Module):
        return task_matrices_from_models(base, source, layers)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if (path / ADAPTER_CONFIG).is_file():
            return task_matrices_from_adapter(base, path, layers)
        if (path / TASK_MANIFEST).is_file():
            raise UnlearnError(f"{source} is a task-matrix folder holding both tasks: pass it as the forget task "
                               "(qr_erase(model, folder)) or pass its forget/ and retain/ subfolders")
        from ..models import load_model

        dtype = getattr(base, "dtype", None)
        return task_matrices_from_models(base, load_model(path, dtype=dtype), layers)
    raise UnlearnError(f"cannot read task matrices from a {type(source).__name__}; pass a fine-tuned model, a LoRA "
                       "adapter (folder or PeftModel), a model folder, or a dict of tensors")


def _restrict(matrices: TaskMatrices, layers, base) -> TaskMatrices:
    layers = list(layers) if layers is not None else target_layers(base)
    shapes = {t.name: t.shape for t in layers}
    unknown = sorted(set(matrices) - set(t.name for t in target_layers(base)))
    if unknown:
        raise UnlearnError(f"task matrices for layers this model does not have: {', '.join(unknown[:3])}")
    for name in matrices:
        if name in shapes and tuple(matrices.shapes[name]) != tuple(shapes[name]):
            raise UnlearnError(f"task matrix {name} is {matrices.shapes[name]} but the layer is {shapes[name]} (out x in)")
    kept = {n: matrices.shapes[n] for n in matrices if n in shapes}
    out = TaskMatrices(kept, matrices._compute, kind=matrices.kind, fingerprint=matrices.fingerprint,
                       source=matrices.source, meta=matrices.meta)
    out._norms = {n: v for n, v in matrices._norms.items() if n in kept}
    return out


# -- task-matrix folders (hf-unlearn edit task-matrices) -------------------------------------------------------
@dataclass
class TaskFolder:
    """A folder written by ``hf-unlearn edit task-matrices``: ``forget/`` and ``retain/`` (LoRA adapters or
    fine-tuned models) and ``task_matrices.json`` (the base's weight hash, splits, forget ids; stays local)."""

    path: Path
    manifest: dict[str, Any]

    @property
    def forget(self) -> Path:
        return self.path / self.manifest["forget"]

    @property
    def retain(self) -> Path | None:
        return self.path / self.manifest["retain"] if self.manifest.get("retain") else None

    @property
    def forget_ids(self) -> list:
        return list(self.manifest.get("forget_ids") or [])

    def check_base(self, base_params_root: str) -> None:
        """Refuse a base whose weights differ from the one the task models were trained from."""
        expected = self.manifest.get("base_params_root")
        if not expected:
            raise UnlearnError(f"{self.path / TASK_MANIFEST} records no base weight hash (base_params_root); "
                               "recreate the folder with `hf-unlearn edit task-matrices`")
        if expected != base_params_root:
            raise UnlearnError(f"the task matrices in {self.path} were computed against another base (weights hash "
                               f"{expected[:12]}, this base {base_params_root[:12]}); load the base named in "
                               f"{TASK_MANIFEST} ({self.manifest.get('base', '?')}) in the same dtype")

    def check_sources(self, forget: TaskMatrices, retain: TaskMatrices | None) -> None:
        """Refuse task models whose tensors differ from those recorded when the folder was written (swapped or
        altered files). Whoever can rewrite the folder can rewrite the manifest too: this is an integrity check,
        not a proof of origin."""
        for name, matrices in (("forget", forget), ("retain", retain)):
            expected = self.manifest.get(f"{name}_fingerprint")
            if matrices is None or not expected:
                continue
            if matrices.fingerprint != expected:
                raise UnlearnError(f"{self.path / self.manifest[name]} is not the {name} task model recorded in "
                                   f"{TASK_MANIFEST} (tensor hash {matrices.fingerprint[:12]}, recorded "
                                   f"{expected[:12]}); its files were replaced or modified")


def read_task_folder(path) -> TaskFolder | None:
    """The :class:`TaskFolder` at ``path``, or None when ``path`` is not one."""
    if not isinstance(path, (str, os.PathLike)) or not (Path(path) / TASK_MANIFEST).is_file():
        return None
    try:
        manifest = json.loads((Path(path) / TASK_MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise UnlearnError(f"{Path(path) / TASK_MANIFEST} is not valid JSON: {e}") from None
    if manifest.get("format") != "hf_unlearn.task_matrices.v1" or "forget" not in manifest:
        raise UnlearnError(f"{Path(path) / TASK_MANIFEST} is not a task-matrix manifest")
    return TaskFolder(Path(path), manifest)
