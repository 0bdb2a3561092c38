"""Interpolants: paths ``x_t = alpha(t) x1 + sigma(t) x0`` from noise to data, as data.

Time runs from noise to data: ``x0 ~ N(0, I)`` at ``t = 0`` and the data ``x1`` at ``t = 1``
(TorchEBM's and the stochastic-interpolants papers' convention). An :class:`Interpolant` is one
pure function ``coefficients(t) -> (alpha, d_alpha, sigma, d_sigma)`` of a time tensor of any
shape, elementwise, so it runs under ``torch.func.vmap``, ``grad`` and ``torch.compile``; its
parameters (the VP schedule's betas) are tensors closed over, so gradients flow through them.

* :func:`linear`: ``alpha = t``, ``sigma = 1 - t`` (rectified flow, flow matching's default);
* :func:`cosine`: ``alpha = sin(pi t / 2)``, ``sigma = cos(pi t / 2)``;
* :func:`variance_preserving`: DDPM's linear-beta schedule, ``sigma = sqrt(1 - alpha^2)``;
* :func:`custom`: a user's own pair of functions, with the derivatives by forward-mode AD when
  not given.

:func:`interpolate` gives ``x_t`` and the conditional velocity ``u_t = d_alpha x1 + d_sigma x0``
(the flow-matching target); :func:`velocity_from_score` and :func:`velocity_from_noise` turn a
learned score or noise prediction into the probability-flow velocity of the same path.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Interpolant",
    "linear",
    "cosine",
    "variance_preserving",
    "custom",
    "interpolate",
    "expand_time",
    "velocity_from_score",
    "velocity_from_noise",
    "score_from_velocity",
]

Coefficients = tuple[Tensor, Tensor, Tensor, Tensor]


class Interpolant(NamedTuple):
    """``coefficients(t) -> (alpha, d_alpha, sigma, d_sigma)``, elementwise in ``t``; ``name`` for reports."""

    coefficients: Callable[[Tensor], Coefficients]
    name: str = "custom"


def _linear(t: Tensor) -> Coefficients:
    one = torch.ones_like(t)
    return t, one, 1.0 - t, -one


def linear() -> Interpolant:
    """``x_t = t x1 + (1 - t) x0``: straight paths, constant velocity ``x1 - x0``."""
    return Interpolant(_linear, "linear")


def _cosine(t: Tensor) -> Coefficients:
    a = 0.5 * math.pi
    return torch.sin(a * t), a * torch.cos(a * t), torch.cos(a * t), -a * torch.sin(a * t)


def cosine() -> Interpolant:
    """``x_t = sin(pi t / 2) x1 + cos(pi t / 2) x0``: variance preserving for unit-variance data."""
    return Interpolant(_cosine, "cosine")


def variance_preserving(beta_min: float | Tensor = 0.1, beta_max: float | Tensor = 20.0) -> Interpolant:
    """DDPM's schedule with ``beta(s)`` linear in ``s = 1 - t`` from ``beta_min`` (data) to ``beta_max``.

    ``alpha(t) = exp(-(1 - t)^2 (beta_max - beta_min) / 4 - (1 - t) beta_min / 2)`` and
    ``sigma = sqrt(1 - alpha^2)`` (TorchEBM's ``VariancePreservingInterpolant`` with
    ``sigma_min = beta_min``, ``sigma_max = beta_max``). ``sigma`` is clamped above ``1e-6`` so
    its derivative stays finite at ``t = 1``.
    """
    for name, v in (("beta_min", beta_min), ("beta_max", beta_max)):
        if not isinstance(v, (int, float, Tensor)) or isinstance(v, bool):
            raise TypeError(f"{name} must be a number or a tensor, got {type(v).__name__}")
    if not isinstance(beta_min, Tensor) and not isinstance(beta_max, Tensor):
        if not (0.0 <= beta_min < beta_max) or not math.isfinite(beta_max):
            raise ValueError(f"need 0 <= beta_min < beta_max < inf, got beta_min={beta_min}, beta_max={beta_max}")

    def coefficients(t: Tensor) -> Coefficients:
        s = 1.0 - t
        log_alpha = -0.25 * s * s * (beta_max - beta_min) - 0.5 * s * beta_min
        d_log_alpha = 0.5 * s * (beta_max - beta_min) + 0.5 * beta_min
        alpha = torch.exp(log_alpha)
        sigma = torch.sqrt(torch.clamp(1.0 - alpha * alpha, min=1e-12)).clamp(min=1e-6)
        return alpha, alpha * d_log_alpha, sigma, -alpha * alpha * d_log_alpha / sigma

    return Interpolant(coefficients, "variance_preserving")


def custom(
    alpha: Callable[[Tensor], Tensor],
    sigma: Callable[[Tensor], Tensor],
    d_alpha: Callable[[Tensor], Tensor] | None = None,
    d_sigma: Callable[[Tensor], Tensor] | None = None,
    name: str = "custom",
) -> Interpolant:
    """A path from a user's elementwise ``alpha(t)`` and ``sigma(t)``; missing derivatives by ``torch.func.jvp``."""
    for arg, f in (("alpha", alpha), ("sigma", sigma), ("d_alpha", d_alpha), ("d_sigma", d_sigma)):
        if f is not None and not callable(f):
            raise TypeError(f"{arg} must be a function of t, got {type(f).__name__}")

    def derivative(f: Callable[[Tensor], Tensor], df: Callable[[Tensor], Tensor] | None, t: Tensor) -> tuple[Tensor, Tensor]:
        if df is not None:
            return f(t), df(t)
        return torch.func.jvp(f, (t,), (torch.ones_like(t),))

    def coefficients(t: Tensor) -> Coefficients:
        a, da = derivative(alpha, d_alpha, t)
        s, ds = derivative(sigma, d_sigma, t)
        return a, da, s, ds

    return Interpolant(coefficients, name)


