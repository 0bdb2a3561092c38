"""HMC and the symplectic integrators: reversibility, energy-error order, the target's moments,
the metrics, and bad input. HMC also runs the conformance suite (tests/test_conformance.py)."""

import math

import pytest
import torch

import fnebm
from fnebm import energies as E
from fnebm import random as fr
from fnebm.gradients import value_and_grad
from fnebm.integrators import IntegratorState, euclidean, integrate, mclachlan, velocity_verlet, yoshida
from fnebm.samplers.base import over_batch

F64 = torch.float64
Z = 4.5  # |z| bound for moment checks: a false alarm about once in 150,000 per check
MEAN = torch.tensor([1.0, -1.0], dtype=F64)
COV = torch.tensor([[1.0, 0.8], [0.8, 1.0]], dtype=F64)
INTEGRATORS = {"velocity_verlet": (velocity_verlet, 2), "mclachlan": (mclachlan, 2), "yoshida": (yoshida, 4)}


def _start(energy, x, p):
    e, g = over_batch(value_and_grad(energy), 1)(x)
    return IntegratorState(x, p, e, g)


def _trajectory(state, energy, h, n, coefficients, velocity=lambda p: p):
    vg = over_batch(value_and_grad(energy), 1)
    for _ in range(n):
        state = integrate(state, torch.tensor(h, dtype=F64), vg, velocity, coefficients)
    return state


