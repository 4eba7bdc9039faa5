"""Dominant subspaces of task matrices, as pure functions on tensors.

A task matrix ``T`` (``out x in``, the ``nn.Linear`` weight convention) is what fine-tuning on a task added to a
layer. Its dominant **column** subspace -- the directions in the layer's output that the task writes into -- is
recovered three ways, with one rank rule for all of them:

- :func:`cpqr_subspace`: column-pivoted QR (LAPACK ``geqp3`` through ``scipy.linalg.qr(pivoting=True)``); only
  the ``k`` needed columns of ``Q`` are formed (LAPACK ``orgqr`` on the first ``k`` reflectors), so the cost is
  the pivoted factorisation itself. The spectrum the rank rule reads is ``|diag(R)|`` (non-increasing).
- :func:`svd_subspace`: the SVD baseline (the UNLEARN method): left singular vectors, spectrum = singular values.
- :func:`truncated_cpqr_subspace`: a randomised range finder (Gaussian sketch ``Y = T @ Omega`` with
  ``rank + oversample`` columns and ``power_iters`` subspace iterations) followed by CPQR of the small sketch:
  only the leading directions are ever computed, for matrices where a full decomposition is wasteful.

Rank rule (:func:`choose_rank`): a fixed ``rank`` k, or the smallest k whose squared spectrum reaches ``energy`` of
the total (``sum_{i<k} s_i^2 >= energy * sum_i s_i^2``), in both cases capped at the numerical rank (a LoRA task
matrix ``B @ A`` has rank <= r: directions beyond it would be arbitrary and are dropped). For the truncated
variant the energy is measured within the sketch, i.e. relative to its leading ``max_rank + oversample``
directions, not the whole matrix.

The edit (:func:`erase_update`) keeps the forget task's component in its own subspace and removes what the retain
subspace explains: ``(I - Q_r Q_r^T) Q_f Q_f^T T_f``. Subspaces are compared by principal angles
(:func:`principal_angles`, ``scipy.linalg.subspace_angles``). Layer localisation (:func:`layer_energies`,
:func:`select_layers`): ``E_l = ||T_f^l||_F / sum_j ||T_f^j||_F``, keep layers with ``E_l >= 1/|L|`` or the top k.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..errors import UnlearnError

METHODS = ("qr", "qr-truncated", "svd")


@dataclass
class Subspace:
    """An orthonormal basis (``m x k``) of a matrix's dominant column subspace and how it was chosen."""

    basis: torch.Tensor
    spectrum: torch.Tensor  # |diag(R)| (CPQR, of the sketch for the truncated variant) or singular values (SVD)
    rank: int
    method: str
    seconds: float
    capped: bool = False  # the rank rule asked for more directions than the numerical rank


def _float32(matrix: torch.Tensor) -> torch.Tensor:
    if matrix.dim() != 2:
        raise UnlearnError(f"a task matrix must be 2-D, got shape {tuple(matrix.shape)}")
    return matrix.detach().float()


def check_rank_rule(rank: int | None, energy: float | None) -> None:
    if (rank is None) == (energy is None):
        raise UnlearnError("give exactly one rank rule: rank=K (a fixed number of directions) or energy=F in (0, 1]")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise UnlearnError(f"rank must be a positive integer, got {rank!r}")
    if energy is not None and not 0.0 < float(energy) <= 1.0:
        raise UnlearnError(f"energy must be in (0, 1], got {energy!r}")


def check_rank_fits(rank: int | None, shape: Sequence[int], name: str = "the matrix") -> None:
    """A fixed rank larger than ``min(out, in)`` cannot be met: refuse it before any decomposition runs."""
    if rank is not None and rank > min(shape):
        raise UnlearnError(f"rank {rank} is larger than {name} ({shape[0]} x {shape[1]}) allows: at most "
                           f"{min(shape)}; lower --rank or use --energy")


def numerical_rank(spectrum: torch.Tensor, shape: Sequence[int]) -> int:
    """Directions whose spectrum value is above the float32 round-off of the largest one."""
    if spectrum.numel() == 0 or float(spectrum[0]) <= 0.0:
        return 0
    tol = float(spectrum[0]) * max(shape) * torch.finfo(torch.float32).eps
    return int((spectrum > tol).sum())


def choose_rank(spectrum: torch.Tensor, shape: Sequence[int], rank: int | None = None,
                energy: float | None = None) -> tuple[int, bool]:
    """``(k, capped)``: k by the rank rule (see the module docstring), capped at the numerical rank."""
    check_rank_rule(rank, energy)
    spectrum = spectrum.detach().double().abs()
    if rank is not None:
        wanted = min(rank, spectrum.numel())
    else:
        power = spectrum ** 2
        total = float(power.sum())
        if total == 0.0:
            return 0, False
        fraction = torch.cumsum(power, 0) / total
        wanted = int((fraction < float(energy) - 1e-12).sum()) + 1
        wanted = min(wanted, spectrum.numel())
    available = numerical_rank(spectrum, shape)
    return min(wanted, available), wanted > available


