"""Whole chains of Langevin or MALA in one launch, for separable analytic energies.

For an energy whose gradient is elementwise in closed form — the families
:mod:`fnebm.kernels.families` lists for ``"triton"`` — one program of the Triton kernel holds a block of chains'
positions, energies and gradients in registers and runs *every* step of the chain: it draws
the step's noise in-kernel from the :mod:`fnebm.random` stream, evaluates the energy and its
gradient at the proposal, accepts or rejects (MALA) or drops a divergent move (Langevin), and
writes the kept draws (burn-in, thinning) straight into the trace buffer. Memory traffic is the
start state, the trace and the final state; nothing else.

Two pieces:

* :func:`langevin_chain_kernel` — the ``@triton.jit`` kernel (``MALA`` a compile-time switch);
* :func:`langevin_chain` / :func:`mala_chain` — the launchers, registered as the torch ops
  ``torch.ops.fnebm.langevin_chain`` and ``torch.ops.fnebm.mala_chain`` (``triton_op`` with
  ``wrap_triton`` on a GPU; ``custom_op`` with a fake under ``TRITON_INTERPRET=1``), and
  :func:`run_into`, the launch that :func:`fnebm.sample_chain` calls.

What the kernel computes is defined by the samplers themselves: ``fnebm.langevin(energy, h,
s).step`` and ``fnebm.mala(energy, h).step`` run with :func:`fnebm.chain.run` from the same keys
(tests/test_kernels.py compares them under ``TRITON_INTERPRET=1``).

**The same draws as fnebm's samplers.** Step ``t`` of chain ``c`` (``t`` counts from ``start``,
e.g. ``ChainState.steps_taken``) uses the key ``k = fnebm.random.fold_in(keys[c], t)``, as
:func:`fnebm.sample_chain` does. Langevin's noise is ``fnebm.random.normal(k, (d,))``. MALA
splits it first, as :mod:`fnebm.samplers.mala` does: ``k0, k1 = fnebm.random.split(k)``, the
noise is ``normal(k0, (d,))`` and the accept/reject uniform ``uniform(k1, ())``. In the kernel:
``fold_in`` is ``tl.philox(seed_c, (t_lo, t_hi, 0x666F6C64, 0))`` (its first two words are the new
key), ``split`` is ``tl.philox(seed, (0, 0, 0x73706C74, 0))`` (words 0-1 the first key, 2-3 the
second), the noise ``tl.randn4x(seed, b)`` for blocks ``b < ceil(d / 4)`` with element ``i`` lane
``i // m`` of block ``i % m``, and the uniform ``tl.rand4x(seed, 0)``'s first lane.

The kernel covers float32 (the stream's normals are float32), events of 1 to
:data:`MAX_DIM` elements, 0-dim or per-chain step sizes and noise scales, any chain axes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import random as fr
from fnebm.kernels import families

try:  # the module imports without triton (its checks and HAS_TRITON); the kernel and the ops need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

HAS_TRITON = triton is not None

__all__ = [
    "HAS_TRITON",
    "MAX_DIM",
    "LangevinChain",
    "MALAChain",
    "covers",
    "langevin_chain",
    "mala_chain",
    "run_into",
]

_DTYPES = (torch.float32,)
# A program holds its chains' positions, gradients and proposals in registers: events past
# this many elements would spill (one chain of 4096 is 16 warps of 8 values per array).
MAX_DIM = 4096
# Elements per program (4 lanes x BLOCK_C chains x BLOCK_M blocks) and the fewest programs a
# launch aims for before it shrinks BLOCK_C; untuned (no GPU measurement exists yet).
_TILE = 512
_MIN_PROGRAMS = 1024
# Per-step chain keys live in a buffer of at most this many bytes (a launch runs in pieces).
_KEYS_BYTES = 64 * 2**20
_KEYS_BLOCK = 256


class LangevinChain(NamedTuple):
    """A Langevin run: the final ``position (*chains, d)``, ``energy (chains)``, ``grad``; the
    ``trace (n_kept, *chains, d)`` and ``is_divergent (n_kept, *chains)`` at the kept steps."""

    position: Tensor
    energy: Tensor
    grad: Tensor
    trace: Tensor
    is_divergent: Tensor


class MALAChain(NamedTuple):
    """A MALA run: the final state, the trace and MALA's info at the kept steps (``(n_kept, *chains)`` each)."""

    position: Tensor
    energy: Tensor
    grad: Tensor
    trace: Tensor
    acceptance_rate: Tensor
    is_accepted: Tensor
    is_divergent: Tensor


