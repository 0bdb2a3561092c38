"""Parameters are data: one compiled graph across parameter values, gradients through chains,
runs that continue where they stopped, explicit batching, and the boundary checks.

Compiles here use ``aot_eager`` through a counting backend (``RunnerCache(backend=...)``): the
same Dynamo graphs and AOTAutograd as Inductor, without its C++ code generation (minutes on
two cores for a differentiated chain). Inductor itself is exercised by test_chain.py.
"""

import io
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import fnebm
from fnebm import energies as E
from fnebm import random as fr
from fnebm.chain.loop import needs_grad
from torch.utils._pytree import tree_leaves

from conftest import walled

F64 = torch.float64
PREC = torch.tensor([[2.0, 0.3], [0.3, 1.0]], dtype=F64)


def gaussian(mean, prec=PREC):
    return E.Gaussian(mean, prec, torch.linalg.cholesky(prec))


def collect_both(state):
    return state.position, state.energy


@pytest.fixture(scope="module")
def counted():
    """A runner cache compiling with a counting aot_eager backend, shared by this module."""
    counter = CompileCounterWithBackend("aot_eager")
    return counter, fnebm.chain.RunnerCache(backend=counter)


# ----------------------------------------------------------------- one graph across values


def test_new_network_weights_reuse_the_graph(counted):
    counter, cache = counted
    net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    energy_fn, params = E.from_module(net)
    x0 = fr.normal(fr.key(1), (16, 2), F64)
    frames, outs = None, []
    for i in range(3):
        new = {k: v + 0.1 * i * fr.normal(fr.key(10 + i), v.shape, F64) for k, v in params.items()}
        alg = fnebm.mala(E.bind(energy_fn, new), 0.2)
        state = torch.func.vmap(alg.init)(x0)
        _, trace, _ = fnebm.sample_chain(alg.step, state, fr.key(2), 6, cache=cache, progress=False)
        _, eager, _ = fnebm.sample_chain(alg.step, state, fr.key(2), 6, compile=False, progress=False)
        torch.testing.assert_close(trace, eager, rtol=1e-9, atol=1e-9)
        frames = counter.frame_count if frames is None else frames
        assert counter.frame_count == frames
        outs.append(trace)
    assert not torch.equal(outs[0], outs[1])  # the weights mattered


def test_inline_collect_does_not_compile_per_call(counted):
    counter, cache = counted
    alg = fnebm.mala(gaussian(torch.zeros(2, dtype=F64)), 0.3)
    state = torch.func.vmap(alg.init)(torch.zeros(8, 2, dtype=F64))

    def call(i):  # a new lambda object on every call, from one place in the source
        return fnebm.sample_chain(alg.step, state, fr.key(i), 4, cache=cache, progress=False,
                                  collect=lambda s: (s.position, s.energy))

    call(0)
    frames, runners = counter.frame_count, len(cache)
    for i in range(1, 4):
        call(i)
    assert (counter.frame_count, len(cache)) == (frames, runners)


def test_users_compiled_function_builds_a_sampler_and_compiles_once():
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, backend=counter)
    def sweep(mean, step_size, x0, keys):
        alg = fnebm.mala(gaussian(mean), step_size)  # built inside the compiled function
        state = torch.func.vmap(alg.init)(x0)
        final, trace, info = fnebm.chain.run(alg.step, state, keys, 5)
        return final.position, trace, info.acceptance_rate

    def eager(mean, step_size, x0, keys):
        alg = fnebm.mala(gaussian(mean), step_size)
        final, trace, info = fnebm.chain.run(alg.step, torch.func.vmap(alg.init)(x0), keys, 5)
        return final.position, trace, info.acceptance_rate

    for i in range(3):
        args = (
            torch.tensor([i, -i], dtype=F64),
            torch.linspace(0.1, 0.5, 12, dtype=F64) * (1 + i),  # per-chain step sizes
            fr.normal(fr.key(i), (12, 2), F64),
            fr.split(fr.key(100 + i), 12),
        )
        for got, want in zip(sweep(*args), eager(*args)):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert counter.frame_count == 1


