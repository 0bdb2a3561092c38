"""Interpolants: the coefficients and derivatives, the conversions between velocity, score and noise."""

import math

import pytest
import torch

from fnebm import interpolants as fi
from fnebm import random as fr

PATHS = [fi.linear(), fi.cosine(), fi.variance_preserving(),
         fi.custom(lambda t: t * t, lambda t: 1.0 - t * t, name="quadratic")]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_derivatives_match_finite_differences(path):
    t = torch.linspace(0.05, 0.95, 19, dtype=torch.float64)
    a, da, s, ds = path.coefficients(t)
    h = 1e-6
    ap, _, sp, _ = path.coefficients(t + h)
    am, _, sm, _ = path.coefficients(t - h)
    torch.testing.assert_close(da, (ap - am) / (2 * h), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ds, (sp - sm) / (2 * h), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS[:3], ids=lambda p: p.name)
def test_endpoints(path):
    a, _, s, _ = path.coefficients(torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert a[1] == pytest.approx(1.0, abs=1e-6) and s[1] == pytest.approx(0.0, abs=1e-5)
    assert s[0] == pytest.approx(1.0, abs=1e-4)
    if path.name != "variance_preserving":  # VP reaches alpha = exp(-5.05) at t = 0, not 0
        assert a[0] == pytest.approx(0.0, abs=1e-7)
    else:
        assert a[0] == pytest.approx(math.exp(-0.25 * 19.9 - 0.05), rel=1e-9)


def test_interpolate_shapes_and_values():
    k0, k1, kt = fr.split(fr.key(3), 3)
    x0, x1 = fr.normal(k0, (8, 3, 4, 4)), fr.normal(k1, (8, 3, 4, 4))
    t = fr.uniform(kt, (8,))
    xt, ut = fi.interpolate(fi.linear(), x0, x1, t)
    tt = t[:, None, None, None]
    torch.testing.assert_close(xt, tt * x1 + (1 - tt) * x0)
    torch.testing.assert_close(ut, x1 - x0)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_conversions_invert(path):
    """For Gaussian data N(0, c^2 I) the true score at time t is -x / (alpha^2 c^2 + sigma^2); the velocity it
    implies, converted back, gives the same score, and it equals E[d_alpha x1 + d_sigma x0 | x_t]."""
    c = 0.7
    x = fr.normal(fr.key(0), (5, 2), dtype=torch.float64)
    t = torch.full((5,), 0.4, dtype=torch.float64)
    a, da, s, ds = path.coefficients(t[:, None])
    var = a * a * c * c + s * s
    score = -x / var
    v = fi.velocity_from_score(path, score, x, t)
    # E[x1 | x] = a c^2 x / var, E[x0 | x] = s x / var for jointly Gaussian (x1, x0)
    torch.testing.assert_close(v, da * a * c * c * x / var + ds * s * x / var)
    torch.testing.assert_close(fi.score_from_velocity(path, v, x, t), score)
    torch.testing.assert_close(fi.velocity_from_noise(path, s * x / var, x, t), v)


def test_vp_beta_checked():
    with pytest.raises(ValueError, match="beta_min"):
        fi.variance_preserving(5.0, 1.0)
    with pytest.raises(TypeError, match="alpha"):
        fi.custom(1.0, lambda t: t)


def test_grads_flow_through_schedule_parameters():
    beta = torch.tensor(20.0, requires_grad=True)
    path = fi.variance_preserving(0.1, beta)
    x0, x1 = torch.ones(4, 2), torch.zeros(4, 2)
    xt, _ = fi.interpolate(path, x0, x1, torch.full((4,), 0.5))
    xt.sum().backward()
    assert beta.grad is not None and torch.isfinite(beta.grad)