def covers(energy_fn) -> str | None:
    """``None`` if the kernel computes ``energy_fn`` in closed form (a family of
    :mod:`fnebm.kernels.families` for ``"triton"``), else why not (one phrase)."""
    return families.covers(energy_fn, families.TRITON)


def _params(energy_fn, d: int) -> tuple[int, Tensor, Tensor]:
    """``(family id, scalars (2,), vectors)``: the energy's parameters as the kernel reads them
    (:func:`fnebm.kernels.families.pack`). Torch ops only (no host sync)."""
    return families.pack(energy_fn, d)


# ------------------------------------------------------------------------------ the checks


def _tunable(name: str, value, like: Tensor, chains: tuple[int, ...]) -> Tensor:
    if not isinstance(value, Tensor):
        value = torch.tensor(_checks.check_real(name, value), dtype=like.dtype, device=like.device)
    if not value.dtype.is_floating_point or (value.device != like.device and value.ndim):
        raise TypeError(f"{name} must be a floating-point tensor on the position's device (or 0-dim), got "
                        f"{value.dtype} {tuple(value.shape)} on {value.device}")
    _checks.check_tunable_shape(name, value, chains)
    value = value.to(dtype=like.dtype, device=like.device)  # a sampler's 0-dim number follows the position
    if value.ndim == 0:
        return value
    # a prefix of the chain axes (or size-1 axes) gives rows of chains one value: one per chain here
    return value.reshape(value.shape + (1,) * (len(chains) - value.ndim)).expand(chains)


