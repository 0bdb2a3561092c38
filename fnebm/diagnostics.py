"""MCMC convergence diagnostics: rank-normalised split-R̂, bulk/tail ESS, acceptance.

The numbers are ArviZ 0.23's (Vehtari, Gelman, Simpson, Carpenter, Bürkner 2021,
"Rank-normalization, folding, and localization: An improved R-hat"), reproduced in torch
and batched over every event dimension at once.

Layout: ``trace: (draws, chains, *event)`` -- what ``fnebm.sample_chain`` returns; ArviZ
and BlackJAX users hold ``(chain, draw, *shape)`` and pass ``layout="chains_draws"``
(left unstated, a trace that looks swapped warns). Each statistic has shape ``event``
(0-dim for a ``(draws, chains)`` trace), the trace's floating dtype and device. Work is done in float64 internally.
:func:`summary_table` prints ArviZ's ``az.summary``; :func:`to_arviz` and
:func:`to_inference_data` hand a trace and its sampler info to ArviZ.

These run once, after sampling, so they may sync with the host; they are not for use
inside a compiled step.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = [
    "rhat",
    "ess",
    "ess_bulk",
    "ess_tail",
    "mcse_mean",
    "mcse_sd",
    "acceptance_summary",
    "summary",
    "summary_table",
    "SummaryTable",
    "to_arviz",
    "to_inference_data",
    "ARVIZ_SAMPLE_STATS",
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


def _rows(trace: Tensor) -> Tensor:
    """``(draws, chains, *event) -> (D, chains, draws)`` in float64."""
    draws, chains = trace.shape[:2]
    return trace.reshape(draws, chains, -1).permute(2, 1, 0).to(_F64)


def _unrows(values: Tensor, trace: Tensor) -> Tensor:
    """``(D,) -> event`` in the trace's dtype."""
    return values.reshape(trace.shape[2:]).to(trace.dtype)


