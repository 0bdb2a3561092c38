"""Eager steps on a CUDA device replayed from a CUDA graph (``fnebm.chain.engines.TorchEngine._graphed``).

On this CPU machine the route's plumbing runs with the capture faked (a "graph" whose replay calls
the captured function): buffers, step indices, kept draws, chunks, the probe's step and the fallbacks
must give the draws the one-by-one eager steps give, bit for bit. The real capture runs where a CUDA
device is (the last test; ``bench/gpu_graph_check.py`` on the device machine).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import fnebm
from fnebm import energies as E
from fnebm import random as fr
from fnebm.chain import engines
from fnebm.chain.runner import RunnerCache

F64 = torch.float64


class _FakeGraph:
    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def replay(self):
        self.log["replays"] += 1
        self.fn()


@pytest.fixture
def fake_cuda(monkeypatch):
    """The graph route on the CPU: every chunk of at least _GRAPH_MIN_STEPS steps takes it."""
    log = {"captures": 0, "replays": 0, "fail": None}

    def capture(fn, stream):
        log["captures"] += 1
        if log["fail"] is not None:
            raise log["fail"]
        return _FakeGraph(fn, log)

    monkeypatch.setattr(engines, "graphable", lambda device, steps: steps >= engines._GRAPH_MIN_STEPS)
    monkeypatch.setattr(engines, "_side_stream", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(engines, "_capture", capture)
    return log


def _net(d=5, h=12, seed=0):
    g = torch.Generator().manual_seed(seed)  # the test's own generator: weights only
    net = nn.Sequential(nn.Linear(d, h), nn.SiLU(), nn.Linear(h, 1)).to(F64)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=F64))
    return net


def _algs():
    net = _net()
    neural = E.bind(*E.from_module(net))
    return {
        "langevin-mlp": (fnebm.langevin(neural, 0.05, 0.5), 5),
        "mala-function": (fnebm.mala(lambda x: 0.5 * (x * x).sum() + 0.1 * x[0] ** 4, 0.2), 3),
        "hmc-mlp": (fnebm.hmc(neural, 0.1, torch.ones(5, dtype=F64), 3), 5),
    }


def _run(alg, d, steps=30, **kw):
    """A run of its own cache unless one is given (a failed capture is remembered in a cache's ledger)."""
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(3), (6, d), F64))
    kw.setdefault("cache", RunnerCache())
    return fnebm.sample_chain(alg.step, state, fr.key(11), steps, progress=False, compile=False, **kw)


def _assert_same(a, b):
    for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b), strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["langevin-mlp", "mala-function", "hmc-mlp"])
@pytest.mark.parametrize("kw", [{}, {"thin": 4, "burn_in": 3}, {"chunk_size": 9, "thin": 2}])
def test_replayed_steps_give_the_one_by_one_draws(fake_cuda, monkeypatch, name, kw):
    alg, d = _algs()[name]
    graphed = _run(alg, d, **kw)
    assert fake_cuda["captures"] == 1  # once per call, kept across its chunks
    assert fake_cuda["replays"] >= 30 - 2 * engines._GRAPH_MIN_STEPS  # the steps did go through the graph
    monkeypatch.setattr(engines, "graphable", lambda device, steps: False)
    _assert_same(graphed, _run(alg, d, **kw))


def test_a_chunk_shorter_than_the_threshold_runs_one_by_one_on_the_graphs_buffers(fake_cuda, monkeypatch):
    alg, d = _algs()["langevin-mlp"]
    n = engines._GRAPH_MIN_STEPS
    got = _run(alg, d, steps=n + n - 1, chunk_size=n)  # a graphed chunk, then a short one
    assert fake_cuda["captures"] == 1 and fake_cuda["replays"] == n - 1
    monkeypatch.setattr(engines, "graphable", lambda device, steps: False)
    _assert_same(got, _run(alg, d, steps=n + n - 1, chunk_size=n))


def test_a_failed_capture_leaves_the_steps_eager_and_their_draws_unchanged(fake_cuda, monkeypatch):
    alg, d = _algs()["langevin-mlp"]
    fake_cuda["fail"] = RuntimeError("operation not permitted when stream is capturing")
    got = _run(alg, d, chunk_size=10)
    assert fake_cuda["captures"] == 1  # not tried again in the call's later chunks
    assert fake_cuda["replays"] == 0
    monkeypatch.setattr(engines, "graphable", lambda device, steps: False)
    _assert_same(got, _run(alg, d, chunk_size=10))


