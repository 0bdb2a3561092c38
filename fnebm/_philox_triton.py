"""The Philox4x32 block function as one Triton kernel: :func:`fnebm.random.philox4x32`'s eager
path on a CUDA device (the torch path is about 150 small kernels). Imported only when used.
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
