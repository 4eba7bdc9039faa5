"""Plots people would rather look at than read: truth-ratio histograms, the forget/utility trade-off, recovery curves.

matplotlib is imported inside each function (with the non-interactive Agg backend), never at package import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import UnlearnError


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UnlearnError("plots need matplotlib: pip install 'hf_unlearn[plot]'") from None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _as_result(obj):
    from .tofu import TofuResult

    return obj if isinstance(obj, TofuResult) else TofuResult.from_json(obj)


def plot_truth_ratio_histogram(result, reference=None, path: str | os.PathLike = "truth_ratio.png",
                               bins: int = 30, labels: Sequence[str] = ("model", "retain-only reference")) -> Path:
    """Histogram of per-item forget truth ratios of ``result`` (and of ``reference``) on a log axis; KS p in the title.

    ``result``/``reference``: :class:`TofuResult` objects or paths to their JSON.
    """
    import numpy as np

    from .metrics import forget_quality

    plt = _pyplot()
    res = _as_result(result)
    series = [(labels[0], res.forget_truth_ratios())]
    if reference is not None:
        series.append((labels[1], _as_result(reference).forget_truth_ratios()))
    if not series[0][1]:
        raise UnlearnError("the result has no forget truth ratios to plot")
    logs = [np.log10(np.asarray(v, float)) for _, v in series if v]
    edges = np.linspace(min(x.min() for x in logs), max(x.max() for x in logs) + 1e-9, bins + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    for (label, _), values in zip(series, logs):
        ax.hist(values, bins=edges, alpha=0.55, label=f"{label} (n={len(values)})")
    title = f"TOFU {res.meta.get('forget_split', '')} forget truth ratio"
    if len(series) == 2 and series[1][1]:
        title += f" (KS p = {forget_quality(series[0][1], series[1][1]):.3g})"
    ax.set(xlabel="log10 truth ratio  (P(perturbed) / P(paraphrased))", ylabel="items", title=title)
    ax.legend()
    return save_figure(fig, path)


def plot_tradeoff(results: Mapping[str, object] | Sequence[object], path: str | os.PathLike = "tradeoff.png",
                  x: str = "forget_truth_ratio", y: str = "model_utility") -> Path:
    """Scatter of ``summary[x]`` against ``summary[y]`` across checkpoints/methods, joined in the given order.

    ``results``: ``{label: TofuResult or JSON path}`` or a sequence (labelled by position or file name).
    """
    plt = _pyplot()
    if not isinstance(results, Mapping):
        results = {(Path(r).stem if isinstance(r, (str, os.PathLike)) else str(i)): r for i, r in enumerate(results)}
    points = []
    for label, r in results.items():
        s = _as_result(r).summary
        if s.get(x) is None or s.get(y) is None:
            raise UnlearnError(f"result {label!r} has no {x if s.get(x) is None else y!r} value to plot")
        points.append((label, float(s[x]), float(s[y])))
    if not points:
        raise UnlearnError("no results to plot")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p[1] for p in points], [p[2] for p in points], "o-", alpha=0.8)
    for label, px, py in points:
        ax.annotate(label, (px, py), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(xlabel=x, ylabel=y, title="forget / utility trade-off")
    if x == "forget_quality":
        ax.set_xscale("log")
    return save_figure(fig, path)


def plot_recovery_curves(results, path: str | os.PathLike = "recovery.png") -> Path:
    """Relearning curves of :class:`~hf_unlearn.eval.robustness.RobustnessResult` objects (or JSON paths): the
    recovery fraction per step of every attacked model (left; only where the result has an original model to measure
    it against; a model whose unlearning removed less than the threshold has no fraction and is marked in the
    legend with the reason) and the held-out forget probability (right, which stays readable when unlearning removed
    little). ``results``: one result, or ``{label: result}`` (several methods)."""
    from .robustness import RobustnessResult

    plt = _pyplot()
    if not isinstance(results, Mapping):
        results = {"": results}
    series = []
    for label, r in results.items():
        r = r if isinstance(r, RobustnessResult) else RobustnessResult.from_json(r)
        steps = r.summary.get("steps") or []
        if not steps:
            raise UnlearnError(f"result {label or 'given'!r} has no relearning curve")
        for name, m in r.summary["models"].items():
            if m.get("relearning") and name != "original":
                tag = (label if name == "model" else f"{label} {name}").strip() or name
                series.append((tag, steps, m["relearning"], name == "model"))
    with_recovery = any(p.get("recovery") is not None or p.get("removed") is not None
                        for _, _, points, _ in series for p in points)
    fig, axes = plt.subplots(1, 2 if with_recovery else 1, figsize=(11 if with_recovery else 6, 4), squeeze=False)
    panels = [("recovery", "recovery fraction")] if with_recovery else []
    panels.append(("probability", "held-out forget probability"))
    for ax, (key, ylabel) in zip(axes[0], panels):
        for tag, steps, points, main in series:
            note = points[0].get("recovery_note") if key == "recovery" else None
            if note and all(p.get(key) is None for p in points):  # below the threshold: marked, not drawn
                ax.plot([], [], "x", label=f"{tag}: not computed ({note})")
                continue
            ax.plot(steps, [p.get(key) for p in points], "o-" if main else "s--", label=tag, alpha=0.85)
        ax.set(xlabel="relearning steps on the other half of the forget rows", ylabel=ylabel)
        if key == "probability":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle("relearning attack")
    return save_figure(fig, path)


def save_figure(fig, path) -> Path:
    """Write ``fig`` to ``path`` (folders made, tight layout, 120 dpi) and close it: the library's one figure saver."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
