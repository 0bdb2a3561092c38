"""``run``: K steps of a batched step as one functional loop, usable inside your own compiled code.

Step ``t`` of chain ``c`` uses the key ``fold_in(keys[c], t)``, with ``t`` counted from ``start``:
the position in the random stream is data, so a run continued from step ``start`` equals the
uninterrupted run.

Under ``torch.compile`` the loop is ``torch._higher_order_ops.scan`` (one traced body, any
length); in eager mode it is a Python loop. ``unroll=True`` traces a Python loop under compile
too, which ``torch.func.grad`` needs: torch 2.13's scan has no ``torch.func`` transform rule
(``torch.autograd`` through scan works and is tested against the unrolled loop).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch._higher_order_ops.scan import scan

from fnebm import _checks
from fnebm import random as fr

__all__ = ["run", "position"]


def position(state: Any) -> Tensor:
    """The default ``collect``: what a trace keeps of a state."""
    return state.position


def _steps(start: int | Tensor, n_steps: int, device: torch.device) -> Tensor:
    ts = torch.arange(n_steps, device=device)
    return ts + start.to(device=device, dtype=torch.int64) if isinstance(start, Tensor) else ts + start


def _copy(old: Tensor, new: Tensor) -> Tensor:
    return torch.empty_like(old).copy_(new)


def body(step: Callable, collect: Callable, keys: Tensor, state: Any, t: Tensor) -> tuple[Any, tuple[Any, Any]]:
    """One step: ``(state, t) -> (state, (collect(state), info))``.

    Outputs never alias inputs (a scan body may not return its carry unchanged, and a step
    may pass a field through) and the carry keeps its strides from step to step, which the
    compiled scan requires.
    """
    new, info = step(state, fr.fold_in(keys, t))
    kept = pytree.tree_map(torch.clone, collect(new))
    return pytree.tree_map(_copy, state, new), (kept, pytree.tree_map(torch.clone, info))


def loop(step: Callable, collect: Callable, keys: Tensor, state: Any, ts: Tensor, unroll: bool) -> tuple[Any, Any, Any]:
    """The steps ``ts``: ``(state, kept (L, ...), info (L, ...))`` as pytrees."""
    if unroll or not torch.compiler.is_compiling():
        outs = []
        for i in range(ts.shape[0]):
            state, out = body(step, collect, keys, state, ts[i])
            outs.append(out)
        kept, info = pytree.tree_map(lambda *xs: torch.stack(xs), *outs)
        return state, kept, info
    # scan carries and emits flat tuples of tensors only: learn the trees' structures from one
    # traced step first (pure, unused: the compiler drops it)
    probe, probe_info = step(state, fr.fold_in(keys, ts[0]))
    specs = [pytree.tree_structure(x) for x in (state, collect(probe), probe_info)]

    def flat_body(carry, t):
        new, (kept, info) = body(step, collect, keys, pytree.tree_unflatten(list(carry), specs[0]), t)
        return tuple(pytree.tree_leaves(new)), (tuple(pytree.tree_leaves(kept)), tuple(pytree.tree_leaves(info)))

    carry, (kept, info) = scan(flat_body, tuple(pytree.tree_leaves(state)), ts)
    return tuple(pytree.tree_unflatten(list(x), spec) for x, spec in zip((carry, kept, info), specs))


def run(
    step: Callable[[Any, Tensor], tuple[Any, Any]],
    state: Any,
    keys: Tensor,
    n_steps: int,
    *,
    start: int | Tensor = 0,
    collect: Callable[[Any], Any] | None = None,
    unroll: bool = False,
) -> tuple[Any, Any, Any]:
    """Run ``n_steps`` steps; returns ``(state, trace, info)``, every step kept.

    Args:
        step: a batched ``step(state, keys: (*chains, 2)) -> (state, info)`` (fnebm's samplers'
            ``alg.step``, or a one-chain step wrapped in :func:`fnebm.samplers.vmap_chains`).
        state: leading chain axes ``chains`` on every field (none for one chain).
        keys: one key per chain, ``(*chains, 2)`` (e.g. ``fnebm.random.split(key, n_chains)``).
        n_steps: a Python int (static under compile).
        start: the index of the first step in each chain's stream (an int or a 0-dim integer
            tensor, e.g. ``ChainState.steps_taken``).
        collect: ``state -> pytree`` kept after every step (default: the position).
        unroll: trace a Python loop instead of ``scan`` under compile (for ``torch.func.grad``
            through the chain; the graph grows with ``n_steps``).

    Returns:
        the final state; ``trace`` (``collect``'s pytree, leaves ``(n_steps, *chains, ...)``);
        ``info`` (the step's info, same layout). Differentiable with ``torch.autograd`` (eager
        and compiled) and ``torch.func.grad`` (eager, or compiled with ``unroll=True``).
    """
    _checks.check_callable("step", step, "step(state, keys) -> (state, info)")
    _checks.check_key(keys, "keys")
    n_steps = _checks.check_int("n_steps", n_steps, 1)
    collect = position if collect is None else collect
    _checks.check_callable("collect", collect, "state -> pytree of tensors")
    return loop(step, collect, keys, state, _steps(start, n_steps, keys.device), unroll)
