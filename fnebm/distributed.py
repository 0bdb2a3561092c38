"""Chains across processes on ``torch.distributed``; every helper is the identity in one process.

**Key layout.** ``n_chains`` global chains are cut into contiguous blocks, one per rank, of
sizes that differ by at most one (the first ``n_chains % world_size`` ranks hold one more, as
``torch.tensor_split``): rank ``r`` runs chains ``chain_slice(n_chains)``, with the keys
``split(key, n_chains)[chain_slice(n_chains)]``. Chain ``c`` therefore has the same key and
the same start on any number of ranks, and the union of every rank's draws is the
single-process run, bit for bit. Contiguous rather than strided (``r::w``) because then
the chains of rank 0, then rank 1, ... *are* the global chains in order: gathering a trace
is a concatenation, a global start ``x0`` is sliced with a plain ``x0[chain_slice(n)]``,
and the per-chain statistics the diagnostics combine line up with the single-process order.

**Sampling needs no communication.** Chains are independent, so each rank calls
:func:`fnebm.sample_chain` on its own chains; no collective runs inside the compiled chain.
Collectives run only after sampling, in :func:`gather_chains` and the diagnostics below.

**Diagnostics across ranks** (:func:`rhat`, :func:`ess_bulk`, :func:`ess_tail`, :func:`ess`,
:func:`mcse_mean`, :func:`mcse_sd`, :func:`summary`, :func:`summary_table`,
:func:`acceptance_summary`) take each rank's local trace ``(draws, local_chains, *event)``
and return, on every rank, the numbers :mod:`fnebm.diagnostics` gives for the whole trace
(equal to float rounding, ~1e-15 relative). What moves between ranks:

* per-chain statistics (all-gathered): each (split) chain's mean and variance, ``(event,
  chains)`` numbers — for R̂'s between/within variances and ESS's variance of chain means;
* sums (all-reduced): the power spectra of the chains summed over chains (one chain's length
  per event element) — the chain-averaged autocovariance ESS needs — plus totals, minima,
  maxima and NaN flags;
* for the **rank-normalised** statistics only (``rhat``, ``ess_bulk``, ``ess_tail`` and the
  summary): the draws' *values*, one block of event elements (about 2**20 draws) at a time,
  so that each rank can rank its own draws among all of them and read the global median and
  quantiles. That is exact; it is also as much data as the trace (twice for R̂: the draws
  and the folded draws). The gathered blocks are dropped after use: the trace itself stays
  rank-local unless you call :func:`gather_chains`. ``mean``, ``std``, ``ess``,
  ``mcse_mean`` and ``mcse_sd`` need no draws from other ranks.

Every rank of the group must call a diagnostic together (they are collectives), with traces
of the same number of draws and event shape. Without a process group (or with one process)
each function is the one in :mod:`fnebm.diagnostics`, so one script runs under ``python``
and under ``torchrun --nproc-per-node 2``.

**Training across ranks** (data parallelism). The unit of randomness is the *example*: the
global batch of ``n`` examples at training step ``t`` takes the keys ``split(fold_in(key, t),
n)``, and rank ``r`` holds the examples ``chain_slice(n)`` of the batch with their keys
(:func:`step_keys`) and their persistent chains (one chain per example). :func:`per_example`
evaluates a loss with one key per example (each example a batch of one, ``vmap``-ed), so the
noise an example gets depends on its global index only, never on the number of ranks: two
ranks draw exactly what one process draws for the combined batch. The gradients are then
averaged across ranks, weighted by each rank's number of examples (:func:`all_reduce_mean`,
for ``torch.func.grad`` over a parameter pytree), or by ``DistributedDataParallel`` /
``fully_shard`` for an ``nn.Module`` (docs/distributed.md). :func:`save_checkpoint` writes the
replicated state once (rank 0) and each rank's chains; :func:`load_checkpoint` reads them back
on the same number of ranks, or re-shards the chains onto another.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import uuid
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fnebm import _checks
from fnebm import diagnostics as fd
from fnebm import losses as fl
from fnebm import random as fr

__all__ = [
    "is_distributed",
    "rank",
    "world_size",
    "chain_counts",
    "chain_slice",
    "local_keys",
    "shard",
    "gather_chains",
    "rhat",
    "ess",
    "ess_bulk",
    "ess_tail",
    "mcse_mean",
    "mcse_sd",
    "acceptance_summary",
    "summary",
    "summary_table",
    "step_keys",
    "per_example",
    "per_example_pcd_init",
    "all_reduce_mean",
    "save_checkpoint",
    "load_checkpoint",
]

_F64 = torch.float64


def _dist():
    import torch.distributed as dist

    return dist


def is_distributed(group: Any = None) -> bool:
    """Whether a process group of more than one process is initialised (else every helper
    here is the identity)."""
    dist = _dist()
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    dist = _dist()
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def world_size(group: Any = None) -> int:
    """The number of processes in ``group`` (1 without a process group)."""
    dist = _dist()
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


# ------------------------------------------------------------------------ chain layout


def chain_counts(n_chains: int, world_size_: int | None = None, *, group: Any = None) -> list[int]:
    """How many of ``n_chains`` chains each rank holds: ``n // w`` each, one more for the
    first ``n % w`` ranks (``torch.tensor_split``'s sizes)."""
    n = _checks.check_int("n_chains", n_chains, 1)
    w = world_size(group) if world_size_ is None else _checks.check_int("world_size", world_size_, 1)
    if n < w:
        raise ValueError(
            f"n_chains must be at least the number of processes ({w}) so that every rank runs a chain, got {n}"
        )
    return [n // w + (r < n % w) for r in range(w)]


def chain_slice(n_chains: int, *, rank_: int | None = None, world_size_: int | None = None, group: Any = None) -> slice:
    """The contiguous block of global chains this rank runs: ``slice(start, stop)``.

    ``slice(0, n_chains)`` without a process group. ``rank_``/``world_size_`` override the
    group's (to plan a layout without one).
    """
    w = world_size(group) if world_size_ is None else _checks.check_int("world_size", world_size_, 1)
    r = rank(group) if rank_ is None else _checks.check_int("rank", rank_, 0)
    if r >= w:
        raise ValueError(f"rank must be < world_size ({w}), got {r}")
    counts = chain_counts(n_chains, w)
    start = sum(counts[:r])
    return slice(start, start + counts[r])


def local_keys(key: Tensor, n_chains: int | None = None, *, group: Any = None) -> Tensor:
    """This rank's per-chain keys ``(local_chains, 2)``: ``split(key, n_chains)[chain_slice(n_chains)]``
    for one key ``(2,)``, or the rank's rows of per-chain keys ``(n_chains, 2)``.

    Pass them to :func:`fnebm.sample_chain` with this rank's start (:func:`shard`): the run
    is then the single-process run's chains ``chain_slice(n_chains)``, bit for bit.
    """
    fr.check_key(key)
    if key.ndim == 1:
        if n_chains is None:
            raise TypeError("local_keys needs n_chains (the global number of chains) with one key (2,)")
        n = _checks.check_int("n_chains", n_chains, 1)
        return fr.split(key, n)[chain_slice(n, group=group)]
    if key.ndim != 2:
        raise ValueError(f"key must be one key (2,) or per-chain keys (n_chains, 2), got shape {tuple(key.shape)}")
    if n_chains is not None and n_chains != key.shape[0]:
        raise ValueError(f"key holds {key.shape[0]} per-chain keys but n_chains={n_chains}")
    return key[chain_slice(key.shape[0], group=group)]


def shard(tree: Any, *, group: Any = None) -> Any:
    """This rank's chains of a global per-chain pytree (a start ``x0: (n_chains, ...)``, a
    sampler state, per-chain step sizes): every leaf sliced along axis 0 by :func:`chain_slice`.

    The leaves must share their leading (chain) size. A start drawn from per-chain keys needs
    no global tensor at all: ``fr.normal(local_keys(k, n), (dim,))`` is this rank's rows of
    ``fr.normal(fr.split(k, n), (dim,))``.
    """
    leaves, spec = pytree.tree_flatten(tree)
    if not leaves or not all(isinstance(x, Tensor) and x.ndim >= 1 for x in leaves):
        raise TypeError("shard needs a tensor or a pytree of tensors with a leading chain axis")
    sizes = {x.shape[0] for x in leaves}
    if len(sizes) != 1:
        raise ValueError(f"every leaf must lead with the same number of chains, got leading sizes {sorted(sizes)}")
    sl = chain_slice(sizes.pop(), group=group)
    return pytree.tree_unflatten([x[sl] for x in leaves], spec)


# ------------------------------------------------------------------------ collectives


def _all_reduce(t: Tensor, op: str, group: Any) -> Tensor:
    dist = _dist()
    t = t.clone()
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dist.all_reduce(t, op=ops[op], group=group)
    return t


def _sizes(n: int, device: torch.device, group: Any) -> list[int]:
    dist = _dist()
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(x) for x in out]


def _gather_cat(t: Tensor, dim: int, sizes: Sequence[int], group: Any) -> Tensor:
    """All ranks' ``t`` concatenated along ``dim`` in rank order; ``sizes[r]`` is rank r's
    length along ``dim`` (padded to the largest for the collective, then trimmed)."""
    dist = _dist()
    t = t.movedim(dim, 0)
    top = max(sizes)
    if top == 0 or math.prod(t.shape[1:]) == 0:  # nothing to move: gloo aborts on empty tensors
        return t.new_empty((sum(sizes), *t.shape[1:])).movedim(0, dim)
    if t.shape[0] < top:
        t = torch.cat([t, t.new_zeros((top - t.shape[0], *t.shape[1:]))])
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in sizes]
    dist.all_gather(out, t, group=group)
    return torch.cat([o[:n] for o, n in zip(out, sizes)]).movedim(0, dim)