def expand_time(t: Tensor, x: Tensor) -> Tensor:
    """``t: (batch,)`` (or 0-dim) shaped ``(batch, 1, ..., 1)`` to broadcast against ``x: (batch, ...)``."""
    if t.ndim == 0:
        return t
    return t.reshape(t.shape + (1,) * (x.ndim - t.ndim))


def interpolate(interpolant: Interpolant, x0: Tensor, x1: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """``(x_t, u_t)`` with ``x_t = alpha x1 + sigma x0`` and ``u_t = d_alpha x1 + d_sigma x0``.

    x0 (noise), x1 (data): ``(batch, ...)``; t: ``(batch,)`` or 0-dim.
    """
    a, da, s, ds = interpolant.coefficients(expand_time(t, x1))
    return a * x1 + s * x0, da * x1 + ds * x0


def velocity_from_noise(interpolant: Interpolant, noise: Tensor, x: Tensor, t: Tensor) -> Tensor:
    """Probability-flow velocity from a noise prediction ``noise ~ E[x0 | x_t = x]``.

    ``E[x1 | x] = (x - sigma E[x0 | x]) / alpha``, so ``v = (d_alpha / alpha) x + (d_sigma - d_alpha sigma / alpha) E[x0 | x]``.
    Undefined where ``alpha = 0`` (pure noise): start an integration at ``t > 0`` for those paths.
    """
    a, da, s, ds = interpolant.coefficients(expand_time(t, x))
    ratio = da / a
    return ratio * x + (ds - ratio * s) * noise


def velocity_from_score(interpolant: Interpolant, score: Tensor, x: Tensor, t: Tensor) -> Tensor:
    """Probability-flow velocity from a score ``grad log p_t(x)``; uses ``E[x0 | x] = -sigma score``."""
    s = interpolant.coefficients(expand_time(t, x))[2]
    return velocity_from_noise(interpolant, -s * score, x, t)


def score_from_velocity(interpolant: Interpolant, velocity: Tensor, x: Tensor, t: Tensor) -> Tensor:
    """The score of ``p_t`` from its probability-flow velocity (the inverse of :func:`velocity_from_score`).

    Needs ``sigma (d_sigma - d_alpha sigma / alpha) != 0``: true inside ``(0, 1)`` for the paths above.
    """
    a, da, s, ds = interpolant.coefficients(expand_time(t, x))
    ratio = da / a
    noise = (velocity - ratio * x) / (ds - ratio * s)
    return -noise / s
