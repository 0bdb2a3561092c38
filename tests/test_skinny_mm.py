"""fnebm's Inductor pass for skinny CPU matrix products (fnebm/_inductor.py): ``mm(a, b)`` with an
output of N <= 8 columns and at least 4N rows runs as ``mm(b^T, a^T)^T``, the batched linear predictor of a
few chains (X @ beta), which MKL ran 3-9x slower than its transpose. The rewrite must keep the values
(to float rounding) and leave other products alone."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fnebm import _inductor

aten = torch.ops.aten


def _mms(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.mm.default]


def _rewritten(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    before = len(_mms(gm))
    _inductor._skinny_mm_pass(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm, before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_skinny_product_and_its_backward_run_transposed_with_the_same_values(dtype):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(1000, 25, generator=g, dtype=dtype)
    B = torch.randn(4, 25, generator=g, dtype=dtype)
    R = torch.randn(4, 1000, generator=g, dtype=dtype)

    def fn(X, B, R):
        return X @ B.T, X.T @ R.T  # (1000, 4) and (25, 4): the forward and backward products of a GLM

    gm, before = _rewritten(fn, X, B, R)
    mms = _mms(gm)
    assert before == 2 and len(mms) == 2
    for node in mms:  # each product now has a wide output, (4, rows), read back transposed
        assert node.meta["val"].shape[0] == 4
        (user,) = node.users
        assert user.target is aten.permute.default
    got, want = gm(X, B, R), fn(X, B, R)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-11)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)


def test_wide_or_short_products_are_left_alone():
    def fn(a, b):
        return a @ b

    for a, b in [(torch.randn(1000, 25), torch.randn(25, 16)),  # 16 columns: not skinny enough
                 (torch.randn(12, 25), torch.randn(25, 4)),  # 12 rows: not tall enough
                 (torch.randn(128, 784), torch.randn(784, 256))]:  # a network's layer
        gm, before = _rewritten(fn, a, b)
        assert before == 1
        (node,) = _mms(gm)
        assert node.args[0].op == "placeholder" and node.args[1].op == "placeholder"
    gm, _ = _rewritten(fn, torch.randn(1000, 25, dtype=torch.float64), torch.randn(25, 2, dtype=torch.float64))
    assert _mms(gm)[0].args[0].target is aten.permute.default  # float64 takes it too


def test_the_pass_has_a_stable_uuid_for_inductors_cache():
    p = _inductor._skinny_pass()
    assert p is _inductor._skinny_pass() and isinstance(p.uuid(), str) and len(p.uuid()) == 64
