"""Toy data: pure functions of a key and a count; shapes, determinism, the sets' geometry, checks.

Moment tests use n = 40,000 points and a bound of 5 standard errors of the sample mean
(SE = std / sqrt(n)), from fixed keys: a correct set passes always, and a wrong scale or shift
of more than ~0.05 fails.
"""

import math

import pytest
import torch

from fnebm import datasets as D
from fnebm import random as fr

NAMES = sorted(D.DATASETS)
N = 40_000


def test_registry_holds_the_seven_sets():
    assert set(NAMES) == {"eight_gaussians", "two_moons", "swiss_roll", "circles", "checkerboard", "pinwheel",
                          "two_spirals"}
    for name in NAMES:
        assert D.get(name) is D.DATASETS[name] is getattr(D, name)


@pytest.mark.parametrize("name", NAMES)
def test_shape_dtype_and_determinism(name):
    fn = D.DATASETS[name]
    x = fn(fr.key(0), 1000)
    assert x.shape == (1000, 2) and x.dtype == torch.float32 and x.device.type == "cpu"
    assert torch.isfinite(x).all() and x.abs().max() < 6
    assert torch.equal(x, fn(fr.key(0), 1000))           # same key, same points
    assert not torch.equal(x, fn(fr.key(1), 1000))       # another key, other points
    assert fn(fr.key(0), 0).shape == (0, 2)
    x64 = fn(fr.key(0), 1000, torch.float64)
    assert x64.dtype == torch.float64
    torch.testing.assert_close(x64.float(), x, rtol=1e-4, atol=1e-4)  # one stream, two precisions
    assert fn(fr.key(0), 10, dtype=torch.bfloat16, device="cpu").dtype == torch.bfloat16


@pytest.mark.parametrize("name", NAMES)
def test_no_global_rng(name):
    torch.manual_seed(0)
    before = torch.get_rng_state()
    D.DATASETS[name](fr.key(3), 100)
    assert torch.equal(before, torch.get_rng_state())


def _assert_mean(x, expected):
    se = x.std(0) / math.sqrt(x.shape[0])
    err = (x.mean(0) - torch.tensor(expected, dtype=x.dtype)).abs()
    assert (err < 5 * se).all(), (x.mean(0), expected, se)


def test_eight_gaussians_geometry():
    x = D.eight_gaussians(fr.key(4), N, torch.float64)
    angles = torch.arange(8, dtype=torch.float64) * (2 * math.pi / 8)
    centers = 4 / 1.414 * torch.stack((angles.cos(), angles.sin()), -1)
    nearest = torch.cdist(x, centers).argmin(1)
    counts = torch.bincount(nearest, minlength=8).double()
    # each blob holds 1/8 of the points: binomial SE sqrt(n p (1 - p))
    assert ((counts - N / 8).abs() < 5 * math.sqrt(N / 8 * 7 / 8)).all()
    resid = x - centers[nearest]
    _assert_mean(resid, [0.0, 0.0])
    torch.testing.assert_close(resid.std(0), torch.full((2,), 0.5 / 1.414, dtype=torch.float64), rtol=0.03, atol=0)
    # the whole set: mean 0, per-axis variance (16/2 + 0.25) / 1.414^2
    _assert_mean(x, [0.0, 0.0])
    torch.testing.assert_close(x.var(0), torch.full((2,), 8.25 / 1.414**2, dtype=torch.float64), rtol=0.03, atol=0)


def test_two_moons_mean():
    # outer moon (cos t, sin t), inner (1 - cos t, 1/2 - sin t), t ~ U(0, pi): mean (1/2, 1/4); then *2 + (-1, -0.2)
    _assert_mean(D.two_moons(fr.key(5), N, torch.float64), [0.0, 0.3])


def test_circles_radii():
    x = D.circles(fr.key(6), N, torch.float64)
    r = x.norm(dim=1)
    outer = r > 2.25
    assert abs(outer.double().mean() - 0.5) < 5 * math.sqrt(0.25 / N)
    assert (r[outer] - 3.0).abs().max() < 6 * 0.24 and (r[~outer] - 1.5).abs().max() < 6 * 0.24
    _assert_mean(x, [0.0, 0.0])


def test_checkerboard_black_squares_only():
    x = D.checkerboard(fr.key(7), N, torch.float64)
    assert (x.abs() <= 4).all()
    cell = torch.floor(x / 2).to(torch.int64)
    assert ((cell[:, 0] + cell[:, 1]) % 2 == 0).all()   # never a white square
    counts = torch.bincount((cell[:, 0] + 2) * 4 + (cell[:, 1] + 2), minlength=16).double()
    black = counts[counts > 0]
    assert black.numel() == 8 and ((black - N / 8).abs() < 5 * math.sqrt(N / 8 * 7 / 8)).all()


def test_symmetric_sets_are_centred():
    for fn in (D.pinwheel, D.two_spirals):
        _assert_mean(fn(fr.key(8), N, torch.float64), [0.0, 0.0])


def test_swiss_roll_radius():
    # radius before the noise is t in [1.5 pi, 4.5 pi], divided by 5
    x = D.swiss_roll(fr.key(9), N, torch.float64)
    r = x.norm(dim=1)
    assert r.min() > 1.5 * math.pi / 5 - 1.0 and r.max() < 4.5 * math.pi / 5 + 1.0


def test_argument_checks():
    k = fr.key(0)
    with pytest.raises(ValueError, match="n must be >= 0"):
        D.two_moons(k, -1)
    with pytest.raises(TypeError, match="n must be an int"):
        D.two_moons(k, 10.0)
    with pytest.raises(TypeError, match="n must be an int"):
        D.two_moons(k, True)
    with pytest.raises(TypeError, match="dtype must be a floating"):
        D.two_moons(k, 10, torch.int64)
    with pytest.raises(TypeError, match="key"):
        D.two_moons(torch.zeros(2), 10)
    with pytest.raises(ValueError, match=r"key must be one key of shape \(2,\)"):
        D.two_moons(fr.split(k, 3), 10)
    with pytest.raises(ValueError, match="key has words outside"):
        D.two_moons(torch.tensor([-1, 0]), 10)
    with pytest.raises(TypeError, match="device"):
        D.two_moons(k, 10, device=3.5)
    with pytest.raises(ValueError, match="name must be one of"):
        D.get("moons")
    with pytest.raises(TypeError, match="name must be a string"):
        D.get(None)
