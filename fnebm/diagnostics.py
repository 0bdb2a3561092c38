"""MCMC convergence diagnostics: rank-normalised split-R̂, bulk/tail ESS, acceptance.

The numbers are ArviZ 0.23's (Vehtari, Gelman, Simpson, Carpenter, Bürkner 2021,
"Rank-normalization, folding, and localization: An improved R-hat"), reproduced in torch
and batched over every event dimension at once.

Layout: ``trace: (draws, chains, *event)`` -- what ``fnebm.sample_chain`` returns; ArviZ
uses ``(chain, draw)``. Each statistic has shape ``event`` (0-dim for a ``(draws, chains)``
trace), the trace's floating dtype and device. Work is done in float64 internally.

These run once, after sampling, so they may sync with the host; they are not for use
inside a compiled step.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = [
    "rhat",
    "ess",
    "ess_bulk",
    "ess_tail",
    "mcse_mean",
    "acceptance_summary",
    "summary",
]

_F64 = torch.float64
# Event elements are processed in row blocks of about this many draws: each statistic
# makes ~15 full-size temporaries, and bounding them keeps memory flat and the work in
# cache (2x faster on CPU for a 40M-draw trace than one pass over everything).
_BLOCK_DRAWS = 1 << 20
# Geyer's sequences branch on the sign of an autocorrelation pair sum (ArviZ: go on while
# it is > 0, keep the pair when it is >= 0), and ESS jumps by a few percent between the
# branches. With tied draws a pair sum is often exactly 0 in exact arithmetic; the float
# value is then FFT rounding noise (~1e-16) whose sign depends on the FFT library (numpy's
# pocketfft in ArviZ, MKL or cuFFT in torch) and on the order of the sums, so no float
# implementation can track ArviZ there. Pair sums this close to 0 are taken as exactly 0:
# the branch ArviZ's algorithm takes in exact arithmetic, the same on every device. (For a
# continuous trace a pair sum this small is a ~1e-12 chance.)
_PAIR_TIE_TOL = 1e-12


# --------------------------------------------------------------------------- helpers
# Internally a trace is a float64 tensor of rows ``x: (D, chains, draws)``, one row per
# flattened event element, so every step below is batched over D.


def _check_trace(trace: Any) -> None:
    if not isinstance(trace, Tensor) or not trace.is_floating_point():
        got = trace.dtype if isinstance(trace, Tensor) else type(trace).__name__
        raise TypeError(
            f"trace must be a floating-point tensor of shape (draws, chains, *event); got {got}"
        )
    if trace.ndim < 2:
        raise ValueError(
            "trace must have shape (draws, chains, *event) with at least 2 dims; "
            f"got shape {tuple(trace.shape)}"
        )
    draws, chains = trace.shape[:2]
    if draws < 4:
        raise ValueError(
            f"trace must have shape (draws, chains, *event) with draws >= 4; got {draws} draws"
        )
    if chains < 1:
        raise ValueError(
            f"trace must have shape (draws, chains, *event) with chains >= 1; got {chains} chains"
        )


def _rows(trace: Tensor) -> Tensor:
    """``(draws, chains, *event) -> (D, chains, draws)`` in float64."""
    draws, chains = trace.shape[:2]
    return trace.reshape(draws, chains, -1).permute(2, 1, 0).to(_F64)


def _unrows(values: Tensor, trace: Tensor) -> Tensor:
    """``(D,) -> event`` in the trace's dtype."""
    return values.reshape(trace.shape[2:]).to(trace.dtype)


