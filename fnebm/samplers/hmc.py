"""Hamiltonian Monte Carlo: a symplectic trajectory from a fresh momentum, corrected by Metropolis–Hastings.

Three layers: :func:`init` (one chain), :func:`build_kernel` (the pure kernel over any chain
axes, with the integrator as data) and :func:`hmc` (the constructor).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import random as fr
from fnebm.gradients import value_and_grad
from fnebm.integrators.metrics import euclidean
from fnebm.integrators.symplectic import IntegratorState, integrate, velocity_verlet
from fnebm.samplers.base import (
    SamplingAlgorithm,
    chain_axes,
    check_energy,
    init_position_state,
    event_all,
    over_batch,
    per_chain,
)
from fnebm.samplers.proposal import metropolis_hastings, select

__all__ = ["HMCState", "HMCInfo", "init", "build_kernel", "hmc"]


class HMCState(NamedTuple):
    """``energy`` and ``grad`` at ``position`` are cached: a trajectory starts from them, so a
    step of ``L`` leapfrog steps costs ``L`` gradients, not ``L + 1``.

    position: ``(*chains, d)``; energy: ``chains``; grad: like position.
    """

    position: Tensor
    energy: Tensor
    grad: Tensor


class HMCInfo(NamedTuple):
    """acceptance_rate ``min(1, exp(-energy_error))``; is_accepted; is_divergent: the energy error
    exceeded ``divergence_threshold`` or the trajectory went non-finite (then rejected);
    energy_error: ``H(end) - H(start)`` (NaN-free: +inf when non-finite)."""

    acceptance_rate: Tensor
    is_accepted: Tensor
    is_divergent: Tensor
    energy_error: Tensor


torch.serialization.add_safe_globals([HMCState, HMCInfo])


def init(position: Tensor, energy_fn: Callable[[Tensor], Tensor]) -> HMCState:
    """One chain's state at ``position: (d,)``; ``torch.func.vmap`` it for many chains."""
    return init_position_state(HMCState, position, energy_fn)


def build_kernel(
    integrator: tuple[float, ...] = velocity_verlet, divergence_threshold: float = 1000.0
) -> Callable[..., tuple[HMCState, HMCInfo]]:
    """The pure kernel ``kernel(state, key, energy_fn, step_size, inverse_mass_matrix, num_integration_steps)``.

    key: ``(*chains, 2)``; step_size: a tensor, 0-dim or per chain; inverse_mass_matrix:
    ``(d,)`` or ``(d, d)``; num_integration_steps: a Python int (the trajectory unrolls at
    trace time). ``integrator``: coefficients from :mod:`fnebm.integrators.symplectic`.
    """

    def kernel(state: HMCState, key: Tensor, energy_fn: Callable[[Tensor], Tensor], step_size: Tensor,
               inverse_mass_matrix: Tensor, num_integration_steps: int):
        batch = chain_axes(state.energy, key)
        x = state.position
        h = per_chain("step_size", step_size, batch, x)
        metric = euclidean(inverse_mass_matrix, x)
        keys = fr.split(key)
        p0 = metric.sample_momentum(keys[..., 0, :], x)
        vg = over_batch(value_and_grad(energy_fn), len(batch))
        end = IntegratorState(x, p0, state.energy, state.grad)
        for _ in range(num_integration_steps):
            end = integrate(end, h, vg, metric.velocity, integrator)
        h0 = state.energy + metric.kinetic_energy(p0)
        h1 = end.energy + metric.kinetic_energy(end.momentum)
        finite = h1.isfinite() & event_all(end.grad.isfinite() & end.position.isfinite(), len(batch))
        error = torch.where(finite, h1 - h0, torch.full_like(h1, torch.inf))
        ok = finite & (error <= divergence_threshold)
        decision = metropolis_hastings(keys[..., 1, :], -error, ok)
        new = select(decision.is_accepted, HMCState(end.position, end.energy, end.grad), state)
        return HMCState(*new), HMCInfo(decision.acceptance_rate, decision.is_accepted, decision.is_divergent, error)

    return kernel


_kernels: dict = {}


