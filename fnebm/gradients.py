"""Gradient helpers on ``torch.func``: energy value and gradient, and the score.

Each takes an energy ``E: (dim,) -> ()`` for one sample and returns a function of one
sample; batch it over chains with ``torch.func.vmap``, or give :func:`value_and_grad` the
number of chain axes (what the samplers do), which also uses an energy's whole-batch form
where it has one. Both trace under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fnebm import _checks
from fnebm.energies.base import Energy
from fnebm.energies.neural import batch_form

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
    grad_and_value = torch.func.grad_and_value(energy)

    def fn(x: Tensor) -> tuple[Tensor, Tensor]:
        grad, value = grad_and_value(x)  # torch.func orders them (grad, value)
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
    form to float rounding (a matrix product over a batch may sum in another order).
    """
    _check(energy)
    chain_ndim = _checks.check_int("chain_ndim", chain_ndim, 0)
    batch = None if chain_ndim == 0 or _closed_form(energy) else batch_form(energy)
    if batch is None:
        fn = _one_sample(energy)
        for _ in range(chain_ndim):
            fn = torch.func.vmap(fn)
        return fn

    def batched(x: Tensor) -> tuple[Tensor, Tensor]:
        chains = x.shape[:chain_ndim]
        xs = x.flatten(0, chain_ndim - 1)  # (n, *event); a view for contiguous chain axes
        if _plain_eager(energy, xs):
            with torch.enable_grad():
                leaf = xs.detach().requires_grad_(True)
                value = batch(leaf)
                (grad,) = torch.autograd.grad(value.sum(), leaf)
            value = value.detach()
        else:
            value, pullback = torch.func.vjp(batch, xs)
            (grad,) = pullback(torch.ones_like(value))
        return value.reshape(chains), grad.reshape(x.shape)

    return batched


def _plain_eager(energy: object, xs: Tensor) -> bool:
    """Eager plain tensors, and no graph asked for through the energy (``torch.autograd.grad`` may serve)."""
    if not _checks.is_concrete(xs) or xs.requires_grad or torch.is_inference_mode_enabled():
        return False
    return not any(isinstance(t, Tensor) and t.requires_grad for t in pytree.tree_leaves(energy))


def score(energy: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``x -> -dE/dx``, the score ``grad log p`` of ``p ∝ exp(-E)``: ``x: (dim,)`` -> ``(dim,)``."""
    _check(energy)
    grad = torch.func.grad(energy)

    def fn(x: Tensor) -> Tensor:
        return -grad(x)

    return fn
