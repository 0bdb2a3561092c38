"""``sample_chain``: run a sampler's step for many steps as one compiled region.

The loop is ``torch._higher_order_ops.scan`` traced by ``torch.compile(fullgraph=True)``:
no Python runs between steps. The scan length is a dynamic dimension, so chunks of any
length share one compiled graph; chunks exist to show progress and bound memory.

Randomness: the run key gives one key per chain, ``chain_keys = split(key, n_chains)``, and
step ``t`` (counted from 0, burn-in included) of chain ``c`` uses ``fold_in(chain_keys[c], t)``.
So the same key gives the same trajectory compiled or eager, chunked or not, and a chain's
draws do not depend on how many other chains run beside it.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch._higher_order_ops.scan import scan

from fnebm import random as fr
from fnebm.samplers.base import is_batch_native

__all__ = ["sample_chain"]


def _position(state: Any) -> Tensor:
    return state.position


_RUNNER_IDS = itertools.count()


def _fresh(fn: Callable) -> Callable:
    """``fn`` with a code object of its own, under a name of its own.

    Dynamo keeps compiled graphs per code object and its automatic-dynamic decisions per code
    name: a fresh one per sampler means compiling many samplers in one process never hits the
    recompile limit, and one sampler's shapes or constants (another step size) never make
    another's graph dynamic.
    """
    name = f"{fn.__name__}_{next(_RUNNER_IDS)}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


# Inductor does not put graphs holding a scan in its on-disk FX graph cache unless told the
# operator is safe to cache; the scan's body is part of the graph it hashes, so it is.
_COMPILE_OPTIONS = {"unsafe_marked_cacheable_functions": {"torch.ops.higher_order.scan": torch.__version__}}


def _make_runner(step, collect, batched: bool, state_spec, compiled: bool) -> Callable:
    """``run(leaves, key, ts: (L,)) -> (leaves, kept: (L, ...) leaves, info: (L, ...) leaves)``."""
    # A batch-native step (fnebm's samplers) takes the chain keys directly: its random draws
    # then vectorise over chains, which vmap's layout does not allow.
    one = torch.func.vmap(step) if batched and not is_batch_native(step) else step

    def chain_keys_of(leaves, key):
        return fr.split(key, leaves[0].shape[0]) if batched else key

    def advance(leaves, chain_keys, t):
        state, info = one(pytree.tree_unflatten(list(leaves), state_spec), fr.fold_in(chain_keys, t))
        # Outputs of a scan body may not alias its carry: copy what is kept.
        kept = tuple(x.clone() for x in pytree.tree_leaves(collect(state)))
        # A step may pass a field through unchanged; a scan carry may not alias its input, and
        # must keep its layout (strides) from step to step.
        carry = tuple(torch.empty_like(old).copy_(new) for old, new in zip(leaves, pytree.tree_leaves(state)))
        return carry, (kept, tuple(x.clone() for x in pytree.tree_leaves(info)))

    if not compiled:

        def run_eager(leaves, key, ts):
            chain_keys = chain_keys_of(leaves, key)
            outs = []
            for t in ts:
                leaves, out = advance(leaves, chain_keys, t)
                outs.append(out)
            kept, info = (tuple(torch.stack(col) for col in zip(*part)) for part in zip(*outs))
            return leaves, kept, info

        return run_eager

    def run(leaves, key, ts):
        chain_keys = chain_keys_of(leaves, key)
        leaves, (kept, info) = scan(lambda carry, t: advance(carry, chain_keys, t), tuple(leaves), ts)
        return leaves, kept, info

    return torch.compile(_fresh(run), fullgraph=True, options=_COMPILE_OPTIONS)


def _runner(step, collect, state, batched, state_spec, compiled) -> tuple[Callable, Any, Any]:
    """The runner for this step and the tree structures of what it keeps: ``(run, out_spec, info_spec)``."""
    # Cached on the step itself, so compiled graphs live exactly as long as the sampler.
    cache_key = (collect, batched, str(state_spec), compiled)
    cache = getattr(step, "_fnebm_runners", None)
    if cache is None:
        cache = {}
        try:
            step._fnebm_runners = cache
        except AttributeError:  # e.g. a bound method: no caching, compile per call
            pass
    if cache_key not in cache:
        # One eager step of one chain gives the structure of what is kept (and surfaces a
        # step that does not fit the state with a plain traceback, before any compiling).
        probe = pytree.tree_map(lambda x: x[0], state) if batched else state
        probe_next, probe_info = step(probe, fr.key(0, device=_device_of(state)))
        specs = pytree.tree_structure(collect(probe_next)), pytree.tree_structure(probe_info)
        cache[cache_key] = (_make_runner(step, collect, batched, state_spec, compiled), *specs)
    return cache[cache_key]


# Events up to this many elements are stored chain-innermost while a batched chain runs.
_CHAINS_LAST_MAX_EVENT = 64


def _chains_last(leaves: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The same tensors with the chain axis innermost in memory (strides only; shapes unchanged).

    With small events (a 10-D position) every per-step kernel then vectorises over chains,
    and the random draws of a batch of keys, computed chain-innermost, need no transpose.
    Large events (images, long vectors) keep their layout.
    """
    if any(math.prod(x.shape[1:]) > _CHAINS_LAST_MAX_EVENT for x in leaves):
        return leaves
    return tuple(x.movedim(0, -1).contiguous().movedim(-1, 0) if x.ndim >= 2 else x for x in leaves)


