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

Euler–Maruyama's whole update, the leapfrog's steps, MALA's proposal densities' elementwise part and
the rows' finiteness checks run in C where the caller passes fnebm's loaded draws library
(:func:`euler_maruyama`, :func:`axpy`, :func:`mala_diff`, :func:`rows_finite`: one pass each, where
NumPy made two to seven, the same bits; ``fnebm/kernels/_cpu_random.c``), else in NumPy. The C
helpers apply from :data:`C_MIN` values up (below the grain size too: one call in place of torch's
operations, each a dispatch of several microseconds), NumPy's passes from :data:`GRAIN` up.

Lowest layer: imports torch (and NumPy, on first use).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["GRAIN", "C_MIN", "views", "plain", "tensor", "axpy", "euler_maruyama", "mala_diff", "rows_finite"]

GRAIN = 32768  # torch's internal grain size: below it an elementwise operation runs on one thread anyway
# The C helpers from this many values up (below GRAIN too: one call in place of torch's two to four
# operations, each a dispatch of several microseconds; 10,000 chains of a 2-D position: Langevin's
# update about 25 against 60 us)
C_MIN = 1024


def views(*tensors: Tensor, min_size: int = GRAIN):
    """NumPy views of ``tensors`` when :func:`plain` allows (at least ``min_size`` values, GRAIN by
    default); else ``None`` (the caller runs torch's operations)."""
    if not plain(*tensors, min_size=min_size):
        return None
    try:
        return tuple(t.numpy() for t in tensors)
    except RuntimeError:  # no NumPy
        return None


def plain(*tensors: Tensor, min_size: int = GRAIN) -> bool:
    """Whether the first of ``tensors`` has at least ``min_size`` values and every one is an eager plain
    CPU float32/float64 tensor of the first's dtype that autograd does not track and that is not a lazy
    negation, each either contiguous of the first's shape or a smaller one that broadcasts to it (a
    per-chain or 0-dim parameter), and nothing intercepts torch's operations (a ``torch.func``
    transform, a compile, forward-mode AD, a dispatch or torch-function mode: ``make_fx`` would bake a
    NumPy or C result into its graph). The C helpers read such tensors' memory through their data
    pointers (checked here without making NumPy views: 5 tensors' views cost about 10 us)."""
    first = tensors[0]
    if type(first) is not Tensor or first.numel() < min_size or not first.is_contiguous() or _intercepted():
        return False
    dtype, shape, size = first.dtype, first.shape, first.numel()
    if dtype not in (torch.float32, torch.float64):
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for t in tensors:
        if type(t) is not Tensor or not t.is_cpu or t.dtype != dtype or t.requires_grad or t.is_neg() or wrapped(t):
            return False
        if t.shape == shape:
            if not t.is_contiguous():
                return False
        elif t.numel() >= size or t.dim() > len(shape) or any(
                d != 1 and d != shape[i] for i, d in enumerate(t.shape, len(shape) - t.dim())):
            return False  # not a smaller operand that broadcasts to the first's shape
    return True


_MODE_KEYS = None  # the infrastructure's dispatch-mode keys (fake, proxy, functional), looked up once


def _intercepted(function_modes: bool = True) -> bool:
    """Whether something would see (or needs) torch's operations here: a compile, a ``torch.func``
    transform, forward-mode AD, a dispatch mode, and (``function_modes``) a torch-function mode."""
    global _MODE_KEYS
    if (torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None
            or (function_modes and torch._C._is_torch_function_mode_enabled())
            or getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0
            or torch._C._len_torch_dispatch_stack() > 0):  # a user's dispatch mode
        return True
    if _MODE_KEYS is None:
        keys = getattr(torch._C, "_TorchDispatchModeKey", None)
        _MODE_KEYS = tuple(keys.__members__.values()) if keys is not None else ()
    get = torch._C._get_dispatch_mode
    return any(get(k) is not None for k in _MODE_KEYS)


def tensor(array) -> Tensor:
    """A NumPy result as a torch tensor (its memory, no copy)."""
    return torch.from_numpy(array)


def axpy(y: Tensor, sign: float, a: Tensor, x: Tensor, lib=None) -> Tensor:
    """``y + a * x`` (``sign`` 1) or ``y - a * x`` (``sign`` -1), as torch's two operations compute it:
    in one C pass of ``lib`` (fnebm's draws library, when the caller passes it) or in NumPy, on one
    thread, where :func:`views` allows; else torch's operations."""
    if lib is not None and _C and x.shape == y.shape and isinstance(a, Tensor) and plain(y, a, x, min_size=C_MIN):
        ra = _rows(a, y)
        if ra is not None:
            out = torch.empty_like(y)
            step = lib.fnebm_axpy_f32 if y.dtype == torch.float32 else lib.fnebm_axpy_f64
            step(ra[0], y.numel() // ra[0], y.data_ptr(), 1 if sign > 0 else -1, a.data_ptr(), ra[1], x.data_ptr(),
                 out.data_ptr())
            return out
    arrays = views(y, a, x)
    if arrays is None:
        return y + a * x if sign > 0 else y - a * x
    import numpy as np

    yn, an, xn = arrays
    out = np.multiply(an, xn)
    (np.add if sign > 0 else np.subtract)(yn, out, out=out)
    return tensor(out)