def test_on_plan_says_the_steps_replay_a_graph_and_when_a_capture_failed(fake_cuda):
    alg, d = _algs()["langevin-mlp"]
    plans = []
    _run(alg, d, on_plan=plans.append)
    assert len(plans) == 1 and plans[0].engine == "eager" and plans[0].reason.endswith(engines.GRAPH_NOTE)
    fake_cuda["fail"] = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    plans.clear()
    _run(alg, d, on_plan=plans.append)
    assert len(plans) == 2 and plans[1].revised and engines.GRAPH_NOTE not in plans[1].reason
    assert plans[1].reason.endswith("no CUDA graph of a step (RuntimeError: CUDA error: operation not permitted "
                                    "when stream is capturing)")


def test_a_failed_capture_is_not_tried_again_for_the_same_kind_of_step(fake_cuda, monkeypatch):
    alg, d = _algs()["langevin-mlp"]
    cache, plans = RunnerCache(), []
    fake_cuda["fail"] = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    first = _run(alg, d, cache=cache)
    _run(alg, d, cache=cache, on_plan=plans.append)
    assert fake_cuda["captures"] == 1 and len(plans) == 1
    assert "one by one: no CUDA graph of a step (RuntimeError: CUDA error" in plans[0].reason
    monkeypatch.setattr(engines, "graphable", lambda device, steps: False)
    _assert_same(first, _run(alg, d))


def test_a_step_whose_output_holds_an_input_buffer_elsewhere_replays_right(fake_cuda, monkeypatch):
    # the replay copies the outputs into the state's buffers in turn: an output that is another field's
    # input (the energy before the move, as info) must be read before that field is overwritten
    alg, d = _algs()["langevin-mlp"]

    def step(state, keys):
        new, info = alg.step(state, keys)
        return new, (info.is_divergent, state.energy, state.position[..., 0])

    def run():
        s = torch.func.vmap(alg.init)(fr.normal(fr.key(3), (6, d), F64))
        return fnebm.sample_chain(step, s, fr.key(11), 20, progress=False, compile=False, cache=RunnerCache())

    graphed = run()
    assert fake_cuda["captures"] == 1 and fake_cuda["replays"] > 0
    monkeypatch.setattr(engines, "graphable", lambda device, steps: False)
    _assert_same(graphed, run())


def test_with_on_chunk_each_chunk_captures_anew(fake_cuda, monkeypatch):
    # the caller's code runs between chunks: what it changes is seen by a new capture
    alg, d = _algs()["langevin-mlp"]
    got = _run(alg, d, steps=30, chunk_size=10, on_chunk=lambda *a: None)
    assert fake_cuda["captures"] == 3
    monkeypatch.setattr(engines, "graphable", lambda device, steps: False)
    _assert_same(got, _run(alg, d, steps=30, chunk_size=10, on_chunk=lambda *a: None))


def test_the_warm_up_step_is_kept_and_the_reason_said_when_no_capture_is_made(fake_cuda):
    alg, d = _algs()["langevin-mlp"]
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(3), (4, d), F64))
    keys = fr.split(fr.key(5), 4)
    t = torch.tensor(7)
    want = alg.step(state, fr.fold_in(keys, 7))

    fake_cuda["fail"] = RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
    g, failed = engines._Graphed.make(alg.step, keys, state, t)
    assert g is None and failed.reason == "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    _assert_same(failed.ran, want)

    tracked = state._replace(position=state.position.clone().requires_grad_(True))
    g, failed = engines._Graphed.make(alg.step, keys, tracked, t)
    assert g is None and "autograd" in failed.reason
    assert fake_cuda["captures"] == 1  # no capture tried for a step autograd tracks

    fake_cuda["fail"] = None
    g, failed = engines._Graphed.make(alg.step, keys, state, t)
    assert failed is None and int(g.t) == 8
    _assert_same((g.state, g.info), want)
    g.replay()
    _assert_same((g.state, g.info), alg.step(want[0], fr.fold_in(keys, 8)))
    assert int(g.t) == 9