class _Local:
    """Where the chains of a diagnostic are: every reduction over chains goes through here.

    This one holds the chains of one process. ``fnebm.distributed`` subclasses it with the
    same methods reducing across the ranks of a process group, each rank holding a block of
    the chains, so the statistics below are written once for both. Rows are ``x: (D, C, N)``
    with ``C`` this process's chains (or ``2C`` split chains); per-chain statistics
    ``(D, C)``. Every method here is the plain one-process operation, so the numbers are
    those of a one-process implementation, bit for bit.
    """

    def count(self, x: Tensor) -> int:
        """The number of chains (rows along axis 1) of ``x`` in all: ``C``."""
        return x.shape[1]

    def chains(self, s: Tensor) -> Tensor:
        """Per-chain statistics ``(D, C)`` of all the chains, in chain order (split chains:
        every first half, then every last half)."""
        return s

    def chain_mean(self, t: Tensor) -> Tensor:
        """The mean of ``t: (D, C, ...)`` over all the chains (axis 1)."""
        return t.mean(1)

    def mean(self, x: Tensor) -> Tensor:
        """The mean of each row ``x: (D, C, N)`` over all chains and draws: ``(D,)``."""
        return x.flatten(1).mean(-1)

    def std(self, x: Tensor) -> Tensor:
        """The standard deviation (``ddof=1``) of each row over all chains and draws."""
        return x.flatten(1).std(-1, correction=1)

    def max(self, t: Tensor) -> Tensor:
        """The elementwise maximum of a per-process ``t`` over the processes."""
        return t

    def min(self, t: Tensor) -> Tensor:
        """The elementwise minimum of a per-process ``t`` over the processes."""
        return t

    def any(self, t: Tensor) -> Tensor:
        """The elementwise ``or`` of a per-process boolean ``t`` over the processes."""
        return t

    def values(self, x: Tensor) -> Tensor:
        """Every value of each row ``x: (D, C, N)``, in any order: ``(D, C * N)``."""
        return x.flatten(1)

    def ranks(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The average 1-based rank of each value of ``x: (D, C, N)`` among every value of
        its row, ties sharing the mean rank: ``(D, C * N)`` float64 (``x.flatten(1)``'s
        order); and the row's values sorted, ``(D, S)``."""
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
        return torch.empty_like(rank_sorted).scatter_(-1, order, rank_sorted), s

    def acceptance(self, info: Any, layout: str) -> dict[str, Any]:
        """:func:`acceptance_summary` of ``info`` (already checked for a swap: no warning)."""
        return _acceptance(info, layout, warn=False, stacklevel=3)


_LOCAL = _Local()


def _per_element(trace: Tensor, stat: Callable[..., Any], outputs: int | None = None,
                 ctx: _Local = _LOCAL) -> Any:
    """Apply ``stat(x, ctx): (D, C, N) -> (D,)`` to every event element of a validated
    ``(draws, chains, *event)`` trace, reshape back. With ``outputs=k``, ``stat`` returns a
    tuple of ``k`` such tensors (statistics that share work) and so does this. Every process
    of ``ctx`` cuts the same row blocks."""
    x = _rows(trace)
    if x.shape[0] == 0:  # empty event: nothing to compute (and FFT rejects empty input)
        empty = trace.new_empty(trace.shape[2:])
        return empty if outputs is None else tuple(empty.clone() for _ in range(outputs))
    # ArviZ returns NaN for a variable with any NaN draw (its `_not_valid` check).
    nan = ctx.any(x.isnan().flatten(1).any(-1))
    rows = max(1, _BLOCK_DRAWS // (ctx.count(x) * x.shape[2]))
    blocks = [stat(block, ctx) for block in x.split(rows)]
    if outputs is None:
        return _unrows(torch.where(nan, torch.nan, torch.cat(blocks)), trace)
    return tuple(_unrows(torch.where(nan, torch.nan, torch.cat([b[i] for b in blocks])), trace)
                 for i in range(outputs))


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


def _z_scale(x: Tensor, ctx: _Local = _LOCAL) -> tuple[Tensor, Tensor]:
    """Rank-normalise each row of ``x: (D, C, N)`` over all its chains and draws: average
    ranks for ties, Blom's offset ``(r - 3/8) / (S + 1/4)``, then the inverse normal CDF.
    Also returns the sorted rows ``(D, S)``, which callers reuse."""
    rank, s = ctx.ranks(x)
    c = 3 / 8
    z = torch.special.ndtri((rank - c) / (s.shape[-1] - 2 * c + 1))
    return z.reshape(x.shape), s


def _rhat_rows(x: Tensor, ctx: _Local = _LOCAL) -> Tensor:
    """Classic R̂ of ``x: (D, C, N)`` (ArviZ ``_rhat``)."""
    n = x.shape[-1]
    between = n * ctx.chains(x.mean(-1)).var(-1, correction=1)
    within = ctx.chains(x.var(-1, correction=1)).mean(-1)
    return torch.sqrt((between / within + n - 1) / n)


def _mean_autocov(x: Tensor, ctx: _Local = _LOCAL) -> Tensor:
    """Biased (divided by N) autocovariance at every lag of ``x: (D, C, N)``, averaged
    over chains: ``(D, N)``. By FFT; zero-padding to 2N makes the circular correlation
    the linear one, and averaging the power spectra first saves C - 1 inverse FFTs (and
    across processes, moves one spectrum per row instead of the chains)."""
    n = x.shape[-1]
    f = torch.fft.rfft(x - x.mean(-1, keepdim=True), n=2 * n)
    power = ctx.chain_mean(f.real.square() + f.imag.square())
    return torch.fft.irfft(power, n=2 * n)[..., :n] / n


def _geyer_ess(rho: Tensor, c: int, n: int) -> Tensor:
    """ESS of ``c`` chains of ``n`` draws from the autocorrelations ``rho: (D, N)`` (lag 0 pinned
    to 1), with Geyer's initial positive and initial monotone sequences as ArviZ's ``_ess``."""
    # Pair sums P_j = rho[2j] + rho[2j+1]; ArviZ's loop can reach j = jmax (t < N - 3).
    jmax = max(0, (n - 3) // 2)
    pairs = rho[:, 0 : 2 * jmax + 2 : 2] + rho[:, 1 : 2 * jmax + 2 : 2]  # (D, jmax + 1)
    pairs = torch.where(pairs.abs() <= _PAIR_TIE_TOL, 0.0, pairs)  # ties: see _PAIR_TIE_TOL
    # Loop iteration j runs while every earlier pair sum is > 0 (NaN stops it too).
    n_pos = (pairs[:, :jmax] > 0).to(torch.int64).cumprod(-1).sum(-1, keepdim=True)
    keep = torch.arange(jmax + 1, device=rho.device) < n_pos
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
    return out


def _ess_rows(x: Tensor, ctx: _Local = _LOCAL) -> Tensor:
    """ESS of ``x: (D, C, N)`` (ArviZ ``_ess``) with Geyer's initial positive and initial
    monotone sequences, vectorised: ArviZ's two while-loops become a count of leading
    positive pair sums and a ``cummin`` over them. Pair sums within ``_PAIR_TIE_TOL`` of
    0 count as 0, the exact-arithmetic branch."""
    n = x.shape[-1]
    c = ctx.count(x)
    flat = x.flatten(1)
    constant = (ctx.max(flat.amax(-1)) - ctx.min(flat.amin(-1))) < torch.finfo(_F64).resolution

    acov = _mean_autocov(x, ctx)
    mean_var = acov[:, 0] * n / (n - 1.0)
    var_plus = mean_var * (n - 1.0) / n
    if c > 1:
        var_plus = var_plus + ctx.chains(x.mean(-1)).var(-1, correction=1)
    rho = 1.0 - (mean_var[:, None] - acov) / var_plus[:, None]  # (D, N)
    rho = torch.cat([torch.ones_like(rho[:, :1]), rho[:, 1:]], dim=-1)  # ArviZ pins lag 0 to 1

    return torch.where(constant, float(c * n), _geyer_ess(rho, c, n))


def _folded_rhat(split: Tensor, z: Tensor, s: Tensor, ctx: _Local) -> Tensor:
    """Rank R̂ of split rows ``split`` from their rank-normalised ``z`` and sorted values
    ``s``: the larger of the bulk R̂ and the R̂ of the folded draws ``|x - median|``."""
    bulk = _rhat_rows(z, ctx)
    tail = _rhat_rows(_z_scale((split - _median(s)[:, None, None]).abs(), ctx)[0], ctx)
    return torch.where(tail > bulk, tail, bulk)  # Python max(bulk, tail): NaN bulk wins


def _rhat_rank_rows(x: Tensor, ctx: _Local = _LOCAL) -> Tensor:
    if ctx.count(x) < 2:  # ArviZ requires 2 chains before splitting
        return torch.full_like(x[:, 0, 0], torch.nan)
    split = _split_chains(x)
    return _folded_rhat(split, *_z_scale(split, ctx), ctx)


def _ess_bulk_rows(x: Tensor, ctx: _Local = _LOCAL) -> Tensor:
    return _ess_rows(_z_scale(_split_chains(x), ctx)[0], ctx)


def _ess_tail_rows(x: Tensor, ctx: _Local = _LOCAL, s: Tensor | None = None) -> Tensor:
    """``s``: the sorted values of every row of ``x``, when a caller has them."""
    if s is None:
        s = ctx.values(x).sort(dim=-1).values
    low, high = (
        _ess_rows(_split_chains((x <= _quantile(s, p)[:, None, None]).to(_F64)), ctx)
        for p in (0.05, 0.95)
    )
    return torch.where(high < low, high, low)  # Python min(low, high), as ArviZ


def _rank_rows(x: Tensor, ctx: _Local = _LOCAL) -> tuple[Tensor, Tensor, Tensor]:
    """``(rhat, ess_bulk, ess_tail)`` of ``x: (D, C, N)``, as the three functions above give
    them, with two sorts instead of four: the rank-normalised split chains serve R̂ and the
    bulk ESS, and with an even ``N`` their sorted values are the draws' (the split keeps every
    draw), which the tail ESS's quantiles need."""
    split = _split_chains(x)
    z, s = _z_scale(split, ctx)
    if ctx.count(x) < 2:  # ArviZ requires 2 chains before splitting
        rhat = torch.full_like(x[:, 0, 0], torch.nan)
    else:
        rhat = _folded_rhat(split, z, s, ctx)
    ess_tail = _ess_tail_rows(x, ctx, s if x.shape[-1] % 2 == 0 else None)
    return rhat, _ess_rows(z, ctx), ess_tail


# ----------------------------------------------------------------------------- layout
# fnebm's traces are (draws, chains, *event); ArviZ and BlackJAX users hold (chain, draw,
# *shape). Passing one for the other raises nothing and gives wrong numbers, so every public
# function takes ``layout`` and, left at its default, warns on a shape that looks swapped.

_LAYOUTS = ("draws_chains", "chains_draws")
_FORMS = {"draws_chains": "(draws, chains, *event)", "chains_draws": "(chains, draws, *event)"}
# A trace looks swapped when it has at most this many draws and at least _SWAP_RATIO times
# as many chains: (4, 1000) is ArviZ's 4 chains of 1000 draws. Split into halves of <= 8
# draws, such chains cannot estimate an autocorrelation, so as fnebm's layout it is an
# unlikely thing to diagnose, while 1-16 chains is what ArviZ and BlackJAX users run.
# Common fnebm shapes, (1000, 4) or (200, 1024), are far from it.
_SWAP_MAX_DRAWS = 16
_SWAP_RATIO = 4


def _check_layout(layout: Any) -> tuple[str, bool]:
    """``(layout, stated)``: ``None`` is fnebm's layout, not stated (so checked for a swap)."""
    if layout is None:
        return "draws_chains", False
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(
            "layout must be 'draws_chains' (fnebm's (draws, chains, *event), the default) or "
            f"'chains_draws' (ArviZ's and BlackJAX's (chain, draw, *shape)); got {layout!r}"
        )
    return layout, True


def _looks_swapped(draws: int, chains: int) -> bool:
    return draws <= _SWAP_MAX_DRAWS and chains >= _SWAP_RATIO * draws


def _swap_hint(what: str, shape: tuple[int, ...]) -> str:
    return (
        f"{what} of shape {shape} has {shape[0]} draws of {shape[1]} chains in fnebm's "
        f"(draws, chains, ...) layout; it looks like (chains, draws, ...), as ArviZ and "
        "BlackJAX lay it out. Pass layout='chains_draws' if it is, or layout='draws_chains' "
        "to say it is not"
    )


def _as_draws_chains(trace: Any, layout: Any) -> Tensor:
    """Validate ``trace`` in ``layout`` and return it as ``(draws, chains, *event)`` (a view).

    Public functions call this themselves, first, so that the swap warning's stack level 3
    points at their caller."""
    layout, stated = _check_layout(layout)
    form = _FORMS[layout]
    if not isinstance(trace, Tensor) or not trace.is_floating_point():
        got = trace.dtype if isinstance(trace, Tensor) else type(trace).__name__
        raise TypeError(f"trace must be a floating-point tensor of shape {form}; got {got}")
    if trace.ndim < 2:
        raise ValueError(
            f"trace must have shape {form} with at least 2 dims; got shape {tuple(trace.shape)}"
        )
    if layout == "chains_draws":
        trace = trace.transpose(0, 1)
    draws, chains = trace.shape[:2]
    swapped = not stated and _looks_swapped(draws, chains)
    if draws < 4:
        hint = f" ({_swap_hint('trace', tuple(trace.shape))})" if swapped else ""
        raise ValueError(f"trace must have shape {form} with draws >= 4; got {draws} draws{hint}")
    if chains < 1:
        raise ValueError(f"trace must have shape {form} with chains >= 1; got {chains} chains")
    if swapped:
        warnings.warn(_swap_hint("trace", tuple(trace.shape)), UserWarning, stacklevel=3)
    return trace


def _info_value(info: Any, name: str) -> Any:
    if isinstance(info, Mapping):
        return info.get(name)
    return getattr(info, name, None)


def _info_items(info: Any) -> list[tuple[str, Any]]:
    """The fields of a NamedTuple, a mapping or a dataclass, in order."""
    if isinstance(info, Mapping):
        return [(str(k), v) for k, v in info.items()]
    if hasattr(info, "_asdict"):
        return list(info._asdict().items())
    if dataclasses.is_dataclass(info) and not isinstance(info, type):
        return [(f.name, getattr(info, f.name)) for f in dataclasses.fields(info)]
    raise TypeError(
        "info must be a NamedTuple, a dataclass or a mapping of (draws, chains) tensors, "
        f"as a sampler's info; got {type(info).__name__}"
    )


# ----------------------------------------------------------------------------- public


def rhat(trace: Tensor, *, layout: str | None = None) -> Tensor:
    """Rank-normalised split-R̂ (ArviZ ``az.rhat(..., method="rank")``).

    Chains are split in half, the draws rank-normalised across all chains, and R̂ taken
    for both the bulk and the folded draws ``|x - median|``; the larger is returned.

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.
        layout: ``"draws_chains"`` (default, as ``sample_chain`` returns) or
            ``"chains_draws"`` for an ArviZ/BlackJAX ``(chains, draws, *event)`` array.
            Left at the default, a trace that looks swapped (at most 16 draws and at
            least 4 times as many chains) gets a ``UserWarning``; stating it silences that.

    Returns:
        ``event``-shaped tensor in ``trace.dtype``. NaN where the trace holds a NaN or
        is constant, and everywhere for a single chain (as ArviZ, which needs 2 chains).
    """
    return _per_element(_as_draws_chains(trace, layout), _rhat_rank_rows)


def ess_bulk(trace: Tensor, *, layout: str | None = None) -> Tensor:
    """Bulk effective sample size (ArviZ ``az.ess(..., method="bulk")``): split-ESS of the
    rank-normalised draws.

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.
        layout: ``"draws_chains"`` or ``"chains_draws"``, as in :func:`rhat`.

    Returns:
        ``event``-shaped tensor in ``trace.dtype``, in draws (not relative). NaN where the
        trace holds a NaN; ``chains * 2 * (draws // 2)`` where it is constant.
    """
    return _per_element(_as_draws_chains(trace, layout), _ess_bulk_rows)


def ess_tail(trace: Tensor, *, layout: str | None = None) -> Tensor:
    """Tail effective sample size (ArviZ ``az.ess(..., method="tail")``): the smaller
    split-ESS of the indicators ``x <= q05`` and ``x <= q95`` (type-7 quantiles over all
    chains and draws).

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.
        layout: ``"draws_chains"`` or ``"chains_draws"``, as in :func:`rhat`.

    Returns:
        ``event``-shaped tensor in ``trace.dtype``. NaN where the trace holds a NaN.
    """
    return _per_element(_as_draws_chains(trace, layout), _ess_tail_rows)


def _ess_mean_rows(x: Tensor, ctx: _Local = _LOCAL) -> Tensor:
    return _ess_rows(_split_chains(x), ctx)


def ess(trace: Tensor, *, layout: str | None = None) -> Tensor:
    """Classic split-ESS of the draws themselves (ArviZ ``az.ess(..., method="mean")``):
    the ESS that governs the Monte Carlo error of the mean. Not rank-normalised, so it
    assumes finite variance; prefer :func:`ess_bulk` for convergence checks.

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.
        layout: ``"draws_chains"`` or ``"chains_draws"``, as in :func:`rhat`.

    Returns:
        ``event``-shaped tensor in ``trace.dtype``. NaN where the trace holds a NaN.
    """
    return _per_element(_as_draws_chains(trace, layout), _ess_mean_rows)


def _mean_rows(x: Tensor, ctx: _Local = _LOCAL) -> Tensor:
    return ctx.mean(x)


def _std_rows(x: Tensor, ctx: _Local = _LOCAL) -> Tensor:
    return ctx.std(x)


def _mcse_mean_rows(x: Tensor, ctx: _Local = _LOCAL) -> Tensor:
    return ctx.std(x) / _ess_mean_rows(x, ctx).sqrt()


def _mcse_sd_rows(x: Tensor, ctx: _Local = _LOCAL) -> Tensor:
    """ArviZ ``_mcse_sd``: the delta method on the squared deviations from the mean."""
    dev2 = (x - ctx.mean(x)[:, None, None]).square()
    evar = ctx.mean(dev2)
    varvar = (ctx.mean(dev2.square()) - evar.square()) / _ess_mean_rows(dev2, ctx)
    return (varvar / evar / 4).sqrt()


def mcse_mean(trace: Tensor, *, layout: str | None = None) -> Tensor:
    """Monte Carlo standard error of the mean (ArviZ ``az.mcse(..., method="mean")``):
    ``std(draws, ddof=1) / sqrt(ess(trace))``.

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.
        layout: ``"draws_chains"`` or ``"chains_draws"``, as in :func:`rhat`.

    Returns:
        ``event``-shaped tensor in ``trace.dtype``, in the units of the trace.
    """
    return _per_element(_as_draws_chains(trace, layout), _mcse_mean_rows)


def mcse_sd(trace: Tensor, *, layout: str | None = None) -> Tensor:
    """Monte Carlo standard error of the standard deviation (ArviZ
    ``az.mcse(..., method="sd")``, the ``mcse_sd`` column of ``az.summary``): with
    ``d = (x - mean)**2``, ``sqrt(var(d) / ess(d) / mean(d) / 4)``, where ``var(d)`` and
    ``mean(d)`` divide by the number of draws.

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.
        layout: ``"draws_chains"`` or ``"chains_draws"``, as in :func:`rhat`.

    Returns:
        ``event``-shaped tensor in ``trace.dtype``, in the units of the trace. NaN where
        the trace holds a NaN or is constant.
    """
    return _per_element(_as_draws_chains(trace, layout), _mcse_sd_rows)


# Sampler info fields read by acceptance_summary: field -> the key its mean goes under.
_MEAN_FIELDS = {
    "tree_depth": "mean_tree_depth",
    "num_integration_steps": "mean_num_integration_steps",
}


def _acceptance(info: Any, layout: str, warn: bool, stacklevel: int) -> dict[str, Any]:
    form = "(draws, chains)" if layout == "draws_chains" else "(chains, draws)"
    warned = not warn

    def field(name: str) -> Tensor | None:
        nonlocal warned
        value = _info_value(info, name)
        if value is None:
            return None
        if not isinstance(value, Tensor) or value.ndim != 2:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"info.{name} must be a {form} tensor; got {shape}")
        if layout == "chains_draws":
            value = value.transpose(0, 1)
        elif not warned and _looks_swapped(*value.shape):
            warned = True
            warnings.warn(_swap_hint(f"info.{name}", tuple(value.shape)), UserWarning,
                          stacklevel=stacklevel + 1)
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
    for name, key in _MEAN_FIELDS.items():
        value = field(name)
        if value is not None:
            out[key] = value.to(_F64).mean()
    return out


def acceptance_summary(info: Any, *, layout: str | None = None) -> dict[str, Any]:
    """Acceptance, divergence and trajectory statistics from a sampler's per-step ``info``.

    Args:
        info: a NamedTuple, dataclass or mapping whose fields, where present, are
            ``(draws, chains)`` tensors: ``acceptance_rate`` (float in [0, 1]),
            ``is_accepted`` (bool), ``is_divergent`` (bool), ``tree_depth`` (NUTS, int),
            ``num_integration_steps`` (HMC/NUTS leapfrog steps, int). Missing fields
            (or ``None``) are skipped.
        layout: ``"draws_chains"`` (default) or ``"chains_draws"`` for ``(chains, draws)``
            fields; as in :func:`rhat`, the default warns on fields that look swapped.

    Returns:
        A dict with only the keys whose source field exists:
        ``mean_acceptance_rate`` (0-dim, dtype of ``acceptance_rate``),
        ``per_chain_acceptance_rate`` (``(chains,)``), ``accepted_fraction`` (0-dim
        float64), ``n_divergent`` (int), ``divergent_fraction`` (0-dim float64),
        ``mean_tree_depth`` and ``mean_num_integration_steps`` (0-dim float64).
    """
    layout, stated = _check_layout(layout)
    return _acceptance(info, layout, warn=not stated, stacklevel=3)


# Each public per-element statistic's rows function, for fnebm.distributed's.
_ROWS = {
    "rhat": _rhat_rank_rows,
    "ess_bulk": _ess_bulk_rows,
    "ess_tail": _ess_tail_rows,
    "ess": _ess_mean_rows,
    "mcse_mean": _mcse_mean_rows,
    "mcse_sd": _mcse_sd_rows,
}


def _stats(trace: Tensor, ctx: _Local = _LOCAL) -> dict[str, Tensor]:
    """Every per-element statistic of a validated ``(draws, chains, *event)`` trace."""
    return {
        "mean": _per_element(trace, _mean_rows, ctx=ctx),
        "std": _per_element(trace, _std_rows, ctx=ctx),
        "mcse_mean": _per_element(trace, _mcse_mean_rows, ctx=ctx),
        "mcse_sd": _per_element(trace, _mcse_sd_rows, ctx=ctx),
    } | dict(zip(("rhat", "ess_bulk", "ess_tail"), _per_element(trace, _rank_rows, 3, ctx)))


def summary(trace: Tensor, info: Any = None, *, layout: str | None = None) -> dict[str, Any]:
    """Posterior summary of a trace, ArviZ ``az.summary``'s diagnostic columns.

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.
        info: optional sampler info; its :func:`acceptance_summary` keys are merged in.
        layout: ``"draws_chains"`` or ``"chains_draws"``, for ``trace`` and ``info``
            alike, as in :func:`rhat`.

    Returns:
        dict with ``mean``, ``std`` (``ddof=1`` over draws and chains), ``mcse_mean``,
        ``mcse_sd``, ``rhat``, ``ess_bulk``, ``ess_tail`` -- each ``event``-shaped in
        ``trace.dtype`` -- plus the acceptance keys when ``info`` is given.
    """
    return _summary(_as_draws_chains(trace, layout), info, layout)


def _summary(trace: Tensor, info: Any, layout: Any, ctx: _Local = _LOCAL) -> dict[str, Any]:
    """:func:`summary` of a validated trace, the chains where ``ctx`` says."""
    out: dict[str, Any] = _stats(trace, ctx)
    if info is not None:  # the trace was checked for a swap; one warning is enough
        out.update(ctx.acceptance(info, _check_layout(layout)[0]))
    return out


# ------------------------------------------------------------------------- the table

_COLUMNS = ("mean", "sd", "mcse_mean", "mcse_sd", "ess_bulk", "ess_tail", "r_hat")
_KEYS = ("mean", "std", "mcse_mean", "mcse_sd", "ess_bulk", "ess_tail", "rhat")
# ArviZ's default rounding in az.summary: 3 decimals, ESS whole, R-hat 2 decimals.
_DECIMALS = (3, 3, 3, 3, 0, 0, 2)


def _label(var_name: str, index: tuple[int, ...]) -> str:
    """ArviZ's row label: ``x``, ``x[1]``, ``x[0, 2]``."""
    return var_name if not index else f"{var_name}[{', '.join(map(str, index))}]"


@dataclasses.dataclass(frozen=True)
class SummaryTable:
    """:func:`summary_table`'s result: ``print`` it for ArviZ's ``az.summary`` table.

    Attributes:
        names: row labels, one per event element (``x[0]``, ``x[1]``, ...).
        columns: ``mean, sd, mcse_mean, mcse_sd, ess_bulk, ess_tail, r_hat``.
        values: ``(len(names), len(columns))`` float64 CPU tensor, unrounded.
        sampler: :func:`acceptance_summary` of the ``info`` given, as Python numbers
            (``per_chain_acceptance_rate`` left out); empty without ``info``.
    """

    names: tuple[str, ...]
    columns: tuple[str, ...]
    values: Tensor
    sampler: dict[str, float | int]

    def __str__(self) -> str:
        cells = [
            [format(v, f".{d}f") for v, d in zip(row, _DECIMALS)] for row in self.values.tolist()
        ]
        name_w = max([0, *map(len, self.names)])
        widths = [max([len(c), *(len(r[j]) for r in cells)]) for j, c in enumerate(self.columns)]
        lines = [" " * name_w + "".join(f"  {c:>{w}}" for c, w in zip(self.columns, widths))]
        for name, row in zip(self.names, cells):
            lines.append(f"{name:<{name_w}}" + "".join(f"  {c:>{w}}" for c, w in zip(row, widths)))
        s = self.sampler
        if "n_divergent" in s:
            lines.append(f"divergences: {s['n_divergent']} ({100 * s['divergent_fraction']:.2f}%)")
        for key, label in (
            ("mean_acceptance_rate", "mean acceptance rate"),
            ("accepted_fraction", "accepted fraction"),
            ("mean_tree_depth", "mean tree depth"),
            ("mean_num_integration_steps", "mean integration steps"),
        ):
            if key in s:
                lines.append(f"{label}: {s[key]:.3f}")
        return "\n".join(lines)

    __repr__ = __str__

    def to_pandas(self) -> Any:
        """The unrounded table as a ``pandas.DataFrame`` (needs pandas), as ``az.summary``
        with ``round_to="none"`` returns it."""
        import pandas as pd

        return pd.DataFrame(self.values.numpy(), index=list(self.names), columns=list(self.columns))


def summary_table(
    trace: Tensor,
    info: Any = None,
    *,
    layout: str | None = None,
    var_name: str = "x",
    names: Sequence[str] | None = None,
) -> SummaryTable:
    """ArviZ's ``az.summary`` diagnostics as a printable table, one row per event element.

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.
        info: optional sampler info; divergences, acceptance, tree depth and integration
            steps (where its fields have them) are printed under the table.
        layout: ``"draws_chains"`` or ``"chains_draws"``, as in :func:`rhat`.
        var_name: the variable's name in the row labels, ArviZ style (``x[0]``, ``x[1, 2]``).
        names: one label per event element (row-major), replacing those labels.

    Returns:
        A :class:`SummaryTable`; ``print`` shows the columns ``mean, sd, mcse_mean,
        mcse_sd, ess_bulk, ess_tail, r_hat`` rounded as ``az.summary`` rounds them.
    """
    return _summary_table(_as_draws_chains(trace, layout), info, layout, var_name, names)


def _summary_table(trace: Tensor, info: Any, layout: Any, var_name: Any, names: Any,
                   ctx: _Local = _LOCAL) -> SummaryTable:
    """:func:`summary_table` of a validated trace, the chains where ``ctx`` says."""
    if not isinstance(var_name, str) or not var_name:
        raise TypeError(f"var_name must be a non-empty str; got {var_name!r}")
    event = tuple(trace.shape[2:])
    size = math.prod(event)
    if names is None:
        labels = tuple(_label(var_name, tuple(i)) for i in itertools.product(*map(range, event)))
    else:
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError("names must be a sequence of str, one per event element")
        labels = tuple(names)
        if len(labels) != size:
            raise ValueError(
                f"names must have one label per event element ({size} for event shape "
                f"{event}); got {len(labels)}"
            )
    stats = _stats(trace, ctx)
    values = torch.stack([stats[k].reshape(-1).to("cpu", _F64) for k in _KEYS], dim=-1)
    sampler: dict[str, float | int] = {}
    if info is not None:
        acc = ctx.acceptance(info, _check_layout(layout)[0])
        acc.pop("per_chain_acceptance_rate", None)
        sampler = {k: v if isinstance(v, int) else float(v) for k, v in acc.items()}
    return SummaryTable(labels, _COLUMNS, values, sampler)


# ------------------------------------------------------------------------------ ArviZ

# fnebm info field -> ArviZ sample_stats name (PyMC's and ArviZ's conventions); other
# fields keep their names.
ARVIZ_SAMPLE_STATS = {
    "is_divergent": "diverging",
    "acceptance_rate": "acceptance_rate",
    "tree_depth": "tree_depth",
    "num_integration_steps": "n_steps",
    "energy": "energy",
    "energy_error": "energy_error",
}


def _numpy(x: Tensor) -> Any:
    x = x.detach()
    if x.dtype in (torch.bfloat16,) or (x.is_floating_point() and x.dtype.itemsize == 1):
        x = x.float()  # numpy has no bfloat16 or float8
    return x.cpu().numpy()


def _arviz_dict(trace: Tensor, info: Any, layout: str, var_name: Any) -> dict[str, dict[str, Any]]:
    """``trace`` already ``(draws, chains, *event)``; ``info`` in ``layout``."""
    if not isinstance(var_name, str) or not var_name:
        raise TypeError(f"var_name must be a non-empty str; got {var_name!r}")
    draws, chains = trace.shape[:2]
    out: dict[str, dict[str, Any]] = {"posterior": {var_name: _numpy(trace.transpose(0, 1))}}
    if info is None:
        return out
    lead = (draws, chains) if layout == "draws_chains" else (chains, draws)
    form = "(draws, chains, ...)" if layout == "draws_chains" else "(chains, draws, ...)"
    stats: dict[str, Any] = {}
    for name, value in _info_items(info):
        if not isinstance(value, Tensor):  # nested states, None: not per-draw statistics
            continue
        if tuple(value.shape[:2]) != lead:
            raise ValueError(
                f"info.{name} must be a {form} tensor matching the trace's {lead}; "
                f"got shape {tuple(value.shape)}"
            )
        if layout == "draws_chains":
            value = value.transpose(0, 1)
        stats[ARVIZ_SAMPLE_STATS.get(name, name)] = _numpy(value)
    if stats:
        out["sample_stats"] = stats
    return out


def to_arviz(
    trace: Tensor, info: Any = None, *, layout: str | None = None, var_name: str = "x"
) -> dict[str, dict[str, Any]]:
    """The trace (and info) as ArviZ's groups, ``{group: {variable: array}}``; ArviZ not needed.

    ``az.from_dict(**to_arviz(trace, info))`` is the ``InferenceData`` in ArviZ 0.x,
    ``az.from_dict(to_arviz(trace, info))`` in ArviZ 1.x (:func:`to_inference_data` does
    whichever the installed ArviZ takes).

    Args:
        trace: ``(draws, chains, *event)`` floating tensor, ``draws >= 4``.
        info: optional sampler info (NamedTuple, dataclass or mapping); each tensor field,
            shaped ``(draws, chains, ...)`` like the trace, goes to ``sample_stats``
            under ArviZ's name (:data:`ARVIZ_SAMPLE_STATS`: ``is_divergent`` ->
            ``diverging``, ``num_integration_steps`` -> ``n_steps``, ...; others keep
            theirs). Fields that are not tensors are left out.
        layout: ``"draws_chains"`` or ``"chains_draws"``, for ``trace`` and ``info``
            alike, as in :func:`rhat`.
        var_name: the posterior variable's name.

    Returns:
        ``{"posterior": {var_name: array}, "sample_stats": {...}}`` of NumPy arrays on
        the CPU shaped ``(chain, draw, ...)``, as ArviZ expects; ``sample_stats`` only when
        ``info`` has tensor fields.
    """
    trace = _as_draws_chains(trace, layout)
    return _arviz_dict(trace, info, _check_layout(layout)[0], var_name)


def to_inference_data(
    trace: Tensor, info: Any = None, *, layout: str | None = None, var_name: str = "x"
) -> Any:
    """:func:`to_arviz` handed to ``arviz.from_dict`` (needs ``pip install arviz``): an
    ``InferenceData`` (ArviZ 0.x; a ``DataTree`` in ArviZ 1.x).

    The layout is known here, so ArviZ's own "more chains than draws" warning (which a
    run of many short chains triggers) is silenced.
    """
    trace = _as_draws_chains(trace, layout)
    groups = _arviz_dict(trace, info, _check_layout(layout)[0], var_name)
    try:
        import arviz as az
    except ImportError as e:
        raise ImportError(
            "to_inference_data needs ArviZ (pip install arviz); to_arviz gives the same "
            "data as a dict without it"
        ) from e
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="More chains", category=UserWarning)
        if int(str(az.__version__).split(".")[0]) >= 1:  # 1.x: from_dict({group: {...}})
            return az.from_dict(groups)
        return az.from_dict(**groups)
