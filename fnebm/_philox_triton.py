"""The Philox4x32 block function as one Triton kernel: :func:`fnebm.random.philox4x32`'s eager
path on a CUDA device (the torch path is about 150 small kernels); and :func:`fnebm.random.normal`
and :func:`~fnebm.random.uniform` each as one launch (Philox, the units, Box–Muller, the layout),
where the block kernel left the conversion to about 25 more torch kernels. Imported only when used.
"""

import triton
import triton.language as tl


@triton.jit
def _word(ptr, a0, a1, a2, a3, t0, t1, t2, t3, live):
    return tl.load(ptr + a0 * t0 + a1 * t1 + a2 * t2 + a3 * t3, mask=live, other=0).to(tl.uint32)


_INTS = ["n", "s1", "s2", "s3"] + [f"a{w}_{x}" for w in range(6) for x in range(4)]


@triton.jit(do_not_specialize=_INTS)  # one compiled kernel for every shape and broadcast
def philox_kernel(c0_ptr, c1_ptr, c2_ptr, c3_ptr, k0_ptr, k1_ptr, o0_ptr, o1_ptr, o2_ptr, o3_ptr, n, s1, s2, s3,
                  a0_0, a0_1, a0_2, a0_3, a1_0, a1_1, a1_2, a1_3, a2_0, a2_1, a2_2, a2_3,
                  a3_0, a3_1, a3_2, a3_3, a4_0, a4_1, a4_2, a4_3, a5_0, a5_1, a5_2, a5_3,
                  ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    # Six broadcast word tensors of shape (s0, s1, s2, s3) with strides a<w>_<axis> (0 on
    # a broadcast axis); four contiguous outputs. One Philox4x32 block per element.
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    x3 = i % s3
    x2 = (i // s3) % s2
    x1 = (i // (s3 * s2)) % s1
    x0 = i // (s3 * s2 * s1)
    c0 = _word(c0_ptr, x0, x1, x2, x3, a0_0, a0_1, a0_2, a0_3, live)
    c1 = _word(c1_ptr, x0, x1, x2, x3, a1_0, a1_1, a1_2, a1_3, live)
    c2 = _word(c2_ptr, x0, x1, x2, x3, a2_0, a2_1, a2_2, a2_3, live)
    c3 = _word(c3_ptr, x0, x1, x2, x3, a3_0, a3_1, a3_2, a3_3, live)
    k0 = _word(k0_ptr, x0, x1, x2, x3, a4_0, a4_1, a4_2, a4_3, live)
    k1 = _word(k1_ptr, x0, x1, x2, x3, a5_0, a5_1, a5_2, a5_3, live)
    seed = k0.to(tl.uint64) | (k1.to(tl.uint64) << 32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3, ROUNDS)
    tl.store(o0_ptr + i, r0.to(tl.int64) & 0xFFFFFFFF, mask=live)
    tl.store(o1_ptr + i, r1.to(tl.int64) & 0xFFFFFFFF, mask=live)
    tl.store(o2_ptr + i, r2.to(tl.int64) & 0xFFFFFFFF, mask=live)
    tl.store(o3_ptr + i, r3.to(tl.int64) & 0xFFFFFFFF, mask=live)


@triton.jit
def _unit(r, F64: tl.constexpr):
    # fnebm.random._to_unit: the word as int32 x, x < 0 -> -x - 1 (= x ^ (x >> 31)), times 2**-31
    # (float32: Triton's 4.6566127342e-10)
    x = r.to(tl.int32, bitcast=True)
    x = x ^ (x >> 31)
    if F64:
        u = x.to(tl.float64) * 4.656612873077393e-10
    else:
        u = x.to(tl.float32) * 4.6566127342e-10
    return u


@triton.jit
def _box_muller(a, b):
    # tl.pair_uniform_to_normal's operations in its order (float32: tl.randn4x's bits, those of
    # fnebm's Triton kernels), which are fnebm.random.normal's: r = sqrt(-2 log max(u1, 1e-7)),
    # th = 2 pi u2; float64 in float64
    a = tl.maximum(1.0e-7, a)
    th = 6.283185307179586 * b
    r = tl.sqrt(-2.0 * tl.log(a))
    return r * tl.cos(th), r * tl.sin(th)


@triton.jit
def _store(out_ptr, row, e, n, v, live):
    tl.store(out_ptr + row + e, v, mask=live & (e < n))


@triton.jit(do_not_specialize=["ks", "kw", "n_keys", "n", "m"])
def draw_kernel(k_ptr, ks, kw, out_ptr, n_keys, n, m, NORMAL: tl.constexpr, F64: tl.constexpr,
                BLOCK: tl.constexpr):
    # fnebm.random.normal / uniform of n_keys keys (key j: words k_ptr[j ks], k_ptr[j ks + kw]),
    # n values each, in one launch: Philox block b of key j, converted, to out[j n + lane m + b]
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = t < n_keys * m
    j = t // m
    b = t - j * m
    k0 = tl.load(k_ptr + j * ks, mask=live, other=0).to(tl.uint32)
    k1 = tl.load(k_ptr + j * ks + kw, mask=live, other=0).to(tl.uint32)
    seed = k0.to(tl.uint64) | (k1.to(tl.uint64) << 32)
    zero = tl.zeros_like(k0)
    r0, r1, r2, r3 = tl.philox(seed, b.to(tl.uint32), (b >> 32).to(tl.uint32), zero, zero, 10)
    u0, u1, u2, u3 = _unit(r0, F64), _unit(r1, F64), _unit(r2, F64), _unit(r3, F64)
    if NORMAL:
        u0, u1 = _box_muller(u0, u1)
        u2, u3 = _box_muller(u2, u3)
    row = j * n
    _store(out_ptr, row, b, n, u0, live)
    _store(out_ptr, row, m + b, n, u1, live)
    _store(out_ptr, row, 2 * m + b, n, u2, live)
    _store(out_ptr, row, 3 * m + b, n, u3, live)
