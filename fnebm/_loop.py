"""``run``: K steps of a batched step as one functional loop, usable inside your own compiled code.

Step ``t`` of chain ``c`` uses the key ``fold_in(keys[c], t)``, with ``t`` counted from ``start``:
the position in the random stream is data, so a run continued from step ``start`` equals the
uninterrupted run.

Under ``torch.compile`` the loop is ``torch._higher_order_ops.scan`` (one traced body, any
length); in eager mode it is a Python loop. When a gradient is taken through the chain the
loop is unrolled under compile too: on torch 2.13, scan has no ``torch.func`` transform rule
and its autograd rule fails on boolean outputs (MALA's ``is_accepted``). The tests check
the unrolled gradients against finite differences, and check that scan's backward, should a
later torch accept it, agrees with them.

It sits below :mod:`fnebm.adaptation` and :mod:`fnebm.chain` (it needs only torch and
:mod:`fnebm.random`); :mod:`fnebm.chain.loop` re-exports it as ``fnebm.chain.run``.

**The warm-ups' runner.** A warm-up of :mod:`fnebm.adaptation` runs its whole ensemble as one
"chain" (a state without chain axes, one key ``(2,)``) through a *runner*::

    runner(step, state, key, n_steps, *, collect, compile, cache, progress, on_plan)
        -> (state, trace, info)

Adaptation sits below :mod:`fnebm.chain`, so it never imports it: it calls the runner it is
given, or else :func:`default_runner`. That is :func:`eager_runner` (this module's loop, eager)
until a higher layer installs its own with :func:`install_runner`; :mod:`fnebm.chain.warmup`
installs ``sample_chain``'s (the compiled runner, its cache, ``compile="auto"``, ``on_plan`` and
the fallback on a failed compile) when :mod:`fnebm.chain` is imported, which ``import fnebm``
always does.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch._higher_order_ops.scan import scan

from fnebm import _checks
from fnebm import random as fr

__all__ = ["run", "position", "position_and_energy", "eager_runner", "install_runner", "default_runner"]


_FIELDWISE: list = []  # collects that only pick a state's fields (fieldwise); compared by identity


def fieldwise(collect: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Mark ``collect`` (fnebm's own) as one that only picks fields of the state, so that on states
    stacked on a leading axis it gives the stacked fields: an eager engine that holds many steps
    stacked (a kernel's block of transitions) then keeps them by one slice per field instead of
    one state at a time."""
    _FIELDWISE.append(collect)
    return collect


def is_fieldwise(collect: Any) -> bool:
    return any(collect is f for f in _FIELDWISE)  # a user's collect may be unhashable


@fieldwise
def position(state: Any) -> Tensor:
    """The default ``collect``: what a trace keeps of a state."""
    return state.position


@fieldwise
def position_and_energy(state: Any) -> tuple[Tensor, Tensor]:
    """A ``collect`` that keeps the position and the energy (what ``fnebm sample`` keeps). The
    CPU's whole-chain kernel (``sample_chain``'s ``backend="c"``) writes both, as it writes the
    position for the default ``collect``."""
    return state.position, state.energy


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


def structure(kept: Any, info: Any) -> tuple[Any, Any, tuple[bool, ...]]:
    """What the compiled loop needs to know of a step's outputs before it traces one: the trees of
    ``collect(state)`` and of the info, and which info leaves are boolean. From one step run
    before (eager, or as meta tensors); equal structures compare equal, so a compiled loop given
    an equal one from another call compiles nothing new."""
    return (pytree.tree_structure(kept), pytree.tree_structure(info),
            tuple(x.dtype == torch.bool for x in pytree.tree_leaves(info)))


def loop(step: Callable, collect: Callable, keys: Tensor, state: Any, ts: Tensor, unroll: bool,
         known: tuple[Any, Any, tuple[bool, ...]] | None = None) -> tuple[Any, Any, Any]:
    """The steps ``ts``: ``(state, kept (L, ...), info (L, ...))`` as pytrees.

    ``known``: :func:`structure` of this step's outputs, when a step ran before (``sample_chain``'s
    probe): the compiled loop then traces the step once, in its body, instead of once more first."""
    if unroll or not torch.compiler.is_compiling():
        outs = []
        for i in range(ts.shape[0]):
            state, out = body(step, collect, keys, state, ts[i])
            outs.append(out)
        kept, info = pytree.tree_map(lambda *xs: torch.stack(xs), *outs)
        return state, kept, info
    # the state is copied inside the graph first: torch's scan and while_loop refuse a carry that
    # shares memory with another of their inputs ("scan might be aliasing the input or the
    # output!"), and a state's fields often do (an eager NUTS step returns its position and
    # gradient as views of one stacked tensor; Inductor may return them as slices of one buffer)
    state = pytree.tree_map(torch.clone, state)
    # scan carries and emits flat tuples of tensors only (a body's output may not be a NamedTuple, nor
    # may it record its structure outside: "unsafe side effect"): the trees' structures are known from
    # a step run before, or else learnt from one traced step first (pure, unused: the compiler drops
    # it, but Dynamo and AOT autograd trace it: Dynamo's trace of a ConvNet's chain 0.7 s longer)
    if known is None:
        probe, probe_info = step(state, fr.fold_in(keys, ts[0]))
        known = structure(collect(probe), probe_info)
    specs = [pytree.tree_structure(state), known[0], known[1]]
    flags = known[2]

    def flat_body(carry, t):
        new, (kept, info) = body(step, collect, keys, pytree.tree_unflatten(list(carry), specs[0]), t)
        # bool info (is_divergent, is_accepted) is stacked as uint8 and compared back to bool after
        # the loop: Inductor's CPU code stores a bool vector lane by lane (a 10,000-chain MALA
        # step: about 60 us of 730 for its two flags), a uint8 one with vector instructions
        info = [x.to(torch.uint8) if b else x for x, b in zip(pytree.tree_leaves(info), flags)]
        return tuple(pytree.tree_leaves(new)), (tuple(pytree.tree_leaves(kept)), tuple(info))

    carry, (kept, info) = scan(flat_body, tuple(pytree.tree_leaves(state)), ts)
    # back to bool by a comparison, not a view: torch 2.11's Inductor cannot lower a uint8 -> bool
    # bitcast (torch.iinfo(torch.bool) raises; measured on an H100, every compiled chain failed)
    info = tuple(x != 0 if b else x for x, b in zip(info, flags))
    return tuple(pytree.tree_unflatten(list(x), spec) for x, spec in zip((carry, kept, info), specs))


