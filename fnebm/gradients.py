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

__all__ = ["value_and_grad", "score"]


def _check(energy: object) -> None:
    _checks.check_callable("energy", energy, "x -> E(x)")


def value_and_grad(energy: Callable[[Tensor], Tensor]) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """``x -> (E(x), dE/dx)``: ``x: (dim,)`` -> ``((), (dim,))``, by autograd.

    One backward pass gives both, which is why samplers cache the pair.
    """
    _check(energy)
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
