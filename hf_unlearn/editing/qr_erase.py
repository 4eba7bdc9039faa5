"""QR-Erase: remove a task from a causal LM's weights in closed form, with no training steps.

For every linear layer ``l`` of the selected transformer blocks (see :mod:`.task_matrices` for what a task matrix is
and why the subspaces act on the output side)::

    Q_f = dominant column subspace of T_f^l   (CPQR; or the SVD baseline; or the truncated CPQR)
    Q_r = dominant column subspace of T_r^l   (same method, same rank rule unless retain_rank/retain_energy)
    W^l <- W^l - scale * (I - Q_r Q_r^T) Q_f Q_f^T T_f^l

The blocks are all of them, those whose normalised forget energy ``E_l = ||T_f^l||_F / sum_j ||T_f^j||_F`` is at
least ``1/|L|`` (``localize=True``), the ``top_k_layers`` highest, or a given list. ``||T_f^l||_F`` of a block is
the Frobenius norm of all its layers' task matrices together.

Why subtracting works: ``T_f`` is the direction fine-tuning on the forget data moved the weights (task arithmetic:
negating a task vector removes the task); keeping only its dominant subspace drops the noise of the fine-tune, and
removing the retain subspace keeps what the retain data also need (format, general knowledge).

Decompositions run in float32 whatever the weights' dtype (bf16/fp16 weights are upcast, the result cast back);
CPQR runs on the CPU (LAPACK; torch has no pivoted QR), the SVD on the model's device.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..errors import UnlearnError
from .decompositions import (
    METHODS,
    blas_threads,
    captured_energy,
    check_rank_fits,
    check_rank_rule,
    decompose,
    erase_update,
    layer_energies,
    mean_angle,
    principal_angles,
    project_onto,
    select_layers,
)
from .report import EditReport, LayerEdit
from .task_matrices import TaskMatrices, load_task_matrices, read_task_folder, target_layers

DEFAULT_RANK = 16


@dataclass
class QREraseConfig:
    """Options of :func:`qr_erase` (the ``hf-unlearn edit qr-erase`` flags map one to one)."""

    method: str = field(default="qr", metadata={
        "help": "Subspace decomposition: 'qr' (column-pivoted QR, LAPACK geqp3), 'qr-truncated' (randomised range "
                "finder + CPQR of the sketch: leading directions only) or 'svd' (the UNLEARN baseline).",
        "choices": list(METHODS)})
    rank: int | None = field(default=None, metadata={
        "help": f"Directions kept per layer (default {DEFAULT_RANK} unless `energy` is set); capped at the numerical "
                "rank (a LoRA task matrix has rank <= r)."})
    energy: float | None = field(default=None, metadata={
        "help": "Instead of `rank`: the smallest k whose squared spectrum (|diag R| for QR, singular values for SVD) "
                "reaches this fraction of the total, in (0, 1]."})
    retain_rank: int | None = field(default=None, metadata={"help": "Rank of the retain subspace (default: the forget rule)."})
    retain_energy: float | None = field(default=None, metadata={"help": "Energy rule for the retain subspace instead."})
    scale: float = field(default=1.0, metadata={"help": "Multiplier of the subtracted update."})
    localize: bool = field(default=False, metadata={
        "help": "Edit only blocks whose normalised forget energy E_l is >= 1/|L|."})
    top_k_layers: int | None = field(default=None, metadata={"help": "Edit only the k blocks of highest energy."})
    layers: list[int] | None = field(default=None, metadata={"help": "Edit exactly these block indices."})
    target_modules: list[str] | None = field(default=None, metadata={
        "help": "Layer names (suffixes such as q_proj, c_attn) to edit; default every linear layer of the blocks."})
    max_rank: int = field(default=128, metadata={
        "help": "qr-truncated with the energy rule: directions sketched at most (the energy is measured within them)."})
    oversample: int = field(default=10, metadata={"help": "qr-truncated: extra sketch columns beyond the rank."})
    power_iters: int = field(default=1, metadata={"help": "qr-truncated: subspace (power) iterations on the sketch."})
    seed: int = field(default=0, metadata={"help": "qr-truncated: seed of the Gaussian test matrix."})
    compare_subspaces: bool = field(default=True, metadata={
        "help": "Also run the other decompositions (SVD for QR, QR for SVD, both for truncated QR) on each forget "
                "matrix and report their time and the principal angles; not counted in the edit's own time."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar over layers (tqdm)."})

    def __post_init__(self):
        if self.method not in METHODS:
            raise UnlearnError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.rank is None and self.energy is None:
            self.rank = DEFAULT_RANK
        check_rank_rule(self.rank, self.energy)
        if self.retain_rank is not None or self.retain_energy is not None:
            check_rank_rule(self.retain_rank, self.retain_energy)
        if not math.isfinite(self.scale) or self.scale <= 0:
            raise UnlearnError(f"scale must be a positive number, got {self.scale!r}")
        chosen = [n for n, v in (("localize", self.localize), ("top_k_layers", self.top_k_layers is not None),
                                 ("layers", self.layers is not None)) if v]
        if len(chosen) > 1:
            raise UnlearnError(f"pick one layer selection: {' / '.join(chosen)} were all given")
        if self.layers is not None:
            if not self.layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.layers):
                raise UnlearnError(f"layers must be a non-empty list of block indices >= 0, got {self.layers!r}")
            self.layers = sorted(set(self.layers))
        if self.top_k_layers is not None and self.top_k_layers < 1:
            raise UnlearnError(f"top_k_layers must be >= 1, got {self.top_k_layers}")
        if self.max_rank < 1 or self.oversample < 0 or self.power_iters < 0:
            raise UnlearnError("max_rank must be >= 1, oversample and power_iters >= 0")

    def retain_rule(self) -> tuple[int | None, float | None]:
        if self.retain_rank is not None or self.retain_energy is not None:
            return self.retain_rank, self.retain_energy
        return self.rank, self.energy

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _truncated_options(cfg: QREraseConfig) -> dict[str, Any]:
    return {"max_rank": cfg.max_rank, "oversample": cfg.oversample, "power_iters": cfg.power_iters, "seed": cfg.seed}


def _decompose(matrix, method, rule, cfg):
    return decompose(matrix, method, *rule, **(_truncated_options(cfg) if method == "qr-truncated" else {}))


def qr_erase(model, forget_task, retain_task=None, config: QREraseConfig | None = None, *, forget_ids=None,
             **config_kwargs) -> tuple[Any, EditReport]:
    """Erase a task from ``model`` **in place** and return ``(model, report)``.

    Args:
        model: the ``PreTrainedModel`` to edit (it holds the knowledge to remove); any dtype and device.
        forget_task: the forget data's task matrices: a fine-tuned model (object or folder), a LoRA adapter (folder
            or ``PeftModel``), a :class:`~hf_unlearn.editing.task_matrices.TaskMatrices`, a dict of ``out x in``
            tensors, or a folder written by ``hf-unlearn edit task-matrices`` (then ``retain_task`` and
            ``forget_ids`` default to the folder's, and the folder's base hash must match ``model``).
        retain_task: the retain data's task matrices, same forms; None = no retain projection.
        config: a :class:`QREraseConfig`; or its fields as keyword arguments.
        forget_ids: the sample ids the forget task was made from (raw; they reach the model card only as keyed tags).

    Raises :class:`UnlearnError` before any decomposition for bad options, another architecture, mismatched shapes,
    an adapter for other modules, a rank larger than a layer allows, or task matrices made against another base.
    """
    from tqdm.auto import tqdm

    from ..trace.hashing import diff_hashes, state_hashes

    if config is not None and config_kwargs:
        raise UnlearnError("pass either config= or keyword options, not both")
    cfg = config or QREraseConfig(**config_kwargs)
    start = time.perf_counter()
    before = state_hashes(model)

    folder = read_task_folder(forget_task)
    if folder is not None:
        folder.check_base(before.params_root)
        forget_task = folder.forget
        retain_task = folder.retain if retain_task is None else retain_task
        forget_ids = folder.forget_ids if forget_ids is None else forget_ids

    layers = target_layers(model, cfg.target_modules)
    forget = load_task_matrices(model, forget_task, layers)
    retain: TaskMatrices | None = None if retain_task is None else load_task_matrices(model, retain_task, layers)
    if folder is not None:
        folder.check_sources(forget, retain if retain_task == folder.retain else None)
    layers = [t for t in layers if t.name in forget]
    num_blocks = len({t.block for t in target_layers(model)})
    retain_rule = cfg.retain_rule()
    for t in layers:  # ranks the layers cannot hold: refused before any decomposition runs
        check_rank_fits(cfg.rank, t.shape, f"layer {t.name}")
        check_rank_fits(retain_rule[0], t.shape, f"layer {t.name}")
    if cfg.layers is not None and max(cfg.layers) >= num_blocks:
        raise UnlearnError(f"layer index {max(cfg.layers)} is out of range: the model has {num_blocks} blocks (0-"
                           f"{num_blocks - 1})")

    # block energies from the forget task matrices
    squares = [0.0] * num_blocks
    for t in layers:
        squares[t.block] += forget.norm(t.name) ** 2
    energies = layer_energies([math.sqrt(s) for s in squares])
    if cfg.localize:
        selected, selection = select_layers(energies), "localized (E_l >= 1/|L|)"
    elif cfg.top_k_layers is not None:
        selected, selection = select_layers(energies, cfg.top_k_layers), f"top-{cfg.top_k_layers} by energy"
    elif cfg.layers is not None:
        selected, selection = list(cfg.layers), "given"
    else:
        selected, selection = sorted({t.block for t in layers}), "all"
    todo = [t for t in layers if t.block in selected]
    if not todo:
        raise UnlearnError("no layer to edit: the selected blocks hold no forget task matrix")

    references = {"qr": ["svd"], "svd": ["qr"], "qr-truncated": ["qr", "svd"]}[cfg.method] if cfg.compare_subspaces else []
    edits: list[LayerEdit] = []
    seconds_decomposition = seconds_comparison = 0.0
    bar = tqdm(todo, desc=f"{cfg.method} edit", unit="layer", disable=not cfg.progress)
    with torch.no_grad(), blas_threads():
        for t in bar:
            bar.set_postfix_str(t.name, refresh=False)
            t_f = forget[t.name]
            sub_f = _decompose(t_f, cfg.method, (cfg.rank, cfg.energy), cfg)
            seconds = {cfg.method: sub_f.seconds}
            sub_r, retain_seconds = None, 0.0
            if retain is not None and t.name in retain:
                sub_r = _decompose(retain[t.name], cfg.method, retain_rule, cfg)
                retain_seconds = sub_r.seconds
            seconds_decomposition += sub_f.seconds + retain_seconds

            kept = project_onto(sub_f.basis, t_f)
            update = erase_update(t_f, sub_f.basis, None if sub_r is None else sub_r.basis)
            kept_norm = float(torch.linalg.matrix_norm(kept))
            removed = float(torch.linalg.matrix_norm(kept - update))
            weight = t.weight()
            old = weight.detach().float().clone()
            weight.copy_((old - cfg.scale * update.to(old.device)).to(weight.dtype))
            applied = weight.detach().float() - old
            leak = 0.0
            if sub_r is not None and sub_r.rank > 0 and float(torch.linalg.matrix_norm(applied)) > 0:
                leak = float(torch.linalg.matrix_norm(sub_r.basis.T.to(applied.device) @ applied)
                             / torch.linalg.matrix_norm(applied))

            angles: dict[str, dict[str, float]] = {}
            for ref in references:
                other = _decompose(t_f, ref, (sub_f.rank, None) if sub_f.rank > 0 else (cfg.rank, cfg.energy), cfg)
                seconds[ref] = other.seconds
                seconds_comparison += other.seconds
                a = principal_angles(sub_f.basis, other.basis)
                angles[ref] = {"max": a[0] if a else float("nan"), "mean": mean_angle(a)}
            edits.append(LayerEdit(
                name=t.name, block=t.block, shape=t.shape, forget_rank=sub_f.rank,
                retain_rank=0 if sub_r is None else sub_r.rank, forget_norm=forget.norm(t.name),
                update_norm=float(torch.linalg.matrix_norm(update)),
                captured_energy=captured_energy(sub_f.basis, t_f),
                retain_overlap=removed / kept_norm if kept_norm > 0 else 0.0, retain_leak=leak,
                rank_capped=sub_f.capped, seconds=seconds, retain_seconds=retain_seconds, angles=angles,
            ))

    after = state_hashes(model)
    changed = diff_hashes(before, after)["params"]
    allowed = {f"{t.name}.weight" for t in todo}
    unexpected = [n for n in changed if n not in allowed]
    if unexpected:  # pragma: no cover - a tied or shared weight; never silently edit what the report does not list
        raise RuntimeError(f"QR-Erase changed tensors outside the edited layers: {', '.join(unexpected[:3])}")
    device = str(next(model.parameters()).device)
    report = EditReport(
        method=cfg.method, config={k: v for k, v in cfg.to_dict().items() if k != "layers"}, num_blocks=num_blocks,
        block_energies=energies, selected_blocks=selected, selection=selection, layers=edits,
        seconds_total=time.perf_counter() - start - seconds_comparison, seconds_decomposition=seconds_decomposition,
        seconds_comparison=seconds_comparison, base_params_root=before.params_root,
        edited_params_root=after.params_root, changed_tensors=len(changed), forget_task=forget.describe(),
        retain_task={} if retain is None else retain.describe(),
        num_forget=len(forget_ids or []), device=device, versions=_versions(),
        forget_ids=list(forget_ids or []),
    )
    return model, report


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from ..version import __version__

    out = {"hf_unlearn": __version__}
    for pkg in ("torch", "scipy", "transformers", "peft"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:  # pragma: no cover
            pass
    return out
