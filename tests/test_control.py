"""fnebm._control.while_loop: eager and compiled agree, also nested in chain.run's scan."""

import torch

from fnebm._control import while_loop


def _run(x, n, prec):
    def cond(i, x, n):
        return (i < n).any()

    def body(i, x, n):
        active = (i < n)[:, None]
        g = prec * x  # prec captured by body only
        return i + 1, torch.where(active, x - 0.1 * g, x), n.clone()

    _, x, _ = while_loop(cond, body, (torch.zeros_like(n), x, n))
    return x


def _expected(x, n, prec):
    out = x.clone()
    for c in range(x.shape[0]):
        for _ in range(int(n[c])):
            out[c] = out[c] - 0.1 * prec * out[c]
    return out


def test_eager_runs_each_chain_its_own_count():
    x, n, prec = torch.ones(4, 3, dtype=torch.float64), torch.tensor([0, 1, 3, 7]), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(_run(x, n, prec), _expected(x, n, prec))


def test_compiled_nested_in_scan_equals_eager():
    from torch._higher_order_ops.scan import scan

    x, prec = torch.ones(4, 3, dtype=torch.float64), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    ns = torch.tensor([[1, 2, 3, 4], [4, 0, 2, 1]])

    def outer(x, ns, prec):
        def f(carry, n):
            y = _run(carry, n, prec)
            return y.clone(), y.sum().clone()

        return scan(f, x, ns)

    got = torch.compile(outer, backend="aot_eager", fullgraph=True)(x, ns, prec)
    want = _expected(_expected(x, ns[0], prec), ns[1], prec)
    torch.testing.assert_close(got[0], want)


def test_eager_under_vmap_each_lane_stops_on_its_own_condition():
    def halve_until_small(x):
        def cond(x):
            return x > 1.0

        def body(x):
            return (x / 2,)

        return while_loop(cond, body, (x,))[0]

    x = torch.tensor([0.5, 3.0, 40.0], dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(halve_until_small)(x), torch.tensor([0.5, 0.75, 0.625], dtype=torch.float64))


def test_compiled_carry_may_alias_itself():
    """Two carry entries that are views of one buffer (an eager NUTS step's state is such) compile."""

    def cond(i, a, b):
        return i < 3

    def body(i, a, b):
        return i + 1, a + b, b * 0.5

    def run(buf):
        a, b = buf[0], buf[1]
        return while_loop(cond, body, (torch.zeros((), dtype=torch.int64), a, b))

    buf = torch.arange(6.0).reshape(2, 3)
    got = torch.compile(run, backend="aot_eager", fullgraph=True)(buf)
    want = run(buf.clone())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
