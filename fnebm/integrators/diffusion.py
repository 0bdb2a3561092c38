"""The overdamped Langevin diffusion, one Euler–Maruyama step: shared by Langevin and MALA.

``dX = -grad E(X) dt + sigma sqrt(2) dW`` discretised with step ``h``:
``x' = x - h grad E(x) + sigma sqrt(2 h) xi``, ``xi ~ N(0, I)``.
"""

from __future__ import annotations

from torch import Tensor

from fnebm import _one_thread
from fnebm import random as _random

__all__ = ["euler_maruyama"]


def euler_maruyama(x: Tensor, grad: Tensor, step_size: Tensor, noise: Tensor, noise_scale: Tensor | float = 1.0) -> Tensor:
    """``x - step_size * grad + noise_scale * sqrt(2 step_size) * noise``.

    x, grad, noise: ``(*chains, *event)``; step_size, noise_scale: tensors that broadcast
    against them (0-dim, or per chain with trailing singleton event axes). Differentiable in
    every argument, including the step size.
    """
    # (x - h grad) + scale noise, each step on one thread for a large eager CPU state (fnebm._one_thread)
    scale = noise_scale * (2.0 * step_size).sqrt()
    fused = _one_thread.euler_maruyama(_random._c_helpers(x), x, step_size, grad, scale, noise)  # one C pass, the same bits
    if fused is not None:
        return fused
    return _one_thread.axpy(_one_thread.axpy(x, -1.0, step_size, grad), 1.0, scale, noise)

