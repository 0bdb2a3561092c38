"""ChEES-HMC: step size and trajectory length adapted across an ensemble of chains, jittered.

Hoffman, Radul & Sountsov (2021), "An adaptive MCMC scheme for setting trajectory lengths in
Hamiltonian Monte Carlo" (BlackJAX's ``chees_adaptation``). Every chain runs HMC with the
same step size and, at each iteration, the same number of leapfrog steps
``ceil(u_t T / h)``, where ``u_t`` is a quasi-random Halton jitter in (0, 1]. The trajectory
length ``T`` climbs the ChEES criterion (the change in the estimator of the expected square,
``E[(|x' - E x'|^2 - |x - E x|^2)^2] / 4``) by Adam on ``log T``; the step size follows dual
averaging on the harmonic mean of the chains' acceptance rates (target 0.651).

**Why ChEES and not MEADS (or NUTS) for many chains.** With many chains in lockstep, NUTS
pays for the longest tree at every iteration. ChEES gives every chain the same length at an
iteration, so a batched step does no masked (wasted) work, and the trajectory is a single
``while_loop`` of the same trip count for all chains. It keeps fnebm's HMC kernel unchanged
(the proposal comes from :func:`fnebm.samplers.hmc.build_transition`). MEADS needs a
different kernel (generalised HMC with persistent momentum and a per-fold damping schedule)
and splits the ensemble into folds; ChEES reuses what exists and is what BlackJAX and TFP
recommend for GPU ensembles.

The warm-up is one call of :func:`fnebm.sample_chain` over the whole ensemble (the ensemble
is one "chain" of a state whose fields lead with the chain axis), so it compiles once; new
positions, targets or initial step sizes of the same shapes reuse the graph. It reaches
``sample_chain`` through the runner of :mod:`fnebm._loop` (:mod:`fnebm.chain` installs it), not by
importing :mod:`fnebm.chain`, which sits above this layer.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import _loop
from fnebm import random as fr
from fnebm.adaptation.step_size import DualAveragingState, dual_averaging
from fnebm.integrators.metrics import Dense, Diagonal, check_inverse_mass_matrix
from fnebm.integrators.symplectic import velocity_verlet
from fnebm.samplers.base import check_energy
from fnebm.samplers.hmc import HMCInfo, HMCState, build_transition
from fnebm.samplers.hmc import init as hmc_init

__all__ = ["ChEESState", "ChEESInfo", "ChEESAdaptation", "chees_adaptation", "halton"]

TARGET_ACCEPTANCE_RATE = 0.651  # the optimal HMC acceptance (Beskos et al. 2013), as BlackJAX
_LOG_UPDATE_CLIP = 0.35  # largest change of log T per iteration (TFP, BlackJAX)
_ADAM_B1, _ADAM_B2, _ADAM_EPS = 0.9, 0.999, 1e-8


class ChEESState(NamedTuple):
    """The ensemble's warm-up state. ``states``: the chains' HMC states ``(chains, ...)``; the
    rest are 0-dim: the current and the averaged log step size and log trajectory length, the
    dual-averaging state, Adam's moments and the (1-based) iteration."""

    states: HMCState
    log_step_size: Tensor
    log_step_size_avg: Tensor
    log_trajectory_length: Tensor
    log_trajectory_length_avg: Tensor
    dual_averaging: DualAveragingState
    adam_m: Tensor
    adam_v: Tensor
    step: Tensor


class ChEESInfo(NamedTuple):
    """Per iteration: the chains' HMC info (``(chains,)`` fields), and the ensemble's step size,
    trajectory length and harmonic-mean acceptance (0-dim)."""

    hmc: HMCInfo
    step_size: Tensor
    trajectory_length: Tensor
    harmonic_mean_acceptance: Tensor


torch.serialization.add_safe_globals([ChEESState, ChEESInfo])


def halton(i: Tensor, base: int = 2, bits: int = 32) -> Tensor:
    """The radical inverse of ``i`` (an integer tensor) in ``base``: the Halton sequence, in [0, 1)."""
    i = i.to(torch.int64)
    out = torch.zeros(i.shape, dtype=torch.float64, device=i.device)
    f = 1.0
    for _ in range(bits):
        f /= base
        out = out + f * torch.remainder(i, base).to(torch.float64)
        i = torch.div(i, base, rounding_mode="floor")
    return out


