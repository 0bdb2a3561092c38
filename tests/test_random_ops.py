"""fnebm.random's CPU draws as operators (torch.ops.fnebm.*): under vmap, grad, jvp and torch.compile
the draws are the eager draws bit for bit, and a compiled graph holds one call per draw, not Philox."""

import pytest
import torch

from fnebm import random as fr

KEYS = fr.split(fr.key(11), 5)
DATA = torch.arange(5) * 3 + 1


def _draws(keys, t):
    k = fr.fold_in(keys, t)
    two = fr.split(k, 2)
    return (fr.normal(two[..., 0, :], (3, 2)), fr.uniform(two[..., 1, :], (4,), minval=-1.0, maxval=2.0),
            fr.normal(k, (5,), dtype=torch.float64), fr.split(k, 3), fr.fold_in(k, DATA))


def _equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


def test_vmap_equals_the_eager_batch():
    want = _draws(KEYS, torch.tensor(7))
    got = torch.func.vmap(lambda k: _draws(k, torch.tensor(7)))(KEYS)
    _equal(got[:4], want[:4])
    # per key, fold_in's data is this key's own element: vmap over both
    per = torch.func.vmap(fr.fold_in)(fr.fold_in(KEYS, 7), DATA)
    assert torch.equal(per, fr.fold_in(fr.fold_in(KEYS, 7), DATA))


_K = fr.split(fr.key(2), 12)


@pytest.mark.parametrize("keys, data, in_dims", [
    (_K.reshape(3, 4, 2), torch.arange(4) + 100, (0, None)),
    (_K[:4], torch.arange(12).reshape(3, 4), (None, 0)),
    (_K.reshape(3, 4, 2), torch.arange(12).reshape(3, 4), (0, 0)),
    (_K.reshape(4, 3, 2), torch.arange(4) + 100, (1, None)),
    (_K[:3], torch.arange(4) + 100, (0, None)),  # one key per call, broadcast against data (4,)
    (_K[0], torch.arange(12).reshape(3, 4), (None, 0)),
    (_K.reshape(3, 4, 2), torch.arange(3), (0, 0)),  # data () per call, keys (4, 2)
])
def test_fold_in_vmap_broadcasts_as_each_call_would(keys, data, in_dims):
    kdim, ddim = in_dims
    size = keys.shape[kdim] if kdim is not None else data.shape[ddim]
    got = torch.func.vmap(fr.fold_in, in_dims=in_dims)(keys, data)
    want = torch.stack([fr.fold_in(keys.select(kdim, i) if kdim is not None else keys,
                                   data.select(ddim, i) if ddim is not None else data) for i in range(size)])
    assert torch.equal(got, want)


def test_nested_vmap_and_grad_and_jvp():
    kk = fr.split(KEYS, 2)  # (5, 2, 2)
    nested = torch.func.vmap(torch.func.vmap(lambda k: fr.normal(k, (3,))))(kk)
    assert torch.equal(nested, fr.normal(kk, (3,)))
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    noise = fr.normal(KEYS, (3,))
    # a captured key inside grad (it failed before: the eager C path read a functorch tensor)
    assert torch.equal(torch.func.grad(lambda x: (x * fr.normal(KEYS, (3,))).sum())(x), noise)
    per_chain = torch.func.vmap(torch.func.grad(lambda x, k: (x * fr.normal(fr.fold_in(k, 0), (3,))).sum()))(x, KEYS)
    assert torch.equal(per_chain, fr.normal(fr.fold_in(KEYS, 0), (3,)))
    _, tangent = torch.func.jvp(lambda x: x * fr.normal(KEYS, (3,)), (x,), (torch.ones_like(x),))
    assert torch.equal(tangent, noise)


def test_the_operators_check_the_words():
    bad = torch.tensor([[0, 2**32]], dtype=torch.int64)
    with pytest.raises(ValueError, match="key"):
        torch.ops.fnebm.normal(bad, [3], torch.float32)
    with pytest.raises(ValueError, match="key"):
        torch.ops.fnebm.fold_in(bad, torch.tensor(1))
    with pytest.raises(TypeError, match="data must have dtype torch.int64"):
        torch.ops.fnebm.fold_in(KEYS, torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32))


def test_a_compiled_graph_calls_the_operators_and_holds_no_philox():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(_draws, backend=backend, fullgraph=True)(KEYS, torch.tensor(3))
    _equal(out, _draws(KEYS, torch.tensor(3)))
    (gm,) = graphs
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("fnebm.normal" in t for t in targets) == 2 and sum("fnebm.fold_in" in t for t in targets) == 2
    assert not any("xor" in t for t in targets), targets  # Philox's rounds are not in the graph


def test_inductor_runs_the_operators_with_their_layouts():
    # split's and fold_in's results are permuted views (word-major): the fake implementations give
    # Inductor those strides, so the kernels after them read the right words
    def f(keys, t):
        out = _draws(keys, t)
        return tuple(o * 1 if o.dtype == torch.int64 else o + 0 for o in out)

    compiled = torch.compile(f, fullgraph=True)
    for t in (3, 4):  # a new step index: no recompile, new draws
        _equal(compiled(KEYS, torch.tensor(t)), f(KEYS, torch.tensor(t)))


def test_other_devices_and_the_forced_torch_path_trace_philox(monkeypatch):
    monkeypatch.setattr(fr, "_NUMPY_EAGER", False)  # the torch path, as the tests of the stream force it
    got = torch.func.vmap(lambda k: fr.normal(k, (3,)))(KEYS)
    want = fr.normal(KEYS, (3,))  # the torch path too (no C, no NumPy)
    assert torch.equal(got, want)
    assert not fr._op_eligible(torch.zeros(2, dtype=torch.int64, device="meta"))
