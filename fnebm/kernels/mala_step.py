"""MALA's step around *any* energy on a CUDA device, eagerly: the proposal and the accept/reject
each one Triton launch.

:mod:`fnebm.samplers.mala` computes a step as the split of the key, the normal draws, the
Euler–Maruyama proposal, the energy and gradient at the proposal (the user's function or
network: not ours to fuse), the log acceptance ratio, the finiteness check, the uniform and the
select of the new state. Eagerly on a GPU the parts around the energy are some fifty small
kernels a step (a 1,024-chain logistic regression on an H100: 0.2 ms a step of GPU time, where
XLA fuses BlackJAX's step into a few kernels). Here they are two:

* :func:`propose` — ``fnebm.random.split(key)``, ``normal(k0, event)`` (the operations of
  :mod:`fnebm._philox_triton`'s draw kernel, whose bits the eager draws on a CUDA device are) and
  ``x - h grad + sqrt(2 h) z``, rounded as torch's separate operations round them (no fused
  multiply-add);
* :func:`accept` — ``log alpha`` (:func:`fnebm.samplers.mala.log_acceptance_ratio`'s terms),
  the finiteness of the new energy, gradient and ``log alpha``, ``uniform(k1, ())`` and the
  select of position, energy and gradient, with MALA's info.

The draws are ``fnebm.random``'s (the uniform's bits exactly, the normals' those of the eager
CUDA path); ``log alpha`` sums the event in another order than torch's ``sum``, so it can differ
from the torch path's in its last bits, and a decision can differ only where the uniform falls
within those bits of ``alpha``. :mod:`fnebm.samplers.mala` takes this path eagerly on CUDA
tensors outside ``torch.compile`` and ``torch.func`` transforms, where nothing asks autograd for
a gradient through the step, for float32 and float64 states; everywhere else (the CPU, compiled
code, a gradient through the chain) it runs its torch operations. Tested against them under
``TRITON_INTERPRET=1`` (``tests/test_mala_step.py``).
"""

from __future__ import annotations

import math
import struct
import warnings

import torch
from torch import Tensor

from fnebm import _one_thread
from fnebm import random as fr

__all__ = ["MAX_EVENT", "NOTE", "eligible", "propose", "accept", "runs_on"]

# The devices the fused step runs on (the tests add "cpu" to run it under TRITON_INTERPRET=1).
_DEVICES = ("cuda",)
_DTYPES = (torch.float32, torch.float64)
# in a sample_chain plan's reason (fnebm.chain.sample) for MALA's eager steps on such a device
NOTE = "MALA's proposal and accept/reject run as two Triton launches a step around the energy (fnebm.kernels.mala_step)"
_kernels = None  # (propose_kernel, accept_kernel), False where triton cannot be imported
_BLOCK = 256  # propose: (chain, Philox block) pairs a program
_ROW = 256  # accept: event elements a program reads at a time (one program a chain)
# accept runs one program a chain over its event: past this many values a chain (few chains of a
# very large event would leave the GPU idle), the torch operations
MAX_EVENT = 1 << 16


def _load():
    global _kernels
    if _kernels is None:
        try:
            from fnebm.kernels import _mala_step_triton as k
        except ImportError:  # pragma: no cover - CUDA builds of torch bring triton
            _kernels = False
        else:
            _kernels = (k.propose_kernel, k.accept_kernel)
    return _kernels or None


def runs_on(device: torch.device) -> bool:
    """Whether MALA's eager steps on ``device`` can take the fused step at all (triton loads)."""
    return device.type in _DEVICES and _load() is not None


