"""Gradient helpers on ``torch.func``: energy value and gradient, and the score.

Each takes an energy ``E: (dim,) -> ()`` for one sample and returns a function of one
sample; batch it over chains with ``torch.func.vmap``, or give :func:`value_and_grad` the
number of chain axes (what the samplers do), which also uses an energy's whole-batch form
where it has one. Both trace under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fnebm import _checks
from fnebm.energies.base import Energy
from fnebm.energies.neural import batch_form, plain_batch

__all__ = ["value_and_grad", "score"]


def _check(energy: object) -> None:
    _checks.check_callable("energy", energy, "x -> E(x)")


def _closed_form(energy: object) -> bool:
    """An analytic family (an :class:`~fnebm.energies.Energy` whose class writes out ``grad``)."""
    return isinstance(energy, Energy) and type(energy).grad is not Energy.grad


def _one_sample(energy: Callable[[Tensor], Tensor]) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    if _closed_form(energy):
        def closed(x: Tensor) -> tuple[Tensor, Tensor]:
            return energy(x), energy.grad(x)

        return closed
    def fn(x: Tensor) -> tuple[Tensor, Tensor]:
        # torch.func.grad would seed the pullback with ones_like(value), which under vmap is a
        # batched (n,) tensor: a last layer `h @ w` then pulls back as the product ones(n, 1) @ w.T,
        # a matrix product per evaluation. A 0-dim 1, not batched, pulls back as w itself, which
        # the next elementwise operation broadcasts: the same numbers, to the bit.
        value, pullback = torch.func.vjp(energy, x)
        if not isinstance(value, Tensor) or value.ndim != 0:
            raise ValueError(f"energy must return a 0-dim tensor for one sample, got "
                             f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}")
        (grad,) = pullback(torch.ones((), dtype=value.dtype, device=value.device))
        return value, grad

    return fn


def value_and_grad(energy: Callable[[Tensor], Tensor], chain_ndim: int = 0) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """``x -> (E(x), dE/dx)``: ``x: (*chains, *event)`` -> ``(chains, like x)``, ``chains`` the first ``chain_ndim`` axes.

    With ``chain_ndim=0`` (default) ``x`` is one sample: ``(dim,)`` -> ``((), (dim,))``.

    For the analytic families (an :class:`~fnebm.energies.Energy` with a closed-form ``grad``,
    checked against autograd in the tests) the pair is ``(energy(x), energy.grad(x))``: no
    autograd pass, so an eager step is cheaper and a compiled graph smaller and quicker to
    build; gradients through it (w.r.t. the energy's parameters or the position) still flow,
    by autograd of those formulas. Any other energy: one backward pass of ``torch.func`` gives
    both, which is why samplers cache the pair. Over chain axes these are mapped with ``vmap``;
    eagerly, on plain tensors, a one-sample function's pairs for all chains come from one
    ``vmap``-ed forward pass and ``torch.autograd.grad`` on a CUDA device (the same numbers to
    float rounding, and no import of Dynamo, which ``torch.func``'s backward pass loads at its
    first use), except where a tensor the function reads from elsewhere requires grad (the
    ``torch.func`` path then keeps the graph to it).

    An energy with a whole-batch form (``energy.batched``: :func:`~fnebm.energies.from_module`,
    :func:`~fnebm.energies.batched`) is evaluated for all chains at once, one forward and one
    backward pass: eagerly by ``torch.autograd.grad`` when nothing asks for a graph through it
    (no parameter or position requires grad), else by ``torch.func.vjp``, which ``vmap``,
    ``torch.func.grad`` (gradients through a chain w.r.t. the energy's parameters) and
    ``torch.compile(fullgraph=True)`` all trace. The values agree with the mapped one-sample
    form to float rounding (a matrix product over a batch may sum in another order). With
    ``chain_ndim=0`` under one ``vmap`` over plain samples (``vmap(alg.init)``), such an energy
    is evaluated on the whole batch the same way (:func:`_one_sample_of_a_batch`).
    """
    _check(energy)
    chain_ndim = _checks.check_int("chain_ndim", chain_ndim, 0)
    closed = _closed_form(energy)
    batch = None if closed else batch_form(energy)
    mapped = batch is None and not closed  # a one-sample function: its vmap, eagerly on _AUTOGRAD_DEVICES
    if mapped:
        batch = torch.func.vmap(energy)
    one = _one_sample(energy)
    if batch is None or chain_ndim == 0 or mapped:  # the one-sample form: the answer, or the fallback
        for _ in range(chain_ndim):
            one = torch.func.vmap(one)
    if batch is None or chain_ndim == 0:
        return one if batch is None else functools.partial(_one_sample_of_a_batch, energy, batch, mapped, one)

    def batched(x: Tensor) -> tuple[Tensor, Tensor]:
        if mapped and x.device.type not in _AUTOGRAD_DEVICES:
            return one(x)
        chains = x.shape[:chain_ndim]
        xs = x.flatten(0, chain_ndim - 1)  # (n, *event); a view for contiguous chain axes
        pair = _autograd_pair(energy, batch, mapped, xs) if _plain_eager(energy, xs) else None
        if pair is not None:
            value, grad = pair
        elif mapped:
            return one(x)
        else:
            value, pullback = torch.func.vjp(batch, xs)
            (grad,) = pullback(torch.ones_like(value))
        return value.reshape(chains), grad.reshape(x.shape)

    return batched


# The devices where a one-sample function's eager gradients go by vmap's forward pass and
# torch.autograd.grad. On a GPU the first torch.func backward pass of a process imported Dynamo,
# sympy and FSDP: most of a MALA call's first 4.6-7.7 s on the lent H100, where the call took 0.19 s
# again (bench/gpu_mala_profile.py). Not on the CPU: there the plain backward pass of a vmap-ed
# forward met its intermediates in mixed layouts (a logistic regression's gradient for 1,024
# chains: 7.3 against 4.9 ms by torch.func; the same bits), and the steps are not a CUDA graph's.
_AUTOGRAD_DEVICES = ("cuda",)


def _autograd_pair(energy, batch, mapped: bool, xs: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(energies (n,), gradients)`` of the plain batch ``xs`` by one forward pass of ``batch`` and
    ``torch.autograd.grad``: the plain loop's way, without ``torch.func``'s transforms of the
    backward pass (whose first use in a process also imports Dynamo, a second or more).

    For a one-sample function (``mapped``: ``batch`` is its ``vmap``), ``None`` (the caller's
    ``torch.func`` path, which raises what it raises) where the forward pass fails or gives no
    energy per sample, and where a tensor the function reads from elsewhere requires grad (its
    autograd graph reaches another leaf: a parameter in a closure, whose gradient the
    ``torch.func`` path keeps a graph for); checked once per eager block of steps."""
    with torch.enable_grad():
        leaf = xs.detach().requires_grad_(True)
        if mapped:
            try:
                value = batch(leaf)
            except Exception:  # noqa: BLE001 - the one-sample path gives the error its own words
                return None
            if not isinstance(value, Tensor) or value.shape != xs.shape[:1] or not value.requires_grad:
                return None
            if not _checks.block_memo("own_leaf", energy, lambda: _reaches_only(value, leaf)):
                return None
        else:
            value = plain_batch(energy, batch)(leaf)
        (grad,) = torch.autograd.grad(value.sum(), leaf)
    return value.detach(), grad


def _reaches_only(value: Tensor, leaf: Tensor) -> bool:
    """Whether ``value``'s autograd graph reaches no leaf tensor but ``leaf``."""
    seen, todo = set(), [value.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        held = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf that requires grad
        if held is not None and held is not leaf:
            return False
        todo.extend(n for n, _ in node.next_functions)
    return True


def _one_sample_of_a_batch(energy, batch, mapped: bool, one, x: Tensor) -> tuple[Tensor, Tensor]:
    """One sample of a batched energy (or of a one-sample function, ``mapped``). Under one ``vmap``
    over plain samples (``vmap(alg.init)``) the batch form runs on the whole batch, by
    ``torch.autograd.grad``, as a step does: one forward and one backward instead of a
    ``torch.func.grad`` per sample (whose first use also imports Dynamo, a second or more).
    Anywhere else, ``one`` (the one-sample form)."""
    if mapped and x.device.type not in _AUTOGRAD_DEVICES:
        return one(x)
    found = _vmapped_batch(energy, x)
    if found is None:
        return one(x)
    xs, level = found
    with _outside_vmap():
        pair = _autograd_pair(energy, batch, mapped, xs)
    if pair is None:
        return one(x)
    return _add_batch_dim(pair[0], 0, level), _add_batch_dim(pair[1], 0, level)


try:  # functorch's own wrappers, as torch.func uses them; without them, the one-sample form serves
    from torch._C._functorch import _add_batch_dim, _unwrap_batched, is_batchedtensor, maybe_current_level
    from torch._C._functorch import maybe_get_level
    from torch._functorch.pyfunctorch import temporarily_pop_interpreter_stack as _outside_vmap
except ImportError:  # pragma: no cover - another torch
    _outside_vmap = None


def _vmapped_batch(energy: object, x: Tensor) -> tuple[Tensor, int] | None:
    """``(the batch (n, *event), vmap level)`` when ``x`` is one sample of a plain batch under the
    innermost ``vmap`` and nothing asks for a graph through the energy; else ``None``."""
    if _outside_vmap is None or torch.compiler.is_compiling() or not is_batchedtensor(x):
        return None
    level = maybe_get_level(x)
    if level != maybe_current_level() or torch.is_inference_mode_enabled():
        return None
    xs, bdim = _unwrap_batched(x, level)
    if torch._C._functorch.is_functorch_wrapped_tensor(xs) or xs.requires_grad:
        return None  # nested transforms: the general path
    for t in pytree.tree_leaves(energy):
        if isinstance(t, Tensor) and (t.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(t)):
            return None
    return xs.movedim(bdim, 0), level


def _plain_eager(energy: object, xs: Tensor) -> bool:
    """Eager plain tensors, and no graph asked for through the energy (``torch.autograd.grad`` may serve)."""
    if not _checks.is_concrete(xs) or xs.requires_grad or torch.is_inference_mode_enabled():
        return False
    # the energy's leaves are walked once per eager block of steps (no user code changes them there)
    return _checks.block_memo("plain_eager", energy, lambda: not any(
        isinstance(t, Tensor) and (t.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(t))
        for t in pytree.tree_leaves(energy)))


def score(energy: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``x -> -dE/dx``, the score ``grad log p`` of ``p ∝ exp(-E)``: ``x: (dim,)`` -> ``(dim,)``."""
    _check(energy)
    grad = torch.func.grad(energy)

    def fn(x: Tensor) -> Tensor:
        return -grad(x)

    return fn
