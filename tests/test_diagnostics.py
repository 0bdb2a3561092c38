"""fnebm.diagnostics against ArviZ, which defines the numbers (Vehtari et al. 2021)."""

from __future__ import annotations

import functools
import logging
import warnings
from fractions import Fraction
from typing import NamedTuple
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fnebm import diagnostics as dg

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    az = pytest.importorskip("arviz")
    from arviz.stats import diagnostics as az_diagnostics

# ArviZ logs a warning (and numpy a RuntimeWarning) for NaN, constant or 1-chain input:
# those cases are expected here.
logging.getLogger("arviz").setLevel(logging.ERROR)
pytestmark = pytest.mark.filterwarnings(
    "ignore::FutureWarning", "ignore::RuntimeWarning"
)

RTOL = 1e-6

STATS = {
    "rhat": (dg.rhat, lambda a: az.rhat(a, method="rank")),
    "ess_bulk": (dg.ess_bulk, lambda a: az.ess(a, method="bulk")),
    "ess_tail": (dg.ess_tail, lambda a: az.ess(a, method="tail")),
    "ess": (dg.ess, lambda a: az.ess(a, method="mean")),
    "mcse_mean": (dg.mcse_mean, lambda a: az.mcse(a, method="mean")),
    "mcse_sd": (dg.mcse_sd, lambda a: az.mcse(a, method="sd")),
}


def arviz_reference(trace: np.ndarray, name: str) -> np.ndarray:
    """ArviZ's value for each event element of a ``(draws, chains, *event)`` trace."""
    ref = STATS[name][1]
    flat = trace.reshape(*trace.shape[:2], -1)
    # ArviZ wants one (chain, draw) array per variable.
    values = [float(ref(flat[:, :, i].T)) for i in range(flat.shape[-1])]
    return np.array(values).reshape(trace.shape[2:])


def _exact_ess(ary, relative=False, ties=None):
    """ArviZ 0.23.4's ``_ess``, line for line, in exact rational arithmetic on the float
    draws (the autocovariance by its defining sum: what ArviZ's FFT computes, unrounded),
    with pair sums within ``dg._PAIR_TIE_TOL`` of 0 taken as 0, as fnebm does. Each such
    pair sum that the loops reach is appended to ``ties``. Small traces only.

    ArviZ branches on the sign of these pair sums; with ties in the draws one can be 0 (or
    1e-17) and ArviZ's float value of it rounding noise of either sign, so there ArviZ is
    not a reference and this is."""
    ary = np.atleast_2d(np.asarray(ary, dtype=float))
    if np.isnan(ary).any() or np.ptp(ary) < np.finfo(float).resolution:
        return _ARVIZ_ESS(ary, relative=relative)  # NaN / constant: no autocovariance
    n_chain, n_draw = ary.shape
    rows = [[Fraction(v) for v in row] for row in ary.tolist()]
    chain_mean = [sum(row) / n_draw for row in rows]
    dev = [[v - m for v in row] for row, m in zip(rows, chain_mean)]
    acov = [  # biased autocovariance, averaged over chains
        sum(sum(d[i] * d[i + t] for i in range(n_draw - t)) for d in dev) / (n_chain * n_draw)
        for t in range(n_draw)
    ]
    mean_var = acov[0] * n_draw / (n_draw - 1)
    var_plus = mean_var * (n_draw - 1) / n_draw
    if n_chain > 1:
        grand = sum(chain_mean) / n_chain
        var_plus += sum((m - grand) ** 2 for m in chain_mean) / (n_chain - 1)
    rho = [1 - (mean_var - a) / var_plus for a in acov]

    def pair_sum(even, odd):
        total = even + odd
        if abs(total) <= dg._PAIR_TIE_TOL:
            if ties is not None:
                ties.append(float(total))
            return 0
        return total

    rho_hat_t = [Fraction(0)] * n_draw
    rho_hat_even = Fraction(1)
    rho_hat_t[0] = rho_hat_even
    rho_hat_odd = rho[1]
    rho_hat_t[1] = rho_hat_odd
    t = 1  # Geyer's initial positive sequence
    while t < (n_draw - 3) and pair_sum(rho_hat_even, rho_hat_odd) > 0:
        rho_hat_even, rho_hat_odd = rho[t + 1], rho[t + 2]
        if pair_sum(rho_hat_even, rho_hat_odd) >= 0:
            rho_hat_t[t + 1], rho_hat_t[t + 2] = rho_hat_even, rho_hat_odd
        t += 2
    max_t = t - 2
    if rho_hat_even > 0:
        rho_hat_t[max_t + 1] = rho_hat_even
    t = 1  # Geyer's initial monotone sequence
    while t <= max_t - 2:
        if (rho_hat_t[t + 1] + rho_hat_t[t + 2]) > (rho_hat_t[t - 1] + rho_hat_t[t]):
            rho_hat_t[t + 1] = rho_hat_t[t + 2] = (rho_hat_t[t - 1] + rho_hat_t[t]) / 2
        t += 2
    ess = n_chain * n_draw
    tau_hat = -1 + 2 * sum(rho_hat_t[: max_t + 1]) + sum(rho_hat_t[max_t + 1 : max_t + 2])
    tau_hat = max(float(tau_hat), 1 / np.log10(ess))
    return (1 if relative else ess) / tau_hat