def _per_element(trace: Tensor, stat: Callable[[Tensor], Tensor]) -> Tensor:
    """Validate, apply ``stat: (D, C, N) -> (D,)`` to every event element, reshape back."""
    _check_trace(trace)
    x = _rows(trace)
    if x.shape[0] == 0:  # empty event: nothing to compute (and FFT rejects empty input)
        return trace.new_empty(trace.shape[2:])
    # ArviZ returns NaN for a variable with any NaN draw (its `_not_valid` check).
    nan = x.isnan().flatten(1).any(-1)
    rows = max(1, _BLOCK_DRAWS // (x.shape[1] * x.shape[2]))
    out = torch.cat([stat(block) for block in x.split(rows)])
    return _unrows(torch.where(nan, torch.nan, out), trace)


def _split_chains(x: Tensor) -> Tensor:
    """``(D, C, N) -> (D, 2C, N // 2)``: first halves, then last halves; an odd N drops
    the middle draw."""
    half = x.shape[-1] // 2
    return torch.cat([x[..., :half], x[..., -half:]], dim=1)


def _median(s: Tensor) -> Tensor:
    """np.median of each sorted row ``s: (D, M) -> (D,)``."""
    n = s.shape[-1]
    return (s[:, (n - 1) // 2] + s[:, n // 2]) / 2


def _quantile(s: Tensor, prob: float) -> Tensor:
    """R type-7 quantile of each sorted row ``s: (D, M) -> (D,)``, with the exact
    arithmetic of scipy's ``mquantiles`` (alphap=betap=1) that ArviZ uses: the tail ESS
    compares draws to it with ``<=``, so a last-bit difference would flip ties."""
    n = s.shape[-1]
    aleph = n * prob + (1.0 + prob * (1.0 - 1.0 - 1.0))
    k = math.floor(min(max(aleph, 1), n - 1))
    gamma = min(max(aleph - k, 0.0), 1.0)
    return (1.0 - gamma) * s[:, k - 1] + gamma * s[:, k]


def _z_scale(x: Tensor) -> tuple[Tensor, Tensor]:
    """Rank-normalise each row of ``x: (D, C, N)`` over all its chains and draws: average
    ranks for ties, Blom's offset ``(r - 3/8) / (S + 1/4)``, then the inverse normal CDF.
    Also returns the sorted rows ``(D, C * N)``, which callers reuse."""
    s, order = x.flatten(1).sort(dim=-1)
    size = s.shape[-1]
    # A tie group spans sorted positions lo..hi and shares the mean 1-based rank.
    pos = torch.arange(size, device=x.device).expand_as(s)
    differ = s[:, 1:] != s[:, :-1]
    edge = torch.ones_like(differ[:, :1])
    lo = torch.where(torch.cat([edge, differ], -1), pos, 0).cummax(-1).values
    hi = torch.where(torch.cat([differ, edge], -1), pos, size).flip(-1).cummin(-1).values
    hi = hi.flip(-1)
    rank_sorted = (lo + hi + 2).to(_F64) / 2
    rank = torch.empty_like(rank_sorted).scatter_(-1, order, rank_sorted)
    c = 3 / 8
    z = torch.special.ndtri((rank - c) / (size - 2 * c + 1))
    return z.reshape(x.shape), s


def _rhat_rows(x: Tensor) -> Tensor:
    """Classic R̂ of ``x: (D, C, N)`` (ArviZ ``_rhat``)."""
    n = x.shape[-1]
    between = n * x.mean(-1).var(-1, correction=1)
    within = x.var(-1, correction=1).mean(-1)
    return torch.sqrt((between / within + n - 1) / n)


def _mean_autocov(x: Tensor) -> Tensor:
    """Biased (divided by N) autocovariance at every lag of ``x: (D, C, N)``, averaged
    over chains: ``(D, N)``. By FFT; zero-padding to 2N makes the circular correlation
    the linear one, and averaging the power spectra first saves C - 1 inverse FFTs."""
    n = x.shape[-1]
    f = torch.fft.rfft(x - x.mean(-1, keepdim=True), n=2 * n)
    power = (f.real.square() + f.imag.square()).mean(1)
    return torch.fft.irfft(power, n=2 * n)[..., :n] / n


def _ess_rows(x: Tensor) -> Tensor:
    """ESS of ``x: (D, C, N)`` (ArviZ ``_ess``) with Geyer's initial positive and initial
    monotone sequences, vectorised: ArviZ's two while-loops become a count of leading
    positive pair sums and a ``cummin`` over them. Pair sums within ``_PAIR_TIE_TOL`` of
    0 count as 0, the exact-arithmetic branch."""
    _, c, n = x.shape
    flat = x.flatten(1)
    constant = (flat.amax(-1) - flat.amin(-1)) < torch.finfo(_F64).resolution

    acov = _mean_autocov(x)
    mean_var = acov[:, 0] * n / (n - 1.0)
    var_plus = mean_var * (n - 1.0) / n
    if c > 1:
        var_plus = var_plus + x.mean(-1).var(-1, correction=1)
    rho = 1.0 - (mean_var[:, None] - acov) / var_plus[:, None]  # (D, N)
    rho = torch.cat([torch.ones_like(rho[:, :1]), rho[:, 1:]], dim=-1)  # ArviZ pins lag 0 to 1

    # Pair sums P_j = rho[2j] + rho[2j+1]; ArviZ's loop can reach j = jmax (t < N - 3).
    jmax = max(0, (n - 3) // 2)
    pairs = rho[:, 0 : 2 * jmax + 2 : 2] + rho[:, 1 : 2 * jmax + 2 : 2]  # (D, jmax + 1)
    pairs = torch.where(pairs.abs() <= _PAIR_TIE_TOL, 0.0, pairs)  # ties: see _PAIR_TIE_TOL
    # Loop iteration j runs while every earlier pair sum is > 0 (NaN stops it too).
    n_pos = (pairs[:, :jmax] > 0).to(torch.int64).cumprod(-1).sum(-1, keepdim=True)
    keep = torch.arange(jmax + 1, device=x.device) < n_pos
    # Initial monotone sequence: each kept pair sum is capped by the previous one.
    head = torch.where(keep, pairs.cummin(-1).values, 0.0).sum(-1)
    # The pair where the loop stopped contributes its even lag when ArviZ stored it
    # (pair sum >= 0) or its "improve estimation" step did (even lag > 0).
    rho_last = rho.gather(-1, 2 * n_pos).squeeze(-1)
    pair_last = pairs.gather(-1, n_pos).squeeze(-1)
    last = torch.where((rho_last > 0) | (pair_last >= 0), rho_last, 0.0)
    tau = -1.0 + 2.0 * head + last

    total = c * n
    floor = 1 / math.log10(total)
    tau = torch.where(floor > tau, floor, tau)  # Python max(tau, floor): NaN tau stays NaN
    out = total / tau
    out = torch.where(pairs[:, 0].isnan(), torch.nan, out)
    return torch.where(constant, float(total), out)


def _rhat_rank_rows(x: Tensor) -> Tensor:
    if x.shape[1] < 2:  # ArviZ requires 2 chains before splitting
        return torch.full_like(x[:, 0, 0], torch.nan)
    split = _split_chains(x)
    z, s = _z_scale(split)
    bulk = _rhat_rows(z)
    tail = _rhat_rows(_z_scale((split - _median(s)[:, None, None]).abs())[0])
    return torch.where(tail > bulk, tail, bulk)  # Python max(bulk, tail): NaN bulk wins


def _ess_bulk_rows(x: Tensor) -> Tensor:
    return _ess_rows(_z_scale(_split_chains(x))[0])


def _ess_tail_rows(x: Tensor) -> Tensor:
    s = x.flatten(1).sort(dim=-1).values
    low, high = (
        _ess_rows(_split_chains((x <= _quantile(s, p)[:, None, None]).to(_F64)))
        for p in (0.05, 0.95)
    )
    return torch.where(high < low, high, low)  # Python min(low, high), as ArviZ


# ----------------------------------------------------------------------------- public


def rhat(trace: Tensor) -> Tensor:
    """Rank-normalised split-R̂ (ArviZ ``az.rhat(..., method="rank")``).

    Chains are split in half, the draws rank-normalised across all chains, and R̂ taken
    for both the bulk and the folded draws ``|x - median|``; the larger is returned.

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.

    Returns:
        ``event``-shaped tensor in ``trace.dtype``. NaN where the trace holds a NaN or
        is constant, and everywhere for a single chain (as ArviZ, which needs 2 chains).
    """
    return _per_element(trace, _rhat_rank_rows)


def ess_bulk(trace: Tensor) -> Tensor:
    """Bulk effective sample size (ArviZ ``az.ess(..., method="bulk")``): split-ESS of the
    rank-normalised draws.

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.

    Returns:
        ``event``-shaped tensor in ``trace.dtype``, in draws (not relative). NaN where the
        trace holds a NaN; ``chains * 2 * (draws // 2)`` where it is constant.
    """
    return _per_element(trace, _ess_bulk_rows)


def ess_tail(trace: Tensor) -> Tensor:
    """Tail effective sample size (ArviZ ``az.ess(..., method="tail")``): the smaller
    split-ESS of the indicators ``x <= q05`` and ``x <= q95`` (type-7 quantiles over all
    chains and draws).

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.

    Returns:
        ``event``-shaped tensor in ``trace.dtype``. NaN where the trace holds a NaN.
    """
    return _per_element(trace, _ess_tail_rows)


def ess(trace: Tensor) -> Tensor:
    """Classic split-ESS of the draws themselves (ArviZ ``az.ess(..., method="mean")``):
    the ESS that governs the Monte Carlo error of the mean. Not rank-normalised, so it
    assumes finite variance; prefer :func:`ess_bulk` for convergence checks.

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.

    Returns:
        ``event``-shaped tensor in ``trace.dtype``. NaN where the trace holds a NaN.
    """
    return _per_element(trace, lambda x: _ess_rows(_split_chains(x)))


def mcse_mean(trace: Tensor) -> Tensor:
    """Monte Carlo standard error of the mean (ArviZ ``az.mcse(..., method="mean")``):
    ``std(draws, ddof=1) / sqrt(ess(trace))``.

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.

    Returns:
        ``event``-shaped tensor in ``trace.dtype``, in the units of the trace.
    """
    return _per_element(
        trace, lambda x: x.flatten(1).std(-1, correction=1) / _ess_rows(_split_chains(x)).sqrt()
    )


def acceptance_summary(info: Any) -> dict[str, Any]:
    """Acceptance statistics from a sampler's per-step ``info``.

    Args:
        info: a NamedTuple (or any object) whose fields, where present, are
            ``(draws, chains)`` tensors: ``acceptance_rate`` (float in [0, 1]),
            ``is_accepted`` (bool), ``is_divergent`` (bool). Missing fields are skipped.

    Returns:
        A dict with only the keys whose source field exists:
        ``mean_acceptance_rate`` (0-dim, dtype of ``acceptance_rate``),
        ``per_chain_acceptance_rate`` (``(chains,)``), ``accepted_fraction`` (0-dim
        float64), ``n_divergent`` (int), ``divergent_fraction`` (0-dim float64).
    """

    def field(name: str) -> Tensor | None:
        value = getattr(info, name, None)
        if value is None:
            return None
        if not isinstance(value, Tensor) or value.ndim != 2:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"info.{name} must be a (draws, chains) tensor; got {shape}")
        return value

    out: dict[str, Any] = {}
    rate = field("acceptance_rate")
    if rate is not None:
        rate = rate if rate.is_floating_point() else rate.to(_F64)
        out["mean_acceptance_rate"] = rate.mean()
        out["per_chain_acceptance_rate"] = rate.mean(0)
    # Fractions of counts in float64: counts stay exact to 2**53 steps (float32: 2**24).
    accepted = field("is_accepted")
    if accepted is not None:
        out["accepted_fraction"] = torch.count_nonzero(accepted).to(_F64) / accepted.numel()
    divergent = field("is_divergent")
    if divergent is not None:
        count = torch.count_nonzero(divergent)
        out["n_divergent"] = int(count)
        out["divergent_fraction"] = count.to(_F64) / divergent.numel()
    return out


def summary(trace: Tensor, info: Any = None) -> dict[str, Any]:
    """Posterior summary of a trace, ArviZ ``az.summary``'s diagnostic columns.

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.
        info: optional sampler info; its :func:`acceptance_summary` keys are merged in.

    Returns:
        dict with ``mean``, ``std`` (``ddof=1`` over draws and chains), ``rhat``,
        ``ess_bulk``, ``ess_tail`` -- each ``event``-shaped in ``trace.dtype`` -- plus the
        acceptance keys when ``info`` is given.
    """
    out = {
        "mean": _per_element(trace, lambda x: x.flatten(1).mean(-1)),
        "std": _per_element(trace, lambda x: x.flatten(1).std(-1, correction=1)),
        "rhat": rhat(trace),
        "ess_bulk": ess_bulk(trace),
        "ess_tail": ess_tail(trace),
    }
    if info is not None:
        out.update(acceptance_summary(info))
    return out
