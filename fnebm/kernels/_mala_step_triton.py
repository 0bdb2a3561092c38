"""The two Triton kernels of :mod:`fnebm.kernels.mala_step` (imported only when used: they need triton).

Each computes what :mod:`fnebm.samplers.mala`'s torch operations compute, in their order of
operations: ``propose_kernel`` the split, the normals (:mod:`fnebm._philox_triton`'s draw
kernel's operations) and the proposal; ``accept_kernel`` one chain a program: the log acceptance
ratio, the finiteness checks, the uniform and the select.
"""

import triton
import triton.language as tl

from fnebm._philox_triton import _box_muller, _unit

_SPLIT_TAG: tl.constexpr = tl.constexpr(0x73706C74)  # fnebm.random._SPLIT_TAG
_NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))


@triton.jit
def _split(k_ptr, j, ks, kw, live, SECOND: tl.constexpr):
    # fnebm.random.split(key)[..., i, :] as a Philox seed: the key's words k0 | k1 << 32 are the
    # seed of the block (0, 0, "splt", 0), whose words 0-1 are the first key and 2-3 the second
    k0 = tl.load(k_ptr + j * ks, mask=live, other=0).to(tl.uint32)
    k1 = tl.load(k_ptr + j * ks + kw, mask=live, other=0).to(tl.uint32)
    zero = tl.zeros_like(k0)
    w0, w1, w2, w3 = tl.philox(k0.to(tl.uint64) | (k1.to(tl.uint64) << 32), zero, zero, zero + _SPLIT_TAG, zero, 10)
    if SECOND:
        return w2.to(tl.uint64) | (w3.to(tl.uint64) << 32)
    return w0.to(tl.uint64) | (w1.to(tl.uint64) << 32)


@triton.jit
def _step_size(h_ptr, j, h_stride, h_bits, live, HOST: tl.constexpr, F64: tl.constexpr):
    # a host scalar arrives as its float64 bits; a device step size is read (stride 0: one value)
    if HOST:
        h = tl.full(j.shape, h_bits, tl.int64).to(tl.float64, bitcast=True)
        if not F64:
            h = h.to(tl.float32)
    else:
        h = tl.load(h_ptr + j * h_stride, mask=live, other=1.0)
    return h


@triton.jit
def _move(x_ptr, g_ptr, out_ptr, row, e, n, h, scale, z, live):
    # fnebm.integrators.diffusion.euler_maruyama: (x - h g) + scale z, each operation rounded
    ok = live & (e < n)
    x = tl.load(x_ptr + row + e, mask=ok, other=0.0)
    g = tl.load(g_ptr + row + e, mask=ok, other=0.0)
    tl.store(out_ptr + row + e, (x - h * g) + scale * z.to(x.dtype), mask=ok)


@triton.jit(do_not_specialize=["ks", "kw", "h_stride", "h_bits", "n_chains", "n", "m"])
def propose_kernel(x_ptr, g_ptr, k_ptr, ks, kw, h_ptr, h_stride, h_bits, out_ptr, n_chains, n, m,
                   HOST: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr):
    # (chain j, Philox block b) pairs: block b of the chain's noise key gives its elements
    # b, m + b, 2m + b, 3m + b (fnebm.random's layout, m = ceil(n / 4))
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = t < n_chains.to(tl.int64) * m
    j = t // m
    b = t - j * m
    seed = _split(k_ptr, j, ks, kw, live, False)
    zero = tl.zeros_like(b).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, b.to(tl.uint32), (b >> 32).to(tl.uint32), zero, zero, 10)
    z0, z1 = _box_muller(_unit(r0, F64), _unit(r1, F64))
    z2, z3 = _box_muller(_unit(r2, F64), _unit(r3, F64))
    h = _step_size(h_ptr, j, h_stride, h_bits, live, HOST, F64)
    # 1.0 * sqrt(2 h), correctly rounded as torch's (MALA's noise scale is 1; sqrt_rn takes float32
    # only, and float64's sqrt is correctly rounded)
    if F64:
        scale = tl.sqrt(2.0 * h)
    else:
        scale = tl.sqrt_rn(2.0 * h)
    row = j * n
    _move(x_ptr, g_ptr, out_ptr, row, b, n, h, scale, z0, live)
    _move(x_ptr, g_ptr, out_ptr, row, m + b, n, h, scale, z1, live)
    _move(x_ptr, g_ptr, out_ptr, row, 2 * m + b, n, h, scale, z2, live)
    _move(x_ptr, g_ptr, out_ptr, row, 3 * m + b, n, h, scale, z3, live)


