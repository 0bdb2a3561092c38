"""Gradient helpers on ``torch.func``: energy value and gradient, and the score.

Each takes an energy ``E: (dim,) -> ()`` for one sample and returns a function of one
sample; batch it over chains with ``torch.func.vmap``. Both trace under
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from fnebm import _checks
from fnebm.energies.base import Energy

__all__ = ["value_and_grad", "score"]


def _check(energy: object) -> None:
    _checks.check_callable("energy", energy, "x -> E(x)")


def _closed_form(energy: object) -> bool:
    """An analytic family (an :class:`~fnebm.energies.Energy` whose class writes out ``grad``)."""
    return isinstance(energy, Energy) and type(energy).grad is not Energy.grad


def value_and_grad(energy: Callable[[Tensor], Tensor]) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """``x -> (E(x), dE/dx)``: ``x: (dim,)`` -> ``((), (dim,))``.

    For the analytic families (an :class:`~fnebm.energies.Energy` with a closed-form ``grad``,
    checked against autograd in the tests) the pair is ``(energy(x), energy.grad(x))``: no
    autograd pass, so an eager step is cheaper and a compiled graph smaller and quicker to
    build; gradients through it (w.r.t. the energy's parameters or the position) still flow,
    by autograd of those formulas. Any other energy: one backward pass of ``torch.func`` gives
    both, which is why samplers cache the pair.
    """
    _check(energy)
    if _closed_form(energy):
        def closed(x: Tensor) -> tuple[Tensor, Tensor]:
            return energy(x), energy.grad(x)

        return closed
    grad_and_value = torch.func.grad_and_value(energy)

    def fn(x: Tensor) -> tuple[Tensor, Tensor]:
        grad, value = grad_and_value(x)  # torch.func orders them (grad, value)
        return value, grad

    return fn


def score(energy: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``x -> -dE/dx``, the score ``grad log p`` of ``p ∝ exp(-E)``: ``x: (dim,)`` -> ``(dim,)``."""
    _check(energy)
    grad = torch.func.grad(energy)

    def fn(x: Tensor) -> Tensor:
        return -grad(x)

    return fn
