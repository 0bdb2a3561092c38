"""The flow sampler and the exact log-likelihood against a closed form: the flow between two
Gaussians.

With the linear path ``x_t = t x1 + (1 - t) x0``, ``x0 ~ N(0, I)`` and ``x1 ~ N(m, S)`` independent,
``x_t ~ N(t m, S_t)`` with ``S_t = t^2 S + (1 - t)^2 I``, and the marginal velocity
``E[x1 - x0 | x_t = x] = m + (t S - (1 - t) I) S_t^{-1} (x - t m)`` (the regression of
``x1 - x0`` on ``x_t``, exact for jointly Gaussian variables). With ``S = R diag(c^2) R^T`` all
these matrices share the eigenvectors ``R``. So the flow pushes ``N(0, I)`` to ``N(m, S)``
exactly, its log-likelihood is the Gaussian log density, and its score is ``-S_t^{-1}(x - t m)``.
"""

import math

import pytest
import torch

from fnebm import interpolants as fi
from fnebm import random as fr
from fnebm.integrators import ode, sde
from fnebm.samplers import flow

F64 = torch.float64
M = torch.tensor([1.0, -2.0], dtype=F64)
C = torch.tensor([0.5, 2.0], dtype=F64)
ANGLE = 0.6
R = torch.tensor([[math.cos(ANGLE), -math.sin(ANGLE)], [math.sin(ANGLE), math.cos(ANGLE)]], dtype=F64)
S = R @ torch.diag(C * C) @ R.T
RT = R.T.contiguous()  # not a view of R: a compiled scan body may not close over aliasing tensors


def _in_basis(x, t, diag):
    """``R diag(d(t)) R^T x`` for ``x: (batch, 2)``, ``t: (batch,)``."""
    return ((x @ R) * diag) @ RT


def velocity(x, t):
    t = t.to(x.dtype)[:, None]
    d = (t * C * C - (1 - t)) / (t * t * C * C + (1 - t) ** 2)
    return M + _in_basis(x - t * M, t, d)


def score(x, t):
    t = t.to(x.dtype)[:, None]
    return -_in_basis(x - t * M, t, 1.0 / (t * t * C * C + (1 - t) ** 2))


def noise(x, t):
    return -(1.0 - t.to(x.dtype)[:, None]) * score(x, t)  # E[x0 | x_t] = -sigma score


def data_log_density(x):
    return torch.distributions.MultivariateNormal(M, S).log_prob(x)


def data(n, seed=1):
    return M + fr.normal(fr.key(seed), (n, 2), dtype=F64) @ (R @ torch.diag(C)).T


def check_moments(x, label):
    """Mean and covariance of ``N(M, S)`` within 4 Monte Carlo standard errors."""
    n = x.shape[0]
    se_mean = (S.diagonal() / n).sqrt()
    assert ((x.mean(0) - M).abs() < 4 * se_mean).all(), (label, x.mean(0))
    cov = torch.cov(x.T)
    # Var of a sample covariance entry (Gaussian): (S_ij^2 + S_ii S_jj) / n
    se_cov = ((S * S + torch.outer(S.diagonal(), S.diagonal())) / n).sqrt()
    assert ((cov - S).abs() < 4 * se_cov).all(), (label, cov)


def test_log_likelihood_exact_divergence_matches_the_closed_form():
    x1 = data(200)
    logp, info = flow.log_likelihood(velocity, x1, rtol=1e-8, atol=1e-8)
    assert bool(info.success)
    torch.testing.assert_close(logp, data_log_density(x1), rtol=0, atol=1e-5)
    fixed, _ = flow.log_likelihood(velocity, x1, method=ode.rk4, steps=40)
    torch.testing.assert_close(fixed, data_log_density(x1), rtol=0, atol=1e-4)


