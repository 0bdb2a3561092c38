"""Training across ranks (data parallelism), with draws independent of the number of ranks.

The unit of randomness is the *example*: the global batch of ``n`` examples at training step
``t`` takes the keys ``split(fold_in(key, t), n)``, and rank ``r`` holds the examples
``chain_slice(n)`` of the batch with their keys (:func:`step_keys`) and their persistent
chains (one chain per example). :func:`per_example` evaluates a loss with one key per example
(each example a batch of one, ``vmap``-ed), so the noise an example gets depends on its global
index only, never on the number of ranks: two ranks draw exactly what one process draws for
the combined batch. The gradients are then averaged across ranks, weighted by each rank's
number of examples (:func:`all_reduce_mean`, for ``torch.func.grad`` over a parameter
pytree), or by ``DistributedDataParallel`` / ``fully_shard`` for an ``nn.Module``
(docs/distributed.md).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fnebm import _checks
from fnebm import losses as fl
from fnebm import random as fr
from fnebm.distributed.sharding import _all_reduce, _dist, is_distributed, local_keys, world_size

__all__ = ["step_keys", "per_example", "per_example_pcd_init", "all_reduce_mean"]

_F64 = torch.float64


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
