"""Large elementwise updates of eager CPU tensors on one thread, in NumPy, with torch's bits.

At or above torch's grain size (32,768 values) an elementwise CPU operation runs on torch's
threads, and on few cores their start and wait cost more than the work: on this project's 2-core
host, with OpenMP's passive wait (which ``import fnebm`` sets), one multiply of 128 x 784 float32
values took 52-69 us on two threads and 11 us on one, and Langevin's update (four operations)
230-300 us against 60 us (docs/performance.md). The samplers' update formulas (Euler-Maruyama, the
leapfrog's momentum and position steps, MALA's proposal densities) therefore run as the same IEEE
operations in the same order in NumPy, which runs them on the calling thread: the same bits, each
operation rounded once (NumPy's ufuncs do not fuse a multiply and an add). Only eagerly, on plain
CPU float tensors of one dtype that nothing tracks (no autograd, no ``torch.func`` transform, no
compile, no tensor subclass): everywhere else the callers run torch's operations.

Lowest layer: imports torch (and NumPy, on first use).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["GRAIN", "views", "tensor"]

GRAIN = 32768  # torch's internal grain size: below it an elementwise operation runs on one thread anyway


def views(*tensors: Tensor):
    """NumPy views of ``tensors`` when the first has at least :data:`GRAIN` values and every one is an
    eager plain CPU float32/float64 tensor of the first's dtype that autograd does not track, and
    their shapes broadcast to the first's; else ``None`` (the caller runs torch's operations)."""
    first = tensors[0]
    if type(first) is not Tensor or first.numel() < GRAIN or torch.compiler.is_compiling():
        return None
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return None
    dtype = first.dtype
    if dtype not in (torch.float32, torch.float64):
        return None
    for t in tensors:
        if (type(t) is not Tensor or t.device.type != "cpu" or t.dtype != dtype or t.requires_grad
                or torch._C._functorch.is_functorch_wrapped_tensor(t)):
            return None
    try:
        import numpy as np

        arrays = tuple(t.numpy() for t in tensors)
        if np.broadcast_shapes(*(a.shape for a in arrays)) != arrays[0].shape:
            return None
    except (ImportError, RuntimeError, ValueError):  # no NumPy; a tensor NumPy cannot view; shapes
        return None
    return arrays


def tensor(array) -> Tensor:
    """A NumPy result as a torch tensor (its memory, no copy)."""
    return torch.from_numpy(array)
