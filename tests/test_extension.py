"""A sampler written outside the package runs everywhere fnebm's own samplers run.

Random-walk Metropolis with a diagonal proposal scale, defined here in the three layers
(``init``, the kernel, the constructor returning ``SamplingAlgorithm(init, Step.of(...))``),
touching no file of fnebm: ``sample_chain`` runs it (dispatch reads its fields and names why no
hand-written kernel applies), ``window_adaptation`` tunes its step size and scale, and the CD loss
trains with it (reusing the energies its ``init`` cached, as for fnebm's samplers).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import pytest
import torch

import fnebm
from fnebm import energies, losses
from fnebm import random as fr
from fnebm.integrators.metrics import Diagonal
from fnebm.samplers.base import SamplingAlgorithm, Step, all_finite, chain_axes, over_batch, per_chain
from fnebm.samplers.proposal import metropolis_hastings, select

F64 = torch.float64


class RWMState(NamedTuple):
    position: torch.Tensor
    energy: torch.Tensor


class RWMInfo(NamedTuple):
    acceptance_rate: torch.Tensor
    is_accepted: torch.Tensor
    is_divergent: torch.Tensor


def rwm_init(position, energy_fn):
    return RWMState(position, energy_fn(position))


def rwm_kernel(state, key, energy_fn, step_size, inverse_mass_matrix):
    batch = chain_axes(state.energy, key)
    x = state.position
    h = per_chain("step_size", step_size, batch, x)
    keys = fr.split(key)
    scale = inverse_mass_matrix.to(x.dtype).sqrt()
    proposal = x + h * scale * fr.normal(keys[..., 0, :], x.shape[len(batch):], x.dtype)
    new_energy = over_batch(energy_fn, len(batch))(proposal)
    decision = metropolis_hastings(keys[..., 1, :], state.energy - new_energy,
                                   all_finite(new_energy, proposal, n_batch=len(batch)))
    new = RWMState(*select(decision.is_accepted, RWMState(proposal, new_energy), state))
    return new, RWMInfo(decision.acceptance_rate, decision.is_accepted, decision.is_divergent)


def rwm(energy_fn, step_size, inverse_mass_matrix=None):
    step_size = torch.as_tensor(step_size, dtype=F64)
    if inverse_mass_matrix is None:
        inverse_mass_matrix = torch.ones(())
    if isinstance(inverse_mass_matrix, Diagonal):  # what window_adaptation passes
        inverse_mass_matrix = inverse_mass_matrix.inverse_mass_matrix
    return SamplingAlgorithm(
        functools.partial(rwm_init, energy_fn=energy_fn),
        Step.of("rwm", rwm_kernel, caches_energy=True, state_type=RWMState, info_type=RWMInfo,
                tunables=("step_size", "inverse_mass_matrix"), energy_fn=energy_fn, step_size=step_size,
                inverse_mass_matrix=inverse_mass_matrix))


SCALES = torch.tensor([0.5, 2.0], dtype=F64)
TARGET = energies.gaussian(torch.zeros(2, dtype=F64), torch.diag(SCALES**2), dtype=F64)  # covariance


def test_sample_chain_runs_it_and_says_why_no_kernel():
    alg = rwm(TARGET, 1.2, SCALES**2)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(0), (64, 2), F64))
    plans = []
    chain, trace, info = fnebm.sample_chain(alg.step, state, fr.key(1), 1500, burn_in=200, compile=False,
                                            on_plan=plans.append, progress=False)
    assert type(chain.state) is RWMState and type(info) is RWMInfo
    assert plans[0].engine == "eager" and all("rwm step" in s.reason for s in plans[0].skipped)
    with pytest.raises(ValueError, match='backend="c" cannot run this chain: the step is a rwm step'):
        fnebm.sample_chain(alg.step, state, fr.key(1), 5, backend="c", progress=False)
    # the draws target the Gaussian: mean 0 and variance SCALES**2, within 5 Monte Carlo errors
    mean = trace.mean((0, 1))
    assert (mean.abs() < 5 * fnebm.diagnostics.mcse_mean(trace)).all(), mean
    sd = trace.std((0, 1))
    assert ((sd - SCALES).abs() < 5 * fnebm.diagnostics.mcse_sd(trace)).all(), sd
    assert 0.2 < info.acceptance_rate.mean() < 0.9


def test_window_adaptation_tunes_it():
    warmup = fnebm.window_adaptation(rwm, TARGET, 300, initial_step_size=0.1, target_acceptance_rate=0.4)
    result = warmup.run(fr.normal(fr.key(2), (16, 2), F64), fr.key(3), compile=False)
    imm = result.parameters["inverse_mass_matrix"].inverse_mass_matrix
    # the adapted proposal scale follows the target's: the second coordinate's variance is 16x the first's
    ratio = float(imm[1] / imm[0])
    assert 4.0 < ratio < 64.0, ratio
    alg = rwm(TARGET, **result.parameters)
    _, _, info = fnebm.sample_chain(alg.step, result.state, fr.key(4), 400, compile=False, progress=False)
    rate = float(info.acceptance_rate.mean())
    assert abs(rate - 0.4) < 0.1, rate


def test_the_cd_loss_trains_with_it():
    mean = torch.tensor([0.3, -0.2], dtype=F64)
    model = energies.gaussian(mean, torch.eye(2, dtype=F64), dtype=F64)
    batch = fr.normal(fr.key(5), (128, 2), F64) + 1.0
    sampler = functools.partial(rwm, step_size=0.5)
    loss, aux = losses.contrastive_divergence(model, batch, fr.key(6), sampler=sampler, n_steps=5)
    assert loss.ndim == 0 and math.isfinite(float(loss)) and type(aux.info) is RWMInfo
    # the positives' energies came from the sampler's init (it declares caches_energy), equal to the model's own
    torch.testing.assert_close(aux.positive_energy, torch.func.vmap(model)(batch))
    # a sampler whose state's `energy` is something else (here the negated energy) and says nothing:
    # the loss computes the positives' energies itself, so the loss is the same
    def negated(energy_fn, step_size):
        alg = rwm(energy_fn, step_size)
        init = lambda x: RWMState(x, -energy_fn(x))  # noqa: E731
        return SamplingAlgorithm(init, Step.of("rwm", rwm_kernel, state_type=RWMState, info_type=RWMInfo,
                                               tunables=("step_size", "inverse_mass_matrix"), **alg.step.keywords))
    loss2, aux2 = losses.contrastive_divergence(model, batch, fr.key(6), sampler=functools.partial(negated, step_size=0.5),
                                                n_steps=1)
    torch.testing.assert_close(aux2.positive_energy, torch.func.vmap(model)(batch))
    grads = torch.func.grad(lambda m: losses.contrastive_divergence(m, batch, fr.key(6), sampler=sampler,
                                                                    n_steps=5)[0])(model)
    assert all(torch.isfinite(g).all() for g in torch.utils._pytree.tree_leaves(grads))