def _exact_rhat(ary, ties=None):
    """ArviZ 0.23.4's ``_rhat`` in exact arithmetic. When every (split) chain is constant
    but the chains differ, the within-chain variance is 0 and R-hat is inf; ArviZ's float
    variance of a constant chain can instead be ~1e-33 (np.mean rounds), giving a finite
    R-hat of ~1e16 that depends on the rounding. Such cases are appended to ``ties``."""
    ary = np.asarray(ary, dtype=float)
    if np.isnan(ary).any():
        return _ARVIZ_RHAT(ary)
    n_chain, n_draw = ary.shape
    rows = [[Fraction(v) for v in row] for row in ary.tolist()]
    chain_mean = [sum(row) / n_draw for row in rows]
    chain_var = [sum((v - m) ** 2 for v in row) / (n_draw - 1) for row, m in zip(rows, chain_mean)]
    grand = sum(chain_mean) / n_chain
    between = n_draw * sum((m - grand) ** 2 for m in chain_mean) / (n_chain - 1)
    within = sum(chain_var) / n_chain
    if within == 0:
        if ties is not None:
            ties.append(0.0)
        return np.inf if between > 0 else np.nan
    return float(np.sqrt(float((between / within + n_draw - 1) / n_draw)))


_ARVIZ_ESS = az_diagnostics._ess
_ARVIZ_RHAT = az_diagnostics._rhat


def arviz_exact_reference(trace: np.ndarray, name: str, ties: list | None = None) -> np.ndarray:
    """:func:`arviz_reference` with ArviZ's ``_ess`` and ``_rhat`` in exact arithmetic
    (:func:`_exact_ess`, :func:`_exact_rhat`); the knife edges they meet go in ``ties``."""
    with (
        mock.patch.object(az_diagnostics, "_ess", functools.partial(_exact_ess, ties=ties)),
        mock.patch.object(az_diagnostics, "_rhat", functools.partial(_exact_rhat, ties=ties)),
    ):
        return arviz_reference(trace, name)


def assert_matches_arviz(trace: np.ndarray, name: str) -> None:
    """fnebm equals ArviZ -- or, only where ArviZ met a knife edge (a Geyer pair sum within
    ``dg._PAIR_TIE_TOL`` of 0, or constant split chains for R-hat) and its float rounding
    gave another value than its algorithm does in exact arithmetic, equals the exact value."""
    ours = STATS[name][0](torch.from_numpy(trace)).numpy()
    ref = arviz_reference(trace, name)
    off = ~np.isclose(ours, ref, rtol=RTOL, atol=0, equal_nan=True)
    if off.any():
        ties: list = []
        exact = arviz_exact_reference(trace, name, ties)
        flipped = ~np.isclose(ref, exact, rtol=RTOL, atol=0, equal_nan=True)
        assert ties and flipped[off].all(), (
            f"{name}: {ours[off]} != ArviZ {ref[off]} (exact: {exact[off]}, ties: {ties})"
        )
        np.testing.assert_allclose(ours[off], exact[off], rtol=RTOL, err_msg=name)


def ar1(rng: np.random.Generator, draws: int, chains: int, phi: float) -> np.ndarray:
    noise = rng.normal(size=(draws, chains))
    x = np.empty_like(noise)
    x[0] = noise[0] / np.sqrt(1 - phi**2)
    for t in range(1, draws):
        x[t] = phi * x[t - 1] + noise[t]
    return x