@pytest.mark.parametrize("name", INTEGRATORS)
def test_integrators_are_reversible(name):
    coefficients, _ = INTEGRATORS[name]
    energy = E.double_well(1.0, 1.0, dtype=F64)
    x, p = fr.normal(fr.key(0), (8, 3), F64), fr.normal(fr.key(1), (8, 3), F64)
    end = _trajectory(_start(energy, x, p), energy, 0.05, 20, coefficients)
    back = _trajectory(end._replace(momentum=-end.momentum), energy, 0.05, 20, coefficients)
    torch.testing.assert_close(back.position, x, rtol=0, atol=1e-10)
    torch.testing.assert_close(back.momentum, -p, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", INTEGRATORS)
def test_energy_error_has_the_integrators_order(name):
    # max |H - H0| over a trajectory of fixed length T shrinks as h^order: halving h divides it by 2^order
    coefficients, order = INTEGRATORS[name]
    energy = E.gaussian(torch.zeros(2, dtype=F64), torch.tensor([[1.0, 0.3], [0.3, 0.5]], dtype=F64))
    x, p = fr.normal(fr.key(2), (16, 2), F64), fr.normal(fr.key(3), (16, 2), F64)

    def max_error(h):
        state, h0, worst = _start(energy, x, p), None, 0.0
        h0 = state.energy + 0.5 * (p * p).sum(-1)
        for _ in range(round(2.0 / h)):
            state = _trajectory(state, energy, h, 1, coefficients)
            err = (state.energy + 0.5 * (state.momentum**2).sum(-1) - h0).abs().max()
            worst = max(worst, float(err))
        return worst

    slope = math.log2(max_error(0.1) / max_error(0.05))
    assert abs(slope - order) < 0.3, slope


def test_dense_metric_with_a_diagonal_matrix_equals_the_diagonal_metric():
    like = torch.zeros(5, 3, dtype=F64)
    diag = torch.tensor([0.5, 2.0, 1.5], dtype=F64)
    a, b = euclidean(diag, like), euclidean(torch.diag(diag), like)
    keys = fr.split(fr.key(4), 5)
    torch.testing.assert_close(a.sample_momentum(keys, like), b.sample_momentum(keys, like))
    p = fr.normal(fr.key(5), (5, 3), F64)
    torch.testing.assert_close(a.kinetic_energy(p), b.kinetic_energy(p))
    torch.testing.assert_close(a.velocity(p), b.velocity(p))


def test_momentum_has_the_mass_matrix_as_covariance():
    inv = torch.tensor([[2.0, 0.6], [0.6, 1.0]], dtype=F64)
    like = torch.zeros(200_000, 2, dtype=F64)
    p = euclidean(inv, like).sample_momentum(fr.split(fr.key(6), 200_000), like)
    mass = torch.linalg.inv(inv)
    se = torch.sqrt((torch.outer(torch.diagonal(mass), torch.diagonal(mass)) + mass**2) / 200_000)
    assert ((torch.cov(p.T) - mass).abs() < Z * se).all()


def _check_moments(x, mean, cov):
    n = x.shape[0]
    assert ((x.mean(0) - mean).abs() < Z * torch.sqrt(torch.diagonal(cov) / n)).all(), x.mean(0)
    se_cov = torch.sqrt((torch.outer(torch.diagonal(cov), torch.diagonal(cov)) + cov**2) / n)
    assert ((torch.cov(x.T) - cov).abs() < Z * se_cov).all(), torch.cov(x.T)


# Step sizes large enough for the leapfrog's own bias to show: with the Metropolis correction
# removed, the moment check fails at h = 0.6 (identity) and h = 1.2 (dense), checked by hand.
@pytest.mark.parametrize("metric,name,h", [
    ("identity", "velocity_verlet", 0.6), ("diagonal", "mclachlan", 0.6), ("dense", "velocity_verlet", 1.2),
    ("identity", "yoshida", 0.5), ("per-chain dense, jittered", "velocity_verlet", 1.2),
])
def test_hmc_final_states_have_the_target_moments(metric, name, h):
    imm = {"identity": None, "diagonal": torch.tensor([1.0, 1.0], dtype=F64), "dense": COV,
           "per-chain dense, jittered": COV * torch.linspace(0.7, 1.3, 4096, dtype=F64)[:, None, None]}[metric]
    jitter = {"step_size_jitter": 0.2, "trajectory_jitter": True} if "jittered" in metric else {}
    alg = fnebm.hmc(E.gaussian(MEAN, COV), h, imm, 5, integrator=INTEGRATORS[name][0], **jitter)
    # invariance: chains started at exact draws of the target must stay distributed as the target
    exact = MEAN + fr.normal(fr.key(7), (4096, 2), F64) @ torch.linalg.cholesky(COV).mT
    state = torch.func.vmap(alg.init)(exact)
    chain, _, info = fnebm.sample_chain(alg.step, state, fr.key(8), 12, compile=False, progress=False)
    # the final states of independent chains are independent draws
    _check_moments(chain.state.position, MEAN, COV)
    assert 0.6 < float(info.acceptance_rate.mean()) <= 1 and not info.is_divergent.any()
    assert info.is_accepted.float().mean() < 1  # the correction was exercised
    assert torch.isfinite(info.energy_error).all()


def test_hmc_state_caches_energy_and_gradient():
    target = E.gaussian(MEAN, COV)
    alg = fnebm.hmc(target, 0.2, None, 4)
    state, _ = alg.step(alg.init(torch.zeros(2, dtype=F64)), fr.key(0))
    torch.testing.assert_close(state.energy, target(state.position))
    torch.testing.assert_close(state.grad, target.grad(state.position))


@pytest.mark.parametrize("call,exc,match", [
    (lambda e: fnebm.hmc(e, 0.1, torch.tensor(1.0, dtype=F64)), ValueError, r"\(d,\) or \(\*chains, d\) diagonal"),
    (lambda e: fnebm.hmc(e, 0.1, fnebm.integrators.metrics.Dense(torch.ones(3, dtype=F64))), ValueError, "has shape"),
    (lambda e: fnebm.hmc(e, 0.1, fnebm.integrators.metrics.Diagonal(-torch.ones(2, 2, dtype=F64))), ValueError, "> 0 everywhere"),
    (lambda e: fnebm.hmc(e, 0.1, torch.ones(2, dtype=F64), step_size_jitter=1.0), ValueError, "step_size_jitter must be < 1"),
    (lambda e: fnebm.hmc(e, 0.1, None, torch.tensor([2, 0])), ValueError, "num_integration_steps must be >= 1"),
    (lambda e: fnebm.hmc(e, 0.1, None, torch.tensor([2.0])), TypeError, "integer tensor"),
    (lambda e: fnebm.hmc(e, 0.1, torch.tensor([1.0, -1.0], dtype=F64)), ValueError, "> 0 everywhere"),
    (lambda e: fnebm.hmc(e, 0.1, torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=F64)), ValueError, "positive definite"),
    (lambda e: fnebm.hmc(e, 0.1, [1.0, 1.0]), TypeError, "inverse_mass_matrix must be a floating tensor"),
    (lambda e: fnebm.hmc(e, 0.1, None, 0), ValueError, "num_integration_steps must be >= 1"),
    (lambda e: fnebm.hmc(e, 0.1, None, 2.5), TypeError, "num_integration_steps must be an int"),
    (lambda e: fnebm.hmc(e, 0.1, integrator=(0.5, 1.0)), ValueError, "palindrome"),
    (lambda e: fnebm.hmc(e, 0.1, divergence_threshold=0), ValueError, "divergence_threshold must be > 0"),
    (lambda e: fnebm.hmc(e, 0.0), ValueError, "step_size must be a finite number > 0"),
])
def test_bad_input_raises(call, exc, match):
    with pytest.raises(exc, match=match):
        call(E.gaussian(MEAN, COV))


