"""Linear probes on hidden states (hf_unlearn.analysis.probes)."""

from __future__ import annotations

import numpy as np
import pytest

from hf_unlearn.analysis.probes import majority_baseline, probe_accuracy, probe_by_layer
from hf_unlearn.errors import UnlearnError


def _data(n=40, hidden=8, seed=0):
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 2
    noise = rng.normal(size=(n, hidden))
    informative = noise.copy()
    informative[:, 0] += 6.0 * labels  # the label is linearly readable along one direction
    return labels, noise, informative


def test_probe_recovers_a_linearly_encoded_label():
    labels, _, informative = _data()
    assert probe_accuracy(informative, labels) == 1.0


def test_probe_is_near_chance_on_noise():
    labels, noise, _ = _data(n=80, hidden=4, seed=1)
    assert probe_accuracy(noise, labels) < 0.75


def test_probe_by_layer_finds_the_informative_layer():
    labels, noise, informative = _data()
    accs = probe_by_layer(np.stack([noise, informative, noise]), labels)
    assert len(accs) == 3 and accs[1] == 1.0 and accs[1] > max(accs[0], accs[2])


def test_probe_is_seeded():
    labels, noise, _ = _data(seed=3)
    assert probe_accuracy(noise, labels, seed=5) == probe_accuracy(noise, labels, seed=5)


def test_majority_baseline():
    assert majority_baseline([0, 0, 1, 2]) == 0.5
    with pytest.raises(UnlearnError):
        majority_baseline([])


@pytest.mark.parametrize("features, labels, match", [
    (np.zeros((4, 3)), [1, 1, 1, 1], "two distinct"),
    (np.zeros((4, 3)), [0, 1, 1, 1], "at least 2 rows"),
    (np.zeros((3, 3)), [0, 1, 1, 0], "matching"),
])
def test_probe_refuses_bad_input(features, labels, match):
    with pytest.raises(UnlearnError, match=match):
        probe_accuracy(features, labels)


def test_probe_by_layer_needs_three_dimensions():
    with pytest.raises(UnlearnError, match="layers, rows, hidden"):
        probe_by_layer(np.zeros((4, 3)), [0, 1, 0, 1])
