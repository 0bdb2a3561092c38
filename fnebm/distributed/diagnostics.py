"""Diagnostics across ranks: :mod:`fnebm.diagnostics` with the chains spread over a process group.

:func:`rhat`, :func:`ess_bulk`, :func:`ess_tail`, :func:`ess`, :func:`mcse_mean`,
:func:`mcse_sd`, :func:`summary`, :func:`summary_table` and :func:`acceptance_summary` take
each rank's local trace ``(draws, local_chains, *event)`` and return, on every rank, the
numbers :mod:`fnebm.diagnostics` gives for the whole trace (equal to float rounding, ~1e-15
relative). They *are* :mod:`fnebm.diagnostics`'s statistics: those reduce over chains through
a context object (``fnebm.diagnostics._Local``: the chains of one process), and this module
only supplies the collective one, :class:`_Collective`. What moves between ranks:

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
  rank-local unless you call :func:`fnebm.distributed.gather_chains`. ``mean``, ``std``,
  ``ess``, ``mcse_mean`` and ``mcse_sd`` need no draws from other ranks.

Every rank of the group must call a diagnostic together (they are collectives), with traces
of the same number of draws and event shape. Without a process group (or with one process)
each function is the one in :mod:`fnebm.diagnostics`, so one script runs under ``python``
and under ``torchrun --nproc-per-node 2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import Tensor

from fnebm import diagnostics as fd
from fnebm.distributed.sharding import _all_reduce, _dist, _gather_cat, _sizes, is_distributed

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
]

_F64 = torch.float64


class _Collective(fd._Local):
    """:mod:`fnebm.diagnostics`'s reductions over chains, across the ranks of ``group``: each
    rank holds a contiguous block of the chains of one trace, in rank order (the global order).

    Built once per diagnostic call from this rank's trace: it checks that every rank has the
    same draws and event shape and learns every rank's number of chains (collectives)."""

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
        self.per_rank = [s[1] for s in shapes]  # chains per rank, in rank order = global chain order
        self.local = self.per_rank[dist.get_rank(group)]
        self.total = sum(self.per_rank)

    def count(self, x: Tensor) -> int:
        return x.shape[1] // self.local * self.total  # x holds k rows per local chain (k = 2: split)

    def chains(self, s: Tensor) -> Tensor:
        # (D, k * C_local) -> (D, k, C_global): every rank's chains in order within each of the
        # k groups (split chains: all first halves, then all last halves, the one-process order)
        d, m = s.shape
        g = _gather_cat(s.reshape(d, m // self.local, self.local), 2, self.per_rank, self.group)
        return g.reshape(d, -1)

    def chain_mean(self, t: Tensor) -> Tensor:
        return self.sum(t.sum(1)) / self.count(t)

    def mean(self, x: Tensor) -> Tensor:
        return self.sum(x.flatten(1).sum(-1)) / (self.count(x) * x.shape[-1])

    def std(self, x: Tensor) -> Tensor:
        dev = x - self.mean(x)[:, None, None]
        return (self.sum(dev.square().flatten(1).sum(-1)) / (self.count(x) * x.shape[-1] - 1)).sqrt()

    def sum(self, t: Tensor) -> Tensor:
        return _all_reduce(t, "sum", self.group)

    def max(self, t: Tensor) -> Tensor:
        return _all_reduce(t, "max", self.group)

    def min(self, t: Tensor) -> Tensor:
        return _all_reduce(t, "min", self.group)

    def any(self, t: Tensor) -> Tensor:
        return self.max(t.to(torch.int64)) > 0

    def values(self, x: Tensor) -> Tensor:
        # every rank's values of each row, rank after rank (the callers sort them)
        per_chain = x.shape[1] // self.local * x.shape[2]
        return _gather_cat(x.flatten(1), 1, [c * per_chain for c in self.per_rank], self.group)

    def ranks(self, x: Tensor) -> tuple[Tensor, Tensor]:
        # Each rank ranks its own draws among every rank's, sorted: a draw's average rank among
        # ties is (#less + #less-or-equal + 1) / 2, the one-process (lo + hi + 2) / 2 -- the same
        # integer, so the same float and the same z. (One process keeps its sort-and-scatter:
        # searchsorted there measured 1.2-2.6x slower.)
        s = self.values(x).sort(dim=-1).values.contiguous()
        flat = x.flatten(1).contiguous()
        lo = torch.searchsorted(s, flat, side="left")
        hi = torch.searchsorted(s, flat, side="right")
        return (lo + hi + 1).to(_F64) / 2, s

    def acceptance(self, info: Any, layout: str) -> dict[str, Any]:
        return _acceptance(info, layout, False, self.group)


def _public(name: str) -> Callable[..., Tensor]:
    single = getattr(fd, name)
    rows = fd._ROWS[name]

    def fn(trace: Tensor, *, layout: str | None = None, group: Any = None) -> Tensor:
        if not is_distributed(group):
            return single(trace, layout=layout)
        trace = fd._as_draws_chains(trace, layout)
        return fd._per_element(trace, rows, ctx=_Collective(trace, group))

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (
        f"Across ranks, :func:`fnebm.diagnostics.{name}` of the trace all ranks hold together.\n\n"
        "``trace``: this rank's ``(draws, local_chains, *event)`` (every rank the same draws and\n"
        "event shape); ``layout`` as there; ``group``: the process group (default: the world).\n"
        "Every rank of the group must call it; each gets the same result. Without a process\n"
        f"group it is :func:`fnebm.diagnostics.{name}`."
    )
    return fn


rhat = _public("rhat")
ess_bulk = _public("ess_bulk")
ess_tail = _public("ess_tail")
ess = _public("ess")
mcse_mean = _public("mcse_mean")
mcse_sd = _public("mcse_sd")


_MEANS = ("mean_acceptance_rate", "accepted_fraction", "divergent_fraction", "mean_tree_depth",
          "mean_num_integration_steps")


def _acceptance(info: Any, layout: str, warn: bool, group: Any) -> dict[str, Any]:
    """This rank's :func:`fnebm.diagnostics.acceptance_summary`, combined across ranks: the
    means weighted by each rank's draws, the counts summed, the per-chain rates gathered."""
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
    return fd._summary(trace, info, layout, _Collective(trace, group))


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
    return fd._summary_table(trace, info, layout, var_name, names, _Collective(trace, group))
