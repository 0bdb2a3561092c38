"""fnebm.diagnostics against ArviZ, which defines the numbers (Vehtari et al. 2021)."""

from __future__ import annotations

import functools
import logging
import sys
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
    # +-1 draws: the median is one of the two values, so the folded draws |x - median| are
    # {0, 2}, a relabelling of x (tail R-hat = bulk R-hat); constant only for an even split.
    return np.sign(rng.normal(size=(60, 2)))


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


def test_sign_case_folds_to_two_values():
    # what the _sign case exercises: folded draws that are not constant but take two values
    x = dg._split_chains(dg._rows(torch.from_numpy(_sign(np.random.default_rng(2021)))))
    z, s = dg._z_scale(x)
    folded = (x - dg._median(s)[:, None, None]).abs()
    assert folded.unique().tolist() == [0.0, 2.0]
    torch.testing.assert_close(dg._rhat_rows(dg._z_scale(folded)[0]), dg._rhat_rows(z))


# ------------------------------------------------------------------ layout (issue 8)

PUBLIC = [dg.rhat, dg.ess_bulk, dg.ess_tail, dg.ess, dg.mcse_mean, dg.mcse_sd, dg.summary,
          dg.summary_table, dg.to_arviz]


def _arviz_style(rng, chains=4, draws=1000):
    """A ``(chains, draws, 2)`` array as ArviZ and BlackJAX hold it, unit stationary
    variance: element 0 mixes badly (AR(1), phi 0.999, from starts 3 sd apart), element 1
    well (phi 0.9)."""
    x = np.empty((chains, draws, 2))
    for i, phi in enumerate((0.999, 0.9)):
        x[:, :, i] = ar1(rng, draws, chains, phi).T * np.sqrt(1 - phi**2)
    x[:, :, 0] += 3.0 * rng.normal(size=(chains, 1)) * 0.999 ** np.arange(draws)  # the starts decay
    return x