def _check(energy_fn, x, energy, grad, keys, start, step_size, noise_scale, n_steps, burn_in, thin, dtypes,
           covers_fn=None, max_dim=MAX_DIM):
    """Metadata checks (free under compile); returns ``(chains, start, step_size, noise_scale)``.
    ``covers_fn`` and ``max_dim``: which energies and sizes the kernel takes (default: this one's)."""
    reason = (covers if covers_fn is None else covers_fn)(energy_fn)
    if reason is not None:
        raise TypeError(f"energy_fn: {reason}")
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point or x.ndim < 1:
        got = getattr(x, "dtype", type(x).__name__)
        raise TypeError(f"position must be a floating-point tensor (*chains, d), got {got}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"position must have dtype in {[str(t) for t in dtypes]} for the kernel, got {x.dtype}")
    fr.check_key(keys, "keys")
    chains = tuple(keys.shape[:-1])
    d = x.shape[-1]
    if tuple(x.shape) != chains + (d,) or keys.device != x.device:
        raise ValueError(f"keys must be (*chains, 2) for a position (*chains, d) on its device, got keys "
                         f"{tuple(keys.shape)} on {keys.device} and position {tuple(x.shape)} on {x.device}")
    if dtypes is not None and max_dim is not None and d > max_dim:
        raise ValueError(f"position has {d} elements per chain, more than the kernel's MAX_DIM={max_dim}")
    energy_fn.check_dim(d)
    if energy_fn.dtype != x.dtype or energy_fn.device != x.device:
        raise TypeError(f"energy_fn's parameters ({energy_fn.dtype} on {energy_fn.device}) must have the "
                        f"position's dtype and device ({x.dtype} on {x.device})")
    for name, t, shape in (("energy", energy, chains), ("grad", grad, tuple(x.shape))):
        if not isinstance(t, Tensor) or tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must be a {x.dtype} tensor of shape {shape} on {x.device}, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if isinstance(start, Tensor):
        if start.ndim != 0 or start.dtype != torch.int64 or start.device != x.device:
            raise TypeError(f"start must be an int or a 0-dim int64 tensor on the position's device, got "
                            f"{start.dtype} {tuple(start.shape)} on {start.device}")
    else:
        start = torch.tensor(_checks.check_int("start", start, 0), dtype=torch.int64, device=x.device)
    _checks.check_int("n_steps", n_steps, 1)
    _checks.check_int("burn_in", burn_in, 0)
    _checks.check_int("thin", thin, 1)
    if thin > n_steps:
        raise ValueError(f"thin must be <= n_steps to keep any draw, got thin={thin}, n_steps={n_steps}")
    step_size = _tunable("step_size", step_size, x, chains)
    noise_scale = _tunable("noise_scale", noise_scale, x, chains)
    return chains, start, step_size, noise_scale


# ------------------------------------------------------------------------------ the kernel


def _grid(n_chains: int, d: int) -> tuple[int, int, int, int]:
    """``(m, BLOCK_C, BLOCK_M, num_warps)`` for ``n_chains`` chains of ``d`` elements.

    On a GPU, blocks of chains shrink until the launch has ``_MIN_PROGRAMS`` programs (or one
    chain each). The interpreter runs programs one after another in Python, so there the
    fewest, largest programs are the fastest.
    """
    m = (d + 3) // 4
    block_m = triton.next_power_of_2(m)
    block_c = max(1, min(_TILE // (4 * block_m), triton.next_power_of_2(n_chains)))
    while not INTERPRETED and block_c > 1 and triton.cdiv(n_chains, block_c) < _MIN_PROGRAMS:
        block_c //= 2
    num_warps = max(1, min(16, 4 * block_c * block_m // 128))
    return m, block_c, block_m, num_warps


if HAS_TRITON:
    _FOLD_TAG: tl.constexpr = tl.constexpr(0x666F6C64)  # fnebm.random._FOLD_TAG
    _SPLIT_TAG: tl.constexpr = tl.constexpr(0x73706C74)  # fnebm.random._SPLIT_TAG
    _TWO_PI: tl.constexpr = tl.constexpr(6.283185307179586)
    _INF: tl.constexpr = tl.constexpr(float("inf"))
    _NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
    # The families' ids (fnebm.kernels.families), as the constexprs ENERGY is compared with
    # (tests/test_kernel_families.py checks each against the table).
    _IDS = families.ids(families.TRITON)
    _DOUBLE_WELL: tl.constexpr = tl.constexpr(_IDS["DOUBLE_WELL"])
    _HARMONIC: tl.constexpr = tl.constexpr(_IDS["HARMONIC"])
    _GAUSSIAN: tl.constexpr = tl.constexpr(_IDS["GAUSSIAN"])
    _RASTRIGIN: tl.constexpr = tl.constexpr(_IDS["RASTRIGIN"])

    @triton.jit
    def _seed(w0, w1):
        # a key's two words as the 64-bit seed k0 | k1 << 32 (fnebm.random.triton_seed)
        return w0.to(tl.uint64) | (w1.to(tl.uint64) << 32)

    @triton.jit
    def _fold_in(seed, t, zero):
        # fnebm.random.fold_in(key, t): the first two words of Philox((t_lo, t_hi, "fold", 0), key)
        c0 = zero + (t & 0xFFFFFFFF).to(tl.uint32)
        c1 = zero + ((t >> 32) & 0xFFFFFFFF).to(tl.uint32)
        w0, w1, _, _ = tl.philox(seed, c0, c1, zero + _FOLD_TAG, zero)
        return _seed(w0, w1)

    @triton.jit
    def _lane_params(v_ptr, s_ptr, d, i, live, ENERGY: tl.constexpr):
        # The parameters one lane's elements see: per element for the Gaussian, else scalars.
        if ENERGY == _GAUSSIAN:
            pa = tl.load(v_ptr + i, mask=live, other=0.0)
            pb = tl.load(v_ptr + d + i, mask=live, other=0.0)
            pc = tl.load(v_ptr + 2 * d + i, mask=live, other=0.0)
        else:
            pa = tl.load(s_ptr)
            pb = tl.load(s_ptr + 1)
            pc = pb
        return pa, pb, pc

    @triton.jit
    def _terms(x, live, pa, pb, pc, ENERGY: tl.constexpr):
        """Per element: the energy's summand (0 past the event) and the gradient, as the
        energies' closed forms in fnebm.energies.analytic compute them."""
        if ENERGY == _DOUBLE_WELL:  # double well: h (x^2 - b^2)^2 summed, times h after; grad 4 h x (x^2 - b^2)
            r = x * x - pb * pb
            e = r * r
            g = 4.0 * pa * x * r
        elif ENERGY == _HARMONIC:  # harmonic: 0.5 k |x|^2; grad k x
            e = x * x
            g = pa * x
        elif ENERGY == _GAUSSIAN:  # diagonal Gaussian: 0.5 |(x - mean) sqrt(P)|^2; grad (x - mean) P
            delta = x - pa
            y = delta * pc
            e = y * y
            g = delta * pb
        elif ENERGY == _RASTRIGIN:  # Rastrigin: a d + sum(x^2 - a cos(2 pi x)); grad 2 x + 2 pi a sin(2 pi x)
            w = _TWO_PI * x
            e = x * x - pa * tl.cos(w)
            g = 2.0 * x + _TWO_PI * pa * tl.sin(w)
        return tl.where(live, e, 0.0), g

    @triton.jit
    def _energy(total, s_ptr, d, ENERGY: tl.constexpr):
        if ENERGY == _DOUBLE_WELL:
            out = tl.load(s_ptr) * total
        elif ENERGY == _HARMONIC:
            out = 0.5 * tl.load(s_ptr) * total
        elif ENERGY == _GAUSSIAN:
            out = 0.5 * total
        elif ENERGY == _RASTRIGIN:
            out = tl.load(s_ptr) * d + total
        return out

    @triton.jit
    def step_keys_kernel(seed_ptr, t0_ptr, key_ptr, u_ptr, n_chains, n_steps, t_off, MALA: tl.constexpr,
                         BLOCK: tl.constexpr):
        """Each chain's key of each step, once: ``key[s, c]`` is the seed of
        ``fold_in(keys[c], t0 + t_off + s)`` (MALA: of the first key of its ``split``, and
        ``u[s, c]`` the accept/reject uniform drawn from the second). ``(n_steps, n_chains)`` each.

        The chain kernel's threads would otherwise each compute these two or three Philox
        blocks per step for their chain (measured on an H100: G2's instructions were
        dominated by them); here they are computed once per chain and step and read back.
        """
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n_chains.to(tl.int64) * n_steps
        c = i % n_chains
        t = tl.load(t0_ptr) + t_off + i // n_chains
        zero = tl.zeros((BLOCK,), dtype=tl.uint32)
        key = _fold_in(tl.load(seed_ptr + c, mask=live, other=0), t, zero)
        if MALA:  # fnebm.random.split(key): words 0-1 draw the noise, 2-3 the uniform
            w0, w1, w2, w3 = tl.philox(key, zero, zero, zero + _SPLIT_TAG, zero)
            key = _seed(w0, w1)
            u, _, _, _ = tl.rand4x(_seed(w2, w3), zero)
            tl.store(u_ptr + i, u, mask=live)
        tl.store(key_ptr + i, key.to(tl.int64), mask=live)

    @triton.jit
    def langevin_chain_kernel(
        x_ptr, e_ptr, g_ptr, key_ptr, u_ptr, h_ptr, s_ptr, par_ptr, vec_ptr,
        xo_ptr, eo_ptr, go_ptr, trace_ptr, rate_ptr, acc_ptr, div_ptr,
        n_chains, d, m, h_stride, s_stride, n_steps, first, thin, n_kept, j0,
        ENERGY: tl.constexpr, MALA: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        """``n_steps`` Langevin (or MALA) steps of BLOCK_C chains, positions in registers.

        x, g, xo, go: ``(n_chains, d)``; e, eo: ``(n_chains,)``; key, u: ``(n_steps, n_chains)``
        from :func:`step_keys_kernel` (the seed of step ``s``'s noise, MALA's uniform); h, s:
        step size and noise scale at ``c * stride``; par, vec: the energy's parameters (``_params``).
        A chain's ``d`` elements are four lane tiles ``(BLOCK_C, BLOCK_M)``: element
        ``i = lane * m + b`` sits at block ``b`` of its lane, where Philox block ``b`` puts it.
        Step ``s`` is kept when ``s >= first``, ``(s - first) % thin == 0`` and
        ``(s - first) // thin < n_kept``: draw ``j0 + (s - first) // thin`` of trace
        ``(draws, n_chains, d)`` and of the info rows ``(draws, n_chains)`` (int8 0/1 flags).
        """
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]  # (BLOCK_C, 1)
        b = tl.arange(0, BLOCK_M)[None, :]  # (1, BLOCK_M)
        live_c = c < n_chains
        live_b = live_c & (b < m)
        i0, i1, i2, i3 = b, b + m, b + 2 * m, b + 3 * m
        l0, l1, l2, l3 = live_b & (i0 < d), live_b & (i1 < d), live_b & (i2 < d), live_b & (i3 < d)
        row = c.to(tl.int64) * d
        x0 = tl.load(x_ptr + row + i0, mask=l0, other=0.0)
        x1 = tl.load(x_ptr + row + i1, mask=l1, other=0.0)
        x2 = tl.load(x_ptr + row + i2, mask=l2, other=0.0)
        x3 = tl.load(x_ptr + row + i3, mask=l3, other=0.0)
        g0 = tl.load(g_ptr + row + i0, mask=l0, other=0.0)
        g1 = tl.load(g_ptr + row + i1, mask=l1, other=0.0)
        g2 = tl.load(g_ptr + row + i2, mask=l2, other=0.0)
        g3 = tl.load(g_ptr + row + i3, mask=l3, other=0.0)
        e = tl.load(e_ptr + c, mask=live_c, other=0.0)
        a0, b0, c0 = _lane_params(vec_ptr, par_ptr, d, i0, l0, ENERGY)
        a1, b1, c1 = _lane_params(vec_ptr, par_ptr, d, i1, l1, ENERGY)
        a2, b2, c2 = _lane_params(vec_ptr, par_ptr, d, i2, l2, ENERGY)
        a3, b3, c3 = _lane_params(vec_ptr, par_ptr, d, i3, l3, ENERGY)
        h = tl.load(h_ptr + c * h_stride, mask=live_c, other=1.0)
        scale = tl.load(s_ptr + c * s_stride, mask=live_c, other=1.0) * tl.sqrt_rn(2.0 * h)
        blocks = tl.broadcast_to(b, (BLOCK_C, BLOCK_M))
        trace_stride = n_chains.to(tl.int64) * d

        for s in range(n_steps):
            key = tl.load(key_ptr + s * n_chains + c, mask=live_c, other=0)
            z0, z1, z2, z3 = tl.randn4x(tl.broadcast_to(key, (BLOCK_C, BLOCK_M)), blocks)
            p0 = tl.where(l0, x0 - h * g0 + scale * z0, 0.0)
            p1 = tl.where(l1, x1 - h * g1 + scale * z1, 0.0)
            p2 = tl.where(l2, x2 - h * g2 + scale * z2, 0.0)
            p3 = tl.where(l3, x3 - h * g3 + scale * z3, 0.0)
            q0, n0 = _terms(p0, l0, a0, b0, c0, ENERGY)
            q1, n1 = _terms(p1, l1, a1, b1, c1, ENERGY)
            q2, n2 = _terms(p2, l2, a2, b2, c2, ENERGY)
            q3, n3 = _terms(p3, l3, a3, b3, c3, ENERGY)
            # Helpers are inlined below: each device-function call costs the interpreter ~1 ms.
            # Elements past the event hold 0 with a finite gradient, so they never count as bad.
            en = _energy(tl.sum(q0 + q1 + q2 + q3, axis=1, keep_dims=True), par_ptr, d, ENERGY)
            fin = (tl.abs(n0) < _INF) & (tl.abs(n1) < _INF) & (tl.abs(n2) < _INF) & (tl.abs(n3) < _INF)
            finite = (tl.abs(en) < _INF) & (tl.sum(tl.where(fin, 0, 1), axis=1, keep_dims=True) == 0)
            if MALA:  # fnebm.samplers.mala.log_acceptance_ratio, then metropolis_hastings
                f0, f1, f2, f3 = p0 - x0 + h * g0, p1 - x1 + h * g1, p2 - x2 + h * g2, p3 - x3 + h * g3
                r0, r1, r2, r3 = x0 - p0 + h * n0, x1 - p1 + h * n1, x2 - p2 + h * n2, x3 - p3 + h * n3
                # zero past the event: p = x = 0 there and both gradients are 0 or cancel
                quad = tl.sum((f0 * f0 - r0 * r0) + (f1 * f1 - r1 * r1) + (f2 * f2 - r2 * r2) + (f3 * f3 - r3 * r3),
                              axis=1, keep_dims=True)
                log_alpha = e - en + quad / (4.0 * h)
                ok = finite & (tl.abs(log_alpha) < _INF)
                log_alpha = tl.where(ok, log_alpha, _NEG_INF)
                u = tl.load(u_ptr + s * n_chains + c, mask=live_c, other=0.5)
                take = (tl.log(u) < log_alpha) & live_c
                rate = tl.exp(tl.minimum(log_alpha, 0.0))
            else:  # fnebm.samplers.langevin: a non-finite move is dropped and reported
                fin = (tl.abs(p0) < _INF) & (tl.abs(p1) < _INF) & (tl.abs(p2) < _INF) & (tl.abs(p3) < _INF)
                ok = finite & (tl.sum(tl.where(fin, 0, 1), axis=1, keep_dims=True) == 0)
                take = ok & live_c
                rate = tl.where(ok, 1.0, 0.0)
            x0, x1 = tl.where(take, p0, x0), tl.where(take, p1, x1)
            x2, x3 = tl.where(take, p2, x2), tl.where(take, p3, x3)
            g0, g1 = tl.where(take, n0, g0), tl.where(take, n1, g1)
            g2, g3 = tl.where(take, n2, g2), tl.where(take, n3, g3)
            e = tl.where(take, en, e)
            j = s - first
            if (j >= 0) & (j % thin == 0) & (j < n_kept * thin):
                draw = (j0 + j // thin).to(tl.int64)
                base = draw * trace_stride + row
                tl.store(trace_ptr + base + i0, x0, mask=l0)
                tl.store(trace_ptr + base + i1, x1, mask=l1)
                tl.store(trace_ptr + base + i2, x2, mask=l2)
                tl.store(trace_ptr + base + i3, x3, mask=l3)
                flag = draw * n_chains + c
                tl.store(div_ptr + flag, tl.where(ok, 0, 1).to(tl.int8), mask=live_c)
                if MALA:
                    tl.store(rate_ptr + flag, rate, mask=live_c)
                    tl.store(acc_ptr + flag, tl.where(take, 1, 0).to(tl.int8), mask=live_c)

        tl.store(xo_ptr + row + i0, x0, mask=l0)
        tl.store(xo_ptr + row + i1, x1, mask=l1)
        tl.store(xo_ptr + row + i2, x2, mask=l2)
        tl.store(xo_ptr + row + i3, x3, mask=l3)
        tl.store(go_ptr + row + i0, g0, mask=l0)
        tl.store(go_ptr + row + i1, g1, mask=l1)
        tl.store(go_ptr + row + i2, g2, mask=l2)
        tl.store(go_ptr + row + i3, g3, mask=l3)
        tl.store(eo_ptr + c, e, mask=live_c)

    def _outputs(x: Tensor, n_draws: int, mala: bool) -> tuple[Tensor, ...]:
        """Fresh ``(trace, *info)`` buffers: ``(n_draws, *chains, d)`` and ``(n_draws, *chains)``."""
        chains = tuple(x.shape[:-1])
        trace = torch.empty((n_draws,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        flag = lambda: torch.empty((n_draws,) + chains, dtype=torch.bool, device=x.device)  # noqa: E731
        if mala:
            return trace, torch.empty((n_draws,) + chains, dtype=x.dtype, device=x.device), flag(), flag()
        return trace, flag()

    def _launch(x, energy, grad, keys, start, step_size, noise_scale, scalars, vectors, family: int, mala: bool,
                n_total: int, first: int, thin: int, n_keep: int, j0: int, outputs,
                direct: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """One launch: ``n_total`` steps from stream index ``start``; step ``s`` is kept when
        ``s >= first``, ``(s - first) % thin == 0`` and ``(s - first) // thin < n_keep``, as draw
        ``j0 + (s - first) // thin`` of ``outputs = (trace, *info)`` (contiguous, draws leading).
        Returns the final ``(position, energy, grad)``. Torch ops and ``wrap_triton`` launches;
        ``direct`` launches the kernels themselves (eager callers outside any trace: on an H100
        the eager dispatch of ``wrap_triton``'s operator cost about 0.3 ms of host time a launch)."""
        wrap = (lambda k: k) if direct and not torch.compiler.is_compiling() else torch.library.wrap_triton
        d = x.shape[-1]
        n_chains = math.prod(keys.shape[:-1])
        x, grad, energy = x.contiguous(), grad.contiguous(), energy.contiguous()
        x_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        g_out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        e_out = torch.empty_like(energy, memory_format=torch.contiguous_format)
        if n_chains == 0:
            return x_out, e_out, g_out
        seeds = fr.triton_seed(keys).reshape(n_chains)
        h = step_size.to(x.dtype).reshape(-1).contiguous()
        s = noise_scale.to(x.dtype).reshape(-1).contiguous()
        trace = outputs[0]
        if mala:
            rate, acc, div = outputs[1], outputs[2].view(torch.int8), outputs[3].view(torch.int8)
        else:
            div = outputs[1].view(torch.int8)
            rate, acc = trace, div  # not read: MALA is off
        m, block_c, block_m, num_warps = _grid(n_chains, d)
        scalars, vectors = scalars.contiguous(), vectors.contiguous()
        # The steps run in pieces whose per-step keys (8 bytes a chain and step, MALA 12) fit in
        # _KEYS_BYTES; a piece's final state is the next one's start (three small tensors).
        piece = max(1, min(n_total, _KEYS_BYTES // (12 * n_chains)))
        keys_buf = torch.empty((piece, n_chains), dtype=torch.int64, device=x.device)
        u_buf = torch.empty((piece, n_chains), dtype=x.dtype, device=x.device) if mala else trace  # not read
        for o in range(0, n_total, piece):
            steps = min(piece, n_total - o)
            wrap(step_keys_kernel)[(triton.cdiv(steps * n_chains, _KEYS_BLOCK),)](
                seeds, start, keys_buf, u_buf, n_chains, steps, o, MALA=mala, BLOCK=_KEYS_BLOCK,
            )
            wrap(langevin_chain_kernel)[(triton.cdiv(n_chains, block_c),)](
                x, energy, grad, keys_buf, u_buf, h, s, scalars, vectors,
                x_out, e_out, g_out, trace, rate, acc, div,
                n_chains, d, m, 0 if step_size.ndim == 0 else 1, 0 if noise_scale.ndim == 0 else 1,
                steps, first - o, thin, n_keep, j0,
                ENERGY=family, MALA=mala, BLOCK_C=block_c, BLOCK_M=block_m, num_warps=num_warps,
            )
            if o + piece < n_total:  # the next piece starts here (the outputs are fresh per piece)
                x, energy, grad = x_out, e_out, g_out
                x_out, e_out, g_out = torch.empty_like(x), torch.empty_like(energy), torch.empty_like(grad)
        return x_out, e_out, g_out

    def _whole_run(x, energy, grad, keys, start, step_size, noise_scale, scalars, vectors, family, mala,
                   n_steps, burn_in, thin):
        outputs = _outputs(x, n_steps // thin, mala)
        final = _launch(x, energy, grad, keys, start, step_size, noise_scale, scalars, vectors, family, mala,
                        burn_in + n_steps, burn_in + thin - 1, thin, n_steps // thin, 0, outputs)
        return final + outputs

    def _langevin_impl(x: Tensor, energy: Tensor, grad: Tensor, keys: Tensor, start: Tensor, step_size: Tensor,
                       noise_scale: Tensor, scalars: Tensor, vectors: Tensor, family: int, n_steps: int,
                       burn_in: int, thin: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return _whole_run(x, energy, grad, keys, start, step_size, noise_scale, scalars, vectors, family, False,
                          n_steps, burn_in, thin)

    def _mala_impl(x: Tensor, energy: Tensor, grad: Tensor, keys: Tensor, start: Tensor, step_size: Tensor,
                   scalars: Tensor, vectors: Tensor, family: int, n_steps: int, burn_in: int,
                   thin: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        one = torch.ones((), dtype=x.dtype, device=x.device)  # MALA's noise scale
        return _whole_run(x, energy, grad, keys, start, step_size, one, scalars, vectors, family, True,
                          n_steps, burn_in, thin)

    # Under TRITON_INTERPRET=1 torch's wrap_triton hands the
    # InterpretedFunction back unwrapped, so there the ops are opaque custom_ops with explicit
    # fakes; with a real Triton backend they are triton_ops that torch.compile traces into.
    INTERPRETED = not isinstance(langevin_chain_kernel, triton.runtime.jit.JITFunction)
    _register = torch.library.custom_op if INTERPRETED else torch.library.triton_op
    _langevin_op = _register("fnebm::langevin_chain", _langevin_impl, mutates_args=())
    _mala_op = _register("fnebm::mala_chain", _mala_impl, mutates_args=())

    if INTERPRETED:

        def _fake_final(x, energy, grad):
            return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (x, energy, grad))

        @_langevin_op.register_fake
        def _(x, energy, grad, keys, start, step_size, noise_scale, scalars, vectors, family, n_steps, burn_in, thin):
            return _fake_final(x, energy, grad) + _outputs(x, n_steps // thin, False)

        @_mala_op.register_fake
        def _(x, energy, grad, keys, start, step_size, scalars, vectors, family, n_steps, burn_in, thin):
            return _fake_final(x, energy, grad) + _outputs(x, n_steps // thin, True)

else:  # pragma: no cover
    INTERPRETED = False


def _need_triton():
    if not HAS_TRITON:
        raise RuntimeError("the whole-chain kernels need triton; fnebm.sample_chain runs the samplers "
                           "without it")


def langevin_chain(energy_fn, position: Tensor, energy: Tensor, grad: Tensor, keys: Tensor, start: Tensor | int,
                   step_size: Tensor | float, noise_scale: Tensor | float = 1.0, *, n_steps: int, burn_in: int = 0,
                   thin: int = 1) -> LangevinChain:
    """Unadjusted Langevin, the whole run in one launch (the op ``torch.ops.fnebm.langevin_chain``).

    position, grad: ``(*chains, d)``; energy: ``chains`` (E and dE/dx at ``position``); keys:
    ``(*chains, 2)``; ``start``: the index of the first step in the chains' streams (int or a 0-dim
    int64 tensor); step_size, noise_scale: 0-dim or ``chains``. Runs ``burn_in + n_steps`` steps
    of ``fnebm.langevin(energy_fn, step_size, noise_scale).step``: step ``t`` proposes ``x - h grad
    + noise_scale sqrt(2h) normal(fold_in(keys, start + t), (d,))`` and moves unless the proposal,
    its energy or its gradient is not finite. Draw ``j`` is the position after step ``burn_in + (j
    + 1) thin - 1``, as in :func:`fnebm.sample_chain`.

    For float32 positions of at most :data:`MAX_DIM` elements per chain on a device Triton runs
    on, and an energy :func:`covers` says it computes. Positions agree with the sampler's to float
    tolerance (the normals agree to about 2 ulp, the closed forms are evaluated in another
    order). Metadata checks only: it traces under ``torch.compile(fullgraph=True)``. Not
    differentiable (no autograd formula).
    """
    _need_triton()
    _, start, h, s = _check(energy_fn, position, energy, grad, keys, start, step_size, noise_scale,
                            n_steps, burn_in, thin, dtypes=_DTYPES)
    family, scalars, vectors = _params(energy_fn, position.shape[-1])
    return LangevinChain(*torch.ops.fnebm.langevin_chain(position, energy, grad, keys, start, h, s, scalars,
                                                         vectors, family, n_steps, burn_in, thin))


def mala_chain(energy_fn, position: Tensor, energy: Tensor, grad: Tensor, keys: Tensor, start: Tensor | int,
               step_size: Tensor | float, *, n_steps: int, burn_in: int = 0, thin: int = 1) -> MALAChain:
    """MALA, the whole run in one launch (the op ``torch.ops.fnebm.mala_chain``): the energy
    difference, the proposal densities and the accept/reject of every chain happen in the kernel.

    Arguments as :func:`langevin_chain` (no noise scale); runs ``fnebm.mala(energy_fn,
    step_size).step``: step ``t`` splits ``fold_in(keys, start + t)`` into ``(k0, k1)``, proposes
    with ``normal(k0, (d,))`` and accepts when ``log uniform(k1, ()) < log alpha``; a proposal
    with a non-finite energy, gradient or ``log alpha`` is rejected and reported divergent. What
    the kernel covers as :func:`langevin_chain`. The uniforms are bit-identical to
    ``fnebm.random.uniform``'s.
    """
    _need_triton()
    _, start, h, _ = _check(energy_fn, position, energy, grad, keys, start, step_size, 1.0,
                            n_steps, burn_in, thin, dtypes=_DTYPES)
    family, scalars, vectors = _params(energy_fn, position.shape[-1])
    return MALAChain(*torch.ops.fnebm.mala_chain(position, energy, grad, keys, start, h, scalars, vectors,
                                                 family, n_steps, burn_in, thin))


def run_into(energy_fn, position: Tensor, energy: Tensor, grad: Tensor, keys: Tensor, start: Tensor,
             step_size: Tensor, noise_scale: Tensor, outputs: tuple[Tensor, ...], *, mala: bool, n_total: int,
             first: int, thin: int, n_keep: int, j0: int) -> tuple[Tensor, Tensor, Tensor]:
    """The launch without the op, writing the kept draws into ``outputs = (trace, *info)``.

    For :mod:`fnebm.chain.engines`, which runs a :func:`fnebm.sample_chain` call in launches of a
    chunk each and fills the run's own (or the caller's ``out=``) buffers in place: ``trace
    (draws, *chains, d)`` and the info ``(draws, *chains)`` (MALA: acceptance rate, is_accepted,
    is_divergent; Langevin: is_divergent), contiguous. Steps ``0 .. n_total - 1`` of the launch
    are stream indices ``start + s``; step ``s`` is kept as draw ``j0 + (s - first) // thin``
    when ``s >= first``, ``(s - first) % thin == 0`` and fewer than ``n_keep`` were kept before.
    The caller has checked the arguments (:func:`covers`, dtype, shapes, devices).
    """
    _need_triton()
    family, scalars, vectors = _params(energy_fn, position.shape[-1])
    if mala:
        noise_scale = torch.ones((), dtype=position.dtype, device=position.device)
    return _launch(position, energy, grad, keys, start, step_size, noise_scale, scalars, vectors, family, mala,
                   n_total, first, thin, n_keep, j0, outputs, direct=True)