# ----------------------------------------------------------------- gradients through a chain

X0 = fr.normal(fr.key(3), (16, 2), F64)
KEYS = fr.split(fr.key(4), 16)
MEAN = torch.tensor([0.5, -0.3], dtype=F64)
H = torch.tensor(0.2, dtype=F64)


def chain_loss(mean, h, make, unroll=None, n=6):
    alg = make(gaussian(mean), h)
    final, trace, _ = fnebm.chain.run(alg.step, torch.func.vmap(alg.init)(X0), KEYS, n, unroll=unroll)
    return (trace**2).mean() + final.position.sum()


def test_compiled_gradients_through_a_chain():
    # torch.func.grad and torch.autograd, compiled with fullgraph=True: the loop unrolls itself
    make = fnebm.mala
    # three steps: the unrolled graph of a gradient of a gradient grows with every step
    want = torch.func.grad(lambda m, s: chain_loss(m, s, make, n=3), argnums=(0, 1))(MEAN, H)
    by_func = torch.compile(torch.func.grad(lambda m, s: chain_loss(m, s, make, n=3), argnums=(0, 1)),
                            fullgraph=True, backend="aot_eager")
    by_autograd = torch.compile(lambda m, s: chain_loss(m, s, make, n=3), fullgraph=True, backend="aot_eager")
    m, h = MEAN.clone().requires_grad_(), H.clone().requires_grad_()
    for got in (by_func(MEAN, H), torch.autograd.grad(by_autograd(m, h), (m, h))):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_scan_backward_is_either_refused_or_right():
    # unroll=False forces torch's scan under compile. On torch 2.13 its backward fails on the
    # boolean info outputs, which is why gradients unroll; if a later torch accepts it, its
    # gradients must equal the unrolled ones — a silently wrong scan gradient fails here.
    f = torch.compile(lambda m, s: chain_loss(m, s, fnebm.mala, unroll=False), fullgraph=True, backend="aot_eager")
    m, h = MEAN.clone().requires_grad_(), H.clone().requires_grad_()
    want = torch.autograd.grad(chain_loss(m, h, fnebm.mala), (m, h))
    try:
        got = torch.autograd.grad(f(m, h), (m, h))
    except Exception as e:  # noqa: BLE001 - any refusal by the compiler
        pytest.xfail(f"scan backward unsupported on torch {torch.__version__}: {type(e).__name__}")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_needs_grad_sees_parameters_held_by_the_step():
    alg = fnebm.mala(gaussian(MEAN.clone().requires_grad_()), 0.1)
    state = torch.func.vmap(alg.init)(X0.detach())
    assert needs_grad(alg.step, state)
    with torch.no_grad():
        assert not needs_grad(alg.step, state)
    plain = fnebm.mala(gaussian(MEAN), 0.1)
    assert not needs_grad(plain.step, torch.func.vmap(plain.init)(X0))


# ----------------------------------------------------------------- runs continue


@pytest.mark.parametrize("compiled", [False, True])
def test_two_runs_continued_equal_one_run(compiled, counted):
    _, cache = counted
    alg = fnebm.mala(gaussian(MEAN), 0.3)
    state = torch.func.vmap(alg.init)(X0)
    kw = dict(progress=False, compile=compiled, cache=cache, collect=collect_both)
    whole, trace, info = fnebm.sample_chain(alg.step, state, fr.key(5), 12, **kw)
    first, t1, i1 = fnebm.sample_chain(alg.step, state, fr.key(5), 5, **kw)
    second, t2, i2 = fnebm.sample_chain(alg.step, first, None, 7, **kw)
    assert int(first.steps_taken) == 5 and int(second.steps_taken) == 12
    for a, b in zip(torch.utils._pytree.tree_leaves((whole, trace, info)),
                    torch.utils._pytree.tree_leaves((second, tuple(map(torch.cat, zip(t1, t2))),
                                                     type(i1)(*map(torch.cat, zip(i1, i2)))))):
        assert torch.equal(a, b)
    # with burn-in: steps 3..11 of the continued run are steps 3..11 of the whole
    _, tail, _ = fnebm.sample_chain(alg.step, first, None, 4, burn_in=3, **kw)
    assert torch.equal(tail[0], trace[0][-4:])


