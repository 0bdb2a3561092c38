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
from fnebm._control import while_loop
from fnebm.integrators.metrics import InverseMassMatrix, check_inverse_mass_matrix, euclidean
from fnebm.integrators.symplectic import IntegratorState, integrate, velocity_verlet
from fnebm.samplers.base import (
    Step,
    KernelCache,
    SamplingAlgorithm,
    chain_axes,
    check_energy,
    init_position_state,
    all_finite,
    caches_energy_of,
    per_chain,
)
from fnebm.samplers.proposal import metropolis_hastings, select

__all__ = ["HMCState", "HMCInfo", "init", "build_kernel", "build_transition", "hmc"]


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
    energy_error: ``H(end) - H(start)`` (NaN-free: +inf when non-finite); num_integration_steps:
    the trajectory's length in integrator steps (int64), after any jitter."""

    acceptance_rate: Tensor
    is_accepted: Tensor
    is_divergent: Tensor
    energy_error: Tensor
    num_integration_steps: Tensor


torch.serialization.add_safe_globals([HMCState, HMCInfo])


def init(position: Tensor, energy_fn: Callable[[Tensor], Tensor]) -> HMCState:
    """One chain's state at ``position: (d,)``; ``torch.func.vmap`` it for many chains."""
    return init_position_state(HMCState, position, energy_fn)


def build_kernel(
    integrator: tuple[float, ...] = velocity_verlet, divergence_threshold: float = 1000.0
) -> Callable[..., tuple[HMCState, HMCInfo]]:
    """The pure kernel ``kernel(state, key, energy_fn, step_size, inverse_mass_matrix,
    num_integration_steps, step_size_jitter=None, trajectory_jitter=False)``.

    key: ``(*chains, 2)``; step_size: a tensor, 0-dim or per chain; inverse_mass_matrix: see
    :mod:`fnebm.integrators.metrics` (shared or per chain, diagonal or dense).
    num_integration_steps: a Python int (the trajectory unrolls at trace time: the fastest
    form), or an integer tensor, 0-dim or per chain (data: one graph serves every length; the
    trajectory is a ``while_loop`` over the longest chain's steps, the others masked).
    step_size_jitter: ``None`` or a tensor ``j`` in [0, 1), 0-dim or per chain: each chain's step
    size is drawn uniformly in ``h (1 ± j)`` at every iteration. trajectory_jitter: each chain's
    length is drawn uniformly in ``{1, ..., L}`` at every iteration (mean ``(L + 1) / 2``).
    ``integrator``: coefficients from :mod:`fnebm.integrators.symplectic`.
    """
    transition = build_transition(integrator, divergence_threshold)

    @caches_energy_of(HMCState)
    def kernel(state: HMCState, key: Tensor, energy_fn: Callable[[Tensor], Tensor], step_size: Tensor,
               inverse_mass_matrix, num_integration_steps, step_size_jitter: Tensor | None = None,
               trajectory_jitter: bool = False):
        new, info, _ = transition(state, key, energy_fn, step_size, inverse_mass_matrix, num_integration_steps,
                                  step_size_jitter, trajectory_jitter)
        return new, info

    return kernel