# -- decompositions -------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _blas_controller():
    import scipy.linalg  # noqa: F401  (loads scipy's OpenBLAS, so the controller sees it)

    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - threadpoolctl comes with the editing extra
        return None
    return ThreadpoolController()


_limit_depth = 0


@contextlib.contextmanager
def blas_threads(threads: int | None = None) -> Iterator[None]:
    """Run scipy's LAPACK with ``threads`` (default: torch's intra-op thread count) BLAS threads.

    scipy ships its own OpenBLAS, whose thread pool knows nothing of torch's: next to torch (and on a busy machine)
    its default of one thread per core can make a small CPQR 100x slower. Nested uses keep the outer limit, so a
    whole edit pays the ``threadpoolctl`` switch once. Without threadpoolctl installed this does nothing.
    """
    global _limit_depth
    controller = None if _limit_depth else _blas_controller()
    if controller is None:
        yield
        return
    import torch

    _limit_depth += 1
    try:
        with controller.limit(limits=threads or torch.get_num_threads(), user_api="blas"):
            yield
    finally:
        _limit_depth -= 1


def _cpqr_leading(matrix, rank, energy, shape) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """CPQR of a CPU float32 matrix; returns (Q_k, |diag R|, k, capped)."""
    import numpy as np
    import scipy.linalg
    from scipy.linalg import lapack

    a = np.asarray(matrix.cpu().numpy(), dtype=np.float32)
    with blas_threads():
        (h, tau), _, _ = scipy.linalg.qr(a, mode="raw", pivoting=True, check_finite=False)
        diag = torch.from_numpy(np.abs(np.diag(h)).copy())
        k, capped = choose_rank(diag, shape, rank, energy)
        if k == 0:
            return torch.zeros(a.shape[0], 0), diag, 0, capped
        orgqr, = lapack.get_lapack_funcs(("orgqr",), (h,))
        q, _, info = orgqr(h[:, :k], tau[:k])
    if info != 0:  # pragma: no cover - LAPACK argument error
        raise RuntimeError(f"LAPACK orgqr failed with info={info}")
    return torch.from_numpy(np.ascontiguousarray(q)), diag, k, capped


def cpqr_subspace(matrix: torch.Tensor, rank: int | None = None, energy: float | None = None) -> Subspace:
    """Dominant column subspace by column-pivoted QR (LAPACK geqp3 on the CPU; torch has no pivoted QR)."""
    a = _float32(matrix)
    check_rank_rule(rank, energy)
    check_rank_fits(rank, a.shape)
    start = time.perf_counter()
    q, diag, k, capped = _cpqr_leading(a, rank, energy, a.shape)
    seconds = time.perf_counter() - start
    return Subspace(q.to(a.device), diag, k, "qr", seconds, capped)


def svd_subspace(matrix: torch.Tensor, rank: int | None = None, energy: float | None = None) -> Subspace:
    """Dominant column subspace by the SVD (``torch.linalg.svd`` in float32 on the matrix's device)."""
    a = _float32(matrix)
    check_rank_rule(rank, energy)
    check_rank_fits(rank, a.shape)
    start = time.perf_counter()
    u, s, _ = torch.linalg.svd(a, full_matrices=False)
    k, capped = choose_rank(s.cpu(), a.shape, rank, energy)
    basis = u[:, :k].contiguous()
    if basis.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return Subspace(basis, s.cpu(), k, "svd", seconds, capped)


def truncated_cpqr_subspace(matrix: torch.Tensor, rank: int | None = None, energy: float | None = None, *,
                            max_rank: int = 128, oversample: int = 10, power_iters: int = 1,
                            seed: int = 0) -> Subspace:
    """The leading directions only: randomised range finder, then CPQR of the ``m x (k + oversample)`` sketch.

    ``rank`` (or, under the energy rule, ``max_rank``) bounds the directions computed; ``power_iters`` rounds of
    subspace iteration (re-orthonormalised with QR) sharpen the sketch when the spectrum decays slowly. The
    Gaussian test matrix is drawn from a generator seeded with ``seed``: the same call gives the same subspace.
    """
    a = _float32(matrix)
    check_rank_rule(rank, energy)
    check_rank_fits(rank, a.shape)
    if max_rank < 1 or oversample < 0 or power_iters < 0:
        raise UnlearnError("max_rank must be >= 1, oversample and power_iters >= 0")
    start = time.perf_counter()
    m, n = a.shape
    budget = rank if rank is not None else min(max_rank, min(m, n))
    width = min(budget + oversample, min(m, n))
    generator = torch.Generator(device=a.device).manual_seed(int(seed))
    omega = torch.randn(n, width, generator=generator, device=a.device, dtype=a.dtype)
    sketch = a @ omega
    for _ in range(power_iters):
        sketch = torch.linalg.qr(sketch).Q
        sketch = a @ torch.linalg.qr(a.T @ sketch).Q
    q, diag, k, capped = _cpqr_leading(sketch, rank, energy, a.shape)
    if k > budget:
        k, q = budget, q[:, :budget]
    seconds = time.perf_counter() - start
    return Subspace(q.to(a.device), diag, k, "qr-truncated", seconds, capped)


