"""Mass matrix by Welford's online covariance (diagonal or dense), regularised as Stan does.

The inverse mass matrix that whitens a target is its covariance. Welford's algorithm
accumulates a mean and the sum of squared deviations ``m2`` draw by draw; a *batch* of draws
(many chains at one iteration) is merged at once with Chan et al.'s pairwise update, which is
as stable:

.. code-block:: text

    n = n_a + n_b,   delta = mean_b - mean_a
    mean = mean_a + delta n_b / n,   m2 = m2_a + m2_b + delta delta^T n_a n_b / n

At the end of a window the estimate is shrunk towards a small multiple of the identity
(Stan): ``(n / (n + 5)) cov + 1e-3 (5 / (n + 5)) I``, ``cov = m2 / (n - 1)``.

**Pooled or per chain.** A :class:`WelfordState`'s ``mean`` has shape ``(*batch, d)``; an
update with draws ``(*batch, *samples, d)`` adds the ``samples`` axes to each statistic. So a
state with ``mean: (d,)`` pools every chain (``update(state, positions)`` with positions
``(*chains, d)``), and a state with ``mean: (*chains, d)`` keeps one statistic per chain.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

__all__ = ["WelfordState", "Welford", "welford", "init", "update", "covariance", "final"]

# Stan's regularisation: the estimate weighs n draws against 5 pseudo-draws at 1e-3 * I
_PRIOR_DRAWS = 5.0
_PRIOR_SCALE = 1e-3


class WelfordState(NamedTuple):
    """mean: ``(*batch, d)``; m2: ``(*batch, d)`` (diagonal) or ``(*batch, d, d)`` (dense), the
    sum of squared deviations from the mean; count: 0-dim, draws per statistic (a float)."""

    mean: Tensor
    m2: Tensor
    count: Tensor


torch.serialization.add_safe_globals([WelfordState])


class Welford(NamedTuple):
    """``init(like) -> state``, ``update(state, draws) -> state``, ``final(state) -> inverse mass matrix``."""

    init: Callable[[Tensor], WelfordState]
    update: Callable[[WelfordState, Tensor], WelfordState]
    final: Callable[[WelfordState], Tensor]


def init(like: Tensor, diagonal: bool = True) -> WelfordState:
    """An empty statistic shaped like ``like: (*batch, d)`` (only its shape, dtype and device are
    read): ``(d,)`` for one pooled statistic, ``(*chains, d)`` for one per chain."""
    if like.ndim < 1:
        raise ValueError("like must have shape (*batch, d), got a 0-dim tensor")
    mean = torch.zeros_like(like)
    m2 = torch.zeros_like(like) if diagonal else torch.zeros(like.shape + like.shape[-1:], dtype=like.dtype,
                                                               device=like.device)
    return WelfordState(mean, m2, torch.zeros((), dtype=like.dtype, device=like.device))


def _is_diagonal(state: WelfordState) -> bool:
    return state.m2.shape == state.mean.shape


def update(state: WelfordState, draws: Tensor) -> WelfordState:
    """Add ``draws: (*batch, *samples, d)`` (``samples`` may be empty: one draw per statistic)."""
    batch, d = tuple(state.mean.shape[:-1]), state.mean.shape[-1]
    k = len(batch)
    if draws.ndim < k + 1 or tuple(draws.shape[:k]) != batch or draws.shape[-1] != d:
        raise ValueError(
            f"draws have shape {tuple(draws.shape)} but the statistic's mean is {tuple(state.mean.shape)}: "
            f"expected {batch + ('*samples', d)}"
        )
    n_b = math.prod(draws.shape[k:-1])
    x = draws.to(state.mean.dtype).reshape(batch + (n_b, d))
    mean_b = x.mean(-2)
    centred = x - mean_b.unsqueeze(-2)
    n_a = state.count
    n = n_a + n_b
    delta = mean_b - state.mean
    mean = state.mean + delta * (n_b / n)
    weight = n_a * n_b / n
    if _is_diagonal(state):
        m2 = state.m2 + (centred * centred).sum(-2) + delta * delta * weight
    else:
        m2 = state.m2 + centred.mT @ centred + delta.unsqueeze(-1) * delta.unsqueeze(-2) * weight
    return WelfordState(mean, m2, n)


def covariance(state: WelfordState) -> Tensor:
    """The sample covariance ``m2 / (n - 1)`` (its diagonal for a diagonal state); 0 with fewer than 2 draws."""
    return state.m2 / torch.clamp(state.count - 1.0, min=1.0)


def final(state: WelfordState) -> Tensor:
    """Stan's regularised inverse mass matrix ``(n/(n+5)) cov + 1e-3 (5/(n+5)) I``: ``(*batch, d)``
    diagonal or ``(*batch, d, d)`` dense; ``1e-3 I`` for an empty statistic (finite, positive definite)."""
    n = state.count
    shrunk = (n / (n + _PRIOR_DRAWS)) * covariance(state)
    ridge = _PRIOR_SCALE * (_PRIOR_DRAWS / (n + _PRIOR_DRAWS))
    if _is_diagonal(state):
        return shrunk + ridge
    eye = torch.eye(state.mean.shape[-1], dtype=shrunk.dtype, device=shrunk.device)
    return shrunk + ridge * eye


def welford(diagonal: bool = True) -> Welford:
    """Welford's covariance estimator as the triple ``Welford(init, update, final)``:

    * ``init(like: (*batch, d)) -> WelfordState`` — ``(d,)`` pools, ``(*chains, d)`` keeps one per chain;
    * ``update(state, draws: (*batch, *samples, d)) -> state`` — a batch of draws at once;
    * ``final(state) -> inverse_mass_matrix`` — Stan's regularised estimate, ``(*batch, d)`` if
      ``diagonal`` else ``(*batch, d, d)``. :func:`covariance` gives the raw sample covariance.
    """
    if not isinstance(diagonal, bool):
        raise TypeError(f"diagonal must be a bool, got {type(diagonal).__name__}")
    return Welford(functools.partial(init, diagonal=diagonal), update, final)
