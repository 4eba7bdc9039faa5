"""Linear probes on hidden states, per layer: is a label still linearly readable after forgetting?

If a logistic-regression probe on the last-prompt-token representation recovers the true labels well above the
model's own (forgotten) accuracy, the forgetting is shallow: the information is still there, only the readout moved.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import UnlearnError


def make_probe(c: float = 1.0):
    """The probe every function here fits: standardised features, L2 logistic regression (scikit-learn)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000))


def transfer_accuracy(train_features, train_labels: Sequence[int], test_features, test_labels: Sequence[int],
                      c: float = 1.0) -> float:
    """Accuracy on ``test_*`` of a probe fitted on ``train_*`` (``[rows, hidden]`` each): does what a probe learns on
    one set of rows read the same label on others?"""
    import numpy as np

    if len(set(train_labels)) < 2:
        raise UnlearnError("a probe needs at least two distinct labels to train on")
    probe = make_probe(c).fit(np.asarray(train_features, dtype=np.float64), np.asarray(train_labels))
    return float(probe.score(np.asarray(test_features, dtype=np.float64), np.asarray(test_labels)))


def probe_accuracy(features, labels: Sequence[int], folds: int = 4, seed: int = 0, c: float = 1.0) -> float:
    """Cross-validated accuracy of a standardised L2 logistic-regression probe on ``[n_rows, hidden]`` features.

    Stratified ``folds``-fold CV, lowered to the size of the rarest class (at least 2); 1.0 is perfect recovery.
    """
    import numpy as np
    from sklearn.model_selection import StratifiedKFold, cross_val_score

    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels)
    if x.ndim != 2 or x.shape[0] != len(y):
        raise UnlearnError(f"probe needs [rows, hidden] features matching {len(y)} labels, got shape {x.shape}")
    classes, counts = np.unique(y, return_counts=True)
    if len(classes) < 2:
        raise UnlearnError("a probe needs at least two distinct labels")
    k = min(folds, int(counts.min()))
    if k < 2:
        raise UnlearnError(f"every label needs at least 2 rows for cross-validation (counts: {counts.tolist()})")
    probe = make_probe(c)
    cv = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed)
    return float(cross_val_score(probe, x, y, cv=cv).mean())


def probe_by_layer(hidden_states, labels: Sequence[int], folds: int = 4, seed: int = 0) -> list[float]:
    """Probe accuracy for every layer of ``[n_layers, n_rows, hidden]`` states (index 0 = embeddings)."""
    import numpy as np

    h = np.asarray(hidden_states)
    if h.ndim != 3:
        raise UnlearnError(f"hidden states must be [layers, rows, hidden], got shape {h.shape}")
    return [probe_accuracy(h[i], labels, folds, seed) for i in range(h.shape[0])]


def majority_baseline(labels: Sequence[int]) -> float:
    """Accuracy of always predicting the most frequent label (the floor a probe must beat)."""
    import numpy as np

    if not len(labels):
        raise UnlearnError("majority baseline of an empty set is undefined")
    _, counts = np.unique(np.asarray(labels), return_counts=True)
    return float(counts.max() / counts.sum())
