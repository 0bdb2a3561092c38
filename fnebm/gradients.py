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
    both, which is why samplers cache the pair. Over chain axes these are mapped with ``vmap``.

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
    batch = None if _closed_form(energy) else batch_form(energy)
    if batch is None or chain_ndim == 0:
        fn = _one_sample(energy)
        for _ in range(chain_ndim):
            fn = torch.func.vmap(fn)
        return fn if batch is None else functools.partial(_one_sample_of_a_batch, energy, batch, fn)

    def batched(x: Tensor) -> tuple[Tensor, Tensor]:
        chains = x.shape[:chain_ndim]
        xs = x.flatten(0, chain_ndim - 1)  # (n, *event); a view for contiguous chain axes
        if _plain_eager(energy, xs):
            with torch.enable_grad():
                leaf = xs.detach().requires_grad_(True)
                value = plain_batch(energy, batch)(leaf)
                (grad,) = torch.autograd.grad(value.sum(), leaf)
            value = value.detach()
        else:
            value, pullback = torch.func.vjp(batch, xs)
            (grad,) = pullback(torch.ones_like(value))
        return value.reshape(chains), grad.reshape(x.shape)

    return batched


def _one_sample_of_a_batch(energy, batch, one, x: Tensor) -> tuple[Tensor, Tensor]:
    """One sample of a batched energy. Under one ``vmap`` over plain samples (``vmap(alg.init)``)
    the batch form runs on the whole batch, by ``torch.autograd.grad``, as a step does: one
    forward and one backward instead of a ``torch.func.grad`` per sample (whose first use also
    imports Dynamo, a second or more). Anywhere else, ``one`` (the one-sample form)."""
    found = _vmapped_batch(energy, x)
    if found is None:
        return one(x)
    xs, level = found
    with _outside_vmap(), torch.enable_grad():
        leaf = xs.detach().requires_grad_(True)
        value = plain_batch(energy, batch)(leaf)
        (grad,) = torch.autograd.grad(value.sum(), leaf)
    return _add_batch_dim(value.detach(), 0, level), _add_batch_dim(grad, 0, level)


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
