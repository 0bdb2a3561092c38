"""Score matching: fit the model's score ``s(x) = -∇x E(x)`` to the data's, with no sampler.

* :func:`exact_score_matching` — Hyvärinen 2005: ``E_data[½|∇E|² - tr ∇²E]``, with the
  Hessian's trace computed exactly (``d`` forward-over-reverse passes: for small ``d``).
* :func:`denoising_score_matching` — Vincent 2011: the score at a noisy point ``x + σε`` is
  regressed on ``-ε/σ``; one noise level or several (Song & Ermon 2019's ``σ²`` weighting).
* :func:`sliced_score_matching` — Song et al. 2019: the trace replaced by random projections
  ``vᵀ∇²E v`` (Rademacher or Gaussian ``v``), one Hessian-vector product each.

Each is a pure ``loss(energy, batch, key, ...) -> (loss, aux)`` whose ``energy`` is the model
and its parameters (see :mod:`fnebm.losses`); ``batch: (n, *event)``; the loss is the mean of
``aux.per_sample``. Nested ``torch.func`` transforms (gradients in ``x`` inside the gradient in
the parameters) compose: ``torch.func.grad(loss, has_aux=True)(energy, batch, key)``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import random as fr
from fnebm.losses import _common

__all__ = [
    "ScoreMatchingAux",
    "DenoisingAux",
    "exact_score_matching",
    "denoising_score_matching",
    "sliced_score_matching",
]


class ScoreMatchingAux(NamedTuple):
    """per_sample: ``(n,)``, each data point's term of the loss (detached)."""

    per_sample: Tensor


class DenoisingAux(NamedTuple):
    """per_sample: ``(n,)`` terms of the loss; sigma: ``(n,)``, the noise level each point got."""

    per_sample: Tensor
    sigma: Tensor


def _flat(energy: Callable[[Tensor], Tensor], event: tuple[int, ...], x: Tensor) -> Tensor:
    return energy(x.reshape(event))