def _device_of(state: Any) -> torch.device:
    return pytree.tree_leaves(state)[0].device


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _infer_batched(state: Any, batched: bool | None) -> bool:
    if batched is not None:
        return bool(batched)
    energy = getattr(state, "energy", None)
    if not isinstance(energy, Tensor):
        raise ValueError(
            "cannot tell whether state has a chain axis (it has no 'energy' field): pass batched=True or False"
        )
    if energy.ndim > 1:
        raise ValueError(
            f"state.energy must have shape () for one chain or (n_chains,) for many, got {tuple(energy.shape)}"
        )
    return energy.ndim == 1


def _chunks(total: int, size: int):
    """``[a, b)`` ranges covering ``range(total)``, none of length 1 unless ``total == 1``.

    Dynamo specialises a length-1 scan into a graph of its own; a run never needs one, so
    a lone last step joins the chunk before it (and ``size`` 1 means 2).
    """
    size = max(size, 2)
    bounds = list(range(0, total, size)) + [total]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(zip(bounds[:-1], bounds[1:]))


def sample_chain(
    step: Callable[[Any, Tensor], tuple[Any, Any]],
    state: Any,
    key: Tensor,
    n_steps: int,
    *,
    burn_in: int = 0,
    thin: int = 1,
    collect: Callable[[Any], Any] | None = None,
    chunk_size: int | None = None,
    compile: bool = True,
    progress: bool | None = None,
    batched: bool | None = None,
    timings: dict | None = None,
) -> tuple[Any, Any, Any]:
    """Run ``burn_in + n_steps`` steps of ``step`` and return ``(final_state, trace, info)``.

    Args:
        step: a sampler's pure ``step(state, key) -> (state, info)`` for one chain.
        state: the initial state. With a leading chain axis (``state.energy: (n_chains,)``,
            e.g. from ``torch.func.vmap(alg.init)(positions)``) the chains run under
            ``vmap`` with one key each; ``batched`` overrides the detection.
        key: one key ``(2,)`` from ``fnebm.random.key``.
        n_steps: steps after burn-in; every ``thin``-th is kept, ``n_kept = n_steps // thin``.
        burn_in: steps run first and not kept.
        collect: ``state -> pytree of tensors`` kept at each kept step (default: the position).
        chunk_size: steps per compiled call. Default: ``max(n_kept, 256)`` steps, or about
            1/20 of the run when a progress bar shows. All chunks share one compiled graph.
        compile: ``False`` runs the same steps eagerly, step by step (for debugging).
        progress: show a tqdm bar; ``None`` shows one when stderr is a terminal.
        timings: if a dict is given, it receives ``first_call_s`` (the first chunk, compile
            included), ``total_s`` and ``n_calls``; the device is synchronised per chunk then.

    Returns:
        ``final_state``; ``trace``, ``collect``'s pytree with leaves ``(n_kept, n_chains, ...)``
        (``(n_kept, ...)`` for one chain) — draw ``j`` is the state after step
        ``burn_in + (j + 1) * thin``; ``info``, the step's info at the kept steps, same layout.
    """
    if not callable(step):
        raise TypeError(f"step must be callable step(state, key) -> (state, info), got {type(step).__name__}")
    fr.check_key(key)
    if key.shape != (2,):
        raise ValueError(f"key must be one key of shape (2,), got {tuple(key.shape)}; per-chain keys are derived")
    n_steps = _check_int("n_steps", n_steps, 1)
    burn_in = _check_int("burn_in", burn_in, 0)
    thin = _check_int("thin", thin, 1)
    if thin > n_steps:
        raise ValueError(f"thin must be <= n_steps to keep any draw, got thin={thin}, n_steps={n_steps}")
    if chunk_size is not None:
        chunk_size = _check_int("chunk_size", chunk_size, 1)
    if collect is None:
        collect = _position
    elif not callable(collect):
        raise TypeError(f"collect must be callable state -> pytree of tensors, got {type(collect).__name__}")
    leaves, state_spec = pytree.tree_flatten(state)
    if not leaves or not all(isinstance(x, Tensor) for x in leaves):
        raise TypeError("state must be a pytree (e.g. NamedTuple) of tensors, as returned by a sampler's init")
    devices = {x.device for x in leaves}
    if len(devices) > 1 or key.device not in devices:
        raise ValueError(f"state and key must be on one device, got state on {devices} and key on {key.device}")
    is_batched = _infer_batched(state, batched)
    if is_batched and any(x.ndim == 0 or x.shape[0] != leaves[0].shape[0] for x in leaves):
        raise ValueError("every state field must have the same leading chain axis (n_chains, ...)")
    run, out_spec, info_spec = _runner(step, collect, state, is_batched, state_spec, bool(compile))
    n_kept = n_steps // thin
    total = burn_in + n_steps
    show = sys.stderr.isatty() if progress is None else bool(progress)
    if chunk_size is None:
        # A call returns every step's draw and thinning picks from them: chunks of n_kept
        # steps (at least 256) keep that scratch near the size of the trace itself.
        chunk_size = -(-total // 20) if show else max(n_kept, min(total, 256))
    first_kept = burn_in + thin - 1  # index of the step whose resulting state is draw 0

    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="step", desc="sampling", file=sys.stderr)
    calls, t_start = [], time.perf_counter()
    leaves = _chains_last(tuple(leaves)) if is_batched else tuple(leaves)
    out_bufs = info_bufs = None
    try:
        for a, b in _chunks(total, chunk_size):
            t0 = time.perf_counter()
            ts = torch.arange(a, b, device=key.device)
            if b - a >= 2:  # one graph for every chunk length (sizes 0 and 1 are specialised)
                torch._dynamo.mark_dynamic(ts, 0)
            leaves, outs, infos = run(leaves, key, ts)
            if timings is not None:
                if key.device.type != "cpu":
                    torch.accelerator.synchronize(key.device)
                calls.append(time.perf_counter() - t0)
            if bar is not None:
                bar.update(b - a)
            # the kept steps in [a, b): first_kept, first_kept + thin, ..., below burn_in + n_kept * thin
            lo = first_kept + max(0, -(-(a - first_kept) // thin)) * thin
            hi = min(b, burn_in + n_kept * thin)
            if lo >= hi:
                continue
            j0, j1 = (lo - first_kept) // thin, (hi - 1 - first_kept) // thin + 1
            if (j0, j1, lo - a, thin) == (0, n_kept, 0, 1) and b - a == n_kept:
                out_bufs, info_bufs = list(outs), list(infos)  # one call: its output is the trace
                continue
            if out_bufs is None:  # allocated once, filled chunk by chunk
                out_bufs = [x.new_empty((n_kept, *x.shape[1:])) for x in outs]
                info_bufs = [x.new_empty((n_kept, *x.shape[1:])) for x in infos]
            for buf, x in zip(out_bufs + info_bufs, list(outs) + list(infos)):
                buf[j0:j1].copy_(x[lo - a : hi - a : thin])
    finally:
        if bar is not None:
            bar.close()
    if timings is not None:
        timings.update(first_call_s=calls[0], total_s=time.perf_counter() - t_start, n_calls=len(calls))
    final_state = pytree.tree_unflatten([x.contiguous() for x in leaves], state_spec)
    return final_state, pytree.tree_unflatten(out_bufs, out_spec), pytree.tree_unflatten(info_bufs, info_spec)
