"""fnebm.random is the stream Triton kernels draw: checked against tl.randn4x / tl.rand4x.

The kernels run under TRITON_INTERPRET=1 on CPU (set before triton is imported), so this
pins the key -> (seed, offset, lane) mapping documented in fnebm.random.
"""

import math
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


# The eager draws on a CUDA device: normal and uniform each as one Triton launch (fnebm._philox_triton
# .draw_kernel), run here by the interpreter on CPU tensors against the torch path
_DRAW_CASES = [((), ()), ((), (1,)), ((), (5,)), ((), (1100,)), ((3,), ()), ((3,), (2,)), ((3,), (3,)), ((4,), (7,)),
               ((2, 3), (2, 5)), ((5,), (0,)), ((0,), (3,)), ((70,), (2,)), ((2,), (1, 6, 6))]


def _draw(monkeypatch, call, triton_path):
    with monkeypatch.context() as mp:
        mp.setattr(fr, "_NUMPY_EAGER", False)  # neither the C nor the NumPy CPU path
        mp.setattr(fr, "_TRITON_EAGER_DEVICES", ("cpu",) if triton_path else ())
        launches = []
        if triton_path:
            from fnebm import _philox_triton

            mp.setattr(fr, "_draw_kernel", _Counted(_philox_triton.draw_kernel, launches))
            mp.setattr(fr, "_philox_triton", lambda *a: pytest.fail("the Philox block kernel ran"))
        return call(), launches


class _Counted:
    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_eager_draws_are_one_launch_with_the_torch_paths_words(monkeypatch, dtype):
    for batch, shape in _DRAW_CASES:
        k = fr.fold_in(fr.key(2**63 + 5), 3)
        keys = k if batch == () else fr.split(k, max(math.prod(batch), 1))[: math.prod(batch)].reshape(batch + (2,))
        for draw in (fr.uniform, fr.normal):
            want, _ = _draw(monkeypatch, lambda: draw(keys, shape, dtype), triton_path=False)
            got, launches = _draw(monkeypatch, lambda: draw(keys, shape, dtype), triton_path=True)
            assert got.shape == want.shape and got.dtype == want.dtype, (draw.__name__, batch, shape)
            assert len(launches) == (1 if got.numel() else 0), (draw.__name__, batch, shape, launches)
            if draw is fr.uniform:  # the same words through the same integer ops and one multiply
                assert torch.equal(got, want), (batch, shape)
            else:  # the interpreter's log/cos/sin against torch's: an ulp or two
                eps = torch.finfo(dtype).eps
                torch.testing.assert_close(got, want, rtol=4 * eps, atol=4 * eps, msg=str((batch, shape)))


def test_eager_draws_read_keys_of_any_layout(monkeypatch):
    base = fr.split(fr.key(9), 12)
    for keys in (base, base.contiguous(), base[::2], base.reshape(3, 4, 2).transpose(0, 1), fr.key(4).expand(5, 2)):
        want, _ = _draw(monkeypatch, lambda: fr.uniform(keys, (6,)), triton_path=False)
        got, launches = _draw(monkeypatch, lambda: fr.uniform(keys, (6,)), triton_path=True)
        assert launches and torch.equal(got, want)


@pytest.mark.parametrize("n", [1, 10, 37])
def test_eager_normal_is_tl_randn4x_bit_for_bit(monkeypatch, n):
    # the one-launch draw runs tl.pair_uniform_to_normal's operations: the bits of Triton kernels that
    # draw with tl.randn4x (fnebm's fused kernels), not just their values to an ulp
    k = fr.fold_in(fr.key(7), 11)
    got, launches = _draw(monkeypatch, lambda: fr.normal(k, (n,)), triton_path=True)
    assert launches and torch.equal(got, _triton_draw(k, n, normal=True))
