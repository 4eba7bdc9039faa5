"""Does random-label forgetting generalise? The measurements, as pure functions.

Definitions (DESIGN.md): chance = mean over rows of 1/n_choices; Forget Gap = acc_after_forgetting - chance;
Forget Ratio = (acc_finetuned - acc_forgot) / (acc_finetuned - chance): 1 means back to chance, 0 means nothing
forgotten, above 1 means pushed below chance. Computed on the rows trained on (train) and on unseen rows (test):
forgetting *generalises* when the test ratio is close to the train ratio.

Predictors of generalisation, one number per task: fine-tuned accuracy (difficulty), mean confidence (probability
of the true label), and the total variance of the last-layer representation at the last prompt token.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from ..errors import UnlearnError
from ..eval.tasks import chance_accuracy  # noqa: F401 - re-exported: measured where accuracy is (eval, below)


def forget_gap(acc_forgot: float, chance: float) -> float:
    """Accuracy after forgetting minus chance (0 = at chance; positive = something left)."""
    return float(acc_forgot) - float(chance)


def forget_ratio(acc_finetuned: float, acc_forgot: float, chance: float) -> float:
    """(acc_finetuned - acc_forgot) / (acc_finetuned - chance); NaN when the fine-tuned model is not above chance.

    NaN rather than an error: a task the model never learned has nothing to forget, and one such task must not
    abort a multi-task analysis. Report it as "not learned".
    """
    denom = float(acc_finetuned) - float(chance)
    if denom <= 0:
        return math.nan
    return (float(acc_finetuned) - float(acc_forgot)) / denom


def total_variance(representations) -> float:
    """Trace of the covariance of ``[n_rows, hidden]`` representations (sum of per-dimension variances, ddof=0)."""
    import numpy as np

    x = np.asarray(representations, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise UnlearnError(f"total variance needs a [rows >= 2, hidden] array, got shape {x.shape}")
    return float(((x - x.mean(0)) ** 2).mean(0).sum())


def correlation(x: Sequence[float], y: Sequence[float], method: str = "spearman") -> tuple[float, float]:
    """(coefficient, p-value) by scipy; NaNs are dropped pairwise; (nan, nan) with < 3 points or a constant side."""
    import numpy as np
    from scipy import stats

    if method not in ("spearman", "pearson", "kendall"):
        raise UnlearnError(f"correlation method must be spearman, pearson or kendall, not {method!r}")
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if a.shape != b.shape:
        raise UnlearnError(f"correlation needs equal lengths, got {a.shape} and {b.shape}")
    keep = ~(np.isnan(a) | np.isnan(b))
    a, b = a[keep], b[keep]
    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return math.nan, math.nan
    fn = {"spearman": stats.spearmanr, "pearson": stats.pearsonr, "kendall": stats.kendalltau}[method]
    res = fn(a, b)
    return float(res[0]), float(res[1])


def first_stable_step(history: Sequence[tuple[int, bool]], target: bool = True) -> float:
    """The step from which a row stays ``target`` (True = learned, False = forgotten) to the end; inf if it does not.

    ``history`` is ``[(step, correct), ...]`` as logged by the trainers (any order).
    """
    events = sorted(history)
    if not events or bool(events[-1][1]) != target:
        return math.inf
    step = events[-1][0]
    for s, ok in reversed(events):
        if bool(ok) != target:
            break
        step = s
    return float(step)


def order_rank_correlation(learned: Mapping, forgotten: Mapping) -> tuple[float, float, int]:
    """Spearman correlation between when rows were learned and when they were forgotten, over shared ids.

    ``learned``/``forgotten`` map row id -> step (``inf`` = never; ranked after every finite step, ties shared).
    Returns (rho, p, n_rows). Positive rho: rows learned early are forgotten early (same order); negative: first
    learned, last forgotten.
    """
    ids = [i for i in learned if i in forgotten]
    if not ids:
        raise UnlearnError("no row ids in common between the learned and forgotten orders")

    def finite(values):
        big = max([v for v in values if math.isfinite(v)], default=0.0) + 1.0
        return [v if math.isfinite(v) else big for v in values]

    rho, p = correlation(finite([learned[i] for i in ids]), finite([forgotten[i] for i in ids]), "spearman")
    return rho, p, len(ids)


def cross_task_matrix(finetuned: Mapping[str, float], forgot: Mapping[str, Mapping[str, float]],
                      chance: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Forget ratio for every (forgotten task A, evaluated task B): ``forgot[A][B]`` is B's accuracy after forgetting A.

    Rows are the forgotten task, columns the evaluated one; the diagonal is ordinary forgetting, off-diagonal
    entries show collateral forgetting.
    """
    out = {}
    for a, accs in forgot.items():
        out[a] = {}
        for b, acc in accs.items():
            if b not in finetuned or b not in chance:
                raise UnlearnError(f"task {b!r} has no fine-tuned accuracy or chance level")
            out[a][b] = forget_ratio(finetuned[b], acc, chance[b])
    return out


def predictor_correlations(predictors: Mapping[str, Mapping[str, float]], outcome: Mapping[str, float],
                           method: str = "spearman") -> dict[str, tuple[float, float]]:
    """Correlate each predictor (name -> {task: value}) with an outcome ({task: value}) across tasks."""
    out = {}
    for name, values in predictors.items():
        tasks = [t for t in outcome if t in values]
        out[name] = correlation([values[t] for t in tasks], [outcome[t] for t in tasks], method)
    return out