def decompose(matrix: torch.Tensor, method: str, rank: int | None = None, energy: float | None = None,
              **truncated_options) -> Subspace:
    """The dominant subspace by ``method`` (``"qr"``, ``"qr-truncated"`` or ``"svd"``)."""
    if method == "qr":
        return cpqr_subspace(matrix, rank, energy)
    if method == "svd":
        return svd_subspace(matrix, rank, energy)
    if method == "qr-truncated":
        return truncated_cpqr_subspace(matrix, rank, energy, **truncated_options)
    raise UnlearnError(f"unknown decomposition {method!r}; choose one of {', '.join(METHODS)}")


# -- the edit ---------------------------------------------------------------------------------------------------
def project_onto(basis: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``Q Q^T M``: the part of ``matrix``'s columns inside the span of ``basis``."""
    if basis.shape[1] == 0:
        return torch.zeros_like(matrix)
    return basis @ (basis.T @ matrix)


def erase_update(forget_matrix: torch.Tensor, forget_basis: torch.Tensor,
                 retain_basis: torch.Tensor | None = None) -> torch.Tensor:
    """``(I - Q_r Q_r^T) Q_f Q_f^T T_f``: the forget task in its own subspace, minus what the retain subspace holds.

    The edited weight is ``W - scale * erase_update(...)``; its output change is orthogonal to ``span(Q_r)``.
    """
    update = project_onto(forget_basis, _float32(forget_matrix))
    if retain_basis is not None and retain_basis.shape[1] > 0:
        update = update - project_onto(retain_basis, update)
    return update


def captured_energy(basis: torch.Tensor, matrix: torch.Tensor) -> float:
    """``||Q^T T||_F^2 / ||T||_F^2``: the share of the matrix's energy inside the subspace (comparable across methods)."""
    total = float(torch.linalg.matrix_norm(matrix.float()) ** 2)
    if total == 0.0 or basis.shape[1] == 0:
        return 0.0
    return float(torch.linalg.matrix_norm(basis.T @ matrix.float()) ** 2) / total


def principal_angles(basis_a: torch.Tensor, basis_b: torch.Tensor) -> list[float]:
    """Principal angles in degrees between two column spaces, largest first (``scipy.linalg.subspace_angles``)."""
    import numpy as np
    import scipy.linalg

    if basis_a.shape[1] == 0 or basis_b.shape[1] == 0:
        return []
    angles = scipy.linalg.subspace_angles(basis_a.detach().cpu().double().numpy(),
                                          basis_b.detach().cpu().double().numpy())
    return [float(x) for x in np.degrees(angles)]


# -- layer localisation -----------------------------------------------------------------------------------------
def layer_energies(norms: Sequence[float]) -> list[float]:
    """``E_l = ||T_f^l||_F / sum_j ||T_f^j||_F`` (all zeros when the task changed nothing)."""
    total = float(sum(norms))
    return [float(x) / total if total > 0 else 0.0 for x in norms]


def select_layers(energies: Sequence[float], top_k: int | None = None) -> list[int]:
    """Layers with ``E_l >= 1/|L|`` (at least the mean energy), or the ``top_k`` highest; sorted indices."""
    n = len(energies)
    if n == 0:
        return []
    if top_k is not None:
        if top_k < 1 or top_k > n:
            raise UnlearnError(f"top-k layers must be between 1 and the number of layers ({n}), got {top_k}")
        order = sorted(range(n), key=lambda i: (-energies[i], i))
        return sorted(order[:top_k])
    threshold = 1.0 / n
    return [i for i, e in enumerate(energies) if e > 0 and e >= threshold * (1 - 1e-9)]


def mean_angle(angles: Sequence[float]) -> float:
    """The angle whose squared cosine is the mean squared cosine of ``angles`` (one number per subspace pair)."""
    if not angles:
        return float("nan")
    mean_cos2 = sum(math.cos(math.radians(a)) ** 2 for a in angles) / len(angles)
    return math.degrees(math.acos(min(1.0, math.sqrt(mean_cos2))))
