"""Mixtures of diagonal Gaussians: ``GaussianMixture`` and its constructor."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from fnebm.energies.base import Energy, _positive, _resolve, _tensor

__all__ = ["GaussianMixture", "gaussian_mixture"]

_LOG_2PI = math.log(2 * math.pi)


@dataclass(frozen=True, eq=False)
class GaussianMixture(Energy):
    """``E(x) = -log sum_k w_k N(x; means_k, diag(scales_k^2))``, normalised.

    ``means, scales: (K, d)``; ``weights: (K,)`` summing to 1; ``log_coef: (K,)`` is
    ``log w_k - sum_j log scales_kj - d/2 log(2 pi)``, precomputed.
    """

    means: Tensor
    scales: Tensor
    weights: Tensor
    log_coef: Tensor = field(repr=False)
    name: ClassVar[str] = "gaussian_mixture"

    @property
    def dim(self) -> int:
        return self.means.shape[-1]

    def _z_logp(self, x: Tensor) -> tuple[Tensor, Tensor]:
        z = (x[..., None, :] - self.means) / self.scales  # (K, d)
        return z, self.log_coef - 0.5 * (z * z).sum(-1)  # (K,)

    def __call__(self, x: Tensor) -> Tensor:
        return -torch.logsumexp(self._z_logp(x)[1], -1)

    def grad(self, x: Tensor) -> Tensor:
        z, logp = self._z_logp(x)
        resp = torch.softmax(logp, -1)  # responsibilities p(k | x)
        return (resp[..., None] * z / self.scales).sum(-2)


def gaussian_mixture(means: Any, scales: Any, weights: Any = None, *, dtype=None, device=None) -> GaussianMixture:
    """Mixture of diagonal Gaussians, ``E = -log p(x)`` with normalising constants.

    means: ``(K, d)``; scales: ``(K,)`` isotropic or ``(K, d)`` diagonal standard
    deviations, > 0; weights: ``(K,)`` > 0, normalised here (``None``: uniform). Values
    (finite, positive) are checked where concrete.
    """
    dtype, device = _resolve(dtype, device, means, scales, weights)
    means = _tensor("means", means, (2,), dtype, device)
    k, d = means.shape
    if k == 0 or d == 0:
        raise ValueError(f"means must have shape (K, d) with K, d >= 1, got {tuple(means.shape)}")
    scales = _positive("scales", _tensor("scales", scales, (1, 2), dtype, device))
    if tuple(scales.shape) not in ((k,), (k, d)):
        raise ValueError(f"scales must have shape ({k},) or ({k}, {d}) to match means, got {tuple(scales.shape)}")
    scales = (scales[:, None] if scales.ndim == 1 else scales).expand(k, d).contiguous()
    if weights is None:
        weights = torch.full((k,), 1 / k, dtype=dtype, device=device)
    else:
        weights = _positive("weights", _tensor("weights", weights, (1,), dtype, device))
        if weights.shape[0] != k:
            raise ValueError(f"weights must have shape ({k},) to match means, got {tuple(weights.shape)}")
        weights = weights / weights.sum()
    log_coef = weights.log() - scales.log().sum(-1) - 0.5 * d * _LOG_2PI
    return GaussianMixture(means, scales, weights, log_coef)
