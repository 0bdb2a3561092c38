"""fnebm's Inductor pass for skinny CPU matrix products (fnebm/_inductor.py): ``mm(a, b)`` with an
output of N <= 8 columns and at least 4N rows runs as ``mm(b^T, a^T)^T``, the batched linear predictor of a
few chains (X @ beta), which MKL ran 3-9x slower than its transpose; and a thin one (an inner dimension
of at most 4, one output column, or at most 2 rows or columns with a contiguous inner dimension) as
elementwise code and a reduction that Inductor fuses with its neighbours. The rewrites must keep the
values (to float rounding) and leave other products alone."""

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


def test_the_pass_has_a_stable_uuid_for_inductors_cache(monkeypatch):
    p = _inductor._skinny_pass()
    assert p is _inductor._skinny_pass() and isinstance(p.uuid(), str) and p.uuid() == p.uuid()
    # the thin-product switch enters it as it is at each compile: a graph compiled with it off is not
    # served from Inductor's cache to a compile with it on
    on = p.uuid()
    monkeypatch.setattr(_inductor, "THIN_PRODUCTS", False)
    assert p.uuid() != on


def test_the_switch_leaves_thin_products_to_the_library(monkeypatch):
    monkeypatch.setattr(_inductor, "THIN_PRODUCTS", False)
    gm, before = _rewritten(lambda x, w: x @ w, torch.randn(1024, 2), torch.randn(2, 128))
    assert before == 1 and len(_mms(gm)) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_thin_products_become_elementwise_code_and_a_reduction_with_the_same_values(dtype):
    # a network's first layer on 2-D inputs (inner dimension 2), its last layer (one output column), and
    # their backward products: no MKL call left, the values those of the products to float rounding
    g = torch.Generator().manual_seed(1)
    x, w0 = torch.randn(1024, 2, generator=g, dtype=dtype), torch.randn(2, 128, generator=g, dtype=dtype)
    h, w2 = torch.randn(1024, 128, generator=g, dtype=dtype), torch.randn(128, 1, generator=g, dtype=dtype)
    seed = torch.randn(1, 1, generator=g, dtype=dtype)

    def fn(x, w0, h, w2, seed):
        # K = 2, N = 1, K = 1, N = 1, M = 2 (the input gradient, transposed), N = 2
        return x @ w0, h @ w2, seed @ w2.T, h @ w0.T[:, :1], w0 @ h.T, h @ w0.T

    gm, before = _rewritten(fn, x, w0, h, w2, seed)
    assert before == 6 and _mms(gm) == []
    ops = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten.sum.dim_IntList in ops and aten.mul.Tensor in ops
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-10)
    for got, want in zip(gm(x, w0, h, w2, seed), fn(x, w0, h, w2, seed)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **tol)


def test_a_product_with_a_wide_inner_dimension_and_output_is_left_to_the_library():
    gm, before = _rewritten(lambda a, b: a @ b, torch.randn(64, 5), torch.randn(5, 16))
    assert before == 1 and len(_mms(gm)) == 1
    # two output columns, but the inner dimension runs down the data's columns (X^T r: a strided
    # reduction, which took longer than the library's product): transposed as a skinny product instead
    gm, before = _rewritten(lambda x, r: x.T @ r.T, torch.randn(1000, 25), torch.randn(2, 1000))
    assert before == 1 and len(_mms(gm)) == 1
