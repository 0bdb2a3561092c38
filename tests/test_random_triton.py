"""fnebm.random is the stream Triton kernels draw: checked against tl.randn4x / tl.rand4x.

The kernels run under TRITON_INTERPRET=1 on CPU (set before triton is imported), so this
pins the key -> (seed, offset, lane) mapping documented in fnebm.random.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from fnebm import random as fr  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 or a GPU",
)


@triton.jit
def _draw_kernel(seed_ptr, out_ptr, n, m, NORMAL: tl.constexpr, BLOCK: tl.constexpr):
    # One Philox block per offset b; its four lanes go to b, b + m, b + 2m, b + 3m.
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr)
    if NORMAL:
        r0, r1, r2, r3 = tl.randn4x(seed, b)
    else:
        r0, r1, r2, r3 = tl.rand4x(seed, b)
    live = b < m
    tl.store(out_ptr + b, r0, mask=live & (b < n))
    tl.store(out_ptr + b + m, r1, mask=live & (b + m < n))
    tl.store(out_ptr + b + 2 * m, r2, mask=live & (b + 2 * m < n))
    tl.store(out_ptr + b + 3 * m, r3, mask=live & (b + 3 * m < n))


def _triton_draw(key, n, normal):
    m = -(-n // 4)
    out = torch.empty(n, dtype=torch.float32)
    seed = fr.triton_seed(key).reshape(1)
    _draw_kernel[(triton.cdiv(m, 16),)](seed, out, n, m, NORMAL=normal, BLOCK=16)
    return out


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3, -1])
@pytest.mark.parametrize("n", [1, 10, 37])
def test_normal_and_uniform_match_triton(seed, n):
    k = fr.fold_in(fr.key(seed), 11)
    torch.testing.assert_close(_triton_draw(k, n, normal=True), fr.normal(k, (n,)), rtol=1e-5, atol=1e-5)
    # uniform is exact: the same integer ops and one float32 multiply
    assert torch.equal(_triton_draw(k, n, normal=False), fr.uniform(k, (n,)))