def _iid(rng):
    return rng.normal(size=(500, 4))


def _ar1(rng):
    return ar1(rng, 1000, 4, 0.9)


def _shifted(rng):
    return rng.normal(size=(200, 4)) + np.arange(4.0)  # chains stuck apart: R-hat >> 1


def _student_t(rng):
    return rng.standard_t(df=2.0, size=(300, 4))


def _odd_draws(rng):
    return ar1(rng, 301, 3, 0.5)  # split drops the middle draw


def _ties(rng):
    return np.round(rng.normal(size=(101, 3)))


def _event(rng):
    x = rng.normal(size=(250, 4, 3))
    x[..., 1] = ar1(rng, 250, 4, 0.95)
    x[..., 2] += np.arange(4.0) * 0.5
    return x


def _negative_ar(rng):
    return ar1(rng, 200, 2, -0.7)  # antithetic: ESS > draws


def _sign(rng):
    return np.sign(rng.normal(size=(60, 2)))  # folded draws are constant: tail R-hat is NaN


def _one_chain(rng):
    return ar1(rng, 100, 1, 0.3)


def _few_draws(rng):
    return rng.normal(size=(5, 2))


CASES = [
    _iid, _ar1, _shifted, _student_t, _odd_draws, _ties, _event, _negative_ar, _sign,
    _one_chain, _few_draws,
]


@pytest.mark.parametrize("name", list(STATS))
@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__.lstrip("_"))
def test_matches_arviz(make, name):
    trace = make(np.random.default_rng(2021))
    ours = STATS[name][0](torch.from_numpy(trace))
    assert ours.dtype == torch.float64
    assert ours.shape == trace.shape[2:]
    np.testing.assert_allclose(ours.numpy(), arviz_reference(trace, name), rtol=RTOL)


def test_shifted_chains_flag_bad_mixing():
    trace = torch.from_numpy(_shifted(np.random.default_rng(0)))
    assert dg.rhat(trace) > 1.3
    assert dg.rhat(torch.from_numpy(_iid(np.random.default_rng(0)))) < 1.01


# Regressions: one chain of {-1, 0, 1} draws whose split halves have an autocorrelation
# pair sum that is exactly 0. ArviZ's FFT rounds it to 0 on the first trace and to
# -2e-16 on the second (same exact pair sums); fnebm rounded the first to -1e-16.
_TIE_FOUND_BY_CI = dict(seed=22853864, draws=20, chains=1, phi=0.0, scale=0.3)
_TIE_ARVIZ_ROUNDS_OFF = dict(seed=3286131223, draws=21, chains=1, phi=0.4866464029510986, scale=0.3)
# Every split chain constant (3 draws each), the chains not all equal: R-hat is inf.
_CONSTANT_SPLIT_CHAINS = dict(seed=2352581173, draws=6, chains=3, phi=0.8518240612543726, scale=0.3)


def _rounded_ar1(seed, draws, chains, phi, scale):
    trace = ar1(np.random.default_rng(seed), draws, chains, phi)
    return trace if scale is None else np.round(trace * scale)  # scale 0.0: constant


@settings(max_examples=40, deadline=None)
@example(**_TIE_FOUND_BY_CI)
@example(**_TIE_ARVIZ_ROUNDS_OFF)
@example(**_CONSTANT_SPLIT_CHAINS)
@given(
    seed=st.integers(0, 2**32 - 1),
    draws=st.integers(4, 40),
    chains=st.integers(1, 4),
    phi=st.floats(-0.95, 0.95),
    scale=st.sampled_from([0.0, 0.3, 1.0, None]),  # rounding step (ties); None: continuous
)
def test_matches_arviz_property(seed, draws, chains, phi, scale):
    trace = _rounded_ar1(seed, draws, chains, phi, scale)
    for name in STATS:
        assert_matches_arviz(trace, name)


