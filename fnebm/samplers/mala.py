"""Metropolis-adjusted Langevin (MALA): a Langevin proposal corrected by Metropolis–Hastings."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import random as fr
from fnebm.gradients import value_and_grad
from fnebm.samplers.base import (
    SamplingAlgorithm,
    batch_native,
    check_batch,
    check_energy,
    check_position,
    check_step_size,
    event_all,
    event_sum,
    over_batch,
    where_batch,
)

__all__ = ["MALAState", "MALAInfo", "mala", "log_acceptance_ratio"]


class MALAState(NamedTuple):
    """One chain's state. ``energy`` and ``grad`` at ``position`` are cached because both the
    next proposal (the drift) and the acceptance ratio need them: one gradient per step.

    position: ``event``; energy: ``()``; grad: ``event``. Many chains: each field leads with
    the chain axes.
    """

    position: Tensor
    energy: Tensor
    grad: Tensor


class MALAInfo(NamedTuple):
    """acceptance_rate: ``min(1, alpha)`` of the proposal; is_accepted: whether it was taken;
    is_divergent: the proposal's energy or gradient was not finite (it is then rejected)."""

    acceptance_rate: Tensor
    is_accepted: Tensor
    is_divergent: Tensor


def log_acceptance_ratio(
    x: Tensor, energy: Tensor, grad: Tensor, proposal: Tensor, new_energy: Tensor, new_grad: Tensor, step_size: float
) -> Tensor:
    """``log alpha`` of MALA's move ``x -> proposal``: ``E(x) - E(x') + log q(x | x') - log q(x' | x)``.

    ``q(b | a) = N(b; a - step_size * grad E(a), 2 step_size I)``. Antisymmetric in the two
    points (detailed balance). Shapes: positions and gradients ``(*batch, *event)``, energies
    ``batch``; returns ``batch`` (0-dim for one chain).
    """
    n_batch = energy.ndim
    forward = proposal - x + step_size * grad
    backward = x - proposal + step_size * new_grad
    log_q_ratio = event_sum(forward * forward - backward * backward, n_batch) / (4.0 * step_size)
    return energy - new_energy + log_q_ratio


def mala(energy_fn: Callable[[Tensor], Tensor], step_size: float) -> SamplingAlgorithm:
    """MALA targeting ``p(x) ∝ exp(-E(x))``.

    Proposal ``x' = x - step_size * grad E(x) + sqrt(2 step_size) * xi``, accepted with
    probability ``min(1, exp(E(x) - E(x') + log q(x | x') - log q(x' | x)))``. Accept/reject is
    arithmetic (``torch.where``), so the step traces into one graph.
    Returns ``SamplingAlgorithm(init, step)`` for one chain:
    ``init(position: event) -> MALAState``, ``step(state, key: (2,)) -> (state, MALAInfo)``.
    ``step`` also takes keys ``(*batch, 2)`` with a state leading with ``batch`` and then equals
    ``vmap(step)``.
    """
    check_energy(energy_fn)
    step_size = check_step_size(step_size)
    vg = value_and_grad(energy_fn)
    scale = math.sqrt(2.0 * step_size)

    def init(position: Tensor) -> MALAState:
        check_position(position, energy_fn)
        energy, grad = vg(position)
        return MALAState(position, energy, grad)

    @batch_native
    def step(state: MALAState, key: Tensor) -> tuple[MALAState, MALAInfo]:
        n_batch = check_batch(state, key)
        keys = fr.split(key)
        x, energy, grad = state
        noise = fr.normal(keys[..., 0, :], x.shape[n_batch:], x.dtype)
        proposal = x - step_size * grad + scale * noise
        new_energy, new_grad = over_batch(vg, n_batch)(proposal)
        log_alpha = log_acceptance_ratio(x, energy, grad, proposal, new_energy, new_grad, step_size)
        finite = new_energy.isfinite() & event_all(new_grad.isfinite(), n_batch) & log_alpha.isfinite()
        log_alpha = torch.where(finite, log_alpha, torch.full_like(log_alpha, -math.inf))
        accepted = torch.log(fr.uniform(keys[..., 1, :], (), x.dtype)) < log_alpha
        new = MALAState(
            where_batch(accepted, proposal, x),
            where_batch(accepted, new_energy, energy),
            where_batch(accepted, new_grad, grad),
        )
        info = MALAInfo(torch.exp(torch.clamp_max(log_alpha, 0.0)), accepted, ~finite)
        return new, info

    return SamplingAlgorithm(init, step)