def test_mass_matrix_of_the_wrong_dimension_is_refused_at_the_step():
    alg = fnebm.hmc(E.gaussian(MEAN, COV), 0.1, torch.ones(3, dtype=F64))
    state = torch.func.vmap(alg.init)(torch.zeros(4, 2, dtype=F64))
    with pytest.raises(ValueError, match="inverse_mass_matrix has shape"):
        alg.step(state, fr.split(fr.key(0), 4))


def _one_chain_each(make, state, keys):
    """Each chain stepped alone by the algorithm ``make(c)`` (its own tunables), restacked."""
    outs = [make(c).step(type(state)(*(f[c] for f in state)), keys[c]) for c in range(keys.shape[0])]
    return [torch.stack(xs) for xs in zip(*(list(s) + list(i) for s, i in outs))]


@pytest.mark.parametrize("form", ["diagonal", "dense", "lengths"])
def test_per_chain_tunables_equal_each_chain_run_with_its_own(form):
    target = E.gaussian(MEAN, COV)
    diag = torch.tensor([[0.5, 2.0], [1.0, 1.0], [2.0, 0.7]], dtype=F64)
    dense = torch.stack([COV, torch.eye(2, dtype=F64), torch.linalg.inv(COV)])
    lengths = torch.tensor([1, 4, 2])
    imm = {"diagonal": diag, "dense": dense, "lengths": diag}[form]
    n = lengths if form == "lengths" else 3
    alg = fnebm.hmc(target, 0.3, imm, n)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(1), (3, 2), F64))
    keys = fr.split(fr.key(2), 3)
    got = [*alg.step(state, keys)[0], *alg.step(state, keys)[1]]
    want = _one_chain_each(lambda c: fnebm.hmc(target, 0.3, imm[c], int(lengths[c]) if form == "lengths" else 3),
                           state, keys)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_tensor_length_equals_the_unrolled_int_length():
    target = E.gaussian(MEAN, COV)
    state = torch.func.vmap(fnebm.hmc(target, 0.3).init)(fr.normal(fr.key(1), (6, 2), F64))
    keys = fr.split(fr.key(3), 6)
    a = fnebm.hmc(target, 0.3, None, 5).step(state, keys)
    b = fnebm.hmc(target, 0.3, None, torch.tensor(5)).step(state, keys)
    for x, y in zip([*a[0], *a[1]], [*b[0], *b[1]], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_trajectory_jitter_draws_lengths_in_one_to_L():
    target = E.gaussian(MEAN, COV)
    alg = fnebm.hmc(target, 0.3, None, 6, trajectory_jitter=True)
    state = torch.func.vmap(alg.init)(torch.zeros(2000, 2, dtype=F64))
    n = alg.step(state, fr.split(fr.key(4), 2000))[1].num_integration_steps
    counts = torch.bincount(n, minlength=8)
    assert counts[0] == 0 and counts[7:].sum() == 0
    # each of 1..6 has probability 1/6: within 4.5 binomial standard errors
    assert ((counts[1:7] / 2000 - 1 / 6).abs() < 4.5 * math.sqrt((1 / 6) * (5 / 6) / 2000)).all(), counts


def test_ambiguous_mass_matrix_is_refused_and_the_wrappers_resolve_it():
    from fnebm.integrators.metrics import Dense, Diagonal
    target = E.gaussian(MEAN, COV)
    state = torch.func.vmap(fnebm.hmc(target, 0.3).init)(fr.normal(fr.key(1), (2, 2), F64))
    keys = fr.split(fr.key(2), 2)
    diag = torch.tensor([[0.5, 2.0], [1.0, 1.5]], dtype=F64)
    with pytest.raises(ValueError, match="ambiguous"):
        fnebm.hmc(target, 0.3, COV).step(state, keys)
    as_dense = fnebm.hmc(target, 0.3, Dense(COV)).step(state, keys)
    want = _one_chain_each(lambda c: fnebm.hmc(target, 0.3, COV), state, keys)
    torch.testing.assert_close(as_dense[0].position, want[0], rtol=1e-12, atol=1e-12)
    per_chain = fnebm.hmc(target, 0.3, Diagonal(diag)).step(state, keys)
    want = _one_chain_each(lambda c: fnebm.hmc(target, 0.3, diag[c]), state, keys)
    torch.testing.assert_close(per_chain[0].position, want[0], rtol=1e-12, atol=1e-12)