def test_ess_with_zero_pair_sum_matches_arviz():
    trace = _rounded_ar1(**_TIE_FOUND_BY_CI)
    ties: list = []
    for name in ("ess", "mcse_mean"):
        ours = STATS[name][0](torch.from_numpy(trace)).numpy()
        np.testing.assert_allclose(ours, arviz_reference(trace, name), rtol=RTOL)
        np.testing.assert_allclose(ours, arviz_exact_reference(trace, name, ties), rtol=RTOL)
    assert ties  # the trace does reach a pair sum of 0
    # tau = -1 + 2 * (1 + rho_1) + rho_2: the pair (rho_2, rho_3) sums to 0 and ends the
    # positive sequence, but is kept (>= 0), so rho_2 = -1/55 counts.
    np.testing.assert_allclose(dg.ess(torch.from_numpy(trace)).item(), 20 / (53 / 55))


def test_zero_pair_sum_takes_the_exact_arithmetic_branch():
    # The same exact pair sums as the CI trace, so the same ESS, whichever way float
    # rounding (ArviZ's, MKL's, cuFFT's) tips the pair sum that is 0.
    a, b = (_rounded_ar1(**c) for c in (_TIE_FOUND_BY_CI, _TIE_ARVIZ_ROUNDS_OFF))
    torch.testing.assert_close(dg.ess(torch.from_numpy(b)), dg.ess(torch.from_numpy(a)))
    for name in ("ess", "mcse_mean", "ess_bulk", "ess_tail"):
        ties: list = []
        exact = arviz_exact_reference(b, name, ties)
        np.testing.assert_allclose(STATS[name][0](torch.from_numpy(b)).numpy(), exact, rtol=RTOL)
        assert ties or name == "ess_tail", name


def test_rhat_of_constant_split_chains_is_inf():
    trace = _rounded_ar1(**_CONSTANT_SPLIT_CHAINS)
    ours = dg.rhat(torch.from_numpy(trace))
    assert torch.isinf(ours)
    assert arviz_reference(trace, "rhat") > 1e10  # ArviZ: ~2e16, from np.mean's rounding
    ties: list = []
    assert np.isinf(arviz_exact_reference(trace, "rhat", ties)) and ties
    x = torch.tensor([[1.0, 2.0, 3.0]]).repeat(8, 1)  # (draws, chains): each chain constant
    assert torch.isinf(dg.rhat(x))


@pytest.mark.parametrize(
    "make", [_sign, _one_chain, _few_draws, _odd_draws, _ties], ids=lambda f: f.__name__.lstrip("_")
)
def test_exact_reference_is_arviz_off_ties(make):
    # The exact-arithmetic oracle of assert_matches_arviz is ArviZ where no tie is reached.
    trace = make(np.random.default_rng(2021))
    for name in STATS:
        ties: list = []
        exact = arviz_exact_reference(trace, name, ties)
        assert not ties, name
        np.testing.assert_allclose(exact, arviz_reference(trace, name), rtol=1e-9, err_msg=name)


def test_constant_trace_matches_arviz():
    trace = np.full((20, 3), 1.5)
    ours = {name: f(torch.from_numpy(trace)) for name, (f, _) in STATS.items()}
    assert torch.isnan(ours["rhat"])
    assert ours["ess_bulk"] == ours["ess_tail"] == 60.0  # chains * 2 * (draws // 2)
    for name in STATS:
        np.testing.assert_allclose(ours[name].numpy(), arviz_reference(trace, name), rtol=RTOL)


def test_nan_is_per_element_and_matches_arviz():
    trace = np.random.default_rng(3).normal(size=(50, 2, 2))
    trace[10, 1, 0] = np.nan
    for name, (f, _) in STATS.items():
        ours = f(torch.from_numpy(trace))
        assert torch.isnan(ours[0]) and torch.isfinite(ours[1]), name
        np.testing.assert_allclose(ours.numpy(), arviz_reference(trace, name), rtol=RTOL)


def test_batched_event_equals_per_element():
    trace = torch.from_numpy(np.random.default_rng(4).normal(size=(40, 3, 2, 5)))
    for name, (f, _) in STATS.items():
        batched = f(trace)
        assert batched.shape == (2, 5), name
        looped = torch.stack([f(trace[:, :, i, j]) for i in range(2) for j in range(5)])
        torch.testing.assert_close(batched.reshape(-1), looped, rtol=1e-12, atol=0)


def test_row_blocks_do_not_change_results(monkeypatch):
    trace = torch.from_numpy(_event(np.random.default_rng(9)))
    whole = {name: f(trace) for name, (f, _) in STATS.items()}
    monkeypatch.setattr(dg, "_BLOCK_DRAWS", 1)  # one event element per block
    for name, (f, _) in STATS.items():
        torch.testing.assert_close(f(trace), whole[name], rtol=1e-12, atol=0)