@pytest.mark.parametrize("probe", ["rademacher", "gaussian"])
def test_log_likelihood_hutchinson_is_unbiased_within_mc_error(probe):
    x1 = data(2000)
    logp, _ = flow.log_likelihood(velocity, x1, divergence="hutchinson", key=fr.key(7), probe=probe, rtol=1e-7, atol=1e-7)
    err = logp - data_log_density(x1)
    assert err.std() > 1e-3  # the Jacobian is not diagonal: the estimator really is random
    assert abs(err.mean().item()) < 4 * err.std().item() / math.sqrt(x1.shape[0]) + 1e-5
    again, _ = flow.log_likelihood(velocity, x1, divergence="hutchinson", key=fr.key(7), probe=probe, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(again, logp, rtol=0, atol=0)


def test_sample_and_log_prob_gives_the_draws_and_their_density():
    x, logq, info = flow.sample_and_log_prob(velocity, fr.key(0), (300, 2), dtype=F64, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(logq, data_log_density(x), rtol=0, atol=1e-5)
    same, _ = flow.flow_sample(velocity, fr.key(0), (300, 2), dtype=F64, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(x, same, rtol=0, atol=1e-6)  # the same base draw, the same map
    _, est, _ = flow.sample_and_log_prob(velocity, fr.key(0), (300, 2), dtype=F64, divergence="hutchinson",
                                         probe="gaussian", rtol=1e-8, atol=1e-8)
    err = est - logq
    assert abs(err.mean().item()) < 4 * err.std().item() / math.sqrt(300) and err.std() > 1e-3


def test_log_likelihood_from_a_score_model():
    x1 = data(100)
    logp, _ = flow.log_likelihood(score, x1, prediction="score", t0=1e-5, rtol=1e-9, atol=1e-9)
    # the base is taken as N(0, I) at t0 = 1e-5 where x_t0 ~ N(t0 m, ~(1 - t0)^2 I): a bias of
    # about t0 (|x|^2 + |m| |x| + d), under 1e-3 for these draws
    torch.testing.assert_close(logp, data_log_density(x1), rtol=0, atol=1e-3)


def test_ode_samples_have_the_target_moments():
    x, info = flow.flow_sample(velocity, fr.key(0), (20_000, 2), dtype=F64)
    assert x.shape == (20_000, 2) and bool(info.success)
    check_moments(x, "dopri5")
    y, _ = flow.flow_sample(velocity, fr.key(0), (20_000, 2), dtype=F64, method=ode.rk4, steps=20)
    assert (y - x).abs().max() < 1e-3  # the same base draw: the same map


def test_score_and_noise_predictions_give_the_velocity_flow():
    kw = dict(dtype=F64, t0=1e-3, rtol=1e-8, atol=1e-8)
    xv, _ = flow.flow_sample(velocity, fr.key(2), (500, 2), **kw)
    xs, _ = flow.flow_sample(score, fr.key(2), (500, 2), prediction="score", **kw)
    xn, _ = flow.flow_sample(noise, fr.key(2), (500, 2), prediction="noise", **kw)
    torch.testing.assert_close(xs, xv, rtol=0, atol=1e-5)
    torch.testing.assert_close(xn, xv, rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", [sde.euler_maruyama_step, sde.heun_step], ids=["em", "heun"])
def test_sde_samples_have_the_target_moments_and_are_keyed(method):
    x, info = flow.flow_sample(velocity, fr.key(3), (20_000, 2), dtype=F64, sde=True, steps=200, method=method)
    check_moments(x, method.__name__)
    same, _ = flow.flow_sample(velocity, fr.key(3), (20_000, 2), dtype=F64, sde=True, steps=200, method=method)
    torch.testing.assert_close(same, x, rtol=0, atol=0)
    ode_x, _ = flow.flow_sample(velocity, fr.key(3), (20_000, 2), dtype=F64, t0=1e-3, t1=1 - 1e-3)
    assert (ode_x - x).abs().mean() > 0.05  # the noise did something: not the ODE's map


def test_constant_diffusion_and_score_prediction_sde():
    x, _ = flow.flow_sample(score, fr.key(4), (20_000, 2), dtype=F64, sde=True, steps=200,
                            prediction="score", diffusion=0.5, method=sde.heun_step)
    check_moments(x, "score, w = 0.5")


def test_trajectory_buffer_and_out():
    buf = torch.empty(11, 64, 2, dtype=F64)
    xs, info = flow.flow_sample(velocity, fr.key(0), (64, 2), dtype=F64, method=ode.heun, steps=10,
                                trajectory=True, out=buf)
    assert xs is buf and int(info.nfe) == 20
    torch.testing.assert_close(xs[0], fr.normal(fr.split(fr.key(0))[0], (64, 2), dtype=F64))
    ys, _ = flow.flow_sample(velocity, fr.key(0), (64, 2), dtype=F64, sde=True, steps=10, trajectory=True)
    assert ys.shape == (11, 64, 2)
    za, _ = flow.flow_sample(velocity, fr.key(0), (64, 2), dtype=F64, trajectory=True)
    assert za.shape == (2, 64, 2)


def test_interpolant_paths_other_than_linear_run():
    # a cosine-path velocity model we do not have in closed form: only the plumbing is checked
    x, info = flow.flow_sample(lambda x, t: -x, fr.key(0), (8, 3), interpolant=fi.cosine(), sde=True, steps=5)
    assert x.shape == (8, 3) and torch.isfinite(x).all()


def test_bad_arguments_name_the_argument():
    key = fr.key(0)
    with pytest.raises(ValueError, match="prediction"):
        flow.flow_sample(velocity, key, (4, 2), prediction="eps")
    with pytest.raises(ValueError, match="steps"):
        flow.flow_sample(velocity, key, (4, 2), sde=True)
    with pytest.raises(ValueError, match="steps"):
        flow.flow_sample(velocity, key, (4, 2), method=ode.rk4)
    with pytest.raises(TypeError, match="method"):
        flow.flow_sample(velocity, key, (4, 2), method="dopri5")
    with pytest.raises(TypeError, match="method"):
        flow.flow_sample(velocity, key, (4, 2), sde=True, steps=3, method=ode.rk4)
    with pytest.raises(ValueError, match="key"):
        flow.flow_sample(velocity, fr.split(key, 3), (4, 2))
    with pytest.raises(TypeError, match="model"):
        flow.flow_sample(None, key, (4, 2))
    with pytest.raises(ValueError, match="t0 < t1"):
        flow.flow_sample(velocity, key, (4, 2), t0=0.5, t1=0.5)
    with pytest.raises(TypeError, match="interpolant"):
        flow.flow_sample(velocity, key, (4, 2), interpolant="linear")
    with pytest.raises(ValueError, match="diffusion"):
        flow.flow_sample(velocity, key, (4, 2), sde=True, steps=2, diffusion=-1.0)
    with pytest.raises(ValueError, match="divergence"):
        flow.log_likelihood(velocity, data(4), divergence="trace")
    with pytest.raises(ValueError, match="key"):
        flow.log_likelihood(velocity, data(4), divergence="hutchinson")
    with pytest.raises(ValueError, match="steps"):
        flow.log_likelihood(velocity, data(4), method=ode.rk4)
    with pytest.raises(ValueError, match="shape"):
        flow.sample_and_log_prob(velocity, key, (4,))


@pytest.mark.parametrize("kw", [dict(method=ode.rk4, steps=6), dict(sde=True, steps=6, method=sde.heun_step)],
                         ids=["ode", "sde"])
def test_fixed_grid_flow_sample_is_one_graph_and_draws_the_eager_numbers(kw):
    # aot_eager: Dynamo's whole graph (fullgraph) without Inductor's C++ build; the key is an input
    def draw(key):
        return flow.flow_sample(velocity, key, (64, 2), dtype=F64, **kw)[0]

    compiled = torch.compile(draw, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(fr.key(0)), draw(fr.key(0)), rtol=1e-12, atol=1e-12)
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(fr.key(1)), draw(fr.key(1)), rtol=1e-12, atol=1e-12)
