"""Unadjusted overdamped Langevin dynamics: ``x <- x - h grad E(x) + sigma sqrt(2 h) xi``.

Three layers: :func:`init` (one chain), :func:`build_kernel` (the pure kernel, any chain
axes) and :func:`langevin` (the constructor).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import random as fr
from fnebm.gradients import value_and_grad
from fnebm.integrators.diffusion import euler_maruyama
from fnebm.samplers.base import (
    Step,
    SamplingAlgorithm,
    chain_axes,
    check_energy,
    init_position_state,
    all_finite,
    caches_energy_of,
    per_chain,
)
from fnebm.samplers.proposal import select

__all__ = ["LangevinState", "LangevinInfo", "init", "build_kernel", "langevin"]


class LangevinState(NamedTuple):
    """``energy`` and ``grad`` are E and dE/dx at ``position``: caching them means a step
    evaluates the gradient once, at the new point, instead of twice.

    position: ``(*chains, *event)``; energy: ``chains``; grad: like position.
    """

    position: Tensor
    energy: Tensor
    grad: Tensor


class LangevinInfo(NamedTuple):
    """``is_divergent``: the move gave a non-finite position, energy or gradient. The chain then
    stays where it was, so it never turns into NaN; count these to spot a too-large step."""

    is_divergent: Tensor


# torch.load(weights_only=True) refuses classes it does not know: these are plain tensor tuples
torch.serialization.add_safe_globals([LangevinState, LangevinInfo])


def init(position: Tensor, energy_fn: Callable[[Tensor], Tensor]) -> LangevinState:
    """One chain's state at ``position: event``; ``torch.func.vmap`` it for many chains."""
    return init_position_state(LangevinState, position, energy_fn)


def build_kernel() -> Callable[..., tuple[LangevinState, LangevinInfo]]:
    """The pure kernel ``kernel(state, key, energy_fn, step_size, noise_scale) -> (state, info)``.

    key: ``(*chains, 2)``; step_size, noise_scale: tensors, 0-dim or one per chain.
    """

    @caches_energy_of(LangevinState)
    def kernel(state: LangevinState, key: Tensor, energy_fn: Callable[[Tensor], Tensor], step_size: Tensor,
               noise_scale: Tensor):
        batch = chain_axes(state.energy, key)
        x = state.position
        h = per_chain("step_size", step_size, batch, x, host_scalar=True)
        sigma = per_chain("noise_scale", noise_scale, batch, x, host_scalar=True)
        proposal = euler_maruyama(x, state.grad, h, fr.normal(key, x.shape[len(batch):], x.dtype), sigma)
        energy, grad = value_and_grad(energy_fn, len(batch))(proposal)
        finite = all_finite(energy, grad, proposal, n_batch=len(batch))
        new = select(finite, LangevinState(proposal, energy, grad), state)
        return LangevinState(*new), LangevinInfo(is_divergent=~finite)

    return kernel


_kernel = build_kernel()


def langevin(energy_fn: Callable[[Tensor], Tensor], step_size: float | Tensor,
             noise_scale: float | Tensor = 1.0) -> SamplingAlgorithm:
    """Unadjusted Langevin: ``x' = x - h grad E(x) + noise_scale sqrt(2 h) xi``.

    With ``noise_scale=1`` it targets ``exp(-E)`` up to an O(h) bias; ``noise_scale=0`` is
    gradient descent. ``step_size`` (``> 0``) and ``noise_scale`` (``>= 0``): numbers or tensors,
    0-dim or one per chain. Returns ``SamplingAlgorithm(init, step)``:
    ``init(position: event) -> LangevinState`` for one chain and
    ``step(state, keys: (*chains, 2)) -> (LangevinState, LangevinInfo)``.
    """
    check_energy(energy_fn)
    step_size = _checks.tunable("step_size", step_size)
    noise_scale = _checks.tunable("noise_scale", noise_scale, allow_zero=True)
    return SamplingAlgorithm(
        functools.partial(init, energy_fn=energy_fn),
        Step.of("langevin", _kernel, caches_energy=True, state_type=LangevinState, info_type=LangevinInfo,
                host_scalars=True, tunables=("step_size", "noise_scale"), energy_fn=energy_fn, step_size=step_size,
                noise_scale=noise_scale),
    )
