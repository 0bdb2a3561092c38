"""Euclidean metrics: the kinetic energy ``K(p) = 0.5 p^T M^{-1} p``, its momentum draw and velocity.

An inverse mass matrix is diagonal (a vector of variances) or dense (symmetric positive
definite), shared by the chains or one per chain:

=====================  ============================  =================================
form                   shared                        per chain (chain axes ``chains``)
=====================  ============================  =================================
diagonal               ``(d,)``                      ``(*chains, d)``
dense                  ``(d, d)``                    ``(*chains, d, d)``
=====================  ============================  =================================

A plain tensor is read by its shape. One shape is ambiguous: with one chain axis of ``d``
chains, ``(d, d)`` is both a shared dense matrix and one diagonal per chain. Say which with
:class:`Diagonal` or :class:`Dense` (pytrees of one tensor, so they pass through ``vmap``,
``torch.compile`` and ``torch.save`` like the tensor itself); a plain ``(d, d)`` tensor there
is refused. Momenta are drawn from ``N(0, M)``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Union

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import random as fr

__all__ = ["Metric", "Diagonal", "Dense", "InverseMassMatrix", "euclidean", "resolve", "check_inverse_mass_matrix"]


class Metric(NamedTuple):
    """``sample_momentum(key, like)``, ``kinetic_energy(p)`` (one per chain), ``velocity(p) = M^{-1} p``."""

    sample_momentum: Callable[[Tensor, Tensor], Tensor]
    kinetic_energy: Callable[[Tensor], Tensor]
    velocity: Callable[[Tensor], Tensor]


class Diagonal(NamedTuple):
    """A diagonal inverse mass matrix: variances ``(d,)`` or ``(*chains, d)``."""

    inverse_mass_matrix: Tensor


class Dense(NamedTuple):
    """A dense inverse mass matrix: ``(d, d)`` or ``(*chains, d, d)``, symmetric positive definite."""

    inverse_mass_matrix: Tensor


InverseMassMatrix = Union[Tensor, Diagonal, Dense]

torch.serialization.add_safe_globals([Diagonal, Dense])

_FORMS = "(d,) or (*chains, d) diagonal, (d, d) or (*chains, d, d) dense"


def resolve(m: InverseMassMatrix, batch: tuple[int, ...], d: int) -> tuple[bool, Tensor]:
    """``(dense, tensor)`` of an inverse mass matrix for positions ``(*batch, d)``: whether it is dense, and
    the tensor (shared or per chain); ``ValueError`` for a shape that fits neither. Metadata only."""
    if isinstance(m, (Diagonal, Dense)):
        dense, t = isinstance(m, Dense), m.inverse_mass_matrix
        event = (d, d) if dense else (d,)
        if tuple(t.shape) not in (event, batch + event):
            kind = "Dense" if dense else "Diagonal"
            raise ValueError(
                f"{kind} inverse_mass_matrix has shape {tuple(t.shape)}; positions {batch + (d,)} "
                f"need {event} (shared) or {batch + event} (per chain)"
            )
        return dense, t
    shape = tuple(m.shape)
    diagonal = shape in ((d,), batch + (d,))
    dense = shape in ((d, d), batch + (d, d))
    if diagonal and dense:
        raise ValueError(
            f"inverse_mass_matrix of shape {shape} is ambiguous for {batch[0]} chains of dimension {d}: "
            "one diagonal per chain or one dense matrix for all; wrap it as "
            "fnebm.integrators.metrics.Diagonal(m) or Dense(m)"
        )
    if not (diagonal or dense):
        raise ValueError(
            f"inverse_mass_matrix has shape {shape} but positions are {batch + (d,)}: expected {_FORMS}"
        )
    return dense, m


def euclidean(inverse_mass_matrix: InverseMassMatrix, like: Tensor, n_batch: int = 0) -> Metric:
    """The metric for positions ``like: (*chains, d)`` with ``n_batch`` chain axes (dtype and device
    follow ``like``). A shared matrix needs no ``n_batch``; a per-chain one does."""
    batch, d = tuple(like.shape[:n_batch]), like.shape[-1]
    dense, inv = resolve(inverse_mass_matrix, batch, d)
    inv = inv.to(dtype=like.dtype, device=like.device)
    if not dense:
        scale = inv.rsqrt()

        def sample_momentum(key: Tensor, like: Tensor) -> Tensor:
            return scale * fr.normal(key, like.shape[key.ndim - 1:], like.dtype)

        def velocity(p: Tensor) -> Tensor:
            return inv * p

    else:
        tril = torch.linalg.cholesky(inv)  # M^{-1} = L L^T, so p = L^{-T} z has covariance M

        def sample_momentum(key: Tensor, like: Tensor) -> Tensor:
            z = fr.normal(key, like.shape[key.ndim - 1:], like.dtype)
            return torch.linalg.solve_triangular(tril.mT, z.unsqueeze(-1), upper=True).squeeze(-1)

        if inv.ndim == 2:

            def velocity(p: Tensor) -> Tensor:
                return p @ inv  # inv is symmetric

        else:

            def velocity(p: Tensor) -> Tensor:
                return (inv @ p.unsqueeze(-1)).squeeze(-1)

    def kinetic_energy(p: Tensor) -> Tensor:
        return 0.5 * (p * velocity(p)).sum(-1)

    return Metric(sample_momentum, kinetic_energy, velocity)


def check_inverse_mass_matrix(m: object, name: str = "inverse_mass_matrix") -> InverseMassMatrix:
    """The boundary check: a floating tensor (or :class:`Diagonal`/:class:`Dense`); where concrete,
    finite and positive (diagonal) or symmetric positive definite (dense, every matrix of a
    per-chain stack). A plain tensor whose last two axes are square is checked as dense. Shapes
    against the chains are checked by the kernel (:func:`euclidean`)."""
    t = m.inverse_mass_matrix if isinstance(m, (Diagonal, Dense)) else m
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor ({_FORMS}), got {type(t).__name__}"
                        + (f" of dtype {t.dtype}" if isinstance(t, Tensor) else ""))
    if t.ndim == 0 or (isinstance(m, Dense) and (t.ndim < 2 or t.shape[-1] != t.shape[-2])):
        raise ValueError(f"{name} has shape {tuple(t.shape)}: expected {_FORMS}")
    if _checks.is_concrete(t):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} must be finite")
        # a plain tensor with square trailing axes is read as dense (wrap per-chain diagonals
        # of d chains of dimension d in Diagonal)
        dense = isinstance(m, Dense) or (not isinstance(m, Diagonal) and t.ndim >= 2 and t.shape[-1] == t.shape[-2])
        if not dense and not bool((t > 0).all()):
            raise ValueError(f"{name} must be > 0 everywhere (a diagonal of variances)")
        if dense and not (torch.allclose(t, t.mT) and bool((torch.linalg.cholesky_ex(t).info == 0).all())):
            raise ValueError(f"{name} must be symmetric positive definite")
    return m