def build_transition(
    integrator: tuple[float, ...] = velocity_verlet, divergence_threshold: float = 1000.0
) -> Callable[..., tuple[HMCState, HMCInfo, IntegratorState]]:
    """The kernel's work, also returning the proposal: ``transition(...) -> (state, info, proposal)``
    with the kernel's arguments. ``proposal`` is the trajectory's end (position, momentum,
    energy, gradient) before accept/reject, which adaptation schemes learn from
    (:mod:`fnebm.adaptation.chees`)."""

    def transition(state: HMCState, key: Tensor, energy_fn: Callable[[Tensor], Tensor], step_size: Tensor,
                   inverse_mass_matrix, num_integration_steps, step_size_jitter: Tensor | None = None,
                   trajectory_jitter: bool = False):
        batch = chain_axes(state.energy, key)
        x = state.position
        h = per_chain("step_size", step_size, batch, x)
        metric = euclidean(inverse_mass_matrix, x, len(batch))
        jitter = step_size_jitter is not None or trajectory_jitter
        keys = fr.split(key, 4 if jitter else 2)
        if step_size_jitter is not None:
            j = per_chain("step_size_jitter", step_size_jitter, batch, x)
            u = fr.uniform(keys[..., 2, :], (), x.dtype).reshape(batch + (1,) * (x.ndim - len(batch)))
            h = h * (1.0 + j * (2.0 * u - 1.0))
        p0 = metric.sample_momentum(keys[..., 0, :], x)
        vg = value_and_grad(energy_fn, len(batch))
        start = IntegratorState(x, p0, state.energy, state.grad)
        static = isinstance(num_integration_steps, int) and not trajectory_jitter
        if static:
            end = start
            for _ in range(num_integration_steps):
                end = integrate(end, h, vg, metric.velocity, integrator)
            n = torch.full(batch, num_integration_steps, dtype=torch.int64, device=x.device)
        else:
            n = _lengths(num_integration_steps, batch, x.device)
            if trajectory_jitter:
                u = fr.uniform(keys[..., 3, :], (), torch.float64)
                n = torch.ceil(u.to(n.device) * n).to(torch.int64).clamp_min(1)
            end = _masked_trajectory(start, n, h, vg, metric.velocity, integrator, len(batch))
        h0 = state.energy + metric.kinetic_energy(p0)
        h1 = end.energy + metric.kinetic_energy(end.momentum)
        finite = all_finite(h1, end.grad, end.position, n_batch=len(batch))
        error = torch.where(finite, h1 - h0, torch.full_like(h1, torch.inf))
        ok = finite & (error <= divergence_threshold)
        decision = metropolis_hastings(keys[..., 1, :], -error, ok)
        new = select(decision.is_accepted, HMCState(end.position, end.energy, end.grad), state)
        info = HMCInfo(decision.acceptance_rate, decision.is_accepted, decision.is_divergent, error, n)
        return HMCState(*new), info, end

    return transition


def _lengths(num_integration_steps, batch: tuple[int, ...], device: torch.device) -> Tensor:
    """Per-chain trajectory lengths ``batch`` (int64) from an int or an integer tensor."""
    if isinstance(num_integration_steps, int):
        return torch.full(batch, num_integration_steps, dtype=torch.int64, device=device)
    _checks.check_tunable_shape("num_integration_steps", num_integration_steps, batch)
    n = num_integration_steps.to(dtype=torch.int64, device=device)
    return n.reshape(tuple(n.shape) + (1,) * (len(batch) - n.ndim)).expand(batch)


def _masked_trajectory(start: IntegratorState, n: Tensor, h: Tensor, vg, velocity, integrator, n_batch: int):
    """``n[c]`` integrator steps for chain ``c``: a ``while_loop`` until the longest is done, each
    chain frozen (``torch.where``) after its own length."""

    def cond(i, n, x, p, e, g):
        return (i < n).any()

    def body(i, n, x, p, e, g):
        nx, np_, ne, ng = integrate(IntegratorState(x, p, e, g), h, vg, velocity, integrator)
        active = i < n
        wide = active.reshape(active.shape + (1,) * (x.ndim - n_batch))
        return (i + 1, n.clone(), torch.where(wide, nx, x), torch.where(wide, np_, p),
                torch.where(active, ne, e), torch.where(wide, ng, g))

    i0 = torch.zeros_like(n)
    _, _, x, p, e, g = while_loop(cond, body, (i0, n, *start))
    return IntegratorState(x, p, e, g)


# one kernel object per (integrator, threshold), built once (equal configurations share a graph)
_kernel_for = KernelCache(build_kernel)


