"""Symplectic, time-reversible integrators for Hamiltonian dynamics, each one line of coefficients.

``H(x, p) = E(x) + K(p)`` with ``K(p) = 0.5 p^T M^{-1} p``. An integrator is a palindromic
sequence of coefficients alternating momentum and position updates (as BlackJAX's
``mcmc/integrators.py``): for ``(b1, a1, b2, ..., a1, b1)`` one step of size ``h`` is

    p <- p - b1 h grad E(x);  x <- x + a1 h M^{-1} p;  p <- p - b2 h grad E(x);  ...

Velocity Verlet (leapfrog) is ``(1/2, 1, 1/2)``: one gradient per step, energy error O(h^2).
McLachlan's minimum-error two-stage scheme: two gradients per step, O(h^2) with a smaller
constant. Yoshida's triple jump: three gradients per step (one of them a step backwards),
O(h^4). The tests measure each order.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from torch import Tensor

from fnebm import _one_thread
from fnebm import random as _random

__all__ = ["IntegratorState", "velocity_verlet", "mclachlan", "yoshida", "integrate", "gradient_evaluations"]


class IntegratorState(NamedTuple):
    """position, momentum: ``(*chains, d)``; energy: ``chains``; grad: ``dE/dx`` at position."""

    position: Tensor
    momentum: Tensor
    energy: Tensor
    grad: Tensor


velocity_verlet: tuple[float, ...] = (0.5, 1.0, 0.5)

_B1_MCLACHLAN = 0.1931833275037836  # McLachlan (1995), minimising the error constant
mclachlan: tuple[float, ...] = (_B1_MCLACHLAN, 0.5, 1.0 - 2.0 * _B1_MCLACHLAN, 0.5, _B1_MCLACHLAN)

# Yoshida (1990): three leapfrog steps of w1, w0, w1 h with w1 = 1 / (2 - 2^(1/3)), w0 = -2^(1/3) w1
# (one step backwards), fourth order. (BlackJAX's "yoshida" coefficients measure second order.)
_W1 = 1.0 / (2.0 - 2.0 ** (1.0 / 3.0))
_W0 = -(2.0 ** (1.0 / 3.0)) * _W1
yoshida: tuple[float, ...] = (_W1 / 2, _W1, (_W0 + _W1) / 2, _W0, (_W0 + _W1) / 2, _W1, _W1 / 2)


def gradient_evaluations(coefficients: tuple[float, ...]) -> int:
    """Gradient evaluations per step: one per position update."""
    return len(coefficients) // 2


def integrate(
    state: IntegratorState,
    step_size: Tensor,
    energy_and_grad: Callable[[Tensor], tuple[Tensor, Tensor]],
    velocity: Callable[[Tensor], Tensor],
    coefficients: tuple[float, ...] = velocity_verlet,
) -> IntegratorState:
    """One step of the scheme ``coefficients`` (a palindrome of odd length, momentum first).

    step_size broadcasts against ``(*chains, d)`` (a per-chain value has trailing singleton
    axes); ``energy_and_grad`` maps positions ``(*chains, d)`` to ``(chains, (*chains, d))``;
    ``velocity(p) = M^{-1} p``. The coefficients are static (the loop unrolls at trace time).
    """
    if len(coefficients) % 2 == 0 or tuple(coefficients) != tuple(reversed(coefficients)):
        raise ValueError(f"coefficients must be a palindrome of odd length, got {coefficients}")
    x, p, energy, grad = state
    lib = _random._c_helpers(x)  # a large eager CPU state: each step one pass in C (else NumPy's two)
    for i, c in enumerate(coefficients):
        if i % 2 == 0:
            p = _one_thread.axpy(p, -1.0, c * step_size, grad, lib)  # on one thread for a large eager CPU state
        else:
            x = _one_thread.axpy(x, 1.0, c * step_size, velocity(p), lib)
            energy, grad = energy_and_grad(x)
    return IntegratorState(x, p, energy, grad)
