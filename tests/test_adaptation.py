"""Adaptation: dual averaging, Welford, Stan's schedule, and window_adaptation with HMC and NUTS.

The statistical tests use fixed keys and tolerances from the draws' own Monte Carlo standard
errors (``fnebm.diagnostics.mcse_mean``), on a correlated 4-D Gaussian with condition number
100. They run eagerly: on a 2-core CPU an ``aot_eager`` step costs as much as an eager one, so
compiling pays nothing there. One small warm-up is compiled, with a counting ``aot_eager``
backend, for the compile promises (one graph; new values and lengths reuse it; equal to eager).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fnebm
from fnebm import diagnostics
from fnebm import energies as E
from fnebm import random as fr
from fnebm.adaptation import build_schedule, dual_averaging, welford, window_adaptation
from fnebm.adaptation import mass_matrix as mm
from fnebm.adaptation.window import (
    MAX_WINDOWS,
    default_num_integration_steps,
    default_step_size,
    default_target_acceptance_rate,
    stages,
)
from fnebm.integrators.metrics import Dense, Diagonal

F64 = torch.float64
D = 4
Z = 4.5  # 14 moments per check: a false alarm under 1e-4 each


def ill_conditioned(d: int = D, seed: int = 0, condition: float = 100.0):
    """A correlated Gaussian whose covariance has eigenvalues log-spaced in [1/condition, 1]."""
    q, _ = torch.linalg.qr(fr.normal(fr.key(seed), (d, d), F64))
    cov = q @ torch.diag(torch.logspace(-math.log10(condition), 0, d, dtype=F64)) @ q.T
    cov = 0.5 * (cov + cov.T)
    mean = torch.linspace(-1.0, 2.0, d, dtype=F64)
    return mean, cov, E.gaussian(mean, cov)


MEAN, COV, TARGET = ill_conditioned()


def moment_z(trace: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """z-scores of the sample mean and of every covariance entry (``E[(x - mu)(x - mu)^T]`` with the
    true mean) against the truth, each divided by its MCSE from the draws ``(draws, chains, d)``."""
    i, j = torch.triu_indices(mean.shape[0], mean.shape[0])
    centred = trace - mean
    stats = torch.cat([trace, centred[..., i] * centred[..., j]], -1)
    truth = torch.cat([mean, cov[i, j]])
    return (stats.mean((0, 1)) - truth) / diagnostics.mcse_mean(stats, layout="draws_chains")


def passes(trace: torch.Tensor) -> bool:
    return bool((moment_z(trace, MEAN, COV).abs() < Z).all())


def whitened_condition(inverse_mass_matrix: torch.Tensor) -> float:
    """cond(P^1/2 M^-1 P^1/2): 1 for a metric equal to the covariance, 100 for the identity here."""
    eig = torch.linalg.eigvals(inverse_mass_matrix @ torch.linalg.inv(COV)).real
    return float(eig.max() / eig.min())


# ------------------------------------------------------------------------------ dual averaging


def test_dual_averaging_first_iterations_follow_stans_formulas():
    da = dual_averaging(0.8)
    state = da.init(torch.tensor(0.5, dtype=F64))
    assert float(da.final(state)) == pytest.approx(0.5)
    mu = math.log(5.0)
    # t = 1: Hbar = 0.3 / 11, log h = mu - 1 / 0.05 * Hbar, the average is the iterate
    state = da.update(state, torch.tensor(0.5, dtype=F64))
    hbar = 0.3 / 11
    log_h = mu - 20 * hbar
    assert float(state.log_step_size) == pytest.approx(log_h)
    assert float(state.log_step_size_avg) == pytest.approx(log_h)
    # t = 2: Hbar = (1 - 1/12) Hbar + (0.8 - 1) / 12; the average weighs the new iterate by 2^-0.75
    state = da.update(state, torch.tensor(1.0, dtype=F64))
    hbar = (1 - 1 / 12) * hbar - 0.2 / 12
    log_h2 = mu - math.sqrt(2) * 20 * hbar
    w = 2**-0.75
    assert float(state.log_step_size) == pytest.approx(log_h2)
    assert float(state.log_step_size_avg) == pytest.approx(w * log_h2 + (1 - w) * log_h)


@pytest.mark.parametrize("target", [0.65, 0.8])
def test_dual_averaging_finds_the_step_size_of_the_target_acceptance(target):
    # a smooth decreasing acceptance: a(h) = exp(-h^2), the root is sqrt(-log target)
    da = dual_averaging(target)
    state = da.init(torch.full((3,), 2.0, dtype=F64))  # one step size per "chain"
    for _ in range(2000):
        state = da.update(state, torch.exp(-state.log_step_size.exp() ** 2))
    torch.testing.assert_close(da.final(state), torch.full((3,), math.sqrt(-math.log(target)), dtype=F64),
                               rtol=0.01, atol=0)


def test_dual_averaging_pools_trailing_chain_axes_and_counts_nan_as_zero():
    da = dual_averaging(0.7)
    h0 = torch.tensor([0.3, 0.6], dtype=F64)
    acc = torch.tensor([[0.2, 0.4, 0.9], [1.0, 0.5, float("nan")]], dtype=F64)  # (2 rows, 3 chains)
    pooled = da.update(da.init(h0), acc)
    by_hand = da.update(da.init(h0), torch.tensor([0.5, 0.5], dtype=F64))
    for a, b in zip(pooled, by_hand):
        torch.testing.assert_close(a, b)
    one = da.update(da.init(torch.tensor(0.3, dtype=F64)), acc)  # a 0-dim state pools every chain
    assert one.log_step_size.shape == ()
    with pytest.raises(ValueError, match="does not lead with"):
        da.update(da.init(torch.ones(3, dtype=F64)), acc)


def test_dual_averaging_keeps_a_float32_state_float32():
    da = dual_averaging(torch.tensor(0.8, dtype=F64))
    state = da.update(da.init(torch.tensor(0.1)), torch.rand(5))
    assert all(x.dtype == torch.float32 for x in state)


@pytest.mark.parametrize("kwargs,match", [
    (dict(target=1.0), "target must be in"), (dict(target=0.0), "target must be in"),
    (dict(target=0.8, gamma=0.0), "gamma"), (dict(target=0.8, kappa=0.4), "kappa"),
    (dict(target=0.8, t0=-1.0), "t0"),
])
def test_dual_averaging_refuses_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dual_averaging(**kwargs)


# ------------------------------------------------------------------------------ Welford


@pytest.mark.parametrize("diagonal", [True, False])
def test_welford_pooled_and_per_chain_match_torch_cov(diagonal):
    draws = fr.normal(fr.key(3), (7, 5, 3), F64) @ torch.tensor([[1.0, 0, 0], [0.5, 2, 0], [0, 0.3, 0.1]], dtype=F64)
    w = welford(diagonal)

    def as_stat(cov):
        return cov.diagonal(dim1=-2, dim2=-1) if diagonal else cov

    pooled = w.init(torch.zeros(3, dtype=F64))
    per_chain = w.init(torch.zeros(5, 3, dtype=F64))
    for x in draws:  # one iteration of 5 chains at a time
        pooled, per_chain = w.update(pooled, x), w.update(per_chain, x)
    torch.testing.assert_close(mm.covariance(pooled), as_stat(torch.cov(draws.reshape(-1, 3).T)))
    torch.testing.assert_close(mm.covariance(per_chain), as_stat(torch.stack([torch.cov(draws[:, c].T) for c in range(5)])))
    # one batch of everything == draw by draw
    once = w.update(w.init(torch.zeros(3, dtype=F64)), draws)
    for a, b in zip(once, pooled):
        torch.testing.assert_close(a, b)
    # Stan's regularisation towards 1e-3 I
    n = 35.0
    eye = torch.ones(3, dtype=F64) if diagonal else torch.eye(3, dtype=F64)
    torch.testing.assert_close(w.final(pooled), n / (n + 5) * mm.covariance(pooled) + 1e-3 * 5 / (n + 5) * eye)
    torch.testing.assert_close(w.final(w.init(torch.zeros(3, dtype=F64))), 1e-3 * eye)


def test_welford_refuses_draws_of_another_shape():
    w = welford(False)
    with pytest.raises(ValueError, match="expected"):
        w.update(w.init(torch.zeros(4, 3)), torch.zeros(5, 3))


# ------------------------------------------------------------------------------ schedule


def flags(num_steps: int, **kwargs):
    s = build_schedule(num_steps, **kwargs)
    return stages(s, torch.arange(num_steps))


def test_stans_default_schedule():
    slow, end = flags(1000)
    assert end.nonzero().flatten().tolist() == [99, 149, 249, 449, 949]
    assert slow.nonzero().flatten()[[0, -1]].tolist() == [75, 949]
    assert int(slow.sum()) == 875


@pytest.mark.parametrize("num_steps", [5, 19, 20, 60, 149, 150, 151, 300, 1000, 2345])
def test_schedule_matches_blackjax(num_steps):
    pytest.importorskip("blackjax")
    from blackjax.adaptation.window_adaptation import build_schedule as blackjax_schedule

    theirs = torch.as_tensor(blackjax_schedule(num_steps).tolist())
    slow, end = flags(num_steps)
    assert slow.tolist() == (theirs[:, 0] == 1).tolist()
    assert end.tolist() == (theirs[:, 1] == 1).tolist()


def test_schedule_is_fixed_size_data():
    a, b = build_schedule(40), build_schedule(4000)
    assert [x.shape for x in a] == [x.shape for x in b] == [(), (), (MAX_WINDOWS,)]
    assert not flags(19)[0].any()  # below 20 iterations: the step size only


# ------------------------------------------------------------------------------ rules of thumb and defaults


def test_defaults_follow_the_rules_of_thumb_and_the_algorithm():
    assert default_step_size(16) == pytest.approx(0.5)
    assert default_num_integration_steps(10) == 4
    assert default_target_acceptance_rate(fnebm.hmc) == 0.65
    assert default_target_acceptance_rate(fnebm.nuts) == 0.8
    assert default_target_acceptance_rate(functools.partial(fnebm.nuts, max_tree_depth=5)) == 0.8
    x0 = fr.normal(fr.key(0), (8, D), F64)
    warm = window_adaptation(fnebm.hmc, TARGET, 50)
    state = warm.init(x0)
    assert state.step_size.shape == () and float(state.step_size) == pytest.approx(D**-0.25)  # pooled: 8 chains
    assert float(state.target) == 0.65
    assert torch.equal(state.inverse_mass_matrix, torch.ones(D, dtype=F64))
    _, parameters = warm.final(state)
    assert parameters["num_integration_steps"] == 2  # ceil(sqrt(4))
    assert isinstance(parameters["inverse_mass_matrix"], Diagonal)
    _, parameters = window_adaptation(fnebm.hmc, TARGET, 50, num_integration_steps=7).final(state)
    assert parameters["num_integration_steps"] == 7
    nuts = window_adaptation(fnebm.nuts, TARGET, 50, is_mass_matrix_diagonal=False)
    state = nuts.init(x0)
    assert float(state.target) == 0.8 and state.inverse_mass_matrix.shape == (D, D)
    assert "num_integration_steps" not in nuts.final(state)[1]
    per_chain = window_adaptation(fnebm.hmc, TARGET, 50, pooled=False).init(x0)
    assert per_chain.step_size.shape == (8,) and per_chain.inverse_mass_matrix.shape == (8, D)


# ------------------------------------------------------------------------------ HMC: only after adaptation


@pytest.fixture(scope="module")
def hmc_adapted():
    """Dense window adaptation of HMC (200 iterations, 128 chains from N(0, I)), then 200 draws at the
    tuned values."""
    x0 = fr.normal(fr.key(1), (128, D), F64)
    result = window_adaptation(fnebm.hmc, TARGET, 200, is_mass_matrix_diagonal=False).run(x0, fr.key(2), compile=False)
    alg = fnebm.hmc(TARGET, **result.parameters)
    _, trace, info = fnebm.sample_chain(alg.step, result.state, fr.key(3), 200, compile=False, progress=False)
    return x0, result, trace, info


def test_hmc_with_the_defaults_and_no_adaptation_fails_the_moment_check(hmc_adapted):
    x0 = hmc_adapted[0]
    # the rules of thumb alone: step d^-1/4 and the identity metric are unstable along the
    # narrowest direction (sd 0.1): nearly every proposal is rejected
    alg = fnebm.hmc(TARGET, default_step_size(D), None, default_num_integration_steps(D))
    state = torch.func.vmap(alg.init)(x0)
    _, trace, info = fnebm.sample_chain(alg.step, state, fr.key(3), 100, burn_in=100, compile=False, progress=False)
    assert float(info.acceptance_rate.mean()) < 0.05
    assert not passes(trace)


def test_hmc_with_the_step_size_alone_adapted_mixes_far_worse(hmc_adapted):
    x0, _, adapted, _ = hmc_adapted
    # below 20 iterations the schedule adapts the step size only: the identity metric stays
    plans = []
    result = window_adaptation(fnebm.hmc, TARGET, 19).run(x0, fr.key(4), compile=False, on_plan=plans.append)
    assert [(p.compiled, p.steps) for p in plans] == [(False, 19)]  # told once, before the warm-up
    assert torch.equal(result.parameters["inverse_mass_matrix"].inverse_mass_matrix, torch.ones(D, dtype=F64))
    alg = fnebm.hmc(TARGET, **result.parameters)
    _, trace, _ = fnebm.sample_chain(alg.step, result.state, fr.key(5), 100, compile=False, progress=False)
    per_draw = diagnostics.ess(trace).min() / trace[:, :, 0].numel()
    per_draw_adapted = diagnostics.ess(adapted).min() / adapted[:, :, 0].numel()
    assert float(per_draw_adapted / per_draw) > 20, (float(per_draw), float(per_draw_adapted))


def test_adapted_hmc_recovers_mean_and_covariance(hmc_adapted):
    _, result, trace, info = hmc_adapted
    z = moment_z(trace, MEAN, COV)
    assert (z.abs() < Z).all(), z
    assert not info.is_divergent.any()
    # the metric whitens the target (the identity's condition number here is 100)
    assert whitened_condition(result.parameters["inverse_mass_matrix"].inverse_mass_matrix) < 1.5


def test_adapted_hmc_step_size_lands_the_acceptance_near_its_target(hmc_adapted):
    _, result, _, info = hmc_adapted
    assert result.parameters["step_size"].shape == ()  # pooled over 128 chains by default
    assert abs(float(info.acceptance_rate.mean()) - 0.65) < 0.05, float(info.acceptance_rate.mean())
    # during warm-up: one step size per iteration, the chains' acceptance per iteration
    assert result.info.step_size.shape == (200,) and result.info.acceptance_rate.shape == (200, 128)


# ------------------------------------------------------------------------------ NUTS


@pytest.fixture(scope="module")
def nuts_adapted():
    """Dense window adaptation of NUTS (trees of depth 6 at most while the metric is still the
    identity), then 100 draws at the tuned values."""
    x0 = fr.normal(fr.key(6), (64, D), F64)
    warm = window_adaptation(fnebm.nuts, TARGET, 200, is_mass_matrix_diagonal=False, max_tree_depth=6)
    result = warm.run(x0, fr.key(7), compile=False)
    alg = fnebm.nuts(TARGET, **result.parameters)
    _, trace, info = fnebm.sample_chain(alg.step, result.state, fr.key(8), 100, compile=False, progress=False)
    return result, trace, info


def test_adapted_nuts_recovers_mean_and_covariance_and_its_acceptance_target(nuts_adapted):
    result, trace, info = nuts_adapted
    z = moment_z(trace, MEAN, COV)
    assert (z.abs() < Z).all(), z
    assert not info.is_divergent.any()
    assert whitened_condition(result.parameters["inverse_mass_matrix"].inverse_mass_matrix) < 1.5
    assert abs(float(info.acceptance_rate.mean()) - 0.8) < 0.05, float(info.acceptance_rate.mean())


# ------------------------------------------------------------------------------ per chain


def test_per_chain_adaptation_gives_each_chain_its_own_step_size_and_metric():
    # two groups of chains on targets 10x apart in scale can only be served per chain
    x0 = fr.normal(fr.key(9), (8, 2), F64)
    target = E.gaussian(torch.zeros(2, dtype=F64), torch.tensor([1.0, 0.04], dtype=F64))
    warm = window_adaptation(fnebm.hmc, target, 60, pooled=False,
                             initial_step_size=torch.linspace(0.05, 1.0, 8, dtype=F64))
    result = warm.run(x0, fr.key(10), compile=False)
    h = result.parameters["step_size"]
    imm = result.parameters["inverse_mass_matrix"]
    assert h.shape == (8,) and imm.inverse_mass_matrix.shape == (8, 2) and isinstance(imm, Diagonal)
    assert float(h.std() / h.mean()) > 0.01  # each chain's own
    assert result.info.step_size.shape == (60, 8)
    # each chain's metric learned the scales from its own draws (ratio 25)
    ratio = imm.inverse_mass_matrix[:, 0] / imm.inverse_mass_matrix[:, 1]
    assert (ratio > 5).all(), ratio
    # the parameters sample on as they are (per-chain step size and metric)
    alg = fnebm.hmc(target, **result.parameters)
    fnebm.sample_chain(alg.step, result.state, fr.key(11), 5, compile=False, progress=False)


# ------------------------------------------------------------------------------ compiled


@pytest.fixture(scope="module")
def counted():
    counter = CompileCounterWithBackend("aot_eager")
    return counter, fnebm.chain.RunnerCache(backend=counter)


def graphs(counter) -> int:
    return sum(1 for g in counter.graphs if len(g.graph.nodes))


def test_the_warm_up_is_one_graph_and_new_values_do_not_recompile(counted):
    counter, cache = counted
    x0 = fr.normal(fr.key(12), (16, 3), F64)
    _, _, target = ill_conditioned(3, seed=1)
    first = window_adaptation(fnebm.hmc, target, 30, is_mass_matrix_diagonal=False)
    before = graphs(counter)
    compiled = first.run(x0, fr.key(13), cache=cache)
    assert graphs(counter) == before + 1  # the whole warm-up: one graph, one call
    frames = counter.frame_count
    # another target's parameters, initial step size, target acceptance and length: the same graph
    _, _, other = ill_conditioned(3, seed=2, condition=10.0)
    second = window_adaptation(fnebm.hmc, other, 45, is_mass_matrix_diagonal=False, initial_step_size=0.3,
                               target_acceptance_rate=0.7)
    result = second.run(2.0 * x0, fr.key(14), cache=cache)
    assert counter.frame_count == frames
    assert result.info.step_size.shape == (45,)
    # compiled == eager
    eager = first.run(x0, fr.key(13), compile=False)
    torch.testing.assert_close(compiled.state.position, eager.state.position, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(compiled.parameters["step_size"], eager.parameters["step_size"], rtol=1e-9, atol=0)
    torch.testing.assert_close(compiled.parameters["inverse_mass_matrix"].inverse_mass_matrix,
                               eager.parameters["inverse_mass_matrix"].inverse_mass_matrix, rtol=1e-9, atol=1e-12)


def test_the_pieces_run_in_a_loop_of_your_own():
    # init / step / final with fnebm.chain.run: the ensemble is one "chain" with one key
    x0 = fr.normal(fr.key(15), (8, 2), F64)
    warm = window_adaptation(fnebm.hmc, E.gaussian(torch.zeros(2, dtype=F64)), 25)
    final, trace, info = fnebm.chain.run(warm.step, warm.init(x0), fr.key(16), 25)
    assert trace.shape == (25, 8, 2) and int(final.step) == 25
    state, parameters = warm.final(final)
    assert state.position.shape == (8, 2) and parameters["step_size"].shape == ()


# ------------------------------------------------------------------------------ boundary checks


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(num_steps=0), ValueError, "num_steps"),
    (dict(num_steps=10, target_acceptance_rate=1.5), ValueError, "target_acceptance_rate"),
    (dict(num_steps=10, is_mass_matrix_diagonal="yes"), TypeError, "is_mass_matrix_diagonal"),
    (dict(num_steps=10, pooled=1), TypeError, "pooled"),
    (dict(num_steps=10, initial_step_size=-1.0), ValueError, "initial_step_size"),
    (dict(num_steps=10, step_size=0.1), TypeError, "initial_step_size"),
    (dict(num_steps=10, initial_inverse_mass_matrix=Dense(torch.eye(2, dtype=F64))), ValueError, "Dense"),
    (dict(num_steps=10, initial_inverse_mass_matrix=-torch.ones(2, dtype=F64)), ValueError, "> 0"),
    (dict(num_steps=10, gamma=0.0), ValueError, "gamma"),
])
def test_window_adaptation_refuses_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        window_adaptation(fnebm.hmc, E.gaussian(torch.zeros(2, dtype=F64)), **kwargs)


@pytest.mark.parametrize("kwargs,position,key,exc,match", [
    (dict(), torch.zeros(4, 2, dtype=F64), fr.split(fr.key(0), 4), ValueError, "one key"),
    (dict(), torch.zeros(4, 2, dtype=torch.int64), fr.key(0), TypeError, "floating"),
    (dict(), torch.full((4, 2), math.nan, dtype=F64), fr.key(0), ValueError, "finite"),
    (dict(initial_step_size=torch.ones(4, dtype=F64)), torch.zeros(4, 2, dtype=F64), fr.key(0), ValueError,
     "pooled"),
    (dict(initial_inverse_mass_matrix=torch.ones(3, dtype=F64)), torch.zeros(4, 2, dtype=F64), fr.key(0),
     ValueError, "initial_inverse_mass_matrix"),
])
def test_run_refuses_bad_inputs(kwargs, position, key, exc, match):
    warm = window_adaptation(fnebm.hmc, E.gaussian(torch.zeros(2, dtype=F64)), 10, **kwargs)
    with pytest.raises(exc, match=match):
        warm.run(position, key, compile=False)


def test_window_adaptation_names_an_algorithm_that_cannot_take_a_mass_matrix():
    """At construction, not at ``run``: the algorithm is called as (energy_fn, step_size, inverse_mass_matrix, **extra)."""
    target = E.gaussian(torch.zeros(2, dtype=F64))
    with pytest.raises(TypeError, match=r"algorithm must be callable as algorithm\(energy_fn, step_size, "
                                        r"inverse_mass_matrix, \*\*extra\), but mala\(energy_fn, step_size\) cannot "
                                        r"be \(too many positional arguments\); .*fnebm.hmc or fnebm.nuts"):
        window_adaptation(fnebm.mala, target, 10)
    with pytest.raises(TypeError, match=r"but nuts\(.*\) cannot be \(got an unexpected keyword argument "
                                        r"'num_integration_steps'\); window_adaptation passes"):
        window_adaptation(fnebm.nuts, target, 10, num_integration_steps=5)

    class Sampler:
        def __call__(self, energy_fn, step_size, inverse_mass_matrix, **kwargs):
            return fnebm.hmc(energy_fn, step_size, inverse_mass_matrix, **kwargs)

    # what the algorithm may be: a partial, a callable object, a function of *args/**kwargs
    for algorithm, extra in ((functools.partial(fnebm.hmc, num_integration_steps=3), {}), (Sampler(), {}),
                             (lambda *a, **kw: fnebm.hmc(*a, **kw), dict(num_integration_steps=3)),
                             (fnebm.nuts, dict(max_tree_depth=4))):
        window_adaptation(algorithm, target, 10, **extra)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(integrator=(0.5, 0.5)), ValueError, "integrator must be a palindrome of odd length"),
    (dict(integrator="leapfrog"), TypeError, "integrator must be a tuple of coefficients"),
    (dict(divergence_threshold=-1.0), ValueError, "divergence_threshold must be > 0 and finite"),
    (dict(divergence_threshold="big"), TypeError, "divergence_threshold must be a real number"),
    (dict(learning_rate=math.inf), ValueError, "learning_rate must be > 0 and finite"),
    (dict(compile="yes"), ValueError, 'compile must be True, False or "auto"'),
])
def test_chees_adaptation_refuses_bad_arguments_at_construction(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fnebm.adaptation.chees_adaptation(E.gaussian(torch.zeros(2, dtype=F64)), 10, **kwargs)
