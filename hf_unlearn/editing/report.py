"""``EditReport``: what a closed-form edit did, layer by layer (JSON, markdown, a plot, and the model-card info).

It records the block energies and the blocks chosen, per edited layer the ranks, energies, the update's norm, the
share of the forget update the retain subspace explained (removed), the measured leak of the applied change into
the retain subspace, the decomposition time of every method run on it and the principal angles between the
subspaces they found, and the state-hash roots of the model before and after. It never holds raw sample ids (only
their count): the forget ids live in :meth:`EditReport.unlearning_card_info`, which the Hub code turns into keyed
tags.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UnlearnError
from ..hub.leaks import own_numbers
from ..utils import atomic_write_text

REPORT_FORMAT = "hf_unlearn.edit_report.v1"
METHOD_NAMES = {"qr": "QR-Erase", "qr-truncated": "QR-Erase (truncated)", "svd": "UNLEARN (SVD)"}
UNLEARN_CITATION = """@inproceedings{lizzo2025unlearn,
  title     = {{UNLEARN}: Efficient Removal of Knowledge in Large Language Models},
  author    = {Lizzo, Tyler and Heck, Larry},
  booktitle = {Findings of the Association for Computational Linguistics: NAACL 2025},
  pages     = {7257--7268},
  year      = {2025}
}"""


@dataclass
class LayerEdit:
    """One edited linear layer."""

    name: str
    block: int
    shape: tuple[int, int]  # out x in
    forget_rank: int
    retain_rank: int
    forget_norm: float  # ||T_f||_F
    update_norm: float  # ||(I - Q_r Q_r^T) Q_f Q_f^T T_f||_F, before the scale
    captured_energy: float  # ||Q_f^T T_f||^2 / ||T_f||^2
    retain_overlap: float  # share of ||Q_f Q_f^T T_f||_F inside span(Q_r), removed by the retain projection
    retain_leak: float  # ||Q_r^T dW||_F / ||dW||_F of the change actually written (dtype round-off)
    rank_capped: bool = False
    seconds: dict[str, float] = field(default_factory=dict)  # decomposition time of the forget matrix per method
    retain_seconds: float = 0.0
    angles: dict[str, dict[str, float]] = field(default_factory=dict)  # other method -> {max, mean} degrees


@dataclass
class EditReport:
    """The record of one ``qr_erase`` call; ``to_json``/``to_markdown``/``plot_energies``/``save``."""

    method: str
    config: dict[str, Any]
    num_blocks: int
    block_energies: list[float]
    selected_blocks: list[int]
    selection: str  # "all", "localized (E_l >= 1/|L|)", "top-k", "given"
    layers: list[LayerEdit]
    seconds_total: float = 0.0
    seconds_decomposition: float = 0.0  # the method's own decompositions (forget + retain)
    seconds_comparison: float = 0.0  # the reference decompositions run for the angles
    base_params_root: str = ""
    edited_params_root: str = ""
    changed_tensors: int = 0
    forget_task: dict[str, Any] = field(default_factory=dict)
    retain_task: dict[str, Any] = field(default_factory=dict)
    num_forget: int = 0
    device: str = "cpu"
    versions: dict[str, str] = field(default_factory=dict)
    format: str = REPORT_FORMAT
    forget_ids: list = field(default_factory=list, repr=False)  # raw; never written by to_json

    # -- summaries -----------------------------------------------------------------------------------------------
    @property
    def method_name(self) -> str:
        return METHOD_NAMES.get(self.method, self.method)

    def mean_rank(self) -> float:
        return sum(e.forget_rank for e in self.layers) / len(self.layers) if self.layers else 0.0

    def decomposition_seconds(self) -> dict[str, float]:
        """Total forget-matrix decomposition time per method over the edited layers."""
        out: dict[str, float] = {}
        for e in self.layers:
            for m, s in e.seconds.items():
                out[m] = out.get(m, 0.0) + s
        return out

    def max_angles(self) -> dict[str, float]:
        """The largest principal angle (degrees) between this method's subspace and each reference, over layers."""
        out: dict[str, float] = {}
        for e in self.layers:
            for m, a in e.angles.items():
                if not math.isnan(a["max"]):
                    out[m] = max(out.get(m, 0.0), a["max"])
        return out

    # -- files ---------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("forget_ids")
        return data

    def to_json(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=True))
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> EditReport:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UnlearnError(f"cannot read an edit report from {path}: {e}") from None
        if data.get("format") != REPORT_FORMAT:
            raise UnlearnError(f"{path} is not an hf_unlearn edit report")
        data["layers"] = [LayerEdit(**{**e, "shape": tuple(e["shape"])}) for e in data["layers"]]
        return cls(**data)

    def to_markdown(self) -> str:
        cfg = self.config
        rule = f"rank {cfg.get('rank')}" if cfg.get("rank") is not None else f"energy {cfg.get('energy')}"
        lines = [
            f"# {self.method_name} edit",
            "",
            f"- decomposition: `{self.method}`, {rule}, scale {cfg.get('scale')}; forget task: "
            f"{self.forget_task.get('kind', '?')}; retain task: {self.retain_task.get('kind', 'none')}",
            f"- blocks edited ({self.selection}): {len(self.selected_blocks)} of {self.num_blocks}: "
            f"{', '.join(map(str, self.selected_blocks))}",
            f"- layers edited: {len(self.layers)}, mean forget rank {self.mean_rank():.1f}; tensors changed: "
            f"{self.changed_tensors}",
            f"- wall clock: {self.seconds_total:.2f} s (decompositions {self.seconds_decomposition:.2f} s, "
            f"comparisons {self.seconds_comparison:.2f} s)",
            f"- state-hash roots: base `{self.base_params_root[:16]}`, edited `{self.edited_params_root[:16]}`",
        ]
        totals = self.decomposition_seconds()
        if len(totals) > 1 and totals.get(self.method):
            lines.append("- forget-matrix decomposition time: " + ", ".join(
                f"{m} {s:.3f} s ({s / totals[self.method]:.2f}x)" for m, s in totals.items()))
        for m, a in self.max_angles().items():
            lines.append(f"- largest principal angle to the `{m}` subspace: {a:.2f} deg")
        lines += ["", "| block | energy | chosen |", "|---|---|---|"]
        lines += [f"| {i} | {e:.4f} | {'yes' if i in self.selected_blocks else ''} |"
                  for i, e in enumerate(self.block_energies)]
        refs = sorted({m for e in self.layers for m in e.angles})
        head = ["layer", "out x in", "rank f/r", "captured energy", "retain overlap", "retain leak",
                f"{self.method} s", *[f"angle to {m} (max/mean deg)" for m in refs]]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for e in self.layers:
            cells = [e.name, f"{e.shape[0]} x {e.shape[1]}", f"{e.forget_rank}/{e.retain_rank}",
                     f"{e.captured_energy:.3f}", f"{e.retain_overlap:.3f}", f"{e.retain_leak:.1e}",
                     f"{e.seconds.get(self.method, float('nan')):.4f}"]
            cells += [f"{e.angles[m]['max']:.1f} / {e.angles[m]['mean']:.1f}" if m in e.angles else "-" for m in refs]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def plot_energies(self, path: str | os.PathLike) -> Path | None:
        """Bar chart of the block energies, the 1/|L| line and the chosen blocks (None without matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:  # pragma: no cover
            return None
        n = len(self.block_energies)
        fig, ax = plt.subplots(figsize=(max(5.0, 0.3 * n + 2), 3.2))
        colors = ["tab:red" if i in self.selected_blocks else "tab:gray" for i in range(n)]
        ax.bar(range(n), self.block_energies, color=colors)
        if n:
            ax.axhline(1.0 / n, color="k", linestyle="--", linewidth=1, label="1/|L|")
            ax.legend(loc="upper right", fontsize=8)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("transformer block")
        ax.set_ylabel("forget energy (normalised)")
        ax.set_title(f"{self.method_name}: {len(self.selected_blocks)} of {n} blocks edited (red)", fontsize=9)
        from ..eval.plots import save_figure

        return save_figure(fig, path)

    def save(self, output_dir: str | os.PathLike) -> dict[str, Path]:
        """``edit_report.json``, ``edit_report.md`` and ``layer_energies.png`` in ``output_dir``."""
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": self.to_json(out / "edit_report.json")}
        atomic_write_text(out / "edit_report.md", self.to_markdown())
        paths["markdown"] = out / "edit_report.md"
        plot = self.plot_energies(out / "layer_energies.png")
        if plot is not None:
            paths["plot"] = plot
        return paths

    # -- model card ----------------------------------------------------------------------------------------------
    def unlearning_card_info(self) -> dict[str, Any]:
        """The trainer contract of ``hf_unlearn.hub`` (method, hyperparameters, forget_ids (raw), citation, paper,
        extra): pass it to ``push_unlearned(..., card_info=...)`` or ``write_model_card``.

        Per-block details are keyed by block name (``block_3``), never as lists of numbers, which the Hub code would
        rightly take for leaked sample ids.
        """
        blocks: dict[str, dict[str, Any]] = {}
        for b in self.selected_blocks:
            edits = [e for e in self.layers if e.block == b]
            blocks[f"block_{b}"] = {
                "energy": round(self.block_energies[b], 5),
                "layers": len(edits),
                "mean_forget_rank": round(sum(e.forget_rank for e in edits) / max(len(edits), 1), 2),
                "mean_retain_rank": round(sum(e.retain_rank for e in edits) / max(len(edits), 1), 2),
            }
        extra = {
            "edit": "closed-form (no training steps)",
            "blocks_edited": blocks,
            "num_blocks": self.num_blocks,
            "selection": self.selection,
            "layers_edited": len(self.layers),
            "edit_seconds": round(self.seconds_total, 3),
            "base_params_root": self.base_params_root,
            "edited_params_root": self.edited_params_root,
            "forget_task": {k: v for k, v in self.forget_task.items() if k in ("kind", "fingerprint")},
            "retain_task": {k: v for k, v in self.retain_task.items() if k in ("kind", "fingerprint")},
            "num_forget": self.num_forget,
        }
        angles = self.max_angles()
        if angles:
            extra["max_principal_angle_deg"] = {m: round(a, 3) for m, a in angles.items()}
        paper = ("QR-Erase: the forget task's dominant subspace by column-pivoted QR, minus the retain subspace, "
                 "subtracted in the layers holding the task's energy; SVD baseline: UNLEARN (Lizzo & Heck, 2025)")
        hyperparameters = {k: v for k, v in self.config.items() if k != "progress"}
        own = {k: v for k, v in hyperparameters.items() if k != "target_modules"}  # user strings stay scanned
        not_ids = {**own_numbers(own, "hyperparameters"), **own_numbers(extra, "extra")}
        if any(c.isdigit() for c in self.selection):  # "top-3 by energy", "localized (E_l >= 1/|L|)"
            not_ids["extra.selection"] = [int(n) for n in re.findall(r"\d+", self.selection)]
        return {
            "method": self.method_name,
            "hyperparameters": hyperparameters,
            "forget_ids": list(self.forget_ids),
            "citation": UNLEARN_CITATION,
            "paper": paper,
            "extra": extra,
            "not_ids": not_ids,
        }
