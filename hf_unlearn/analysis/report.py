"""Render a forgetting experiment (:func:`~.forgetting_experiment.run_forgetting_experiment`) as files.

``report.md`` (a table per task, the cross-task matrix, predictor correlations), ``results.json`` and three plots:
forget ratio on train vs unseen rows, variance vs generalisation, probe accuracy by layer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..utils import atomic_write_text


def _clean(value):
    """JSON-safe: NaN/inf become None, tuples lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


TASK_ROWS = [
    ("rows train / test", lambda r: f"{r['n_train']} / {r['n_test']}"),
    ("chance", lambda r: _fmt(r["chance"])),
    ("accuracy before fine-tuning (test)", lambda r: _fmt(r.get("acc_base_test"))),
    ("accuracy fine-tuned (train / test)", lambda r: f"{_fmt(r.get('acc_ft_train'))} / {_fmt(r.get('acc_ft_test'))}"),
    ("accuracy after forgetting (train / test)",
     lambda r: f"{_fmt(r.get('acc_forgot_train'))} / {_fmt(r.get('acc_forgot_test'))}"),
    ("forget gap (train / test)", lambda r: f"{_fmt(r.get('forget_gap_train'))} / {_fmt(r.get('forget_gap_test'))}"),
    ("forget ratio (train / test)",
     lambda r: f"{_fmt(r.get('forget_ratio_train'))} / {_fmt(r.get('forget_ratio_test'))}"),
    ("mean confidence, fine-tuned (test)", lambda r: _fmt(r.get("confidence_ft_test"))),
    ("total variance, last layer, last prompt token", lambda r: _fmt(r.get("total_variance_last_layer"), 1)),
    ("probe accuracy fine-tuned: best layer",
     lambda r: f"{_fmt(r.get('probe_ft_best'))} at layer {r.get('probe_ft_best_layer', 'n/a')}"
     if "probe_ft_best" in r else r.get("probe_ft_error", "not run")),
    ("probe accuracy after forgetting: best layer (majority)",
     lambda r: f"{_fmt(r.get('probe_best'))} at layer {r.get('probe_best_layer', 'n/a')} ({_fmt(r.get('probe_majority'))})"
     if "probe_best" in r else r.get("probe_error", "not run")),
    ("model accuracy after forgetting (train + test)", lambda r: _fmt(r.get("acc_forgot_all"))),
    ("learned vs forgotten order, Spearman (p, rows)",
     lambda r: f"{_fmt(r.get('order_spearman'))} ({_fmt(r.get('order_p'))}, {r.get('order_n', 'n/a')})"),
    ("training rows never forgotten", lambda r: str(r.get("never_forgotten_train", "n/a"))),
]


def render_markdown(result: dict) -> str:
    """The report as markdown: per-task tables, cross-task forget ratios, predictor correlations."""
    s = result["setup"]
    lines = ["# Random-label forgetting report", "",
             f"Tasks {', '.join(s['tasks'])}; {s['n_train']} train / {s['n_test']} test rows per task; fine-tuning "
             f"{s['epochs']} epochs at lr {s['learning_rate']}, forgetting ({s['label_mode']} labels) "
             f"{s['forget_epochs']} epochs at lr {s['forget_learning_rate']}; batch {s['batch_size']}, "
             f"max_length {s['max_length']}, seed {s['seed']}. Total time {_fmt(result['timing_s'].get('total'), 0)} s.",
             "", "Forget ratio: 1 = back to chance, 0 = nothing forgotten. Forgetting generalises when the test ratio "
             "is close to the train ratio.", ""]
    for name, row in result["tasks"].items():
        lines += [f"## {name}", "", "| measure | value |", "|---|---|"]
        lines += [f"| {label} | {fn(row)} |" for label, fn in TASK_ROWS]
        lines.append("")
    matrix = result.get("cross_task_ratio") or {}
    if matrix:
        cols = list(result["tasks"])
        lines += ["## Cross-task forget ratio (row: task forgotten, column: task evaluated, test rows)", "",
                  "| forgotten \\ evaluated | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for a, accs in matrix.items():
            lines.append(f"| {a} | " + " | ".join(_fmt(accs.get(b)) if b in accs else "-" for b in cols) + " |")
        lines.append("")
    preds = result.get("predictors") or {}
    if preds:
        lines += ["## Predictors of generalisation (correlation with the test forget ratio, across tasks)", "",
                  "| predictor | Spearman (p) | Pearson (p) |", "|---|---|---|"]
        for name in preds.get("spearman", {}):
            sp, pe = preds["spearman"][name], preds.get("pearson", {}).get(name, (None, None))
            lines.append(f"| {name} | {_fmt(sp[0])} ({_fmt(sp[1])}) | {_fmt(pe[0])} ({_fmt(pe[1])}) |")
        lines += ["", f"With {len(result['tasks'])} tasks these correlations rest on {len(result['tasks'])} points.",
                  ""]
    return "\n".join(lines)


def plot_report(result: dict, out: str | Path) -> list[Path]:
    """Write the three plots next to the report; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    names = list(result["tasks"])
    rows = [result["tasks"][n] for n in names]
    nan = float("nan")
    paths = []

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [r.get("forget_ratio_train", nan) for r in rows], 0.4, label="train (forgotten)")
    ax.bar([x + 0.2 for x in xs], [r.get("forget_ratio_test", nan) for r in rows], 0.4, label="test (unseen)")
    ax.axhline(1.0, color="gray", ls="--", lw=0.8)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("forget ratio")
    ax.set_title("Forget ratio: train vs unseen")
    ax.legend()
    paths.append(_save(fig, out / "forget_ratio.png"))

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for n, r in zip(names, rows):
        x, y = r.get("total_variance_last_layer", nan), r.get("forget_ratio_test", nan)
        ax.scatter([x], [y])
        ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("total variance of last-layer last-prompt-token representation")
    ax.set_ylabel("forget ratio on unseen rows")
    ax.set_title("Variance vs generalisation of forgetting")
    paths.append(_save(fig, out / "variance_vs_generalisation.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for n, r in zip(names, rows):
        if "probe_by_layer" in r:
            line = ax.plot(r["probe_by_layer"], label=f"{n} probe")[0]
            ax.axhline(r.get("acc_forgot_all", nan), color=line.get_color(), ls=":", lw=1)
            if "probe_ft_by_layer" in r:
                ax.plot(r["probe_ft_by_layer"], color=line.get_color(), alpha=0.35, lw=1)
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("accuracy")
    ax.set_title("Probes after forgetting (faint: before; dotted: model)", fontsize=9)
    if ax.lines:
        ax.legend(fontsize=7)
    paths.append(_save(fig, out / "probe_accuracy_by_layer.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(result: dict, out: str | Path) -> Path:
    """Write ``results.json``, ``report.md`` and the plots into ``out``; returns the report's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(_clean(result), indent=2, allow_nan=False) + "\n")
    plot_report(result, out)
    report = out / "report.md"
    atomic_write_text(report, render_markdown(result) + "\n")
    return report