@given(split=st.integers(1, 9), burn_in=st.integers(0, 3), thin=st.integers(1, 3))
@settings(max_examples=12, deadline=None)
def test_any_split_of_a_run_continues_exactly(split, burn_in, thin):
    # eager, small: k steps then the rest (with the same burn-in and thinning of the rest)
    alg = fnebm.langevin(gaussian(MEAN), 0.2)
    state = torch.func.vmap(alg.init)(X0[:4])
    kw = dict(progress=False, compile=False)
    whole, trace, _ = fnebm.sample_chain(alg.step, state, fr.key(11), 10, burn_in=split, thin=1, **kw)
    first, _, _ = fnebm.sample_chain(alg.step, state, fr.key(11), split, **kw)
    rest, tail, _ = fnebm.sample_chain(alg.step, first, None, 10 - burn_in, burn_in=burn_in, thin=thin, **kw)
    assert torch.equal(rest.state.position, whole.state.position)
    assert torch.equal(tail, trace[burn_in + thin - 1 :: thin][: (10 - burn_in) // thin])


def test_saved_chain_loads_with_weights_only_and_resumes_exactly():
    alg = fnebm.mala(gaussian(MEAN), 0.3)
    state = torch.func.vmap(alg.init)(X0)
    kw = dict(progress=False, compile=False)
    first, _, _ = fnebm.sample_chain(alg.step, state, fr.key(6), 4, **kw)
    buffer = io.BytesIO()
    torch.save(first, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only=True by default
    assert type(loaded) is fnebm.ChainState and type(loaded.state) is fnebm.samplers.MALAState
    a = fnebm.sample_chain(alg.step, first, None, 3, **kw)
    b = fnebm.sample_chain(alg.step, loaded, None, 3, **kw)
    assert all(torch.equal(x, y) for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)))


def test_langevin_info_also_loads_with_weights_only():
    alg = fnebm.langevin(gaussian(MEAN), 0.1)
    _, _, info = fnebm.sample_chain(alg.step, torch.func.vmap(alg.init)(X0), fr.key(0), 2, compile=False, progress=False)
    buffer = io.BytesIO()
    torch.save(info, buffer)
    buffer.seek(0)
    assert type(torch.load(buffer)) is fnebm.samplers.LangevinInfo


# ----------------------------------------------------------------- explicit batching


def test_per_chain_keys_equal_one_key_split():
    alg = fnebm.mala(gaussian(MEAN), 0.3)
    state = torch.func.vmap(alg.init)(X0)
    kw = dict(progress=False, compile=False)
    a = fnebm.sample_chain(alg.step, state, fr.key(7), 4, **kw)
    b = fnebm.sample_chain(alg.step, state, fr.split(fr.key(7), 16), 4, **kw)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0].keys, b[0].keys)


def test_two_chain_axes_with_a_step_size_per_row():
    # (4 step sizes, 8 chains): each row equals a run with that row's scalar step size
    sizes = torch.tensor([0.05, 0.1, 0.3, 0.8], dtype=F64)
    x0 = fr.normal(fr.key(8), (4, 8, 2), F64)
    keys = fr.split(fr.key(9), 32).reshape(4, 8, 2)
    target = gaussian(MEAN)
    sweep = fnebm.mala(target, sizes)
    state = torch.func.vmap(torch.func.vmap(sweep.init))(x0)
    _, trace, info = fnebm.sample_chain(sweep.step, state, keys, 5, compile=False, progress=False)
    assert trace.shape == (5, 4, 8, 2) and info.acceptance_rate.shape == (5, 4, 8)
    for r in range(4):
        one = fnebm.mala(target, float(sizes[r]))
        _, row, _ = fnebm.sample_chain(one.step, torch.func.vmap(one.init)(x0[r]), keys[r], 5, compile=False,
                                       progress=False)
        torch.testing.assert_close(trace[:, r], row, rtol=1e-12, atol=1e-12)


