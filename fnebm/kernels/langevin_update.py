"""Fused Langevin update: ``x' = x - h grad + noise_scale sqrt(2 h) xi`` in one pass, noise in-kernel.

Given positions ``x: (*chains, *event)``, their energy gradients (computed by torch, any
energy), keys ``(*chains, 2)``, and a step size and noise scale (0-dim or one per chain), the
Triton kernel reads ``x`` and ``grad`` once and writes ``x'``: the standard normals ``xi`` are
drawn inside the kernel from the Philox stream of :mod:`fnebm.random`, so no noise tensor is
ever in memory. It is the proposal of unadjusted Langevin and of MALA.

Three pieces, as in Triton's tutorials:

* :func:`langevin_update_kernel` — the ``@triton.jit`` kernel;
* :func:`langevin_update_torch` — its pure-torch twin, which defines what it computes:
  ``x - h * grad + (noise_scale * sqrt(2 h)) * fnebm.random.normal(key, event_shape)``;
* :func:`langevin_update` — the launcher, registered as the torch op
  ``torch.ops.fnebm.langevin_update`` with ``torch.library.triton_op`` (the kernel launched
  through ``torch.library.wrap_triton``), so it sits inside ``torch.compile`` graphs.

**Same key, same noise.** Chain ``c`` (flat index over ``chains``) draws
``fnebm.random.normal(keys[c], event_shape)``: ``d = prod(event_shape)`` numbers from
``m = ceil(d / 4)`` Philox blocks under the seed ``k0 | k1 << 32`` (:func:`fnebm.random.triton_seed`),
element ``i`` being lane ``i // m`` of block ``i % m``. The kernel computes ``tl.randn4x(seed_c, b)``
for a tile of chains and blocks ``b`` and writes its four lanes to ``b, b + m, b + 2m, b + 3m``.
A single key ``(2,)`` makes the whole of ``x`` one draw (``chains = ()``), as
``fnebm.random.normal(key, x.shape)`` does.

The kernel covers float32 on any device Triton runs on (a GPU, or the CPU under
``TRITON_INTERPRET=1``); other dtypes raise (:func:`langevin_update_torch` handles every
float dtype). Arithmetic is in ``x``'s dtype: the step size and noise scale are cast to it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import random as fr

try:  # the twin works without triton; the kernel and the op need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

HAS_TRITON = triton is not None

__all__ = ["HAS_TRITON", "INTERPRETED", "langevin_update", "langevin_update_torch", "langevin_update_kernel"]

# Philox blocks per program (each gives four numbers): a 2-D tile of BLOCK_C chains by BLOCK_B
# blocks with BLOCK_C * BLOCK_B = _TILE, so a chain of 2 numbers and one of 10^6 both fill it.
_TILE = 256
_DTYPES = (torch.float32,)


def _split(x: Tensor, key: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    chains = tuple(key.shape[:-1])
    return chains, tuple(x.shape[len(chains):])


def _per_chain(name: str, value: Tensor, chains: tuple[int, ...], n_event: int, like: Tensor) -> Tensor:
    # () stays 0-dim; (*chains,) gets trailing singleton event axes to broadcast against x.
    value = value.to(like.dtype)
    return value if value.ndim == 0 else value.reshape(chains + (1,) * n_event)


def langevin_update_torch(x: Tensor, grad: Tensor, key: Tensor, step_size: Tensor | float,
                          noise_scale: Tensor | float = 1.0) -> Tensor:
    """The twin: ``x - h grad + (noise_scale sqrt(2 h)) fnebm.random.normal(key, event_shape)``.

    x, grad: ``(*chains, *event)``; key: ``(*chains, 2)``; step_size, noise_scale: 0-dim or
    ``chains``. Equals ``fnebm.integrators.euler_maruyama`` with that noise; differentiable in
    ``x``, ``grad``, ``step_size`` and ``noise_scale``; any float dtype.
    """
    step_size, noise_scale = _check(x, grad, key, step_size, noise_scale, dtypes=None)
    chains, event = _split(x, key)
    h = _per_chain("step_size", step_size, chains, len(event), x)
    s = _per_chain("noise_scale", noise_scale, chains, len(event), x)
    noise = fr.normal(key, event, x.dtype)
    return x - h * grad + (s * (2.0 * h).sqrt()) * noise


def _check(x, grad, key, step_size, noise_scale, dtypes):
    """Metadata checks only (free under compile); returns step_size and noise_scale as tensors."""
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"x must have dtype in {[str(d) for d in dtypes]} for the Triton kernel, got {x.dtype} "
                        "(use langevin_update_torch)")
    if not isinstance(grad, Tensor) or grad.shape != x.shape or grad.dtype != x.dtype or grad.device != x.device:
        raise ValueError("grad must be a tensor with x's shape, dtype and device, got "
                         f"{getattr(grad, 'shape', type(grad).__name__)} {getattr(grad, 'dtype', '')}")
    fr.check_key(key)
    chains = tuple(key.shape[:-1])
    if tuple(x.shape[:len(chains)]) != chains or key.device != x.device:
        raise ValueError(f"key must have shape (*chains, 2) with chains a leading part of x's shape "
                         f"{tuple(x.shape)} and x's device, got {tuple(key.shape)} on {key.device}")
    out = []
    for name, value in (("step_size", step_size), ("noise_scale", noise_scale)):
        if not isinstance(value, Tensor):
            value = torch.tensor(_checks.check_real(name, value), dtype=x.dtype, device=x.device)
        if not value.dtype.is_floating_point or value.device != x.device:
            raise TypeError(f"{name} must be a floating-point tensor on x's device, got {value.dtype} on {value.device}")
        if value.ndim != 0 and tuple(value.shape) != chains:
            raise ValueError(f"{name} must be 0-dim or one per chain {chains}, got shape {tuple(value.shape)}")
        out.append(value)
    return tuple(out)


if HAS_TRITON:

    @triton.jit
    def _lane(x_ptr, g_ptr, out_ptr, base, i, d, live, h, scale, z):
        # One Philox lane of the tile: element i of each chain in it (masked past d: the tail).
        mask = live & (i < d)
        x = tl.load(x_ptr + base + i, mask=mask, other=0.0)
        g = tl.load(g_ptr + base + i, mask=mask, other=0.0)
        tl.store(out_ptr + base + i, x - h * g + scale * z, mask=mask)

    @triton.jit
    def langevin_update_kernel(x_ptr, g_ptr, seed_ptr, h_ptr, s_ptr, out_ptr, n_chains, d, m,
                               h_stride, s_stride, BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr):
        """``x' = x - h g + (s sqrt(2h)) z`` on a tile of BLOCK_C chains by BLOCK_B Philox blocks.

        x, g, out: ``(n_chains, d)`` contiguous; seed: ``(n_chains,)`` int64
        (``fnebm.random.triton_seed``); h, s: float32 read at ``c * stride`` (stride 0: one
        value for every chain). Chain c's element i is lane ``i // m`` of Philox block ``i % m``
        of seed c, ``m = ceil(d / 4)``: the noise is ``fnebm.random.normal(keys[c], (d,))``.
        """
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]  # (BLOCK_C, 1) chains
        b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)[None, :]  # (1, BLOCK_B) blocks
        live_c = c < n_chains
        live = live_c & (b < m)
        seed = tl.load(seed_ptr + c, mask=live_c, other=0)
        h = tl.load(h_ptr + c * h_stride, mask=live_c, other=0.0)
        s = tl.load(s_ptr + c * s_stride, mask=live_c, other=0.0)
        scale = s * tl.sqrt_rn(2.0 * h)  # correctly rounded, as torch.sqrt
        z0, z1, z2, z3 = tl.randn4x(tl.broadcast_to(seed, (BLOCK_C, BLOCK_B)),
                                    tl.broadcast_to(b, (BLOCK_C, BLOCK_B)))
        base = c.to(tl.int64) * d
        _lane(x_ptr, g_ptr, out_ptr, base, b, d, live, h, scale, z0)
        _lane(x_ptr, g_ptr, out_ptr, base, b + m, d, live, h, scale, z1)
        _lane(x_ptr, g_ptr, out_ptr, base, b + 2 * m, d, live, h, scale, z2)
        _lane(x_ptr, g_ptr, out_ptr, base, b + 3 * m, d, live, h, scale, z3)

    def _launch(x: Tensor, grad: Tensor, key: Tensor, step_size: Tensor, noise_scale: Tensor) -> Tensor:
        # Torch ops plus one launch through wrap_triton: on a GPU, triton_op registers this as
        # the op's fake implementation too, and torch.compile traces through it to the kernel.
        n_batch = key.ndim - 1
        n_chains = math.prod(key.shape[:-1])
        d = math.prod(x.shape[n_batch:])
        m = (d + 3) // 4
        x = x.contiguous()
        grad = grad.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if n_chains == 0 or d == 0:
            return out
        seeds = fr.triton_seed(key).reshape(n_chains)
        h = step_size.to(x.dtype).reshape(-1).contiguous()
        s = noise_scale.to(x.dtype).reshape(-1).contiguous()
        block_b = min(triton.next_power_of_2(m), _TILE)
        block_c = _TILE // block_b
        grid = (triton.cdiv(n_chains, block_c), triton.cdiv(m, block_b))
        torch.library.wrap_triton(langevin_update_kernel)[grid](
            x, grad, seeds, h, s, out, n_chains, d, m,
            0 if step_size.ndim == 0 else 1, 0 if noise_scale.ndim == 0 else 1,
            BLOCK_C=block_c, BLOCK_B=block_b,
        )
        return out

    # Under TRITON_INTERPRET=1, @triton.jit gives an InterpretedFunction and torch's wrap_triton
    # hands it back unwrapped (torch 2.13), so a triton_op's body, which is also its fake
    # implementation, would launch the interpreter on fake tensors, and AOT tracing would
    # decompose the op into a launch it cannot trace. There the op is an opaque custom_op with
    # an explicit fake instead: compiled graphs hold one call to it, run eagerly.
    INTERPRETED = not isinstance(langevin_update_kernel, triton.runtime.jit.JITFunction)
    _register = torch.library.custom_op if INTERPRETED else torch.library.triton_op
    _langevin_update_op = _register("fnebm::langevin_update", _launch, mutates_args=())

    if INTERPRETED:

        @_langevin_update_op.register_fake
        def _(x, grad, key, step_size, noise_scale):
            return torch.empty_like(x, memory_format=torch.contiguous_format)

    def _setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def _backward(ctx, g_out):
        # d x'/dx = 1, d x'/d grad = -h; for h and s the noise is redrawn from the key (the
        # twin's), so nothing beyond the inputs is saved. Per-chain tunables sum over the event.
        x, grad, key, step_size, noise_scale = ctx.saved_tensors
        chains, event = _split(x, key)
        h = _per_chain("step_size", step_size, chains, len(event), x)
        s = _per_chain("noise_scale", noise_scale, chains, len(event), x)
        out = [g_out, -h * g_out, None, None, None]
        if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
            z = fr.normal(key, event, x.dtype)
            root = (2.0 * h).sqrt()
            for i, tunable, local in ((3, step_size, -grad + (s / root) * z), (4, noise_scale, root * z)):
                if ctx.needs_input_grad[i]:
                    total = g_out * local
                    total = total.sum() if tunable.ndim == 0 else total.flatten(len(chains)).sum(-1)
                    out[i] = total.to(tunable.dtype)
        return tuple(out)

    _langevin_update_op.register_autograd(_backward, setup_context=_setup_context)

else:  # pragma: no cover
    INTERPRETED = False


def langevin_update(x: Tensor, grad: Tensor, key: Tensor, step_size: Tensor | float,
                    noise_scale: Tensor | float = 1.0) -> Tensor:
    """The fused update through the Triton kernel (the op ``torch.ops.fnebm.langevin_update``).

    Same arguments and result as :func:`langevin_update_torch` (to float tolerance: the normals
    agree to about 1e-6), for float32 ``x`` on a device Triton runs on. Checks metadata only,
    so it traces under ``torch.compile(fullgraph=True)``. Differentiable in ``x``, ``grad``,
    ``step_size`` and ``noise_scale`` (the backward redraws the noise from the key in torch).
    """
    if not HAS_TRITON:
        raise RuntimeError("langevin_update needs triton; langevin_update_torch computes the same without it")
    step_size, noise_scale = _check(x, grad, key, step_size, noise_scale, dtypes=_DTYPES)
    return torch.ops.fnebm.langevin_update(x, grad, key, step_size, noise_scale)
