"""Unadjusted overdamped Langevin dynamics (Euler–Maruyama): ``x <- x - eta grad E(x) + sigma sqrt(2 eta) xi``."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

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
    over_batch,
    where_batch,
)

__all__ = ["LangevinState", "LangevinInfo", "langevin"]


class LangevinState(NamedTuple):
    """One chain's state. ``energy`` and ``grad`` are E and dE/dx at ``position``: caching them
    means a step evaluates the gradient once, at the proposal, instead of twice.

    position: ``event`` (e.g. ``(dim,)``); energy: ``()``; grad: ``event``. Many chains: each
    field leads with the chain axes.
    """

    position: Tensor
    energy: Tensor
    grad: Tensor


class LangevinInfo(NamedTuple):
    """``is_divergent``: the move gave a non-finite position, energy or gradient. The chain then
    stays where it was, so it never turns into NaN; count these to spot a too-large step."""

    is_divergent: Tensor


def langevin(energy_fn: Callable[[Tensor], Tensor], step_size: float, noise_scale: float = 1.0) -> SamplingAlgorithm:
    """Unadjusted Langevin: ``x' = x - step_size * grad E(x) + noise_scale * sqrt(2 step_size) * xi``.

    With ``noise_scale=1`` it targets ``exp(-E)`` up to an O(step_size) bias; ``noise_scale=0``
    is gradient descent. Returns ``SamplingAlgorithm(init, step)`` for one chain:
    ``init(position: event) -> LangevinState``, ``step(state, key: (2,)) -> (state, LangevinInfo)``.
    ``step`` also takes keys ``(*batch, 2)`` with a state leading with ``batch`` and then equals
    ``vmap(step)``.
    """
    check_energy(energy_fn)
    step_size = check_step_size(step_size)
    noise_scale = check_step_size(noise_scale, "noise_scale", allow_zero=True)
    vg = value_and_grad(energy_fn)
    scale = noise_scale * math.sqrt(2.0 * step_size)

    def init(position: Tensor) -> LangevinState:
        check_position(position, energy_fn)
        energy, grad = vg(position)
        return LangevinState(position, energy, grad)

    @batch_native
    def step(state: LangevinState, key: Tensor) -> tuple[LangevinState, LangevinInfo]:
        n_batch = check_batch(state, key)
        x = state.position
        noise = fr.normal(key, x.shape[n_batch:], x.dtype)
        proposal = x - step_size * state.grad + scale * noise
        energy, grad = over_batch(vg, n_batch)(proposal)
        finite = energy.isfinite() & event_all(grad.isfinite() & proposal.isfinite(), n_batch)
        new = LangevinState(
            where_batch(finite, proposal, x),
            where_batch(finite, energy, state.energy),
            where_batch(finite, grad, state.grad),
        )
        return new, LangevinInfo(is_divergent=~finite)

    return SamplingAlgorithm(init, step)