@triton.jit
def _piece(x_ptr, p_ptr, g_ptr, gp_ptr, row, i, live):
    # one piece of a chain's position, proposal and their gradients
    x = tl.load(x_ptr + row + i, mask=live, other=0.0)
    p = tl.load(p_ptr + row + i, mask=live, other=0.0)
    g = tl.load(g_ptr + row + i, mask=live, other=0.0)
    gp = tl.load(gp_ptr + row + i, mask=live, other=0.0)
    return x, p, g, gp


@triton.jit(do_not_specialize=["ks", "kw", "h_stride", "h_bits", "n"])
def accept_kernel(x_ptr, e_ptr, g_ptr, p_ptr, ep_ptr, gp_ptr, k_ptr, ks, kw, h_ptr, h_stride, h_bits,
                  xo_ptr, eo_ptr, go_ptr, rate_ptr, acc_ptr, div_ptr, n,
                  HOST: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr):
    # One chain a program; its event in pieces of BLOCK.
    j = tl.program_id(0).to(tl.int64) + tl.zeros((1,), tl.int64)
    one = j == j
    row = j * n
    h = _step_size(h_ptr, j, h_stride, h_bits, one, HOST, F64)
    e = tl.load(e_ptr + j)
    ep = tl.load(ep_ptr + j)
    quad = tl.zeros((BLOCK,), e.dtype)
    bad = tl.zeros((BLOCK,), e.dtype)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        live = i < n
        x, p, g, gp = _piece(x_ptr, p_ptr, g_ptr, gp_ptr, row, i, live)
        # log_acceptance_ratio: forward = (p - x) + h g, backward = (x - p) + h g'
        f = (p - x) + h * g
        r = (x - p) + h * gp
        quad += tl.where(live, f * f - r * r, 0.0)
        bad += tl.where(live, gp - gp, 0.0)  # 0 where finite, NaN where not (all_finite)
    finite = ((ep - ep) + tl.sum(bad, axis=0)) == 0
    if F64:
        log_alpha = (e - ep) + tl.sum(quad, axis=0) / (4.0 * h)
    else:  # torch's division is correctly rounded; Triton's float32 "/" is not (div.full)
        log_alpha = (e - ep) + tl.div_rn(tl.sum(quad, axis=0), 4.0 * h)
    ok = finite & ((log_alpha - log_alpha) == 0)
    log_alpha = tl.where(ok, log_alpha, _NEG_INF)
    # metropolis_hastings: uniform(split(key)[1], ()) is lane 0 of its block 0
    seed = _split(k_ptr, j, ks, kw, one, True)
    zero = tl.zeros_like(j).to(tl.uint32)
    r0, _, _, _ = tl.philox(seed, zero, zero, zero, zero, 10)
    take = tl.log(_unit(r0, F64)) < log_alpha
    tl.store(eo_ptr + j, tl.where(take, ep, e))
    tl.store(rate_ptr + j, tl.exp(tl.minimum(log_alpha, 0.0)))
    tl.store(acc_ptr + j, tl.where(take, 1, 0).to(tl.int8))
    tl.store(div_ptr + j, tl.where(ok, 0, 1).to(tl.int8))
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        live = i < n
        x, p, g, gp = _piece(x_ptr, p_ptr, g_ptr, gp_ptr, row, i, live)
        tl.store(xo_ptr + row + i, tl.where(take, p, x), mask=live)
        tl.store(go_ptr + row + i, tl.where(take, gp, g), mask=live)


INTERPRETED = not isinstance(accept_kernel, triton.runtime.jit.JITFunction)