def _kernel_for(integrator: tuple[float, ...], divergence_threshold: float):
    # one kernel per (integrator, threshold): the runner cache keys graphs by the kernel's
    # code and Dynamo guards these closure constants, so each pair gets its own graph
    key = (tuple(integrator), float(divergence_threshold))
    if key not in _kernels:
        _kernels[key] = build_kernel(*key)
    return _kernels[key]


def hmc(
    energy_fn: Callable[[Tensor], Tensor],
    step_size: float | Tensor,
    inverse_mass_matrix: Tensor | None = None,
    num_integration_steps: int = 10,
    *,
    integrator: tuple[float, ...] = velocity_verlet,
    divergence_threshold: float = 1000.0,
) -> SamplingAlgorithm:
    """HMC targeting ``p(x) ∝ exp(-E(x))`` with ``num_integration_steps`` steps of ``integrator``.

    ``step_size``: a number or a tensor, 0-dim or one per chain. ``inverse_mass_matrix``:
    ``(d,)`` diagonal or ``(d, d)`` dense (``None``: the identity, for any d). A proposal whose
    energy error exceeds ``divergence_threshold`` or is not finite is rejected and flagged.
    Returns ``SamplingAlgorithm(init, step)``: ``init(position: (d,)) -> HMCState`` for one
    chain, ``step(state, keys: (*chains, 2)) -> (HMCState, HMCInfo)``.
    """
    check_energy(energy_fn)
    step_size = _checks.tunable("step_size", step_size)
    num_integration_steps = _checks.check_int("num_integration_steps", num_integration_steps, 1)
    threshold = _checks.check_real("divergence_threshold", divergence_threshold)
    if not threshold > 0:
        raise ValueError(f"divergence_threshold must be > 0, got {threshold}")
    coefficients = tuple(_checks.check_real("integrator coefficient", c) for c in integrator)
    if len(coefficients) % 2 == 0 or coefficients != coefficients[::-1]:
        raise ValueError(f"integrator must be a palindrome of odd length (e.g. fnebm.integrators.velocity_verlet), "
                         f"got {integrator}")
    if inverse_mass_matrix is not None:
        inverse_mass_matrix = _check_inverse_mass_matrix(inverse_mass_matrix)
    kernel = _kernel_for(coefficients, threshold)
    if inverse_mass_matrix is None:
        step = functools.partial(_identity_metric, kernel, energy_fn=energy_fn, step_size=step_size,
                                 num_integration_steps=num_integration_steps)
    else:
        step = functools.partial(kernel, energy_fn=energy_fn, step_size=step_size,
                                 inverse_mass_matrix=inverse_mass_matrix, num_integration_steps=num_integration_steps)
    return SamplingAlgorithm(functools.partial(init, energy_fn=energy_fn), step)


def _identity_metric(kernel, state, key, energy_fn, step_size, num_integration_steps):
    ones = torch.ones(state.position.shape[-1], dtype=state.position.dtype, device=state.position.device)
    return kernel(state, key, energy_fn, step_size, ones, num_integration_steps)


def _check_inverse_mass_matrix(m) -> Tensor:
    if not isinstance(m, Tensor) or not m.is_floating_point():
        raise TypeError(f"inverse_mass_matrix must be a floating tensor, (d,) or (d, d), got {type(m).__name__}")
    if m.ndim not in (1, 2) or (m.ndim == 2 and m.shape[0] != m.shape[1]):
        raise ValueError(f"inverse_mass_matrix must be (d,) diagonal or (d, d) dense, got shape {tuple(m.shape)}")
    if _checks.is_concrete(m):
        if not bool(torch.isfinite(m).all()):
            raise ValueError("inverse_mass_matrix must be finite")
        if m.ndim == 1 and not bool((m > 0).all()):
            raise ValueError("inverse_mass_matrix must be > 0 everywhere (a diagonal of variances)")
        if m.ndim == 2 and (not torch.allclose(m, m.mT) or int(torch.linalg.cholesky_ex(m).info) != 0):
            raise ValueError("inverse_mass_matrix must be symmetric positive definite")
    return m
