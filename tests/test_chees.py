"""ChEES-HMC (fnebm.adaptation.chees): the Halton jitter, the adapted step size and trajectory
length, the target's moments after warm-up, one compiled warm-up, and bad input."""

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fnebm
from fnebm import diagnostics
from fnebm import energies as E
from fnebm import random as fr
from fnebm.adaptation.chees import chees_adaptation, halton
from fnebm.integrators.metrics import Dense, Diagonal

F64 = torch.float64
Z = 4.5


def test_halton_is_the_base_2_radical_inverse():
    got = halton(torch.arange(8))
    torch.testing.assert_close(got, torch.tensor([0, 0.5, 0.25, 0.75, 0.125, 0.625, 0.375, 0.875], dtype=F64))


@pytest.fixture(scope="module")
def counted():
    counter = CompileCounterWithBackend("aot_eager")
    return counter, fnebm.chain.RunnerCache(backend=counter)


@pytest.fixture(scope="module")
def adapted(counted):
    _, cache = counted
    scales = torch.tensor([0.2, 0.5, 1.0, 0.7], dtype=F64)
    mean = torch.tensor([1.0, -1.0, 0.5, 0.0], dtype=F64)
    target = E.gaussian(mean, torch.diag(scales**2))
    x0 = mean + fr.normal(fr.key(0), (64, 4), F64)  # over-dispersed for the small scales
    states, params, info = chees_adaptation(target, 150, cache=cache).run(x0, fr.key(1))
    return target, mean, scales, states, params, info


def test_warm_up_tunes_acceptance_and_a_quarter_period_trajectory(adapted):
    _, _, scales, _, params, info = adapted
    # the step size tracks the harmonic-mean acceptance target (0.651) over the last iterations
    last = info.harmonic_mean_acceptance[-50:]
    assert abs(float(last.mean()) - 0.651) < 0.1, float(last.mean())
    # for a Gaussian, ChEES's optimum trajectory is near the quarter period pi/2 of the widest
    # scale (Hoffman et al. 2021); it starts at one step (T = h0) and climbs there
    T = float(params["num_integration_steps"] * params["step_size"])
    assert 0.6 * math.pi / 2 < T / float(scales.max()) < 1.6 * math.pi / 2, T
    assert float(info.trajectory_length[0]) < 0.5 * T  # from one step of d^(-1/4) = 0.71
    assert set(params) == {"step_size", "inverse_mass_matrix", "num_integration_steps", "trajectory_jitter"}


def test_sampling_with_the_adapted_parameters_has_the_target_moments(adapted, counted):
    target, mean, scales, states, params, _ = adapted
    alg = fnebm.hmc(target, **params)
    _, trace, info = fnebm.sample_chain(alg.step, states, fr.key(2), 100, compile=False, progress=False)
    ess = diagnostics.ess(trace, layout="draws_chains")
    se_mean = scales / ess.sqrt()
    assert ((trace.mean((0, 1)) - mean).abs() < Z * se_mean).all(), (trace.mean((0, 1)) - mean) / se_mean
    # sd of a variance estimate from ESS effectively independent Gaussian draws: sqrt(2 / ESS) var
    var = trace.var((0, 1))
    assert ((var - scales**2).abs() < Z * math.sqrt(2) * scales**2 / ess.sqrt()).all(), var / scales**2
    assert not info.is_divergent.any()


def test_a_second_warm_up_with_new_values_does_not_recompile(adapted, counted):
    counter, cache = counted
    frames = counter.frame_count
    target = E.gaussian(torch.zeros(4, dtype=F64), torch.diag(torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=F64)))
    x0 = fr.normal(fr.key(3), (64, 4), F64)
    chees_adaptation(target, 150, initial_step_size=0.3, cache=cache).run(x0, fr.key(4))
    assert counter.frame_count == frames


def test_compiled_warm_up_equals_eager(adapted, counted):
    # the shapes of the fixture's warm-up: its graph serves (no compile here)
    target = E.gaussian(torch.zeros(4, dtype=F64), torch.diag(torch.tensor([1.0, 0.5, 0.3, 2.0], dtype=F64)))
    x0 = fr.normal(fr.key(5), (64, 4), F64)
    a = chees_adaptation(target, 6, cache=counted[1]).run(x0, fr.key(6))
    b = chees_adaptation(target, 6, compile=False).run(x0, fr.key(6))
    torch.testing.assert_close(a[0].position, b[0].position, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(a[1]["step_size"], b[1]["step_size"], rtol=1e-9, atol=1e-12)
    assert torch.equal(a[1]["num_integration_steps"], b[1]["num_integration_steps"])


@pytest.mark.parametrize("kwargs,positions,exc,match", [
    (dict(num_steps=0), (8, 2), ValueError, "num_steps"),
    (dict(num_steps=5, target_acceptance_rate=1.2), (8, 2), ValueError, "target_acceptance_rate"),
    (dict(num_steps=5, learning_rate=0.0), (8, 2), ValueError, "learning_rate must be > 0"),
    (dict(num_steps=5, initial_step_size=torch.ones(3, dtype=F64)), (8, 2), ValueError, "one value"),
    (dict(num_steps=5, inverse_mass_matrix=torch.ones(8, 2, dtype=F64)), (8, 2), ValueError, "shared"),
    (dict(num_steps=5, inverse_mass_matrix=Diagonal(torch.ones(8, 2, dtype=F64))), (8, 2), ValueError, "shared"),
    (dict(num_steps=5), (1, 2), ValueError, "at least 2"),
    (dict(num_steps=5), (2,), ValueError, r"\(chains, d\)"),
])
def test_bad_input_raises(kwargs, positions, exc, match):
    target = E.gaussian(torch.zeros(2, dtype=F64), torch.eye(2, dtype=F64))
    with pytest.raises(exc, match=match):
        chees_adaptation(target, **kwargs).run(torch.zeros(positions, dtype=F64), fr.key(0))


def test_a_wrapped_mass_matrix_is_read_as_its_tensor():
    target = E.gaussian(torch.zeros(2, dtype=F64), torch.tensor([[1.0, 0.5], [0.5, 2.0]], dtype=F64))
    x0 = fr.normal(fr.key(5), (8, 2), F64)
    cov = torch.tensor([[1.0, 0.5], [0.5, 2.0]], dtype=F64)
    a = chees_adaptation(target, 4, inverse_mass_matrix=Dense(cov), compile=False).run(x0, fr.key(6))
    b = chees_adaptation(target, 4, inverse_mass_matrix=cov, compile=False).run(x0, fr.key(6))
    torch.testing.assert_close(a[0].position, b[0].position, rtol=0, atol=0)
