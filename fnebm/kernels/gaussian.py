"""Gaussian energy and score with a full precision matrix, for a batch, in one pass.

For ``x: (*batch, d)``, ``mean: (d,)`` and a precision matrix ``P: (d, d)``:

``delta = x - mean``, ``g = delta @ P``, ``energy = 0.5 * (delta * g).sum(-1)``, ``score = -g``

— the energy ``0.5 (x - mean)^T P (x - mean)`` of :class:`fnebm.energies.Gaussian` and its score
``-grad E``. One program of the Triton kernel takes a block of rows and, tile by tile over the
output's columns, accumulates ``delta @ P`` with ``tl.dot`` (float32 products, no TF32), writes
that tile of the score and adds its share of the energy, so ``P`` is read once per block of rows
and the energy needs no second pass.

Three pieces, as in Triton's tutorials:

* :func:`gaussian_energy_score_kernel` — the ``@triton.jit`` kernel;
* :func:`gaussian_energy_score_torch` — the pure-torch twin, which defines it (any float dtype);
* :func:`gaussian_energy_score` — the launcher, registered as the op
  ``torch.ops.fnebm.gaussian_energy_score`` (``triton_op`` on a GPU, ``custom_op`` with a fake
  under ``TRITON_INTERPRET=1``), differentiable in ``x``, ``mean`` and ``precision`` (the
  backward is torch, from the saved inputs).

``tl.dot`` needs tiles of at least 16 along each axis: smaller batches and dimensions are
padded with masked (zero) loads, so every ``d >= 1`` runs. The energy is ``0.5 delta . (delta P)``,
not ``Gaussian.__call__``'s ``0.5 |delta L|^2`` through the Cholesky factor: the same number to
float tolerance, one matrix product instead of two.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:  # the twin works without triton; the kernel and the op need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

HAS_TRITON = triton is not None

__all__ = ["HAS_TRITON", "gaussian_energy_score", "gaussian_energy_score_torch"]

_DTYPES = (torch.float32,)
# Rows per program, score columns per tile, reduction depth per tl.dot. Untuned on a GPU; chosen
# so that ptxas (sm_90a) allocates no spill: 32 x 32 x 32 uses 168 registers a thread, while
# 32 x 128 x 64 spilled 1.8 KB (float32 "ieee" dots keep both operands in registers).
_BLOCK_N = 32
_MAX_BLOCK_J = 32
_MAX_BLOCK_K = 32


def _check(x, mean, precision, dtypes):
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point or x.ndim < 1:
        raise TypeError(f"x must be a floating-point tensor (*batch, d), got {getattr(x, 'dtype', type(x).__name__)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"x must have dtype in {[str(t) for t in dtypes]} for the Triton kernel, got {x.dtype} "
                        "(gaussian_energy_score_torch takes any float dtype)")
    d = x.shape[-1]
    for name, t, shape in (("mean", mean, (d,)), ("precision", precision, (d, d))):
        if not isinstance(t, Tensor) or tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must be a {x.dtype} tensor of shape {shape} on {x.device} for x of shape "
                             f"{tuple(x.shape)}, got {getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")


def gaussian_energy_score_torch(x: Tensor, mean: Tensor, precision: Tensor) -> tuple[Tensor, Tensor]:
    """The twin: ``(0.5 (delta * (delta @ P)).sum(-1), -(delta @ P))``, ``delta = x - mean``.

    x: ``(*batch, d)``; mean: ``(d,)``; precision: ``(d, d)``. Returns energy ``batch`` and score
    ``(*batch, d)``. Any float dtype; differentiable by autograd.
    """
    _check(x, mean, precision, dtypes=None)
    delta = x - mean
    g = delta @ precision
    return 0.5 * (delta * g).sum(-1), -g


def _tiles(d: int) -> tuple[int, int]:
    return (min(_MAX_BLOCK_J, max(16, triton.next_power_of_2(d))),
            min(_MAX_BLOCK_K, max(16, triton.next_power_of_2(d))))


if HAS_TRITON:

    @triton.jit
    def gaussian_energy_score_kernel(x_ptr, mu_ptr, p_ptr, e_ptr, s_ptr, n, d,
                                     BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
        """Rows ``BLOCK_N * pid ..`` of ``x (n, d)``: ``s = -(x - mu) @ P`` and
        ``e = 0.5 sum((x - mu) * (x - mu) @ P)``, all contiguous float32; masked past ``n`` and ``d``."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]  # (BLOCK_N, 1)
        live_r = rows < n
        row = rows.to(tl.int64) * d
        energy = tl.zeros((BLOCK_N, 1), dtype=tl.float32)
        for j0 in range(0, d, BLOCK_J):
            cols = j0 + tl.arange(0, BLOCK_J)[None, :]  # (1, BLOCK_J)
            live_j = cols < d
            acc = tl.zeros((BLOCK_N, BLOCK_J), dtype=tl.float32)
            for k0 in range(0, d, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                live_k = ks < d
                delta = (tl.load(x_ptr + row + ks[None, :], mask=live_r & live_k[None, :], other=0.0)
                         - tl.load(mu_ptr + ks[None, :], mask=live_k[None, :], other=0.0))
                delta = tl.where(live_r & live_k[None, :], delta, 0.0)
                p = tl.load(p_ptr + ks[:, None].to(tl.int64) * d + cols, mask=live_k[:, None] & live_j, other=0.0)
                acc = tl.dot(delta, p, acc, input_precision="ieee")
            mask = live_r & live_j
            delta_j = (tl.load(x_ptr + row + cols, mask=mask, other=0.0)
                       - tl.load(mu_ptr + cols, mask=live_j, other=0.0))
            energy += tl.sum(tl.where(mask, delta_j * acc, 0.0), axis=1, keep_dims=True)
            tl.store(s_ptr + row + cols, -acc, mask=mask)
        tl.store(e_ptr + rows, 0.5 * energy, mask=live_r)

    def _launch(x: Tensor, mean: Tensor, precision: Tensor) -> tuple[Tensor, Tensor]:
        # torch ops and one wrap_triton launch (on a GPU this body is the op's fake too)
        batch, d = tuple(x.shape[:-1]), x.shape[-1]
        n = math.prod(batch)
        x2 = x.reshape(n, d).contiguous()
        energy = torch.empty(batch, dtype=x.dtype, device=x.device)
        score = torch.empty(batch + (d,), dtype=x.dtype, device=x.device)
        if n == 0:
            return energy, score
        block_j, block_k = _tiles(d)
        torch.library.wrap_triton(gaussian_energy_score_kernel)[(triton.cdiv(n, _BLOCK_N),)](
            x2, mean.contiguous(), precision.contiguous(), energy, score, n, d,
            BLOCK_N=_BLOCK_N, BLOCK_J=block_j, BLOCK_K=block_k,
        )
        return energy, score

    INTERPRETED = not isinstance(gaussian_energy_score_kernel, triton.runtime.jit.JITFunction)
    _register = torch.library.custom_op if INTERPRETED else torch.library.triton_op
    _op = _register("fnebm::gaussian_energy_score", _launch, mutates_args=())

    if INTERPRETED:  # see fnebm.kernels.langevin_update: opaque op with an explicit fake

        @_op.register_fake
        def _(x, mean, precision):
            return (torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device),
                    torch.empty(x.shape, dtype=x.dtype, device=x.device))

    def _setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def _backward(ctx, g_energy, g_score):
        # E = 0.5 delta P delta^T, S = -delta P, per row: dL/d delta = gE 0.5 delta (P + P^T) - gS P^T,
        # dL/dx = dL/d delta, dL/dmean = -sum_rows dL/d delta, dL/dP = delta^T (0.5 gE delta - gS).
        x, mean, precision = ctx.saved_tensors
        d = x.shape[-1]
        delta = (x - mean).reshape(-1, d)
        ge = g_energy.reshape(-1, 1)
        gs = g_score.reshape(-1, d)
        d_delta = ge * (0.5 * (delta @ precision + delta @ precision.mT)) - gs @ precision.mT
        d_x = d_delta.reshape(x.shape) if ctx.needs_input_grad[0] else None
        d_mean = -d_delta.sum(0) if ctx.needs_input_grad[1] else None
        d_p = delta.mT @ (0.5 * ge * delta - gs) if ctx.needs_input_grad[2] else None
        return d_x, d_mean, d_p

    _op.register_autograd(_backward, setup_context=_setup_context)

else:  # pragma: no cover
    INTERPRETED = False


def gaussian_energy_score(x: Tensor, mean: Tensor, precision: Tensor) -> tuple[Tensor, Tensor]:
    """Energy and score of a Gaussian with a full precision matrix, through the Triton kernel
    (the op ``torch.ops.fnebm.gaussian_energy_score``).

    Same arguments and result as :func:`gaussian_energy_score_torch`, for float32 on a device
    Triton runs on (agreeing to float tolerance: the sums run in another order). Metadata
    checks only, so it traces under ``torch.compile(fullgraph=True)``. For an energy from
    :func:`fnebm.energies.gaussian`: ``gaussian_energy_score(x, g.mean, g.precision)``.
    """
    if not HAS_TRITON:
        raise RuntimeError("gaussian_energy_score needs triton; gaussian_energy_score_torch computes the same "
                           "without it")
    _check(x, mean, precision, dtypes=_DTYPES)
    return torch.ops.fnebm.gaussian_energy_score(x, mean, precision)
