"""The chain layout across ranks, and the collectives that move chains between them.

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
Collectives run only after sampling, in :func:`gather_chains` and the diagnostics
(:mod:`fnebm.distributed.diagnostics`), through the helpers at the end of this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fnebm import _checks
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
]


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
