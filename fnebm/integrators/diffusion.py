"""The overdamped Langevin diffusion, one Euler–Maruyama step: shared by Langevin and MALA.

``dX = -grad E(X) dt + sigma sqrt(2) dW`` discretised with step ``h``:
``x' = x - h grad E(x) + sigma sqrt(2 h) xi``, ``xi ~ N(0, I)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["euler_maruyama"]


def euler_maruyama(x: Tensor, grad: Tensor, step_size: Tensor, noise: Tensor, noise_scale: Tensor | float = 1.0) -> Tensor:
    """``x - step_size * grad + noise_scale * sqrt(2 step_size) * noise``.

    x, grad, noise: ``(*chains, *event)``; step_size, noise_scale: tensors that broadcast
    against them (0-dim, or per chain with trailing singleton event axes). Differentiable in
    every argument, including the step size.
    """
    scale = noise_scale * (2.0 * step_size).sqrt()
    out = _on_one_thread(x, grad, step_size, noise, scale)
    if out is not None:
        return out
    return x - step_size * grad + scale * noise


# At or above torch's grain size an elementwise CPU operation runs on torch's threads, and on few
# cores their start and wait cost more than the work: on this project's 2-core host (OpenMP's
# passive wait, which `import fnebm` sets), the update of 128 x 784 values took 230-300 us as four
# torch operations and about 60 us on one thread. Eagerly, on plain CPU tensors nothing tracks, it
# runs as the same four IEEE operations in NumPy (one thread): the same bits.
_GRAIN = 32768


def _on_one_thread(x: Tensor, grad: Tensor, step_size: Tensor, noise: Tensor, scale: Tensor | float) -> Tensor | None:
    if x.numel() < _GRAIN or torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None:
        return None
    dtype = x.dtype
    if dtype not in (torch.float32, torch.float64):
        return None
    for t in (x, grad, step_size, noise, scale):
        if (type(t) is not Tensor or t.device.type != "cpu" or t.dtype != dtype or t.requires_grad
                or torch._C._functorch.is_functorch_wrapped_tensor(t)):
            return None
    try:
        import numpy as np

        xn, gn, hn, zn, cn = (t.numpy() for t in (x, grad, step_size, noise, scale))
        if np.broadcast_shapes(xn.shape, gn.shape, hn.shape, zn.shape, cn.shape) != xn.shape:
            return None
        out = np.multiply(hn, gn)
        np.subtract(xn, out, out=out)
        np.add(out, np.multiply(cn, zn), out=out)
    except (ImportError, RuntimeError, ValueError):  # no NumPy; a tensor NumPy cannot view
        return None
    return torch.from_numpy(out)