def _jitter(step: Tensor, amount: Tensor) -> Tensor:
    # Halton of the iteration, moved into (0, 1]: the first element of the sequence is 0
    u = 1.0 - halton(step)
    return amount * u + (1.0 - amount)


def _adapt_step(transition, da, learning_rate, decay_rate, jitter_amount, max_steps, energy_fn,
                inverse_mass_matrix, n_chains, state: ChEESState, key: Tensor) -> tuple[ChEESState, ChEESInfo]:
    states = state.states
    x0 = states.position
    dtype = x0.dtype
    h = state.log_step_size.exp()
    T = state.log_trajectory_length.exp()
    u = _jitter(state.step, jitter_amount).to(dtype)
    n = torch.clamp(torch.ceil(u * T / h), 1, max_steps).to(torch.int64)
    keys = fr.split(key, n_chains)
    new, info, proposal = transition(states, keys, energy_fn, h, inverse_mass_matrix, n)

    # step size: dual averaging on the harmonic mean of the acceptance rates of non-divergent chains
    ok = ~info.is_divergent
    acc = info.acceptance_rate.to(dtype)
    inv = torch.where(ok, 1.0 / acc, torch.zeros_like(acc))
    harmonic = ok.sum() / inv.sum()
    harmonic = torch.where(harmonic.isfinite(), harmonic, torch.zeros_like(harmonic))
    da_new = da.update(state.dual_averaging, harmonic)
    finite_h = da_new.log_step_size.isfinite()
    log_h = torch.where(finite_h, da_new.log_step_size, state.log_step_size)
    da_state = DualAveragingState(*(torch.where(finite_h, a, b) for a, b in zip(da_new, state.dual_averaging)))
    weight = state.step.to(dtype) ** (-decay_rate)
    log_h_avg = (1 - weight) * state.log_step_size_avg + weight * log_h

    # trajectory length: ascend the ChEES criterion in log T (gradient whitened by the metric)
    w = torch.where(ok, acc, torch.zeros_like(acc))
    x1 = torch.where(proposal.position.isfinite(), proposal.position, torch.zeros_like(proposal.position))
    w1 = torch.where(proposal.position.isfinite().all(-1), w, torch.zeros_like(w))
    m1 = (w1[:, None] * x1).sum(0) / (w1.sum() + 1e-20)
    m0 = x0.mean(0)
    c1, c0 = x1 - m1, x0 - m0
    # whitened by the metric: |c|^2 in its geometry is c . M c, while <c1, v1> in whitened
    # coordinates is <c1, p1> (position and momentum are conjugate)
    p1 = torch.where(proposal.momentum.isfinite(), proposal.momentum, torch.zeros_like(proposal.momentum))
    sq1 = (c1 * _mass_times(inverse_mass_matrix, c1)).sum(-1)
    sq0 = (c0 * _mass_times(inverse_mass_matrix, c0)).sum(-1)
    per_chain = u * T * (sq1 - sq0) * (c1 * p1).sum(-1)
    g = (w * torch.where(w > 0, per_chain, torch.zeros_like(per_chain))).sum() / (w.sum() + 1e-20)
    t = state.step.to(dtype)
    m = _ADAM_B1 * state.adam_m + (1 - _ADAM_B1) * g
    v = _ADAM_B2 * state.adam_v + (1 - _ADAM_B2) * g * g
    update = learning_rate * (m / (1 - _ADAM_B1**t)) / ((v / (1 - _ADAM_B2**t)).sqrt() + _ADAM_EPS)
    log_T = state.log_trajectory_length + torch.clamp(update, -_LOG_UPDATE_CLIP, _LOG_UPDATE_CLIP)
    finite_T = log_T.isfinite()
    log_T = torch.where(finite_T, log_T, state.log_trajectory_length)
    m, v = torch.where(finite_T, m, state.adam_m), torch.where(finite_T, v, state.adam_v)
    log_T_avg = (1 - weight) * state.log_trajectory_length_avg + weight * log_T
    # the next length: the averaged one, between one step and max_steps steps of the new step size
    log_T_next = torch.clamp(log_T_avg, log_h, log_h + math.log(max_steps))

    out = ChEESState(new, log_h, log_h_avg, log_T_next, log_T_avg, da_state, m, v, state.step + 1)
    return out, ChEESInfo(info, h, T, harmonic)