def test_chains_draws_layout_gives_arviz_numbers():
    # The issue: an ArviZ/BlackJAX user's (chains, draws, dim) array. Stated as such, fnebm
    # gives ArviZ's numbers (for every statistic); read as fnebm's layout, it would not.
    x = _arviz_style(np.random.default_rng(8))
    trace = torch.from_numpy(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stating the layout never warns
        for name, (f, ref) in STATS.items():
            ours = f(trace, layout="chains_draws")
            expected = [float(ref(x[:, :, i])) for i in range(2)]
            np.testing.assert_allclose(ours.numpy(), expected, rtol=RTOL, err_msg=name)
            # the same as moving the axes by hand
            torch.testing.assert_close(ours, f(trace.transpose(0, 1)), rtol=0, atol=0)
    assert dg.rhat(trace, layout="chains_draws")[0] > 1.3  # the bad mixing shows
    assert dg.ess_bulk(trace, layout="chains_draws")[0] < 50
    with pytest.warns(UserWarning):  # read as (draws, chains): it hides
        assert dg.ess_bulk(trace)[0] > 10_000


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__name__)
def test_default_layout_warns_when_it_looks_swapped(fn):
    trace = torch.from_numpy(_arviz_style(np.random.default_rng(8)))  # (4, 1000, 2)
    with pytest.warns(UserWarning, match=r"\(4, 1000, 2\).*layout='chains_draws'") as record:
        fn(trace)
    assert len(record) == 1  # once, even for summary's many statistics
    assert record[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn(trace, layout="draws_chains")  # stating the layout (either way) silences it
        fn(trace, layout="chains_draws")


@pytest.mark.parametrize(
    "shape", [(1000, 4), (200, 1024), (100, 4096), (20, 64), (17, 1000), (16, 63), (8, 2), (4, 1)]
)
def test_default_layout_does_not_warn_on_common_shapes(shape):
    trace = torch.from_numpy(np.random.default_rng(1).normal(size=shape))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dg.ess_bulk(trace)


def test_swap_heuristic_edges():
    assert dg._looks_swapped(4, 1000) and dg._looks_swapped(16, 64) and dg._looks_swapped(8, 32)
    assert not dg._looks_swapped(17, 10_000) and not dg._looks_swapped(16, 63)
    assert not dg._looks_swapped(1000, 4) and not dg._looks_swapped(200, 1024)


def test_too_few_draws_suggests_the_layout():
    trace = torch.zeros(2, 1000, 3)  # ArviZ: 2 chains of 1000 draws
    with pytest.raises(ValueError, match=r"draws >= 4.*layout='chains_draws'"):
        dg.rhat(trace)
    assert dg.rhat(trace, layout="chains_draws").shape == (3,)
    with pytest.raises(ValueError, match=r"trace.*\(chains, draws, \*event\).*draws >= 4"):
        dg.rhat(torch.zeros(1000, 2), layout="chains_draws")
    with pytest.raises(ValueError, match=r"trace.*\(chains, draws, \*event\).*chains >= 1"):
        dg.rhat(torch.zeros(0, 10), layout="chains_draws")


@pytest.mark.parametrize("fn", [*PUBLIC, dg.to_inference_data], ids=lambda f: f.__name__)
@pytest.mark.parametrize("layout", ["chains", "ChainsDraws", "", 0, ("draws", "chains")])
def test_bad_layout(fn, layout):
    with pytest.raises(ValueError, match=r"layout must be 'draws_chains'.*'chains_draws'"):
        fn(torch.zeros(10, 2), layout=layout)


@pytest.mark.parametrize("layout", ["chains", 1])
def test_acceptance_summary_bad_layout(layout):
    with pytest.raises(ValueError, match="layout"):
        dg.acceptance_summary(_RateOnly(torch.zeros(5, 2)), layout=layout)


# ------------------------------------------------- NUTS/HMC statistics in the summary


class _NUTSInfo(NamedTuple):
    acceptance_rate: torch.Tensor
    is_divergent: torch.Tensor
    tree_depth: torch.Tensor
    num_integration_steps: torch.Tensor
    energy: torch.Tensor


def _nuts_info(draws=6, chains=2):
    steps = torch.arange(draws * chains).reshape(draws, chains) % 7 + 1
    return _NUTSInfo(
        acceptance_rate=torch.linspace(0, 1, draws * chains, dtype=torch.float64).reshape(draws, chains),
        is_divergent=(torch.arange(draws * chains).reshape(draws, chains) % 4) == 0,
        tree_depth=torch.ceil(torch.log2(steps + 1.0)).to(torch.int32),
        num_integration_steps=steps,
        energy=torch.arange(draws * chains, dtype=torch.float32).reshape(draws, chains),
    )


def test_acceptance_summary_reports_nuts_fields():
    info = _nuts_info()
    out = dg.acceptance_summary(info)
    assert out["n_divergent"] == 3 and out["divergent_fraction"].item() == 0.25
    assert out["mean_tree_depth"].dtype == torch.float64
    assert out["mean_tree_depth"].item() == info.tree_depth.double().mean().item()
    assert out["mean_num_integration_steps"].item() == info.num_integration_steps.double().mean().item()
    assert out["mean_acceptance_rate"].item() == 0.5
    # (chains, draws) fields, stated, give the same numbers
    flipped = _NUTSInfo(*(f.T for f in info))
    again = dg.acceptance_summary(flipped, layout="chains_draws")
    assert set(again) == set(out)
    for key in out:
        torch.testing.assert_close(torch.as_tensor(again[key]), torch.as_tensor(out[key]))
    # a mapping works as well as a NamedTuple
    assert dg.acceptance_summary(info._asdict())["n_divergent"] == 3


def test_acceptance_summary_without_nuts_fields():
    # an MH info without tree depth or integration step counts: those keys are left out
    info = _Info(torch.full((5, 2), 0.8), torch.ones(5, 2, dtype=torch.bool),
                 torch.zeros(5, 2, dtype=torch.bool))
    out = dg.acceptance_summary(info)
    assert "mean_tree_depth" not in out and "mean_num_integration_steps" not in out
    assert out["n_divergent"] == 0 and out["accepted_fraction"].item() == 1.0


def test_acceptance_summary_warns_on_swapped_info():
    info = _RateOnly(torch.full((4, 1000), 0.5))  # (chains, draws)
    with pytest.warns(UserWarning, match=r"info.acceptance_rate.*layout='chains_draws'") as rec:
        out = dg.acceptance_summary(info)
    assert rec[0].filename == __file__ and out["per_chain_acceptance_rate"].shape == (1000,)
    out = dg.acceptance_summary(info, layout="chains_draws")
    assert out["per_chain_acceptance_rate"].shape == (4,)


def test_summary_with_nuts_info_and_layout():
    x = np.random.default_rng(7).normal(size=(6, 3, 2))
    info = _nuts_info(6, 3)
    out = dg.summary(torch.from_numpy(x), info)
    flipped = dg.summary(torch.from_numpy(x).transpose(0, 1), _NUTSInfo(*(f.T for f in info)),
                         layout="chains_draws")
    assert set(out) == set(flipped) >= {"mcse_mean", "mcse_sd", "n_divergent", "mean_tree_depth"}
    for key in out:
        torch.testing.assert_close(torch.as_tensor(flipped[key]), torch.as_tensor(out[key]),
                                   rtol=0, atol=0)


# ---------------------------------------------------------------- ArviZ export, table


def _nuts_run(rng, draws=200, chains=4, event=(2,)):
    trace = torch.from_numpy(rng.normal(size=(draws, chains, *event)))
    trace[:, 1] += 0.5  # one chain off: R-hat above 1.01
    return trace, _nuts_info(draws, chains)


def test_to_arviz_dict():
    trace, info = _nuts_run(np.random.default_rng(0))
    d = dg.to_arviz(trace, info, var_name="theta")
    assert set(d) == {"posterior", "sample_stats"}
    np.testing.assert_array_equal(d["posterior"]["theta"], trace.numpy().transpose(1, 0, 2))
    assert set(d["sample_stats"]) == {"acceptance_rate", "diverging", "tree_depth", "n_steps", "energy"}
    assert d["sample_stats"]["diverging"].dtype == np.bool_
    for name, field in zip(("acceptance_rate", "diverging", "tree_depth", "n_steps", "energy"), info):
        np.testing.assert_array_equal(d["sample_stats"][name], field.numpy().T)
    assert set(dg.to_arviz(trace)) == {"posterior"}
    # (chains, draws) in, stated: the same dict
    again = dg.to_arviz(trace.transpose(0, 1), _NUTSInfo(*(f.T for f in info)),
                        layout="chains_draws", var_name="theta")
    for group in d:
        for name in d[group]:
            np.testing.assert_array_equal(again[group][name], d[group][name])


def test_to_arviz_skips_non_tensors_and_checks_shapes():
    trace = torch.zeros(10, 3)
    info = {"acceptance_rate": torch.ones(10, 3), "nested": (torch.ones(10, 3),), "none": None}
    assert set(dg.to_arviz(trace, info)["sample_stats"]) == {"acceptance_rate"}
    with pytest.raises(ValueError, match=r"info.acceptance_rate.*\(10, 3\)"):
        dg.to_arviz(trace, {"acceptance_rate": torch.ones(9, 3)})
    with pytest.raises(TypeError, match="info must be"):
        dg.to_arviz(trace, [torch.ones(10, 3)])
    with pytest.raises(TypeError, match="var_name"):
        dg.to_arviz(trace, var_name="")
    # bfloat16 has no NumPy dtype: exported as float32
    assert dg.to_arviz(trace.bfloat16())["posterior"]["x"].dtype == np.float32


def test_to_inference_data_agrees_with_arviz_summary():
    trace, info = _nuts_run(np.random.default_rng(1), event=(2, 3))
    idata = dg.to_inference_data(trace, info, var_name="theta")
    assert dict(idata.posterior.sizes) == {"chain": 4, "draw": 200, "theta_dim_0": 2, "theta_dim_1": 3}
    assert idata.sample_stats["diverging"].dims == ("chain", "draw")
    assert int(idata.sample_stats["diverging"].sum()) == dg.acceptance_summary(info)["n_divergent"]
    ref = az.summary(idata, kind="diagnostics", round_to="none")
    ref_stats = az.summary(idata, kind="stats", round_to="none")
    table = dg.summary_table(trace, info, var_name="theta")
    assert list(ref.index) == list(table.names) and table.names[4] == "theta[1, 1]"
    ours = table.to_pandas()
    for col in ("mcse_mean", "mcse_sd", "ess_bulk", "ess_tail", "r_hat"):
        np.testing.assert_allclose(ours[col], ref[col], rtol=1e-9, err_msg=col)
    for col in ("mean", "sd"):
        np.testing.assert_allclose(ours[col], ref_stats[col], rtol=1e-9, err_msg=col)
    assert (ours["r_hat"] > 1.01).all()


def test_to_inference_data_with_many_short_chains_is_quiet():
    # fnebm's many short chains: ArviZ's "more chains than draws" warning is silenced, the
    # layout being stated
    trace = torch.from_numpy(np.random.default_rng(2).normal(size=(20, 64)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        idata = dg.to_inference_data(trace)
    assert dict(idata.posterior.sizes) == {"chain": 64, "draw": 20}


def test_to_inference_data_without_arviz(monkeypatch):
    monkeypatch.setitem(sys.modules, "arviz", None)  # import arviz now raises ImportError
    with pytest.raises(ImportError, match="pip install arviz"):
        dg.to_inference_data(torch.zeros(10, 2))
    assert dg.to_arviz(torch.zeros(10, 2))["posterior"]["x"].shape == (2, 10)


def test_summary_table_prints_like_arviz():
    trace, info = _nuts_run(np.random.default_rng(3))
    table = dg.summary_table(trace, info)
    text = str(table)
    assert repr(table) == text
    lines = text.splitlines()
    assert lines[0].split() == ["mean", "sd", "mcse_mean", "mcse_sd", "ess_bulk", "ess_tail", "r_hat"]
    # the rows are ArviZ's rounded numbers: 3 decimals, ESS whole, R-hat 2 decimals
    ref = az.summary(dg.to_inference_data(trace), round_to=None)
    ref = ref[["mean", "sd", "mcse_mean", "mcse_sd", "ess_bulk", "ess_tail", "r_hat"]]
    for line, (name, row) in zip(lines[1:3], ref.iterrows()):
        cells = line.split()
        assert cells[0] == name
        np.testing.assert_array_equal(np.array(cells[1:], dtype=float), row.to_numpy())
    assert lines[3] == "divergences: 200 (25.00%)"
    assert lines[4] == "mean acceptance rate: 0.500"
    assert lines[5].startswith("mean tree depth: ") and lines[6].startswith("mean integration steps: ")
    assert table.sampler["n_divergent"] == 200 and isinstance(table.sampler["mean_tree_depth"], float)
    assert table.values.shape == (2, 7) and table.values.dtype == torch.float64


def test_summary_table_names_and_scalar_event():
    trace = torch.from_numpy(np.random.default_rng(4).normal(size=(50, 2)))
    table = dg.summary_table(trace)
    assert table.names == ("x",) and table.sampler == {}
    assert len(str(table).splitlines()) == 2
    named = dg.summary_table(torch.stack([trace, trace], -1), names=["a", "bb"])
    assert named.names == ("a", "bb") and str(named).splitlines()[2].startswith("bb ")
    with pytest.raises(ValueError, match=r"names.*one label per event element \(2"):
        dg.summary_table(torch.stack([trace, trace], -1), names=["a"])
    with pytest.raises(TypeError, match="names"):
        dg.summary_table(trace, names="x")
    with pytest.raises(TypeError, match="var_name"):
        dg.summary_table(trace, var_name=3)
    # NaN stays visible
    bad = trace.clone()
    bad[3, 1] = float("nan")
    assert "nan" in str(dg.summary_table(bad))


def test_to_inference_data_calls_arviz_1x_with_the_groups(monkeypatch):
    # ArviZ 1.x takes from_dict({group: {variable: array}}), 0.x from_dict(**groups)
    calls = []
    monkeypatch.setattr(az, "__version__", "1.2.0")
    monkeypatch.setattr(az, "from_dict", lambda *a, **kw: calls.append((a, kw)) or "tree")
    trace = torch.zeros(10, 2)
    assert dg.to_inference_data(trace, {"is_divergent": torch.zeros(10, 2, dtype=torch.bool)}) == "tree"
    (args, kwargs), = calls
    assert kwargs == {} and set(args[0]) == {"posterior", "sample_stats"}
    assert args[0]["sample_stats"]["diverging"].shape == (2, 10)


def test_real_hmc_run_reports_integration_steps():
    # an fnebm HMC run end to end: info fields straight from sample_chain (eager)
    import fnebm
    from fnebm import energies, random as fr

    alg = fnebm.hmc(energies.gaussian(torch.zeros(2)), 0.3, num_integration_steps=5)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(0), (4, 2)))
    _, trace, info = fnebm.sample_chain(alg.step, state, fr.key(1), 40, compile=False, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (40, 4): no swap warning
        out = dg.summary(trace, info)
        d = dg.to_arviz(trace, info)
    assert out["mean_num_integration_steps"].item() == 5.0 and "mean_tree_depth" not in out
    assert out["n_divergent"] == 0 and 0 < out["mean_acceptance_rate"].item() <= 1
    assert {"n_steps", "diverging", "energy_error", "acceptance_rate"} <= set(d["sample_stats"])
    assert d["sample_stats"]["n_steps"].shape == (4, 40) and d["posterior"]["x"].shape == (4, 40, 2)
    assert "mean integration steps: 5.000" in str(dg.summary_table(trace, info))


@pytest.mark.parametrize("draws, chains, event", [(40, 4, (2,)), (41, 3, (3,)), (9, 1, ()), (12, 2, (2, 0))])
def test_summary_shares_sorts_and_equals_the_single_diagnostics(draws, chains, event):
    """summary computes R̂, bulk and tail ESS together with two sorts (the split chains' ranks
    serve R̂ and the bulk ESS; with an even number of draws their sorted values serve the tail
    ESS's quantiles): bit-identical to rhat, ess_bulk and ess_tail called alone, odd draws, a
    single chain (R̂ NaN) and a NaN draw included."""
    gen = torch.Generator().manual_seed(draws)  # a test's own generator, fixed seed
    trace = torch.randn((draws, chains) + event, generator=gen, dtype=torch.float64).cumsum(0) * 0.1
    with_nan = trace.clone()
    if with_nan.numel():
        with_nan.view(-1)[3] = float("nan")
    for t in (trace, with_nan):
        s = dg.summary(t)
        for name in ("rhat", "ess_bulk", "ess_tail"):
            alone = getattr(dg, name)(t)
            assert s[name].shape == alone.shape
            assert torch.equal(s[name].nan_to_num(-1.0), alone.nan_to_num(-1.0)), name