def gather_chains(tree: Any, dim: int = 1, *, group: Any = None) -> Any:
    """Every rank's chains of ``tree`` concatenated along the chain axis ``dim``, on every rank.

    ``dim=1`` for a trace or info ``(draws, chains, ...)`` (the default), ``dim=0`` for a
    sampler state or keys. Ranks may hold different numbers of chains. This moves the whole
    trace to every rank: the diagnostics here do not need it. The identity without a process
    group.
    """
    if not is_distributed(group):
        return tree
    leaves, spec = pytree.tree_flatten(tree)
    if not all(isinstance(x, Tensor) and x.ndim > dim for x in leaves):
        raise TypeError(f"gather_chains needs a pytree of tensors with a chain axis at dim {dim}")
    out = []
    for x in leaves:
        sizes = _sizes(x.shape[dim], x.device, group)
        out.append(_gather_cat(x, dim, sizes, group))
    return pytree.tree_unflatten(out, spec)


# ------------------------------------------------------------------------ diagnostics


class _Ctx:
    """The group and every rank's number of chains, for one diagnostic call."""

    def __init__(self, trace: Tensor, group: Any):
        dist = _dist()
        self.group = group
        draws, chains = trace.shape[:2]
        mine = torch.tensor([draws, chains, *trace.shape[2:]], dtype=torch.int64, device=trace.device)
        dims = _sizes(mine.numel(), trace.device, group)
        if len(set(dims)) != 1:
            raise ValueError("every rank's trace must have the same number of event dimensions")
        shapes = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shapes, mine, group=group)
        shapes = [tuple(int(v) for v in s) for s in shapes]
        if len({(s[0], *s[2:]) for s in shapes}) != 1:
            raise ValueError(
                "every rank's trace must have the same number of draws and event shape, got "
                + ", ".join(f"rank {r}: {s[0]} draws, event {s[2:]}" for r, s in enumerate(shapes))
            )
        self.rank = dist.get_rank(group)
        self.chains = [s[1] for s in shapes]  # per rank, in rank order = global chain order
        self.total = sum(self.chains)

    def sum(self, t: Tensor) -> Tensor:
        return _all_reduce(t, "sum", self.group)

    def max(self, t: Tensor) -> Tensor:
        return _all_reduce(t, "max", self.group)

    def min(self, t: Tensor) -> Tensor:
        return _all_reduce(t, "min", self.group)

    def chain_stat(self, s: Tensor, split: bool) -> Tensor:
        """Per-chain statistics ``(D, local)`` of every rank -> ``(D, global)`` in the
        single-process order (split chains: all first halves, then all last halves)."""
        if not split:
            return _gather_cat(s, 1, self.chains, self.group)
        d, m = s.shape
        g = _gather_cat(s.reshape(d, 2, m // 2), 2, self.chains, self.group)
        return g.reshape(d, -1)

    def values(self, x: Tensor) -> Tensor:
        """All ranks' values of each row ``x: (D, k * C_local, n)`` (``k`` 1, or 2 for split
        chains) -> ``(D, k * C_global * n)``, flattened (its callers sort it)."""
        per_chain = x.shape[1] // self.chains[self.rank] * x.shape[2]
        return _gather_cat(x.flatten(1), 1, [c * per_chain for c in self.chains], self.group)


def _per_element(trace: Tensor, stat: Callable[[Tensor, _Ctx], Tensor], ctx: _Ctx) -> Tensor:
    """:func:`fnebm.diagnostics._per_element` across ranks: the same row blocks on every rank."""
    x = fd._rows(trace)
    if x.shape[0] == 0:
        return trace.new_empty(trace.shape[2:])
    nan = ctx.max(x.isnan().flatten(1).any(-1).to(torch.int64)) > 0
    rows = max(1, fd._BLOCK_DRAWS // (ctx.total * x.shape[2]))
    out = torch.cat([stat(block, ctx) for block in x.split(rows)])
    return fd._unrows(torch.where(nan, torch.nan, out), trace)


def _z_scale(x: Tensor, ctx: _Ctx) -> tuple[Tensor, Tensor]:
    """Global rank-normalisation of the local rows ``x: (D, C, N)``; also every rank's values
    sorted ``(D, S)``. A draw's average rank among ties is ``(#less + #less-or-equal + 1) / 2``,
    the single-process ``(lo + hi + 2) / 2``: the same float, so the same z."""
    s = ctx.values(x).sort(dim=-1).values.contiguous()
    flat = x.flatten(1).contiguous()
    lo = torch.searchsorted(s, flat, side="left")
    hi = torch.searchsorted(s, flat, side="right")
    rank_ = (lo + hi + 1).to(_F64) / 2
    c = 3 / 8
    z = torch.special.ndtri((rank_ - c) / (s.shape[-1] - 2 * c + 1))
    return z.reshape(x.shape), s


def _rhat_rows(x: Tensor, ctx: _Ctx) -> Tensor:
    """Classic R̂ of split local rows ``x: (D, 2C, N)``."""
    n = x.shape[-1]
    means = ctx.chain_stat(x.mean(-1), split=True)
    variances = ctx.chain_stat(x.var(-1, correction=1), split=True)
    between = n * means.var(-1, correction=1)
    within = variances.mean(-1)
    return torch.sqrt((between / within + n - 1) / n)


def _ess_rows(x: Tensor, ctx: _Ctx) -> Tensor:
    """:func:`fnebm.diagnostics._ess_rows` of split local rows ``x: (D, 2C, N)``: the
    chain-averaged autocovariance from all-reduced power spectra, the variance of the
    gathered chain means; Geyer's sequences as there."""
    n = x.shape[-1]
    c = 2 * ctx.total
    flat = x.flatten(1)
    constant = (ctx.max(flat.amax(-1)) - ctx.min(flat.amin(-1))) < torch.finfo(_F64).resolution

    f = torch.fft.rfft(x - x.mean(-1, keepdim=True), n=2 * n)
    power = ctx.sum((f.real.square() + f.imag.square()).sum(1)) / c
    acov = torch.fft.irfft(power, n=2 * n)[..., :n] / n
    mean_var = acov[:, 0] * n / (n - 1.0)
    var_plus = mean_var * (n - 1.0) / n
    if c > 1:
        var_plus = var_plus + ctx.chain_stat(x.mean(-1), split=True).var(-1, correction=1)
    rho = 1.0 - (mean_var[:, None] - acov) / var_plus[:, None]
    rho = torch.cat([torch.ones_like(rho[:, :1]), rho[:, 1:]], dim=-1)

    return torch.where(constant, float(c * n), fd._geyer_ess(rho, c, n))


def _rhat_rank_rows(x: Tensor, ctx: _Ctx) -> Tensor:
    if ctx.total < 2:
        return torch.full_like(x[:, 0, 0], torch.nan)
    split = fd._split_chains(x)
    z, s = _z_scale(split, ctx)
    bulk = _rhat_rows(z, ctx)
    tail = _rhat_rows(_z_scale((split - fd._median(s)[:, None, None]).abs(), ctx)[0], ctx)
    return torch.where(tail > bulk, tail, bulk)


def _ess_bulk_rows(x: Tensor, ctx: _Ctx) -> Tensor:
    return _ess_rows(_z_scale(fd._split_chains(x), ctx)[0], ctx)


def _ess_tail_rows(x: Tensor, ctx: _Ctx) -> Tensor:
    s = ctx.values(x).sort(dim=-1).values
    low, high = (
        _ess_rows(fd._split_chains((x <= fd._quantile(s, p)[:, None, None]).to(_F64)), ctx)
        for p in (0.05, 0.95)
    )
    return torch.where(high < low, high, low)


def _ess_mean_rows(x: Tensor, ctx: _Ctx) -> Tensor:
    return _ess_rows(fd._split_chains(x), ctx)


def _mean_rows(x: Tensor, ctx: _Ctx) -> Tensor:
    return ctx.sum(x.flatten(1).sum(-1)) / (ctx.total * x.shape[-1])


def _std_rows(x: Tensor, ctx: _Ctx) -> Tensor:
    dev = x - _mean_rows(x, ctx)[:, None, None]
    return (ctx.sum(dev.square().flatten(1).sum(-1)) / (ctx.total * x.shape[-1] - 1)).sqrt()


def _mcse_mean_rows(x: Tensor, ctx: _Ctx) -> Tensor:
    return _std_rows(x, ctx) / _ess_mean_rows(x, ctx).sqrt()


def _mcse_sd_rows(x: Tensor, ctx: _Ctx) -> Tensor:
    dev2 = (x - _mean_rows(x, ctx)[:, None, None]).square()
    evar = _mean_rows(dev2, ctx)
    varvar = (_mean_rows(dev2.square(), ctx) - evar.square()) / _ess_mean_rows(dev2, ctx)
    return (varvar / evar / 4).sqrt()


def _public(name: str, rows: Callable[[Tensor, _Ctx], Tensor]) -> Callable[..., Tensor]:
    single = getattr(fd, name)

    def fn(trace: Tensor, *, layout: str | None = None, group: Any = None) -> Tensor:
        if not is_distributed(group):
            return single(trace, layout=layout)
        trace = fd._as_draws_chains(trace, layout)
        return _per_element(trace, rows, _Ctx(trace, group))

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (
        f"Across ranks, :func:`fnebm.diagnostics.{name}` of the trace all ranks hold together.\n\n"
        "``trace``: this rank's ``(draws, local_chains, *event)`` (every rank the same draws and\n"
        "event shape); ``layout`` as there; ``group``: the process group (default: the world).\n"
        "Every rank of the group must call it; each gets the same result. Without a process\n"
        f"group it is :func:`fnebm.diagnostics.{name}`."
    )
    return fn


rhat = _public("rhat", _rhat_rank_rows)
ess_bulk = _public("ess_bulk", _ess_bulk_rows)
ess_tail = _public("ess_tail", _ess_tail_rows)
ess = _public("ess", _ess_mean_rows)
mcse_mean = _public("mcse_mean", _mcse_mean_rows)
mcse_sd = _public("mcse_sd", _mcse_sd_rows)


def _stats(trace: Tensor, ctx: _Ctx) -> dict[str, Tensor]:
    return {
        "mean": _per_element(trace, _mean_rows, ctx),
        "std": _per_element(trace, _std_rows, ctx),
        "mcse_mean": _per_element(trace, _mcse_mean_rows, ctx),
        "mcse_sd": _per_element(trace, _mcse_sd_rows, ctx),
        "rhat": _per_element(trace, _rhat_rank_rows, ctx),
        "ess_bulk": _per_element(trace, _ess_bulk_rows, ctx),
        "ess_tail": _per_element(trace, _ess_tail_rows, ctx),
    }


_MEANS = ("mean_acceptance_rate", "accepted_fraction", "divergent_fraction", "mean_tree_depth",
          "mean_num_integration_steps")


def _acceptance(info: Any, layout: str, warn: bool, group: Any) -> dict[str, Any]:
    local = fd._acceptance(info, layout, warn=warn, stacklevel=4)
    present = [v for _, v in fd._info_items(info) if isinstance(v, Tensor) and v.ndim == 2]
    if not present:
        return local
    lead = present[0].shape if layout == "draws_chains" else present[0].shape[::-1]
    device = present[0].device
    n_local = lead[0] * lead[1]
    n_total = _all_reduce(torch.tensor(float(n_local), dtype=_F64, device=device), "sum", group)
    out: dict[str, Any] = {}
    for k, v in local.items():
        if k in _MEANS:
            out[k] = (_all_reduce(v.to(_F64) * n_local, "sum", group) / n_total).to(v.dtype)
        elif k == "n_divergent":
            out[k] = int(_all_reduce(torch.tensor(v, dtype=torch.int64, device=device), "sum", group))
        elif k == "per_chain_acceptance_rate":
            out[k] = _gather_cat(v, 0, _sizes(v.shape[0], v.device, group), group)
    return out


def acceptance_summary(info: Any, *, layout: str | None = None, group: Any = None) -> dict[str, Any]:
    """Across ranks, :func:`fnebm.diagnostics.acceptance_summary` of every rank's ``info``
    (``(draws, local_chains)`` fields): means and counts all-reduced, the per-chain rates
    gathered in global chain order. Every rank must hold the same fields."""
    if not is_distributed(group):
        return fd.acceptance_summary(info, layout=layout)
    lay, stated = fd._check_layout(layout)
    return _acceptance(info, lay, not stated, group)


def summary(trace: Tensor, info: Any = None, *, layout: str | None = None, group: Any = None) -> dict[str, Any]:
    """Across ranks, :func:`fnebm.diagnostics.summary` of the trace (and info) that all ranks
    hold together; every rank gets the same dict. Without a process group it is
    :func:`fnebm.diagnostics.summary`."""
    if not is_distributed(group):
        return fd.summary(trace, info, layout=layout)
    trace = fd._as_draws_chains(trace, layout)
    out: dict[str, Any] = _stats(trace, _Ctx(trace, group))
    if info is not None:
        out.update(_acceptance(info, fd._check_layout(layout)[0], False, group))
    return out


def summary_table(
    trace: Tensor,
    info: Any = None,
    *,
    layout: str | None = None,
    var_name: str = "x",
    names: Sequence[str] | None = None,
    group: Any = None,
) -> fd.SummaryTable:
    """Across ranks, :func:`fnebm.diagnostics.summary_table`: every rank gets the same table
    (print it on rank 0). Without a process group it is :func:`fnebm.diagnostics.summary_table`."""
    if not is_distributed(group):
        return fd.summary_table(trace, info, layout=layout, var_name=var_name, names=names)
    trace = fd._as_draws_chains(trace, layout)
    if not isinstance(var_name, str) or not var_name:
        raise TypeError(f"var_name must be a non-empty str; got {var_name!r}")
    event = tuple(trace.shape[2:])
    if names is None:
        labels = tuple(fd._label(var_name, tuple(i)) for i in itertools.product(*map(range, event)))
    else:
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError("names must be a sequence of str, one per event element")
        labels = tuple(names)
        if len(labels) != math.prod(event):
            raise ValueError(f"names must have one label per event element ({math.prod(event)}); got {len(labels)}")
    stats = _stats(trace, _Ctx(trace, group))
    values = torch.stack([stats[k].reshape(-1).to("cpu", _F64) for k in fd._KEYS], dim=-1)
    sampler: dict[str, float | int] = {}
    if info is not None:
        acc = _acceptance(info, fd._check_layout(layout)[0], False, group)
        acc.pop("per_chain_acceptance_rate", None)
        sampler = {k: v if isinstance(v, int) else float(v) for k, v in acc.items()}
    return fd.SummaryTable(labels, fd._COLUMNS, values, sampler)


# ------------------------------------------------------------------------ training


def step_keys(key: Tensor, step: int | Tensor, n_examples: int, *, group: Any = None) -> Tensor:
    """This rank's per-example keys for training step ``step``: ``(local_examples, 2)``.

    ``local_keys(fold_in(key, step), n_examples)``: example ``i`` of the global batch of
    ``n_examples`` takes ``split(fold_in(key, step), n_examples)[i]``, and this rank holds the
    examples ``chain_slice(n_examples)``. The rank is not folded in: an example's key depends on
    its global index and the step only, so the sharded run draws what one process draws for the
    combined batch. ``step``: an int or an integer tensor (a 0-dim step counter).
    """
    fr.check_key(key)
    if key.shape != (2,):
        raise ValueError(f"key must be one key of shape (2,), got shape {tuple(key.shape)}")
    return local_keys(fr.fold_in(key, step), n_examples, group=group)


def _one_example(loss: Callable, energy: Any, x: Tensor, key: Tensor, *state: Any) -> tuple[Tensor, Any]:
    return loss(energy, x[None], key, *state)


def per_example(loss: Callable[..., tuple[Tensor, Any]]) -> Callable[..., tuple[Tensor, Any]]:
    """A loss with one key per example: ``f(energy, batch, keys, *state) -> (loss, aux)``.

    ``loss`` is an :mod:`fnebm.losses` loss ``loss(energy, batch, key, *state) -> (value, aux)``
    with its options bound (``functools.partial(losses.persistent_contrastive_divergence,
    n_steps=5)``). In ``f``, example ``i`` is ``loss(energy, batch[i:i+1], keys[i], *state_i)``,
    a batch of one with its own key and its own rows ``state_i`` of each state leaf (for
    persistent CD, its own chain: :func:`per_example_pcd_init`), all ``vmap``-ed over the
    examples in one call. ``f`` returns the mean of the examples' values and their ``aux``
    stacked (leaves ``(n, ...)``: each example's ``aux`` for a batch of one, so ``aux.state``
    is the next call's state).

    ``batch: (n, *event)``, ``keys: (n, 2)`` (:func:`step_keys`), each state leaf ``(n, ...)``.
    The losses are means over examples, so the mean of ``n`` batches of one is the loss of the
    batch (CD's negatives: one chain per example, so CD's ``init`` is ``"data"`` or ``"noise"``,
    not a tensor of starts). Used on every rank and in one process alike:
    it communicates nothing. Under ``torch.compile`` the sampler loop must unroll (the losses'
    default ``unroll=None`` does): on torch 2.13 a ``scan`` cannot run under ``vmap``.
    """
    _checks.check_callable("loss", loss, "loss(energy, batch, key, *state) -> (value, aux), e.g. an fnebm.losses loss")

    def f(energy: Any, batch: Tensor, keys: Tensor, *state: Any) -> tuple[Tensor, Any]:
        if not isinstance(batch, Tensor):
            raise TypeError(f"batch must be a tensor (n, *event), got {type(batch).__name__}")
        if batch.ndim < 1 or batch.shape[0] == 0:
            raise ValueError(f"batch must have shape (n, *event) with n >= 1, got {tuple(batch.shape)}")
        _checks.check_key(keys, "keys")
        n = batch.shape[0]
        if keys.shape != (n, 2):
            raise ValueError(f"keys must be one key per example, shape ({n}, 2), got {tuple(keys.shape)}")
        for leaf in pytree.tree_leaves(state):
            if isinstance(leaf, Tensor) and (leaf.ndim == 0 or leaf.shape[0] != n):
                raise ValueError(f"every state leaf must lead with the {n} examples, got shape {tuple(leaf.shape)}")
        one = functools.partial(_one_example, loss)
        values, aux = torch.func.vmap(one, in_dims=(None, 0, 0, *(0,) * len(state)))(energy, batch, keys, *state)
        return values.mean(), aux

    return f


def per_example_pcd_init(positions: Tensor, buffer_size: int = 0) -> fl.PCDState:
    """Persistent chains for :func:`per_example`: one chain per example, each with its own ring
    of ``buffer_size`` replay entries (``0``: none).

    ``positions: (n, *event)`` (e.g. noise, for the global batch, then :func:`shard`; or this
    rank's rows drawn from :func:`local_keys`). Returns a :class:`fnebm.losses.PCDState` with a
    leading example axis: ``positions (n, 1, *event)``, ``buffer (n, buffer_size, *event)``,
    ``count (n,)``, ``pointer (n,)`` — ``vmap`` of :func:`fnebm.losses.pcd_init` over the
    examples. A chain restarts from its own past positions (not from other chains'), which is
    what keeps a run independent of how the chains are spread over ranks.
    """
    if not isinstance(positions, Tensor) or not positions.is_floating_point():
        raise TypeError(f"positions must be a floating tensor (n, *event), got {type(positions).__name__}")
    if positions.ndim < 1 or positions.shape[0] == 0:
        raise ValueError(f"positions must have shape (n, *event) with n >= 1, got {tuple(positions.shape)}")
    buffer_size = _checks.check_int("buffer_size", buffer_size, 0)
    if _checks.is_concrete(positions) and not bool(torch.isfinite(positions).all()):
        raise ValueError("positions must be finite (no NaN or inf)")
    return torch.func.vmap(functools.partial(_pcd_init_one, buffer_size))(positions)


def _pcd_init_one(buffer_size: int, x: Tensor) -> fl.PCDState:
    return fl.pcd_init(x[None], buffer_size)


def all_reduce_mean(tree: Any, *, weight: int | float | Tensor | None = None, group: Any = None) -> Any:
    """Across ranks, the mean of every tensor leaf of ``tree`` (e.g. gradients), on every rank.

    ``weight=None``: the plain mean over ranks. ``weight=n_local`` (this rank's number of
    examples): ``sum_r n_r x_r / sum_r n_r`` — with each rank's gradient the mean over its own
    examples, that is the gradient of the mean over the global batch, however unevenly the
    examples are spread. Leaves of one dtype and device travel in one ``all_reduce``; non-tensor
    leaves pass through. The identity (the same object) without a process group. Call it
    outside compiled code, between the gradient and the optimiser.
    """
    if weight is not None:
        if isinstance(weight, Tensor):
            if weight.ndim != 0 or weight.dtype == torch.bool:
                raise TypeError(f"weight must be a number or a 0-dim numeric tensor, got shape {tuple(weight.shape)}")
        else:
            w = _checks.check_real("weight", weight)
            if not (0 <= w < math.inf):
                raise ValueError(f"weight must be a finite number >= 0, got {w}")
    leaves, spec = pytree.tree_flatten(tree)
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
    for i in tensors:
        if not (leaves[i].is_floating_point() or leaves[i].is_complex()):
            raise TypeError(f"all_reduce_mean averages floating tensors, got a leaf of dtype {leaves[i].dtype}")
    if not is_distributed(group):
        return tree
    if not tensors:
        return tree
    dist = _dist()
    device = leaves[tensors[0]].device
    if weight is None:
        total = None
    else:
        w_t = torch.as_tensor(weight, dtype=_F64, device=device).reshape(())
        total = _all_reduce(w_t, "sum", group)
    buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i in tensors:
        buckets.setdefault((leaves[i].dtype, leaves[i].device), []).append(i)
    out = list(leaves)
    for (dtype, dev), idx in buckets.items():
        flat = torch.cat([leaves[i].reshape(-1) for i in idx])
        if total is None:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat = flat / world_size(group)
        else:
            flat = flat * w_t.to(device=dev, dtype=dtype)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat = flat / total.to(device=dev, dtype=dtype)
        for i, piece in zip(idx, flat.split([leaves[i].numel() for i in idx])):
            out[i] = piece.reshape(leaves[i].shape)
    return pytree.tree_unflatten(out, spec)


# ------------------------------------------------------------------------ checkpoints

_STATE_FILE = "state.pt"
_VERSION = 1


def _chain_file(directory: str, r: int) -> str:
    return os.path.join(directory, f"chains.rank{r}.pt")


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _chain_leaves(chains: Any) -> tuple[list[Any], Any, int]:
    """The leaves of a per-chain pytree, its spec and its number of chains (0-dim leaves are shared)."""
    leaves, spec = pytree.tree_flatten(chains)
    if not leaves or not all(isinstance(x, Tensor) for x in leaves):
        raise TypeError("chains must be a tensor or a pytree of tensors with a leading chain axis (or None)")
    sizes = {x.shape[0] for x in leaves if x.ndim >= 1}
    if len(sizes) != 1:
        raise ValueError("chains: every leaf with a chain axis must lead with the same number of chains, "
                         f"got leading sizes {sorted(sizes) or 'none'}")
    return leaves, spec, sizes.pop()


def save_checkpoint(directory: str | os.PathLike, state: Any, chains: Any = None, *, group: Any = None) -> None:
    """Write a training (or sampling) checkpoint that :func:`load_checkpoint` reads back.

    ``state``: what every rank holds alike — parameters, optimiser state, the key, the step
    (anything ``torch.load(weights_only=True)`` reads back: tensors, dicts, lists, numbers,
    fnebm's NamedTuples); rank 0 writes it to ``directory/state.pt``. ``chains``: this rank's
    block of the global per-chain pytree (every leaf ``(local_chains, ...)``; 0-dim leaves,
    such as a ``ChainState``'s ``steps_taken``, are shared), written by every rank to
    ``directory/chains.rank{r}.pt``. Every rank of the group must call it (it is a collective).

    Each file is written to a temporary name and renamed; ``state.pt`` is written last, after
    every rank's chains, and names the save (a random token every file carries), so a save cut
    short is never read as a whole one. ``directory`` must be one directory every rank sees (a
    shared filesystem across machines). Without a process group: one chains file, rank 0.
    """
    directory = os.fspath(directory)
    r, w = rank(group), world_size(group)
    if chains is not None:
        _, _, n_local = _chain_leaves(chains)
    else:
        n_local = 0
    token = [uuid.uuid4().hex if r == 0 else None]
    if is_distributed(group):
        dist = _dist()
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        counts = _sizes(n_local, _group_device(group), group)
    else:
        counts = [n_local]
    if any(c == 0 for c in counts) and any(counts):
        raise ValueError("save_checkpoint: every rank must pass its chains, or none may: got chain counts "
                         f"{counts} by rank")
    if r == 0:
        os.makedirs(directory, exist_ok=True)
    if is_distributed(group):
        _dist().barrier(group=group)
    if chains is not None:
        _atomic_save({"token": token[0], "rank": r, "world_size": w, "chains": chains}, _chain_file(directory, r))
    if is_distributed(group):
        _dist().barrier(group=group)
    if r == 0:
        meta = {"version": _VERSION, "token": token[0], "world_size": w,
                "chain_counts": counts if chains is not None else None, "state": state}
        _atomic_save(meta, os.path.join(directory, _STATE_FILE))
    if is_distributed(group):
        _dist().barrier(group=group)


def _group_device(group: Any) -> torch.device:
    dist = _dist()
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _load(path: str, map_location: Any) -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    return torch.load(path, map_location=map_location, weights_only=True)


def load_checkpoint(directory: str | os.PathLike, *, map_location: Any = None, group: Any = None) -> tuple[Any, Any]:
    """Read a checkpoint of :func:`save_checkpoint`: ``(state, chains)``, ``chains`` this rank's block.

    On the number of ranks it was saved from, each rank reads its own chains file. On another
    number, every rank reads every chains file, puts the chains back in global order and takes
    its block ``chain_slice(n_chains)`` (re-sharding; ``n_chains`` must be at least the new
    number of ranks). Runs whose keys come from :func:`step_keys` and :func:`local_keys` then
    continue as they would have on the old number of ranks. ``chains`` is ``None`` if none were
    saved. Every rank reads ``state.pt``. Raises ``ValueError`` for a checkpoint that is not
    whole (a chains file from another save, a missing rank) and ``FileNotFoundError`` for a
    missing file.
    """
    directory = os.fspath(directory)
    meta = _load(os.path.join(directory, _STATE_FILE), map_location)
    if not isinstance(meta, dict) or meta.get("version") != _VERSION or "token" not in meta:
        raise ValueError(f"{directory}: not an fnebm.distributed checkpoint (state.pt written by save_checkpoint)")
    counts = meta["chain_counts"]
    if counts is None:
        return meta["state"], None
    saved_w, w, r = meta["world_size"], world_size(group), rank(group)

    def read(i: int) -> Any:
        path = _chain_file(directory, i)
        rec = _load(path, map_location)
        if not isinstance(rec, dict) or rec.get("token") != meta["token"]:
            raise ValueError(f"{path} belongs to another save than {os.path.join(directory, _STATE_FILE)}: "
                             "the checkpoint is not whole")
        return rec["chains"]

    if saved_w == w:
        return meta["state"], read(r)
    n = sum(counts)
    if n < w:
        raise ValueError(f"the checkpoint holds {n} chains, fewer than the {w} ranks loading it: "
                         "every rank needs at least one chain")
    parts = [_chain_leaves(read(i)) for i in range(saved_w)]
    spec = parts[0][1]
    sl = chain_slice(n, group=group)
    out = []
    for j, leaf in enumerate(parts[0][0]):
        if leaf.ndim == 0:
            out.append(leaf)
        else:
            out.append(torch.cat([p[0][j] for p in parts])[sl])
    return meta["state"], pytree.tree_unflatten(out, spec)