def test_vmap_over_step_sizes():
    # torch.func.vmap over step sizes, the BlackJAX way, equals per-chain step sizes
    sizes = torch.tensor([0.1, 0.2, 0.4], dtype=F64)
    target = gaussian(MEAN)

    def final_position(h, x, key):
        alg = fnebm.mala(target, h)
        return fnebm.chain.run(alg.step, alg.init(x), key, 3)[0].position

    x0, keys = X0[:3], KEYS[:3]
    mapped = torch.func.vmap(final_position)(sizes, x0, keys)
    alg = fnebm.mala(target, sizes)
    direct = fnebm.chain.run(alg.step, torch.func.vmap(alg.init)(x0), keys, 3)[0].position
    torch.testing.assert_close(mapped, direct, rtol=1e-12, atol=1e-12)


def test_out_buffers_are_filled_in_place():
    alg = fnebm.mala(gaussian(MEAN), 0.3)
    state = torch.func.vmap(alg.init)(X0)
    kw = dict(progress=False, compile=False, collect=collect_both, burn_in=2, thin=2)
    _, trace, info = fnebm.sample_chain(alg.step, state, fr.key(1), 6, **kw)
    out = (tuple(torch.full_like(x, math.nan) for x in trace), type(info)(*(torch.zeros_like(x) for x in info)))
    _, trace2, info2 = fnebm.sample_chain(alg.step, state, fr.key(1), 6, out=out, **kw)
    assert all(a is b for a, b in zip(trace2, out[0])) and all(a is b for a, b in zip(info2, out[1]))
    assert all(torch.equal(a, b) for a, b in zip(trace + info, trace2 + info2))
    with pytest.raises(ValueError, match=r"out\[0\]\[0\] must be a tensor of shape \(4, 16, 2\).*got \(\(3, 16, 2\)"):
        fnebm.sample_chain(alg.step, state, fr.key(1), 8, out=out, **kw)


def test_eager_draws_go_straight_into_the_trace(monkeypatch):
    """Eager steps on plain tensors copy each kept draw into the trace's buffers (allocated once), not
    a clone a step stacked at the end: the same draws as the clone-and-stack way, which a chain with a
    gradient through it still takes (its draws are autograd's outputs)."""
    from fnebm.chain import engines

    alg = fnebm.mala(gaussian(MEAN), 0.3)
    state = torch.func.vmap(alg.init)(X0)
    kw = dict(progress=False, compile=False, collect=collect_both, burn_in=3, thin=2)
    stacked = []
    real = engines._stacked
    monkeypatch.setattr(engines, "_stacked", lambda st, outs: stacked.append(len(outs)) or real(st, outs))
    final, trace, info = fnebm.sample_chain(alg.step, state, fr.key(1), 13, **kw)
    assert stacked == []  # (a chunk whose draws were all written returns before any stack)
    monkeypatch.setattr(engines.TorchEngine, "_writable", lambda self, got: False)
    final2, trace2, info2 = fnebm.sample_chain(alg.step, state, fr.key(1), 13, **kw)
    assert stacked == [trace[0].shape[0]]  # the clone-and-stack way: one stack of every kept draw
    for a, b in zip(tree_leaves((final, trace, info)), tree_leaves((final2, trace2, info2)), strict=True):
        assert torch.equal(a, b)
    # decided once a chunk: an answer that changes within it (torch.compiler.is_compiling() is True in every
    # thread while a background compile traces) neither drops the draws cloned before nor mixes the two ways
    answers = iter([False, True, True, True, True, True, True])
    monkeypatch.setattr(engines.TorchEngine, "_writable", lambda self, got: next(answers))
    _, trace4, info4 = fnebm.sample_chain(alg.step, state, fr.key(1), 13, **kw)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves((trace, info)), tree_leaves((trace4, info4))))
    monkeypatch.undo()

    mean = MEAN.clone().requires_grad_()
    graded = fnebm.mala(gaussian(mean), 0.3)
    _, trace3, _ = fnebm.sample_chain(graded.step, torch.func.vmap(graded.init)(X0), fr.key(1), 13, **kw)
    assert trace3[0].requires_grad
    (g,) = torch.autograd.grad(trace3[0].sum(), mean)
    assert torch.isfinite(g).all() and g.abs().sum() > 0
    torch.testing.assert_close(trace3[0].detach(), trace[0], rtol=1e-12, atol=1e-12)