def _exact_term(energy: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    # on the flattened sample, so the Hessian is (d, d) for any event shape
    f = functools.partial(_flat, energy, tuple(x.shape))
    x = x.reshape(-1)
    grad = torch.func.grad(f)
    # forward-over-reverse eagerly; reverse-over-reverse under compile, where torch 2.13 fails to
    # trace jacfwd of a gradient whose parameters autograd tracks (fnebm train --loss sm crashed)
    jacobian = torch.func.jacrev if torch.compiler.is_compiling() else torch.func.jacfwd
    hessian = jacobian(grad)(x)
    g = grad(x)
    return 0.5 * (g * g).sum() - torch.diagonal(hessian).sum()


def exact_score_matching(
    energy: Callable[[Tensor], Tensor],
    batch: Tensor,
    key: Tensor | None = None,
    *,
    autocast: torch.dtype | None = None,
) -> tuple[Tensor, ScoreMatchingAux]:
    """Hyvärinen's score matching: ``mean_i [½ |∇E(x_i)|² - tr ∇²E(x_i)]``.

    Equal, up to a constant independent of the parameters, to ``½ E_data |s_model - s_data|²``.
    The trace is exact: ``d`` Jacobian-vector products of ``∇E`` per sample (``d`` = the
    number of elements of one sample), so use it for small ``d`` and the sliced or denoising
    losses beyond. ``key`` is not used (no randomness); it is accepted so every loss has one
    signature. ``autocast`` as in :func:`fnebm.losses.contrastive_divergence`.
    """
    _common.check_energy(energy)
    batch = _common.check_batch(batch)
    _common.check_fits(energy, batch)
    if key is not None:
        _common.check_loss_key(key)
    model = _common.checked(energy, _common.check_autocast(autocast))
    per = torch.func.vmap(functools.partial(_exact_term, model))(batch)
    return per.mean(), ScoreMatchingAux(per.detach())


def _check_sigma(sigma: Any, batch: Tensor) -> Tensor:
    t = _checks.tunable("sigma", sigma)
    if t.ndim > 1 or (t.ndim == 1 and t.shape[0] == 0):
        raise ValueError(
            f"sigma must be a number, a 0-dim tensor or a 1-D tensor of noise levels, got shape {tuple(t.shape)}"
        )
    return t.to(dtype=batch.dtype, device=batch.device)


def _denoising_term(energy: Callable[[Tensor], Tensor], x: Tensor, eps: Tensor, sigma: Tensor) -> Tensor:
    g = torch.func.grad(energy)(x + sigma * eps)   # score = -g
    r = eps - sigma * g                             # σ s(x̃) + ε
    return 0.5 * (r * r).sum()


def denoising_score_matching(
    energy: Callable[[Tensor], Tensor],
    batch: Tensor,
    key: Tensor,
    *,
    sigma: float | Tensor = 0.1,
    autocast: torch.dtype | None = None,
) -> tuple[Tensor, DenoisingAux]:
    """Denoising score matching: ``mean_i ½ |σ_i s(x_i + σ_i ε_i) + ε_i|²``, ``ε ~ N(0, I)``.

    That is ``σ²`` times Vincent's ``½ |s(x̃) - (x - x̃)/σ²|²`` — the weighting ``λ(σ) = σ²`` of
    Song & Ermon 2019 — so the loss is of order ``d/2`` whatever the noise levels, and with one
    level it has Vincent's minimiser: the score of the data convolved with ``N(0, σ² I)``
    (for Gaussian data ``N(μ, Σ)``, the model ``N(μ, Σ + σ² I)``).

    sigma: one noise level (a number or 0-dim tensor, ``> 0``) or several, a 1-D tensor
    ``(L,)``: each point then gets a level drawn uniformly from the ``L``. The energy is not
    told the level (it is not noise-conditional); with several levels the minimiser is the
    data convolved with the ``σ²``-weighted mixture of the noises (for Gaussian data and
    levels drawn uniformly, ``N(μ, Σ + σ̄² I)`` with ``σ̄² = Σσ⁴ / Σσ²``).

    ``key`` is split as ``k_level, k_noise = split(key)``. Returns ``(loss, DenoisingAux)``.
    """
    _common.check_energy(energy)
    batch = _common.check_batch(batch)
    _common.check_fits(energy, batch)
    _common.check_loss_key(key)
    sigma = _check_sigma(sigma, batch)
    model = _common.checked(energy, _common.check_autocast(autocast))
    n = batch.shape[0]
    k_level, k_noise = fr.split(key)
    if sigma.ndim == 1:
        levels = sigma.shape[0]
        idx = torch.floor(fr.uniform(k_level, (n,), torch.float32) * levels).to(torch.int64).clamp(0, levels - 1)
        per_point = sigma[idx]
    else:
        per_point = sigma.expand(n)
    eps = fr.normal(k_noise, tuple(batch.shape), batch.dtype)
    s = per_point.reshape((n,) + (1,) * (batch.ndim - 1))
    per = torch.func.vmap(functools.partial(_denoising_term, model))(batch, eps, s)
    return per.mean(), DenoisingAux(per.detach(), per_point.detach())


def _sliced_term(energy: Callable[[Tensor], Tensor], variance_reduction: bool, x: Tensor, vs: Tensor) -> Tensor:
    grad = torch.func.grad(energy)

    def one(v: Tensor) -> tuple[Tensor, Tensor]:
        g, hv = torch.func.jvp(grad, (x,), (v,))   # ∇E(x) and ∇²E(x) v
        return g, (v * hv).sum()

    g, vhv = torch.func.vmap(one)(vs)                 # (M, *event), (M,)
    if variance_reduction:
        second = 0.5 * (g[0] * g[0]).sum()           # E_v[(vᵀg)²] = |g|² for E[vvᵀ] = I
    else:
        proj = (vs * g).reshape(vs.shape[0], -1).sum(-1)
        second = 0.5 * (proj * proj).mean()
    return -vhv.mean() + second                       # vᵀ∇s v + ½(vᵀs)², s = -∇E


def sliced_score_matching(
    energy: Callable[[Tensor], Tensor],
    batch: Tensor,
    key: Tensor,
    *,
    n_projections: int = 1,
    projection: str = "rademacher",
    variance_reduction: bool = False,
    autocast: torch.dtype | None = None,
) -> tuple[Tensor, ScoreMatchingAux]:
    """Sliced score matching: ``mean_i mean_j [vᵀ∇s(x_i)v + ½ (vᵀs(x_i))²]``, ``v = v_ij``.

    With ``s = -∇E`` the first term is ``-vᵀ∇²E v``, one Hessian-vector product
    (``torch.func.jvp`` of ``∇E``) per projection. ``projection``: ``"rademacher"`` (entries
    ±1) or ``"gaussian"`` (``N(0, I)``), ``n_projections`` per data point, drawn from ``key``.
    ``variance_reduction=True`` is SSM-VR: ``½ |s|²`` replaces ``½ (vᵀs)²`` (its expectation
    over ``v``, as ``E[vvᵀ] = I`` for both projections). Returns ``(loss, ScoreMatchingAux)``.
    """
    _common.check_energy(energy)
    batch = _common.check_batch(batch)
    _common.check_fits(energy, batch)
    _common.check_loss_key(key)
    n_projections = _checks.check_int("n_projections", n_projections, 1)
    if projection not in ("rademacher", "gaussian"):
        raise ValueError(f"projection must be 'rademacher' or 'gaussian', got {projection!r}")
    if not isinstance(variance_reduction, bool):
        raise TypeError(f"variance_reduction must be a bool, got {type(variance_reduction).__name__}")
    model = _common.checked(energy, _common.check_autocast(autocast))
    shape = (batch.shape[0], n_projections, *batch.shape[1:])
    if projection == "gaussian":
        vs = fr.normal(key, shape, batch.dtype)
    else:
        vs = torch.where(fr.uniform(key, shape, batch.dtype) < 0.5, -1.0, 1.0).to(batch.dtype)
    per = torch.func.vmap(functools.partial(_sliced_term, model, variance_reduction))(batch, vs)
    return per.mean(), ScoreMatchingAux(per.detach())

