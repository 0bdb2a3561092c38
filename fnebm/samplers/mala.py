"""Metropolis-adjusted Langevin (MALA): the Euler–Maruyama proposal corrected by Metropolis–Hastings.

Three layers, as BlackJAX's ``mcmc/mala.py``: :func:`init` (one chain), :func:`build_kernel`
(the pure kernel, any chain axes) and :func:`mala` (the constructor that closes over the
energy and the step size).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import _checks, _one_thread
from fnebm import random as fr
from fnebm.integrators.diffusion import euler_maruyama
from fnebm.kernels import mala_step
from fnebm.samplers.base import (
    Step,
    SamplingAlgorithm,
    chain_axes,
    check_energy,
    init_position_state,
    all_finite,
    caches_energy_of,
    event_sum,
    per_chain,
)
from fnebm.gradients import value_and_grad
from fnebm.samplers.proposal import metropolis_hastings, select

__all__ = ["MALAState", "MALAInfo", "init", "build_kernel", "mala", "log_acceptance_ratio"]


class MALAState(NamedTuple):
    """``energy`` and ``grad`` at ``position`` are cached because both the next proposal (the
    drift) and the acceptance ratio need them: one gradient per step.

    position: ``(*chains, *event)``; energy: ``chains``; grad: like position.
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


# torch.load(weights_only=True) refuses classes it does not know: these are plain tensor tuples
torch.serialization.add_safe_globals([MALAState, MALAInfo])


def init(position: Tensor, energy_fn: Callable[[Tensor], Tensor]) -> MALAState:
    """One chain's state at ``position: event``; ``torch.func.vmap`` it for many chains."""
    return init_position_state(MALAState, position, energy_fn)


def log_acceptance_ratio(
    x: Tensor, energy: Tensor, grad: Tensor, proposal: Tensor, new_energy: Tensor, new_grad: Tensor,
    step_size: Tensor | float,
) -> Tensor:
    """``log alpha`` of the move ``x -> proposal``: ``E(x) - E(x') + log q(x | x') - log q(x' | x)``.

    ``q(b | a) = N(b; a - h grad E(a), 2 h I)``. Antisymmetric in the two points (detailed
    balance). Positions and gradients ``(*chains, *event)``, energies ``chains``; ``step_size``
    a number, 0-dim, or ``chains``-shaped (aligned with the leading chain axes). Returns ``chains``.
    """
    n_batch = energy.ndim
    if not isinstance(step_size, Tensor) or step_size.ndim == 0:
        # a 0-dim step size broadcasts as it is (and a CPU one beside device tensors stays a host scalar)
        h_event = h_chain = step_size
    else:
        h_event = step_size.reshape(step_size.shape + (1,) * (x.ndim - step_size.ndim))
        h_chain = step_size.reshape(step_size.shape + (1,) * (n_batch - step_size.ndim))
    # a large eager CPU state: the elementwise part in one C pass, else NumPy's on one thread (torch's bits)
    tensors = isinstance(h_event, Tensor)
    diff = _one_thread.mala_diff(fr._c_helpers(x), x, proposal, grad, new_grad, h_event) if tensors else None
    arrays = _one_thread.views(x, proposal, grad, new_grad, h_event) if tensors and diff is None else None
    if arrays is not None:
        import numpy as np

        xn, pn, gn, qn, hn = arrays
        forward = np.subtract(pn, xn)
        forward += np.multiply(hn, gn)
        backward = np.subtract(xn, pn)
        backward += np.multiply(hn, qn)
        np.multiply(forward, forward, out=forward)
        np.multiply(backward, backward, out=backward)
        np.subtract(forward, backward, out=forward)
        diff = _one_thread.tensor(forward)
    elif diff is None:
        forward = proposal - x + h_event * grad
        backward = x - proposal + h_event * new_grad
        diff = forward * forward - backward * backward
    return energy - new_energy + event_sum(diff, n_batch) / (4.0 * h_chain)


def build_kernel() -> Callable[..., tuple[MALAState, MALAInfo]]:
    """The pure MALA kernel ``kernel(state, key, energy_fn, step_size) -> (state, info)``.

    key: ``(*chains, 2)`` (``(2,)`` for one chain); state fields lead with ``chains``;
    step_size: a tensor, 0-dim or one per chain (see :mod:`fnebm.samplers.base`).
    """

    @caches_energy_of(MALAState)
    def kernel(state: MALAState, key: Tensor, energy_fn: Callable[[Tensor], Tensor], step_size: Tensor):
        batch = chain_axes(state.energy, key)
        x, energy, grad = state
        h = per_chain("step_size", step_size, batch, x, host_scalar=True)
        # eagerly on a GPU, the parts around the energy in two launches (fnebm.kernels.mala_step)
        proposal = mala_step.propose(x, grad, key, h) if mala_step.eligible(x, energy, grad, key, h) else None
        keys = None
        if proposal is None:
            keys = fr.split(key)
            proposal = euler_maruyama(x, grad, h, fr.normal(keys[..., 0, :], x.shape[len(batch):], x.dtype))
        new_energy, new_grad = value_and_grad(energy_fn, len(batch))(proposal)
        if keys is None:  # the fused proposal: the fused accept/reject unless autograd tracks the energy's outputs
            out = (mala_step.accept(*state, proposal, new_energy, new_grad, key, h)
                   if mala_step.eligible(proposal, new_energy, new_grad, key, h) else None)
            if out is not None:
                return MALAState(*out[0]), MALAInfo(*out[1])
            keys = fr.split(key)
        log_alpha = log_acceptance_ratio(x, energy, grad, proposal, new_energy, new_grad, h.reshape(h.shape[:len(batch)]))
        finite = all_finite(new_energy, new_grad, n_batch=len(batch))
        decision = metropolis_hastings(keys[..., 1, :], log_alpha, finite)
        new = select(decision.is_accepted, MALAState(proposal, new_energy, new_grad), state)
        return MALAState(*new), MALAInfo(decision.acceptance_rate, decision.is_accepted, decision.is_divergent)

    return kernel


_kernel = build_kernel()


def mala(energy_fn: Callable[[Tensor], Tensor], step_size: float | Tensor) -> SamplingAlgorithm:
    """MALA targeting ``p(x) ∝ exp(-E(x))``.

    Proposal ``x' = x - h grad E(x) + sqrt(2 h) xi``, accepted with probability
    ``min(1, exp(E(x) - E(x') + log q(x | x') - log q(x' | x)))``; accept/reject is arithmetic.
    ``step_size`` (``h``): a number or a tensor, 0-dim or one per chain. Returns
    ``SamplingAlgorithm(init, step)``: ``init(position: event) -> MALAState`` for one chain and
    ``step(state, keys: (*chains, 2)) -> (MALAState, MALAInfo)``.
    """
    check_energy(energy_fn)
    step_size = _checks.tunable("step_size", step_size)
    return SamplingAlgorithm(
        functools.partial(init, energy_fn=energy_fn),
        Step.of("mala", _kernel, caches_energy=True, state_type=MALAState, info_type=MALAInfo, host_scalars=True,
                tunables=("step_size",), energy_fn=energy_fn, step_size=step_size),
    )
