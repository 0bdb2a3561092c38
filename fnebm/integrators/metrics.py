"""Euclidean metrics: the kinetic energy ``K(p) = 0.5 p^T M^{-1} p``, its momentum draw and velocity.

``inverse_mass_matrix`` is ``(d,)`` (diagonal) or ``(d, d)`` (dense, symmetric positive
definite), shared by the chains. Momenta are drawn from ``N(0, M)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from fnebm import random as fr

__all__ = ["Metric", "euclidean"]


class Metric(NamedTuple):
    """``sample_momentum(key, like)``, ``kinetic_energy(p)`` (one per chain), ``velocity(p) = M^{-1} p``."""

    sample_momentum: object
    kinetic_energy: object
    velocity: object


def euclidean(inverse_mass_matrix: Tensor, like: Tensor) -> Metric:
    """The metric for positions shaped like ``like: (*chains, d)`` (its dtype and device are used)."""
    inv = inverse_mass_matrix.to(dtype=like.dtype, device=like.device)
    d = like.shape[-1]
    if inv.ndim == 1:
        if inv.shape[0] != d:
            raise ValueError(f"inverse_mass_matrix has shape {tuple(inv.shape)} but positions have dimension {d}")
        scale = inv.rsqrt()

        def sample_momentum(key: Tensor, like: Tensor) -> Tensor:
            return scale * fr.normal(key, like.shape[key.ndim - 1:], like.dtype)

        def velocity(p: Tensor) -> Tensor:
            return inv * p

    elif inv.ndim == 2:
        if inv.shape != (d, d):
            raise ValueError(f"inverse_mass_matrix has shape {tuple(inv.shape)} but positions have dimension {d}")
        tril = torch.linalg.cholesky(inv)  # M^{-1} = L L^T, so p = L^{-T} z has covariance M

        def sample_momentum(key: Tensor, like: Tensor) -> Tensor:
            z = fr.normal(key, like.shape[key.ndim - 1:], like.dtype)
            return torch.linalg.solve_triangular(tril.mT, z.unsqueeze(-1), upper=True).squeeze(-1)

        def velocity(p: Tensor) -> Tensor:
            return p @ inv  # inv is symmetric

    else:
        raise ValueError(
            f"inverse_mass_matrix must be (d,) diagonal or (d, d) dense, got shape {tuple(inv.shape)}"
        )

    def kinetic_energy(p: Tensor) -> Tensor:
        return 0.5 * (p * velocity(p)).sum(-1)

    return Metric(sample_momentum, kinetic_energy, velocity)