def test_sample_chain_writes_nothing_onto_its_arguments():
    alg = fnebm.mala(gaussian(MEAN), 0.3)
    state = torch.func.vmap(alg.init)(X0)
    before = (dict(alg.step.keywords), vars(alg.step).copy() if hasattr(alg.step, "__dict__") else None)
    collect = lambda s: s.position  # noqa: E731
    fnebm.sample_chain(alg.step, state, fr.key(0), 3, collect=collect, progress=False, compile=False)
    assert (dict(alg.step.keywords), vars(alg.step).copy() if hasattr(alg.step, "__dict__") else None) == before
    assert not vars(collect)


# ----------------------------------------------------------------- boundary checks


def test_log_density_is_turned_into_an_energy():
    logp = lambda x: -0.5 * ((x - 2.0) ** 2).sum()  # noqa: E731  N(2, I), as BlackJAX users write it
    alg = fnebm.mala(E.from_logdensity(logp), 0.5)
    state = torch.func.vmap(alg.init)(torch.zeros(2048, 1, dtype=F64))
    final, _, _ = fnebm.sample_chain(alg.step, state, fr.key(0), 200, compile=False, progress=False)
    x = final.state.position[:, 0]
    # independent final states: mean within 5 standard errors of 2
    assert abs(float(x.mean()) - 2.0) < 5 / math.sqrt(2048)


BAD_INIT = [
    (lambda: fnebm.mala(gaussian(MEAN), 0.1).init(torch.zeros(1, dtype=F64)), ValueError, "does not fit the energy"),
    (lambda: fnebm.mala(gaussian(MEAN), 0.1).init(torch.zeros(2, 2, dtype=F64)), ValueError,
     r"torch.func.vmap\(alg.init\)"),
    (lambda: fnebm.mala(lambda x: x.sum(dim=1), 0.1).init(torch.zeros(2)), ValueError, "an energy takes one sample"),
    (lambda: fnebm.mala(lambda x: 1.0, 0.1).init(torch.zeros(2)), TypeError, "energy_fn must return a 0-dim tensor"),
    (lambda: fnebm.mala(lambda x: x * 2, 0.1).init(torch.zeros(2)), ValueError, "0-dim energy for one sample"),
    (lambda: fnebm.mala(gaussian(MEAN), 0.1).init(torch.tensor([math.nan, 0.0], dtype=F64)), ValueError,
     "position must be finite"),
    (lambda: fr.uniform(torch.tensor([-5, 2**40]), (10,)), ValueError, "words outside"),
    (lambda: fnebm.mala(gaussian(MEAN), torch.tensor([0.1, math.inf])), ValueError, "step_size must be a finite number > 0"),
]


@pytest.mark.parametrize("call,exc,match", BAD_INIT)
def test_bad_input_is_refused_at_the_boundary(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_nan_start_is_refused_by_sample_chain():
    alg = fnebm.langevin(walled, 0.1)
    state = torch.func.vmap(alg.init)(torch.zeros(4, 2))
    state = state._replace(position=state.position.clone().index_fill_(0, torch.tensor([2]), math.nan))
    with pytest.raises(ValueError, match=r"state\.position has non-finite values"):
        fnebm.sample_chain(alg.step, state, fr.key(0), 3, compile=False, progress=False)


def test_numpy_scalars_are_accepted():
    alg = fnebm.mala(gaussian(MEAN), np.float32(0.3))
    state = torch.func.vmap(alg.init)(X0)
    _, trace, _ = fnebm.sample_chain(alg.step, state, fr.key(np.int64(3)), np.int64(4), burn_in=np.int32(1),
                                     compile=False, progress=False)
    assert trace.shape == (4, 16, 2)
