"""The decompositions and the edit formula of QR-Erase, as pure functions on tensors."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from hf_unlearn.editing.decompositions import (
    captured_energy,
    choose_rank,
    cpqr_subspace,
    decompose,
    erase_update,
    layer_energies,
    principal_angles,
    select_layers,
    svd_subspace,
    truncated_cpqr_subspace,
)
from hf_unlearn.errors import UnlearnError


def low_rank(m, n, spectrum, seed=0):
    """An m x n matrix with the given singular values (random singular vectors)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, len(spectrum), generator=g)).Q
    v = torch.linalg.qr(torch.randn(n, len(spectrum), generator=g)).Q
    return u @ torch.diag(torch.tensor(spectrum, dtype=torch.float32)) @ v.T


def orthonormal(basis):
    return torch.allclose(basis.T @ basis, torch.eye(basis.shape[1]), atol=1e-5)


def test_cpqr_is_lapack_pivoted_qr_with_only_the_needed_columns():
    a = torch.randn(40, 25, generator=torch.Generator().manual_seed(1))
    sub = cpqr_subspace(a, rank=6)
    q, r, _ = scipy.linalg.qr(a.numpy(), pivoting=True, mode="economic")
    assert sub.basis.shape == (40, 6) and sub.basis.dtype == torch.float32 and orthonormal(sub.basis)
    np.testing.assert_allclose(sub.spectrum.numpy(), np.abs(np.diag(r)), rtol=1e-4)
    np.testing.assert_allclose(np.abs(sub.basis.numpy()), np.abs(q[:, :6]), atol=1e-4)  # same columns up to sign
    assert all(sub.spectrum[i] >= sub.spectrum[i + 1] for i in range(len(sub.spectrum) - 1))  # geqp3: non-increasing


@pytest.mark.parametrize("method", ["qr", "svd", "qr-truncated"])
def test_every_method_recovers_an_exactly_low_rank_column_space(method):
    a = low_rank(60, 90, [5.0, 3.0, 2.0, 1.0])
    truth = torch.linalg.svd(a)[0][:, :4]
    sub = decompose(a, method, rank=4)
    assert sub.rank == 4 and orthonormal(sub.basis)
    assert max(principal_angles(sub.basis, truth)) < 0.05  # degrees
    assert captured_energy(sub.basis, a) == pytest.approx(1.0, abs=1e-5)


def test_rank_rule_energy_and_the_cap_at_the_numerical_rank():
    spectrum = torch.tensor([3.0, 2.0, 1.0])  # energies 9, 4, 1 of 14
    assert choose_rank(spectrum, (3, 3), energy=0.6) == (1, False)
    assert choose_rank(spectrum, (3, 3), energy=0.9) == (2, False)
    assert choose_rank(spectrum, (3, 3), energy=1.0) == (3, False)
    assert choose_rank(spectrum, (3, 3), rank=2) == (2, False)
    # a rank-2 matrix (a LoRA-like task matrix): asking for 5 directions keeps the 2 real ones, and says so
    sub = cpqr_subspace(low_rank(30, 20, [2.0, 1.0]), rank=5)
    assert sub.rank == 2 and sub.capped
    assert svd_subspace(low_rank(30, 20, [2.0, 1.0]), energy=1.0).rank == 2
    assert cpqr_subspace(torch.zeros(5, 4), rank=2).rank == 0


def test_same_energy_rule_on_qr_and_svd_spectra():
    a = low_rank(50, 50, [10.0, 5.0, 1.0, 0.5, 0.1])
    qr, svd = cpqr_subspace(a, energy=0.95), svd_subspace(a, energy=0.95)
    assert svd.rank == 2  # (100 + 25) / 126.26 = 0.99 >= 0.95 > 100 / 126.26
    assert 1 <= qr.rank <= 5 and qr.spectrum.shape == (50,)


@pytest.mark.parametrize("bad", [dict(rank=None, energy=None), dict(rank=2, energy=0.5), dict(rank=0),
                                 dict(energy=0.0), dict(energy=1.5), dict(rank=2.5)])