_C = True  # False: NumPy's passes only (A/B, tests)


_MIN_ROW = 16  # values a row at least, for the C helpers' per-row operands


def _rows(t: Tensor, like: Tensor) -> tuple[int, int] | None:
    """``(rows, stride)`` of a tunable ``t`` broadcast against ``like``: one value (stride 0), or one per
    row of ``like``'s leading axes (``t`` of ``like``'s leading shape then size-1 axes, stride 1)."""
    if t.numel() == 1:
        return 1, 0
    shape = tuple(t.shape)
    j = len(shape)
    while j and shape[j - 1] == 1:
        j -= 1
    if (len(shape) != like.dim() or shape[:j] != tuple(like.shape[:j]) or not t.is_contiguous()
            or like.numel() < _MIN_ROW * t.numel()):  # rows of a few values: NumPy's broadcast is faster
        return None
    return t.numel(), 1


def euler_maruyama(lib, x: Tensor, step_size: Tensor, grad: Tensor, scale: Tensor, noise: Tensor) -> Tensor | None:
    """``(x - step_size * grad) + scale * noise`` in one C pass of ``lib`` (fnebm's draws library, or
    ``None``) with torch's bits (each operation rounded once), or ``None`` where it does not apply
    (then :func:`axpy` twice)."""
    if (lib is None or not _C or grad.shape != x.shape or noise.shape != x.shape
            or not plain(x, step_size, grad, scale, noise, min_size=C_MIN)):
        return None
    rh, rc = _rows(step_size, x), _rows(scale, x)
    if rh is None or rc is None:
        return None
    rows = max(rh[0], rc[0])
    if rh[0] not in (1, rows) or rc[0] not in (1, rows):
        return None
    out = torch.empty_like(x)
    em = lib.fnebm_em_f32 if x.dtype == torch.float32 else lib.fnebm_em_f64
    em(rows, x.numel() // rows, x.data_ptr(), grad.data_ptr(), noise.data_ptr(), step_size.data_ptr(), rh[1],
       scale.data_ptr(), rc[1], out.data_ptr(), None)
    return out


def mala_diff(lib, x: Tensor, proposal: Tensor, grad: Tensor, new_grad: Tensor, h: Tensor) -> Tensor | None:
    """MALA's ``f * f - b * b`` with ``f = (proposal - x) + h grad``, ``b = (x - proposal) + h new_grad``
    (each operation rounded once) in one C pass of ``lib``, or ``None`` where it does not apply."""
    if (lib is None or not _C or not (proposal.shape == grad.shape == new_grad.shape == x.shape)
            or not plain(x, proposal, grad, new_grad, h, min_size=C_MIN)):
        return None
    rh = _rows(h, x)
    if rh is None:
        return None
    out = torch.empty_like(x)
    diff = lib.fnebm_mala_diff_f32 if x.dtype == torch.float32 else lib.fnebm_mala_diff_f64
    diff(rh[0], x.numel() // rh[0], x.data_ptr(), proposal.data_ptr(), grad.data_ptr(), new_grad.data_ptr(),
         h.data_ptr(), rh[1], out.data_ptr())
    return out


def rows_finite(lib, ok, array) -> bool:
    """``ok &= `` whether each row of the C-contiguous float32/float64 NumPy ``array`` (rows: ``ok``'s
    length, a contiguous bool array) is finite, in C (``lib``: fnebm's draws library, or ``None``);
    ``False`` where it does not apply (the caller then uses NumPy)."""
    if lib is None or not _C or array.dtype.kind != "f" or array.itemsize not in (4, 8) or not array.flags.c_contiguous:
        return False
    import numpy as np

    if not ok.flags.c_contiguous or not ok.flags.writeable or ok.dtype != np.bool_:
        return False
    n_rows = ok.size
    if n_rows == 0 or array.size % n_rows:
        return False
    check = lib.fnebm_rows_finite_f32 if array.itemsize == 4 else lib.fnebm_rows_finite_f64
    check(n_rows, array.size // n_rows, array.ctypes.data, ok.ctypes.data)
    return True