def _plain(t) -> bool:
    return (type(t) is Tensor and not t.requires_grad and t.device.type in _DEVICES
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def eligible(x: Tensor, energy: Tensor, grad: Tensor, key: Tensor, h: Tensor) -> bool:
    """Whether :func:`propose` and :func:`accept` take this step: eager plain tensors on a device
    of ``_DEVICES`` that autograd does not track (no compile, ``torch.func`` transform, forward-mode
    AD or dispatch mode), a float32/float64 state ``x, grad: (*chains, *event)`` of at most
    :data:`MAX_EVENT` values a chain, ``energy: chains``, ``key: (*chains, 2)``, and ``h`` MALA's
    step size as :func:`fnebm.samplers.base.per_chain` gives it (a 0-dim host scalar, or one value
    or one per chain on the device)."""
    if x.device.type not in _DEVICES or _one_thread._intercepted(function_modes=False):
        return False
    if not (_plain(x) and _plain(energy) and _plain(grad) and _plain(key)):
        return False
    if x.dtype not in _DTYPES or grad.dtype != x.dtype or energy.dtype != x.dtype or key.dtype != torch.int64:
        return False
    batch = tuple(key.shape[:-1])
    if (key.shape[-1:] != (2,) or tuple(energy.shape) != batch or tuple(x.shape[: len(batch)]) != batch
            or grad.shape != x.shape or x.device != key.device or grad.device != x.device
            or energy.device != x.device or math.prod(x.shape[len(batch):]) > MAX_EVENT):
        return False
    if type(h) is not Tensor or h.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(h):
        return False
    if h.dtype != x.dtype:
        return False
    if not _host(h) and (h.device != x.device or h.numel() not in (1, math.prod(batch))):
        return False
    return _load() is not None


def _host(h: Tensor) -> bool:
    # a 0-dim CPU step size (per_chain's host scalar beside device tensors): passed by value
    return h.ndim == 0 and h.device.type == "cpu"


def _h_args(h: Tensor, like: Tensor):
    """``(h_ptr, h_stride, h_bits, HOST)``: a host scalar travels as its float64 bits (Triton takes
    a Python float as float32), a device tensor as a pointer with stride 0 (one value) or 1."""
    if _host(h):
        bits = struct.unpack("<q", struct.pack("<d", float(h)))[0]
        return like, 0, bits, True
    flat = h.reshape(-1).contiguous()
    return flat, 0 if flat.numel() == 1 else 1, 0, False


def _keys(key: Tensor) -> Tensor:
    return key.reshape(-1, 2)


def propose(x: Tensor, grad: Tensor, key: Tensor, h: Tensor) -> Tensor | None:
    """``x - h grad + sqrt(2 h) normal(split(key)[..., 0, :], event)``: one launch (see the module);
    ``None`` if the kernel failed to build or launch here (then the torch operations)."""
    propose_kernel, _ = _load()
    n_chains = math.prod(key.shape[:-1])
    x, grad = x.contiguous(), grad.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    n = x.numel() // max(n_chains, 1)
    if out.numel() == 0:
        return out
    kw = _keys(key)
    m = -(-n // 4)
    h_ptr, h_stride, h_bits, host = _h_args(h, x)
    ok = _launch(propose_kernel, (-(-(n_chains * m) // _BLOCK),), x.device,
                 x, grad, kw, kw.stride(0), kw.stride(1), h_ptr, h_stride, h_bits, out, n_chains, n, m,
                 HOST=host, F64=x.dtype == torch.float64, BLOCK=_BLOCK)
    return out if ok else None


def accept(x: Tensor, energy: Tensor, grad: Tensor, proposal: Tensor, new_energy: Tensor, new_grad: Tensor,
           key: Tensor, h: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]] | None:
    """MALA's accept/reject of ``proposal`` (see the module): ``((position, energy, grad),
    (acceptance_rate, is_accepted, is_divergent))``, one launch; ``None`` as :func:`propose`.
    ``new_energy, new_grad``: the energy and gradient at ``proposal``; ``key``: the step's key (its
    split's second key draws the uniform)."""
    _, accept_kernel = _load()
    batch = tuple(key.shape[:-1])
    n_chains = math.prod(batch)
    x, grad, proposal = x.contiguous(), grad.contiguous(), proposal.contiguous()
    new_grad, energy, new_energy = new_grad.contiguous(), energy.contiguous(), new_energy.contiguous()
    x_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    g_out = torch.empty_like(grad, memory_format=torch.contiguous_format)
    e_out = torch.empty(batch, dtype=x.dtype, device=x.device)
    rate = torch.empty(batch, dtype=x.dtype, device=x.device)
    accepted = torch.empty(batch, dtype=torch.bool, device=x.device)
    divergent = torch.empty(batch, dtype=torch.bool, device=x.device)
    if n_chains:
        n = x.numel() // n_chains
        kw = _keys(key)
        h_ptr, h_stride, h_bits, host = _h_args(h, x)
        if not _launch(accept_kernel, (n_chains,), x.device,
                       x, energy, grad, proposal, new_energy, new_grad, kw, kw.stride(0), kw.stride(1), h_ptr,
                       h_stride, h_bits, x_out, e_out, g_out, rate, accepted.view(torch.int8),
                       divergent.view(torch.int8), n, HOST=host, F64=x.dtype == torch.float64,
                       BLOCK=min(_ROW, _pow2(n))):
            return None
    return (x_out, e_out, g_out), (rate, accepted, divergent)


def _pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())




def _options() -> dict:
    # torch computes ``x - h * g`` with two roundings: so does the kernel (no fused multiply-add);
    # the interpreter takes no compiler options
    from fnebm.kernels import _mala_step_triton as k

    return {} if k.INTERPRETED else {"enable_fp_fusion": False}


def _launch(kernel, grid, device: torch.device, *args, **meta) -> bool:
    """Launch on ``device`` (Triton launches on the current CUDA device and stream). A kernel that
    fails to build or launch outside a CUDA-graph capture (a GPU or a Triton it does not support)
    turns the fused step off for the process, with a warning, and says so (``False``)."""
    global _kernels
    try:
        with fr._on(device):
            kernel[grid](*args, **meta, **_options())
        return True
    except Exception as e:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise  # the capture's failure: the engine runs the steps one by one
        _kernels = False
        warnings.warn(f"fnebm: MALA's fused step failed on {device} ({type(e).__name__}: {e}); its steps run "
                      "as torch operations from here on", RuntimeWarning, stacklevel=3)
        return False