def _tracks_grad(x: Any) -> bool:
    if not isinstance(x, Tensor) or not (x.is_floating_point() or x.is_complex()):
        return False
    if x.requires_grad:
        return True
    # Dynamo cannot call functorch's C queries; under compile, requires_grad is what it knows
    return not torch.compiler.is_compiling() and torch._C._functorch.is_gradtrackingtensor(x)


def _step_tensors(fn: Any, depth: int = 0) -> list[Any]:
    """The tensors a step holds: a partial's arguments (energies are pytrees), a closure's cells."""
    if depth > 4:
        return []
    if isinstance(fn, functools.partial):
        found = pytree.tree_leaves((fn.args, fn.keywords))
        return found + [t for x in (*fn.args, *fn.keywords.values(), fn.func) if callable(x) for t in _step_tensors(x, depth + 1)]
    if torch.compiler.is_compiling():
        return []  # Dynamo cannot read closure cells; fnebm's steps hold their tensors in partials
    cells = getattr(fn, "__closure__", None) or ()
    found = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        found += pytree.tree_leaves(value)
        if callable(value):
            found += _step_tensors(value, depth + 1)
    return found


def needs_grad(step: Any, state: Any) -> bool:
    """Whether a gradient is being taken through the chain: grad mode is on and the state or a
    tensor the step holds requires grad (``torch.autograd``) or is tracked by ``torch.func.grad``."""
    if not torch.is_grad_enabled():
        return False
    return any(_tracks_grad(x) for x in (*pytree.tree_leaves(state), *_step_tensors(step)))


def run(
    step: Callable[[Any, Tensor], tuple[Any, Any]],
    state: Any,
    keys: Tensor,
    n_steps: int,
    *,
    start: int | Tensor = 0,
    collect: Callable[[Any], Any] | None = None,
    unroll: bool | None = None,
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
        unroll: trace a Python loop instead of ``scan`` under compile. ``None`` (default) unrolls
            exactly when a gradient is being taken through the chain (:func:`needs_grad`):
            torch 2.13's scan has no ``torch.func`` rule, and its autograd rule fails on
            boolean outputs such as ``is_accepted``. The unrolled graph grows with ``n_steps``.

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
    if unroll is None:
        unroll = needs_grad(step, state)
    return loop(step, collect, keys, state, _steps(start, n_steps, keys.device), bool(unroll))


def eager_runner(
    step: Callable[[Any, Tensor], tuple[Any, Any]],
    state: Any,
    key: Tensor,
    n_steps: int,
    *,
    collect: Callable[[Any], Any] | None = None,
    compile: bool | str = False,
    cache: Any = None,
    progress: bool | None = False,
    on_plan: Callable[[Any], None] | None = None,
) -> tuple[Any, Any, Any]:
    """The plain warm-up runner: ``n_steps`` eager steps of one chain (``state`` without chain
    axes, one key ``(2,)``) with :func:`run`; the same draws as ``sample_chain(...,
    chain_ndim=0, compile=False)``. It compiles nothing, so ``compile=True``, a progress bar and
    ``on_plan`` (what ``sample_chain``'s runner provides) raise ``ValueError``; ``"auto"`` runs
    eagerly, and ``cache`` is unused (an eager run keeps nothing)."""
    for name, value, ok, plain in (("compile", compile, compile is False or compile == "auto", False),
                                   ("progress", progress, progress is False or progress is None, False),
                                   ("on_plan", on_plan, on_plan is None, None)):
        if not ok:
            raise ValueError(f"{name}={value!r} needs the runner of fnebm.chain (sample_chain's); the plain "
                             f"loop of fnebm._loop runs eagerly and reports nothing: pass {name}={plain}, or "
                             "import fnebm.chain (import fnebm does) and leave runner=None")
    return run(step, state, key, n_steps, collect=collect)


_installed: list[Callable[..., tuple[Any, Any, Any]]] = []


def install_runner(runner: Callable[..., tuple[Any, Any, Any]]) -> None:
    """Make ``runner`` the :func:`default_runner` (a higher layer wires its own in; the last one
    installed wins)."""
    _checks.check_callable("runner", runner, "runner(step, state, key, n_steps, **options) -> (state, trace, info)")
    _installed[:] = [runner]


def default_runner() -> Callable[..., tuple[Any, Any, Any]]:
    """The runner a warm-up uses when given none: the installed one, else :func:`eager_runner`."""
    return _installed[0] if _installed else eager_runner
