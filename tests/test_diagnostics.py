"""fnebm.diagnostics against ArviZ, which defines the numbers (Vehtari et al. 2021)."""

from __future__ import annotations

import logging
import warnings
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnebm import diagnostics as dg

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    az = pytest.importorskip("arviz")

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
}


def arviz_reference(trace: np.ndarray, name: str) -> np.ndarray:
    """ArviZ's value for each event element of a ``(draws, chains, *event)`` trace."""
    ref = STATS[name][1]
    flat = trace.reshape(*trace.shape[:2], -1)
    # ArviZ wants one (chain, draw) array per variable.
    values = [float(ref(flat[:, :, i].T)) for i in range(flat.shape[-1])]
    return np.array(values).reshape(trace.shape[2:])


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


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    draws=st.integers(4, 40),
    chains=st.integers(1, 4),
    phi=st.floats(-0.95, 0.95),
    scale=st.sampled_from([0.0, 0.3, 1.0, None]),  # rounding step (ties); None: continuous
)
def test_matches_arviz_property(seed, draws, chains, phi, scale):
    trace = ar1(np.random.default_rng(seed), draws, chains, phi)
    if scale is not None:
        trace = np.round(trace * scale)  # 0.0 gives a constant trace
    for name, (ours, _) in STATS.items():
        np.testing.assert_allclose(
            ours(torch.from_numpy(trace)).numpy(), arviz_reference(trace, name), rtol=RTOL
        )


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