def test_bad_rank_rules_are_refused(bad):
    with pytest.raises(UnlearnError):
        cpqr_subspace(torch.randn(5, 5), **{"rank": None, "energy": None, **bad})


@pytest.mark.parametrize("method", ["qr", "svd", "qr-truncated"])
def test_a_rank_larger_than_the_matrix_is_refused(method):
    with pytest.raises(UnlearnError, match="larger than"):
        decompose(torch.randn(8, 5), method, rank=6)


def test_erase_update_removes_the_retain_subspace_and_stays_in_the_forget_one():
    g = torch.Generator().manual_seed(3)
    t_f = torch.randn(30, 20, generator=g)
    q_f = cpqr_subspace(t_f, rank=6).basis
    q_r = torch.linalg.qr(torch.randn(30, 4, generator=g)).Q
    update = erase_update(t_f, q_f, q_r)
    assert torch.linalg.matrix_norm(q_r.T @ update) < 1e-5 * torch.linalg.matrix_norm(update)
    expected = q_f @ q_f.T @ t_f
    expected = expected - q_r @ (q_r.T @ expected)
    torch.testing.assert_close(update, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(erase_update(t_f, q_f), q_f @ q_f.T @ t_f, atol=1e-5, rtol=1e-5)
    # a retain subspace equal to the forget one leaves nothing to subtract
    assert torch.linalg.matrix_norm(erase_update(t_f, q_f, q_f)) < 1e-4


def test_truncated_variant_is_seeded_and_close_to_the_full_subspace():
    head = [100.0, 80.0, 60.0, 50.0, 40.0, 30.0, 20.0, 10.0]  # a task-matrix-like spectrum: a head, then a gap
    a = low_rank(200, 150, head + [float(x) for x in np.geomspace(0.5, 0.01, 50)], seed=5)
    one = truncated_cpqr_subspace(a, rank=8, seed=1)
    again = truncated_cpqr_subspace(a, rank=8, seed=1)
    torch.testing.assert_close(one.basis, again.basis)
    full = cpqr_subspace(a, rank=8)
    svd = svd_subspace(a, rank=8)
    # with one power iteration the sketch's CPQR lands on the SVD subspace (the full CPQR picks actual columns and
    # sits a few degrees off it here); all three hold the same energy
    assert max(principal_angles(one.basis, svd.basis)) < 1.0
    assert captured_energy(one.basis, a) == pytest.approx(captured_energy(svd.basis, a), rel=1e-3)
    assert captured_energy(full.basis, a) > 0.999
    # the energy rule is read within the sketch and never exceeds max_rank
    assert truncated_cpqr_subspace(a, energy=1.0, max_rank=12, oversample=4).rank == 12


def test_half_precision_input_is_decomposed_in_float32():
    a = low_rank(40, 30, [4.0, 2.0, 1.0]).to(torch.bfloat16)
    for method in ("qr", "svd", "qr-truncated"):
        sub = decompose(a, method, rank=3)
        assert sub.basis.dtype == torch.float32 and orthonormal(sub.basis)
    update = erase_update(a, decompose(a, "qr", rank=3).basis)
    assert update.dtype == torch.float32


def test_principal_angles_in_degrees():
    e = torch.eye(4)
    assert principal_angles(e[:, :2], e[:, :2]) == pytest.approx([0.0, 0.0], abs=1e-6)
    assert principal_angles(e[:, :2], e[:, 2:]) == pytest.approx([90.0, 90.0])
    assert principal_angles(e[:, :0], e[:, :2]) == []


def test_layer_localisation_by_mean_energy_or_top_k():
    energies = layer_energies([1.0, 5.0, 2.0, 2.0])
    assert energies == pytest.approx([0.1, 0.5, 0.2, 0.2])
    assert select_layers(energies) == [1]  # only the block at or above 1/|L| = 0.25
    assert select_layers(energies, top_k=2) == [1, 2]  # ties broken by index
    assert select_layers(layer_energies([3.0, 3.0, 3.0])) == [0, 1, 2]  # exactly 1/|L| counts
    assert select_layers(layer_energies([0.0, 0.0])) == []
    with pytest.raises(UnlearnError):
        select_layers(energies, top_k=5)