def test_float32_in_float32_out():
    trace64 = torch.from_numpy(np.random.default_rng(5).normal(size=(100, 4, 3)))
    trace32 = trace64.float()
    for name, (f, _) in STATS.items():
        out = f(trace32)
        assert out.dtype == torch.float32 and out.shape == (3,), name
        torch.testing.assert_close(out, f(trace32.double()).float())
    for key, value in dg.summary(trace32).items():
        assert value.dtype == torch.float32 and value.shape == (3,), key


def test_scalar_trace_gives_0dim_and_empty_event_gives_empty():
    trace = torch.from_numpy(np.random.default_rng(6).normal(size=(30, 2)))
    assert dg.rhat(trace).shape == () and dg.ess_tail(trace).shape == ()
    assert dg.ess_bulk(torch.zeros(30, 2, 0)).shape == (0,)


class _Info(NamedTuple):
    acceptance_rate: torch.Tensor
    is_accepted: torch.Tensor
    is_divergent: torch.Tensor


class _RateOnly(NamedTuple):
    acceptance_rate: torch.Tensor


def test_acceptance_summary_exact():
    info = _Info(
        acceptance_rate=torch.tensor([[1.0, 0.5], [0.5, 0.0], [0.75, 0.25], [0.25, 0.75]]),
        is_accepted=torch.tensor([[True, False], [True, True], [False, False], [True, False]]),
        is_divergent=torch.tensor([[False, False], [False, True], [False, False], [False, False]]),
    )
    out = dg.acceptance_summary(info)
    assert set(out) == {
        "mean_acceptance_rate", "per_chain_acceptance_rate", "accepted_fraction",
        "n_divergent", "divergent_fraction",
    }
    assert out["mean_acceptance_rate"].item() == 0.5
    assert out["per_chain_acceptance_rate"].tolist() == [0.625, 0.375]
    assert out["accepted_fraction"].item() == 0.5
    assert out["n_divergent"] == 1 and isinstance(out["n_divergent"], int)
    assert out["divergent_fraction"].item() == 0.125


def test_acceptance_summary_skips_missing_fields():
    out = dg.acceptance_summary(_RateOnly(torch.full((5, 3), 0.25)))
    assert set(out) == {"mean_acceptance_rate", "per_chain_acceptance_rate"}
    assert out["per_chain_acceptance_rate"].shape == (3,)


def test_summary():
    x = np.random.default_rng(7).normal(size=(60, 3, 2))
    info = _RateOnly(torch.full((60, 3), 0.5))
    out = dg.summary(torch.from_numpy(x), info)
    np.testing.assert_allclose(out["mean"].numpy(), x.mean((0, 1)), rtol=1e-12)
    np.testing.assert_allclose(out["std"].numpy(), x.std((0, 1), ddof=1), rtol=1e-12)
    for name in ("rhat", "ess_bulk", "ess_tail"):
        np.testing.assert_allclose(out[name].numpy(), arviz_reference(x, name), rtol=RTOL)
    assert out["mean_acceptance_rate"].item() == 0.5


@pytest.mark.parametrize("fn", [dg.rhat, dg.ess_bulk, dg.ess_tail, dg.ess, dg.summary])
def test_bad_inputs(fn):
    with pytest.raises(TypeError, match="trace"):
        fn(torch.zeros(10, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="trace"):
        fn(np.zeros((10, 2)))
    with pytest.raises(ValueError, match=r"trace.*\(draws, chains, \*event\)"):
        fn(torch.zeros(10))
    with pytest.raises(ValueError, match=r"trace.*draws >= 4"):
        fn(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"trace.*chains >= 1"):
        fn(torch.zeros(10, 0))


def test_acceptance_summary_rejects_bad_shape():
    with pytest.raises(ValueError, match="info.acceptance_rate"):
        dg.acceptance_summary(_RateOnly(torch.zeros(5)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_follows_cuda_device():
    trace = torch.from_numpy(_event(np.random.default_rng(8)))
    for name, (f, _) in STATS.items():
        out = f(trace.cuda())
        assert out.device.type == "cuda", name
        torch.testing.assert_close(out.cpu(), f(trace), rtol=1e-9, atol=0)