def hmc(
    energy_fn: Callable[[Tensor], Tensor],
    step_size: float | Tensor,
    inverse_mass_matrix: InverseMassMatrix | None = None,
    num_integration_steps: int | Tensor = 10,
    *,
    integrator: tuple[float, ...] = velocity_verlet,
    divergence_threshold: float = 1000.0,
    step_size_jitter: float | Tensor | None = None,
    trajectory_jitter: bool = False,
) -> SamplingAlgorithm:
    """HMC targeting ``p(x) ∝ exp(-E(x))`` with ``num_integration_steps`` steps of ``integrator``.

    ``step_size``: a number or a tensor, 0-dim or one per chain. ``inverse_mass_matrix``:
    diagonal ``(d,)`` / ``(*chains, d)`` or dense ``(d, d)`` / ``(*chains, d, d)`` (``None``: the
    identity, for any d); see :mod:`fnebm.integrators.metrics`. ``num_integration_steps``: a
    Python int (unrolled: fastest), or an integer tensor, 0-dim or per chain (one graph for every
    length). ``step_size_jitter``: a fraction ``j`` in [0, 1): each chain's step size drawn in
    ``h (1 ± j)`` every iteration. ``trajectory_jitter``: each chain's length drawn uniformly in
    ``{1, ..., L}`` every iteration. A proposal whose energy error exceeds
    ``divergence_threshold`` or is not finite is rejected and flagged.
    Returns ``SamplingAlgorithm(init, step)``: ``init(position: (d,)) -> HMCState`` for one
    chain, ``step(state, keys: (*chains, 2)) -> (HMCState, HMCInfo)``.
    """
    check_energy(energy_fn)
    step_size = _checks.tunable("step_size", step_size)
    num_integration_steps = _check_lengths(num_integration_steps)
    threshold = _checks.check_real("divergence_threshold", divergence_threshold)
    if not threshold > 0:
        raise ValueError(f"divergence_threshold must be > 0, got {threshold}")
    coefficients = tuple(_checks.check_real("integrator coefficient", c) for c in integrator)
    if len(coefficients) % 2 == 0 or coefficients != coefficients[::-1]:
        raise ValueError(f"integrator must be a palindrome of odd length (e.g. fnebm.integrators.velocity_verlet), "
                         f"got {integrator}")
    if inverse_mass_matrix is not None:
        inverse_mass_matrix = check_inverse_mass_matrix(inverse_mass_matrix)
    if step_size_jitter is not None:
        step_size_jitter = _checks.tunable("step_size_jitter", step_size_jitter, allow_zero=True)
        if _checks.is_concrete(step_size_jitter) and not bool((step_size_jitter < 1).all()):
            raise ValueError("step_size_jitter must be < 1 (a fraction of the step size)")
    if not isinstance(trajectory_jitter, bool):
        raise TypeError(f"trajectory_jitter must be a bool, got {type(trajectory_jitter).__name__}")
    kernel = _kernel_for(coefficients, threshold)
    extra = dict(num_integration_steps=num_integration_steps, step_size_jitter=step_size_jitter,
                 trajectory_jitter=trajectory_jitter)
    fields = dict(state_type=HMCState, info_type=HMCInfo, caches_energy=True, energy_fn=energy_fn,
                  step_size=step_size, **extra)
    if inverse_mass_matrix is None:
        step = Step.of("hmc", _identity_metric, kernel, tunables=("step_size", "step_size_jitter"), **fields)
    else:
        step = Step.of("hmc", kernel, tunables=("step_size", "inverse_mass_matrix", "step_size_jitter"),
                       inverse_mass_matrix=inverse_mass_matrix, **fields)
    return SamplingAlgorithm(functools.partial(init, energy_fn=energy_fn), step)


@caches_energy_of(HMCState)
def _identity_metric(kernel, state, key, energy_fn, step_size, **extra):
    ones = torch.ones(state.position.shape[-1], dtype=state.position.dtype, device=state.position.device)
    return kernel(state, key, energy_fn, step_size, ones, **extra)


def _check_lengths(n) -> int | Tensor:
    """A trajectory length: a Python/NumPy int >= 1, or an integer tensor (0-dim or per chain) >= 1."""
    if isinstance(n, Tensor):
        if n.dtype.is_floating_point or n.dtype.is_complex or n.dtype == torch.bool:
            raise TypeError(f"num_integration_steps must be an int or an integer tensor, got dtype {n.dtype}")
        if _checks.is_concrete(n) and n.numel() and not bool((n >= 1).all()):
            raise ValueError("num_integration_steps must be >= 1 everywhere")
        return n
    return _checks.check_int("num_integration_steps", n, 1)