def _mass_times(inverse_mass_matrix: Tensor, c: Tensor) -> Tensor:
    """``M c`` for rows ``c: (chains, d)`` and a shared ``M^{-1}``, ``(d,)`` or ``(d, d)``."""
    imm = inverse_mass_matrix.to(c.dtype)
    return c / imm if imm.ndim == 1 else torch.linalg.solve(imm, c.mT).mT


class ChEESAdaptation(NamedTuple):
    """``run(positions, key) -> (states, parameters, info)``; see :func:`chees_adaptation`."""

    run: Callable[..., tuple[HMCState, dict[str, Any], ChEESInfo]]


def chees_adaptation(
    energy_fn: Callable[[Tensor], Tensor],
    num_steps: int,
    *,
    initial_step_size: float | None = None,
    inverse_mass_matrix: Tensor | None = None,
    target_acceptance_rate: float = TARGET_ACCEPTANCE_RATE,
    learning_rate: float = 0.025,
    decay_rate: float = 0.5,
    jitter_amount: float = 1.0,
    max_leapfrog_steps: int = 1000,
    integrator: tuple[float, ...] = velocity_verlet,
    divergence_threshold: float = 1000.0,
    compile: bool = True,
    cache: Any = None,
    runner: Callable[..., Any] | None = None,
) -> ChEESAdaptation:
    """ChEES-HMC warm-up of ``num_steps`` iterations over an ensemble of chains.

    Args:
        energy_fn: ``x -> E(x)`` for one sample.
        num_steps: warm-up iterations.
        initial_step_size: the first step size (default: the rule of thumb ``d^(-1/4)``); the
            first trajectory is one step long.
        inverse_mass_matrix: a fixed metric, shared by the chains (``(d,)`` or ``(d, d)``;
            default the identity). Adapt it first with :func:`fnebm.adaptation.window_adaptation`
            where the scales differ widely.
        target_acceptance_rate: of the harmonic mean of the chains' acceptance rates.
        learning_rate: Adam's, on ``log T``.
        decay_rate: the final values average the iterates with weights ``t^(-decay_rate)``.
        jitter_amount: the trajectory length is ``T (1 - a + a u)``, ``u`` in (0, 1] (Halton).
        max_leapfrog_steps: caps the trajectory.
        compile: run the warm-up as one compiled graph (``False``: eagerly, same result). A
            compile that fails runs it eagerly instead, with one
            :class:`~fnebm.chain.runner.CompileFallbackWarning` (see :func:`fnebm.sample_chain`).
        cache: the :class:`fnebm.chain.RunnerCache` holding the compiled warm-up (default: the
            process-wide one).
        runner: what runs the warm-up's steps, ``runner(step, state, key, n_steps, *, collect,
            compile, cache, progress, on_plan) -> (state, trace, info)`` (default:
            ``sample_chain``'s, see :mod:`fnebm._loop`; ``fnebm._loop.eager_runner`` is the plain
            loop).

    Returns:
        ``ChEESAdaptation(run)``. ``run(positions: (chains, d), key) -> (states, parameters,
        info)``: the chains' final :class:`~fnebm.samplers.hmc.HMCState`, a dict of keyword
        arguments for :func:`fnebm.hmc` (``step_size``, ``inverse_mass_matrix``,
        ``num_integration_steps``, ``trajectory_jitter=True``), and the per-iteration
        :class:`ChEESInfo` (leading axis ``num_steps``). Sample on with
        ``fnebm.hmc(energy_fn, **parameters)``.
    """
    check_energy(energy_fn)
    num_steps = _checks.check_int("num_steps", num_steps, 1)
    max_leapfrog_steps = _checks.check_int("max_leapfrog_steps", max_leapfrog_steps, 1)
    for name, value, lo, hi in [("target_acceptance_rate", target_acceptance_rate, 0.0, 1.0),
                                ("jitter_amount", jitter_amount, 0.0, 1.0)]:
        v = _checks.check_real(name, value)
        if not (lo < v < hi or (name == "jitter_amount" and lo <= v <= hi)):
            raise ValueError(f"{name} must be in ({lo}, {hi}), got {v}")
    for name, value in [("learning_rate", learning_rate), ("decay_rate", decay_rate),
                        ("divergence_threshold", divergence_threshold)]:
        v = _checks.check_real(name, value)
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be > 0 and finite, got {value}")
    if isinstance(integrator, (str, bytes)) or not isinstance(integrator, (tuple, list)):
        raise TypeError(f"integrator must be a tuple of coefficients (e.g. fnebm.integrators.velocity_verlet), "
                        f"got {type(integrator).__name__}")
    coefficients = tuple(_checks.check_real("integrator coefficient", c) for c in integrator)
    if len(coefficients) % 2 == 0 or coefficients != coefficients[::-1]:
        raise ValueError(f"integrator must be a palindrome of odd length (e.g. fnebm.integrators.velocity_verlet), "
                         f"got {integrator}")
    if compile not in (True, False, "auto") or not isinstance(compile, (bool, str)):
        raise ValueError(f'compile must be True, False or "auto", got {compile!r}')
    if runner is not None:
        _checks.check_callable("runner", runner, "runner(step, state, key, n_steps, **options) -> (state, trace, info)")
    if initial_step_size is not None:
        initial_step_size = _checks.tunable("initial_step_size", initial_step_size)
        if initial_step_size.ndim:
            raise ValueError("initial_step_size must be one value: ChEES adapts one step size for the ensemble")
    if inverse_mass_matrix is not None:
        wrapped = check_inverse_mass_matrix(inverse_mass_matrix)
        inverse_mass_matrix = getattr(wrapped, "inverse_mass_matrix", wrapped)  # Diagonal/Dense unwrapped
        expected = 2 if isinstance(wrapped, Dense) else 1 if isinstance(wrapped, Diagonal) else inverse_mass_matrix.ndim
        if expected not in (1, 2) or inverse_mass_matrix.ndim != expected or (
                expected == 2 and inverse_mass_matrix.shape[0] != inverse_mass_matrix.shape[1]):
            raise ValueError("inverse_mass_matrix must be shared by the chains: (d,) or (d, d)")
    transition = build_transition(tuple(integrator), float(divergence_threshold))
    da = dual_averaging(target_acceptance_rate)

    def run(positions: Tensor, key: Tensor) -> tuple[HMCState, dict[str, Any], ChEESInfo]:
        if not isinstance(positions, Tensor) or positions.ndim != 2 or not positions.is_floating_point():
            raise ValueError("positions must be a floating tensor (chains, d): one start per chain "
                             f"(ChEES learns from the ensemble), got {getattr(positions, 'shape', type(positions))}")
        n_chains, d = positions.shape
        if n_chains < 2:
            raise ValueError(f"ChEES needs an ensemble of chains (at least 2), got {n_chains}")
        _checks.check_key(key)
        dtype, device = positions.dtype, positions.device
        imm = (torch.ones(d, dtype=dtype, device=device) if inverse_mass_matrix is None
               else inverse_mass_matrix.to(dtype=dtype, device=device))
        h0 = (torch.tensor(d ** -0.25, dtype=dtype, device=device) if initial_step_size is None
              else initial_step_size.to(dtype=dtype, device=device))
        states = torch.func.vmap(lambda x: hmc_init(x, energy_fn))(positions)
        log_h0 = h0.log()
        state = ChEESState(states, log_h0, torch.zeros_like(log_h0), log_h0.clone(), torch.zeros_like(log_h0),
                           da.init(h0), torch.zeros_like(log_h0), torch.zeros_like(log_h0),
                           torch.ones((), dtype=torch.int64, device=device))
        step = functools.partial(_adapt_step, transition, da, learning_rate, decay_rate, jitter_amount,
                             max_leapfrog_steps, energy_fn, imm, n_chains)
        run_steps = _loop.default_runner() if runner is None else runner  # sample_chain's under import fnebm
        final, _, info = run_steps(step, state, key, num_steps, collect=_nothing, compile=compile, cache=cache,
                                   progress=False, on_plan=None)
        step_size = final.log_step_size_avg.exp()
        length = torch.ceil((final.log_trajectory_length_avg - final.log_step_size_avg).exp()).clamp(1, max_leapfrog_steps)
        parameters = {"step_size": step_size, "inverse_mass_matrix": imm,
                      "num_integration_steps": length.to(torch.int64), "trajectory_jitter": True}
        return final.states, parameters, info

    return ChEESAdaptation(run)


def _nothing(state: ChEESState) -> Tensor:
    return state.step