def test_a_gradient_through_the_chain_is_not_captured(fake_cuda):
    net = _net()
    fn, params = E.from_module(net)
    alg = fnebm.langevin(E.bind(fn, params), 0.05, 0.5)
    x0 = fr.normal(fr.key(3), (4, 5), F64).requires_grad_(True)
    state = torch.func.vmap(alg.init)(x0)
    final, _, _ = fnebm.sample_chain(alg.step, state, fr.key(1), 12, progress=False, compile=False)
    assert fake_cuda["captures"] == 0
    (g,) = torch.autograd.grad(final.state.position.sum(), x0)  # the graph through the chain is intact
    assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_a_gradient_through_one_call_does_not_keep_later_calls_from_the_graph(fake_cuda):
    alg, d = _algs()["langevin-mlp"]
    cache = RunnerCache()
    x0 = fr.normal(fr.key(3), (6, d), F64)
    tracked = torch.func.vmap(alg.init)(x0.clone().requires_grad_(True))
    fnebm.sample_chain(alg.step, tracked, fr.key(1), 12, progress=False, compile=False, cache=cache)
    assert fake_cuda["captures"] == 0
    _run(alg, d, cache=cache)
    assert fake_cuda["captures"] == 1 and fake_cuda["replays"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sampler", ["langevin", "mala", "hmc"])
def test_on_a_cuda_device_the_graph_gives_the_one_by_one_draws(monkeypatch, sampler):
    torch.manual_seed(0)  # the test's weights
    net = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 1)).cuda()
    energy = E.bind(*E.from_module(net))
    alg = {"langevin": lambda: fnebm.langevin(energy, 0.01, 0.05), "mala": lambda: fnebm.mala(energy, 0.01),
           "hmc": lambda: fnebm.hmc(energy, 0.02, torch.ones(32, device="cuda"), 3)}[sampler]()
    x0 = fr.normal(fr.key(3, device="cuda"), (64, 32))

    def run(plans):
        state = torch.func.vmap(alg.init)(x0)
        return fnebm.sample_chain(alg.step, state, fr.key(1, device="cuda"), 40, thin=5, progress=False, compile=False,
                                  on_plan=plans.append, cache=RunnerCache())

    plans = []
    graphed = run(plans)
    assert len(plans) == 1 and engines.GRAPH_NOTE in plans[0].reason  # no revised plan: it replayed
    monkeypatch.setattr(engines, "_CUDA_GRAPHS", False)
    _assert_same(graphed, run([]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_cuda_device_a_failed_capture_leaves_the_allocator_working(monkeypatch):
    def host_read(xs):  # reads a value on the host: the capture fails
        return 0.5 * (xs * xs).sum(-1) + 0.0 * float(xs.detach().abs().max().item())

    alg = fnebm.mala(E.batched(host_read), 0.1)
    x0 = fr.normal(fr.key(3, device="cuda"), (8, 32))
    plans = []

    def run(**kw):
        state = torch.func.vmap(alg.init)(x0)
        return fnebm.sample_chain(alg.step, state, fr.key(1, device="cuda"), 30, progress=False, compile=False,
                                  cache=RunnerCache(), **kw)

    got = run(on_plan=plans.append)
    assert len(plans) == 2 and plans[1].revised and "no CUDA graph of a step" in plans[1].reason
    torch.cuda.empty_cache()  # refused while the allocator believes a capture is under way
    torch.cuda.synchronize()
    monkeypatch.setattr(engines, "_CUDA_GRAPHS", False)
    _assert_same(got, run())


def test_a_kernels_host_scalars_stay_on_the_host_and_other_tunables_move_to_the_device():
    # "meta" stands in for the GPU: HMC's CPU step size would be copied to the device at every step
    # (refused inside a capture), so the captured step holds it there; Langevin's and MALA's 0-dim
    # step sizes are host scalars in their kernels' arithmetic and stay (the same bits as one by one)
    net = _net()
    neural = E.bind(*E.from_module(net))
    meta = torch.device("meta")
    hmc = engines._tunables_on(fnebm.hmc(neural, 0.1, torch.ones(5, dtype=F64), 3).step, meta)
    assert hmc.tunables["step_size"].device == meta and hmc.tunables["inverse_mass_matrix"].device == meta
    for alg in (fnebm.langevin(neural, 0.05, 0.5), fnebm.mala(neural, 0.05)):
        assert alg.step.host_scalars
        assert engines._tunables_on(alg.step, meta) is alg.step
    per = fnebm.mala(neural, torch.full((4,), 0.05, dtype=F64)).step  # one per chain: moved
    assert engines._tunables_on(per, meta).tunables["step_size"].device == meta
    opaque = lambda state, key: alg.step(state, key)  # noqa: E731 - a user's wrapper: left as it is
    assert engines._tunables_on(opaque, meta) is opaque
