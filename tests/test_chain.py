import numpy as np
import pytest
import torch

import fnebm
from fnebm import random as fr

from conftest import N_CHAINS, walled

F64 = torch.float64


def _close(a, b):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-9)


@pytest.fixture(scope="module")
def mala_state(mala_alg, start):
    return torch.func.vmap(mala_alg.init)(start)


def test_compiled_equals_eager(mala_alg, mala_state, mala_run):
    # mala_run compiled the graph already: these calls reuse it (the scan length is dynamic)
    kw = dict(burn_in=3, progress=False)
    f1, t1, i1 = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(1), 8, compile=True, **kw)
    f2, t2, i2 = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(1), 8, compile=False, **kw)
    _close(f1.state, f2.state)
    _close([t1], [t2])
    assert torch.equal(i1.is_accepted, i2.is_accepted)
    assert t1.shape == (8, N_CHAINS, 2) and i1.acceptance_rate.shape == (8, N_CHAINS)


def test_chunked_equals_one_call(mala_alg, mala_state, mala_run):
    one = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(5), 20, burn_in=6, compile=True, progress=False)
    calls = []
    chunked = fnebm.sample_chain(
        mala_alg.step, mala_state, fr.key(5), 20, burn_in=6, chunk_size=4, compile=True, progress=False,
        on_chunk=lambda done, total, s: calls.append((done, total, s)),
    )
    _close(one[0].state, chunked[0].state)
    _close([one[1]], [chunked[1]])
    _close(one[2], chunked[2])
    assert [c[0] for c in calls] == [4, 8, 12, 16, 20, 24, 26] and all(c[1] == 26 and c[2] > 0 for c in calls)


def test_draw_j_is_the_state_after_its_step(mala_alg, mala_state, mala_run):
    # thin=1: the last kept draw is the final state, and a run of k steps ends at draw k - 1
    final, trace, _ = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(7), 10, burn_in=2, compile=True, progress=False)
    torch.testing.assert_close(trace[-1], final.state.position)
    shorter, _, _ = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(7), 4, burn_in=2, compile=True, progress=False)
    torch.testing.assert_close(trace[3], shorter.state.position)


def test_thinning_compiled_equals_eager(mala_alg, mala_state):
    # burn_in and n_steps not multiples of thin: exercises the remainder graph too
    kw = dict(burn_in=4, thin=3, progress=False)
    f1, t1, i1 = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(9), 10, compile=True, **kw)
    f2, t2, i2 = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(9), 10, compile=False, **kw)
    _close(f1.state, f2.state)
    _close([t1], [t2])
    _close(i1, i2)
    assert t1.shape == (3, N_CHAINS, 2)
    # draw j is the state after step burn_in + (j + 1) * thin: the unthinned eager run agrees
    _, full, _ = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(9), 10, burn_in=4, compile=False, progress=False)
    torch.testing.assert_close(t2, full[2::3])


def test_each_chain_runs_on_its_own_key(mala_alg, mala_state):
    # chain c of a batched run is the single-chain run with key split(key, n_chains)[c]
    key = fr.key(11)
    _, batched, _ = fnebm.sample_chain(mala_alg.step, mala_state, key, 5, compile=False, progress=False)
    c = 17
    one = mala_alg.init(mala_state.position[c])
    _, single, info = fnebm.sample_chain(
        mala_alg.step, one, fr.split(key, N_CHAINS)[c], 5, compile=False, progress=False, chain_ndim=0
    )
    torch.testing.assert_close(single, batched[:, c])
    assert single.shape == (5, 2) and info.is_accepted.shape == (5,)


def test_collect_picks_what_is_kept(mala_alg, mala_state):
    _, trace, _ = fnebm.sample_chain(
        mala_alg.step, mala_state, fr.key(1), 3, collect=lambda s: {"x": s.position, "e": s.energy},
        compile=False, progress=False,
    )
    assert trace["x"].shape == (3, N_CHAINS, 2) and trace["e"].shape == (3, N_CHAINS)


def test_progress_bar_goes_to_stderr(mala_alg, mala_state, capsys):
    fnebm.sample_chain(mala_alg.step, mala_state, fr.key(1), 4, compile=False, progress=True)
    assert "4/4" in capsys.readouterr().err


def test_inputs_are_not_mutated(mala_alg, mala_state):
    before = [x.clone() for x in mala_state]
    key = fr.key(3)
    fnebm.sample_chain(mala_alg.step, mala_state, key, 3, compile=False, progress=False)
    _close(before, mala_state)
    assert key.tolist() == [3, 0]


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(n_steps=0), ValueError, "n_steps must be >= 1"),
        (dict(n_steps=2.5), TypeError, "n_steps must be an int"),
        (dict(burn_in=-1), ValueError, "burn_in"),
        (dict(thin=0), ValueError, "thin must be >= 1"),
        (dict(thin=5, n_steps=4), ValueError, "thin must be <= n_steps"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(collect="position"), TypeError, "collect must be callable"),
        (dict(key=fr.split(fr.key(0), 3)), ValueError, r"key has chain shape \(3,\) but the state's chains are \(4096,\)"),
        (dict(key=torch.tensor([-5, 2**40])), ValueError, r"key has words outside \[0, 2\*\*32\)"),
        (dict(key=None), TypeError, "key must be a key tensor"),
        (dict(n_steps=np.float64(3.0)), TypeError, "n_steps must be an int"),
        (dict(chain_ndim=2), ValueError, "every state field must lead with the chain axes"),
        (dict(on_chunk=3), TypeError, "on_chunk must be callable"),
        (dict(key=torch.zeros(2)), TypeError, "key must have dtype torch.int64"),
        (dict(step="mala"), TypeError, "step must be callable"),
        (dict(state=(1.0, 2.0)), TypeError, "state must be a pytree"),
        (dict(state=(torch.zeros(3), torch.zeros(2))), ValueError, "every state field must lead with the chain axes"),
    ],
)
def test_bad_arguments_raise(kwargs, exc, match, mala_alg, mala_state):
    args = dict(step=mala_alg.step, state=mala_state, key=fr.key(0), n_steps=4)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        fnebm.sample_chain(args.pop("step"), args.pop("state"), args.pop("key"), args.pop("n_steps"), **args)


@pytest.mark.parametrize("each", [True, False], ids=["each check", "one sync"])
def test_bad_values_raise_with_one_sync_or_many(monkeypatch, each, mala_alg, mala_state):
    """Off the CPU the key-range and finiteness checks are read back in one device sync; both
    ways name the same problem (the one-sync branch is forced here on the CPU)."""
    import fnebm.chain.sample as sample_mod

    if not each:
        monkeypatch.setattr(sample_mod, "_CHECK_EACH_ON", ())
    run = lambda state, key: fnebm.sample_chain(mala_alg.step, state, key, 2, progress=False)  # noqa: E731
    with pytest.raises(ValueError, match=r"key has words outside \[0, 2\*\*32\)"):
        run(mala_state, torch.tensor([-5, 2**40]))
    bad = mala_state._replace(grad=mala_state.grad.clone().index_fill_(0, torch.tensor([7]), float("nan")))
    with pytest.raises(ValueError, match=r"state\.grad has non-finite values"):
        run(bad, fr.key(0))
    assert run(mala_state, fr.key(0))[1].shape[0] == 2


def test_chunks_never_leave_a_lone_step():
    from fnebm.chain.schedule import chunks as _chunks

    for total in range(1, 40):
        for size in range(1, 12):
            chunks = _chunks(total, size)
            assert chunks[0][0] == 0 and chunks[-1][1] == total
            assert all(b0 == a1 for (_, b0), (a1, _) in zip(chunks, chunks[1:]))
            assert all(b - a >= 2 for a, b in chunks) or total == 1


def test_step_may_pass_fields_through(mala_alg, mala_state):
    # a custom step that returns a field unchanged must still compile (no carry aliasing)
    def step(state, key):
        new, info = mala_alg.step(state, key)
        return new._replace(grad=state.grad), info

    f1, t1, _ = fnebm.sample_chain(step, mala_state, fr.key(2), 3, compile=True, progress=False)
    f2, t2, _ = fnebm.sample_chain(step, mala_state, fr.key(2), 3, compile=False, progress=False)
    _close([t1], [t2])
    torch.testing.assert_close(f1.state.grad, mala_state.grad)


def test_one_chain_step_is_batched_by_saying_so(mala_alg, mala_state):
    # a step written for one chain runs over chains through vmap_chains, and equals the batched step
    def one_chain(state, key):
        assert key.shape == (2,)
        return mala_alg.step(state, key)

    kw = dict(burn_in=2, compile=False, progress=False)
    native = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(4), 6, **kw)
    mapped = fnebm.sample_chain(fnebm.vmap_chains(one_chain), mala_state, fr.key(4), 6, **kw)
    _close(native[0].state, mapped[0].state)
    _close([native[1]], [mapped[1]])
    _close(native[2], mapped[2])


def test_unwrapped_one_chain_step_is_refused_with_a_hint(mala_state):
    def one_chain(state, key):  # draws noise of the position's shape for one key: wrong for a batch
        return state._replace(position=state.position + fr.normal(key, state.position.shape, F64)), ()

    with pytest.raises(ValueError, match="vmap_chains"):
        fnebm.sample_chain(one_chain, mala_state, fr.key(0), 3, compile=False, progress=False)


def test_outputs_are_contiguous(mala_run):
    # chains run chain-innermost in memory; what the caller gets back is ordinary row-major
    final, trace, info = mala_run
    assert all(x.is_contiguous() for x in final.state)
    assert trace.is_contiguous() and all(x.is_contiguous() for x in info)


@pytest.mark.parametrize("make", [lambda e: fnebm.mala(e, 0.5), lambda e: fnebm.langevin(e, 0.5)])
def test_compiled_chain_never_turns_non_finite(make):
    # the divergence checks must survive Inductor (which folds some float identities, e.g. x * 0)
    alg = make(walled)
    state = torch.func.vmap(alg.init)(torch.full((256, 2), 0.3))
    final, trace, info = fnebm.sample_chain(alg.step, state, fr.key(0), 12, compile=True, progress=False)
    eager = fnebm.sample_chain(alg.step, state, fr.key(0), 12, compile=False, progress=False)
    assert info.is_divergent.any()  # the wall was hit, so the checks were exercised
    assert torch.isfinite(trace).all() and torch.isfinite(final.state.energy).all()
    assert (trace[..., 0] < 0.5).all()
    torch.testing.assert_close(trace, eager[1])
    assert torch.equal(info.is_divergent, eager[2].is_divergent)


# ----------------------------------------------------------------------------- compile="auto"


def _counting_cache(estimate):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    return counter, fnebm.chain.RunnerCache(backend=counter, compile_estimate_s=estimate)


def test_auto_runs_a_short_run_eagerly_with_the_same_draws(mala_alg, mala_state):
    counter, cache = _counting_cache(estimate=1e9)  # no eager run reaches it
    plans = []
    kw = dict(burn_in=2, progress=False, cache=cache)
    auto = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(3), 5, on_plan=plans.append, **kw)
    eager = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(3), 5, compile=False, **kw)
    assert counter.frame_count == 0 and len(cache) == 0  # nothing compiled
    (plan,) = plans
    assert not plan.compiled and not plan.compiles and plan.reason.startswith("eager")
    assert plan.eager_step_s > 0 and plan.steps == 7
    _close(auto[0].state, eager[0].state)  # the same eager path: equal draws
    _close([auto[1]], [eager[1]])


def _itself(x):
    return x


def _walk(x, keys):  # a cheap step to compile: a Gaussian random walk
    return x + 0.1 * fr.normal(keys, (1,), x.dtype), x[..., 0]


def test_auto_compiles_when_a_compile_costs_less(monkeypatch):
    from fnebm import _inductor

    written = []
    monkeypatch.setattr(_inductor, "record_gain", lambda *a: written.append(a))
    counter, cache = _counting_cache(estimate=0.0)  # any eager run costs more than a free compile
    plans = []
    x0 = torch.zeros(8, 1)
    kw = dict(progress=False, cache=cache, on_plan=plans.append)
    auto = fnebm.sample_chain(_walk, x0, fr.key(3), 5, collect=_itself, **kw)
    compiled = counter.frame_count
    assert compiled >= 1 and plans[0].compiled and plans[0].compiles
    (ledger,) = cache._ledgers.values()
    assert ledger.compiled_chunks == 0  # the chunk that compiled is not a compiled rate
    again = fnebm.sample_chain(_walk, x0, fr.key(3), 5, collect=_itself, **kw)
    assert counter.frame_count == compiled  # reused: no new compile
    assert ledger.compiled_chunks == 1 and ledger.best_compiled_s > 0  # this one is
    assert written == [] and ledger.signature is None  # another backend's runner is not described: nothing recorded
    assert plans[1].compiled and not plans[1].compiles and "earlier" in plans[1].reason
    eager = fnebm.sample_chain(_walk, x0, fr.key(3), 5, collect=_itself, compile=False, progress=False)
    torch.testing.assert_close(auto[1], eager[1])
    torch.testing.assert_close(again[1], eager[1])


def test_auto_rents_before_it_buys():
    # the ski-rental rule on a ledger with known figures: 0.05 s per eager step measured, a
    # compile taken to cost 12 s
    cache = fnebm.chain.RunnerCache(compile_estimate_s=12.0)
    ledger = cache.ledger("kind", "shapes")
    ledger.record(2.0, 40)   # 0.05 s a step
    ledger.record(3.0, 20)   # a slower stretch (a busy neighbour): the estimate keeps the best rate
    assert ledger.eager_s == 5.0 and ledger.eager_steps == 60 and ledger.step_s() == 0.05
    assert not cache.plan("kind", "shapes", 100, "auto").compiled    # 5 + 5 <= 12: rent
    assert cache.plan("kind", "shapes", 200, "auto").compiled        # 5 + 10 > 12: buy
    assert cache.plan("kind", "shapes", 200, "auto").compiles
    ledger.eager_s = 8.0                                               # after more eager calls
    assert cache.plan("kind", "shapes", 100, "auto").compiled        # 8 + 5 > 12: buy now
    assert not cache.plan("kind", "shapes", 10_000, False).compiled  # forced choices win
    assert cache.plan("kind", "shapes", 1, True).compiled
    assert cache.plan("other", "shapes", 1, "auto").compiled         # never timed: compile
    ledger.compiled = True
    assert not cache.plan("kind", "shapes", 1, "auto").compiles      # compiled: reuse


def test_auto_estimates_and_bad_arguments(mala_alg, mala_state):
    assert fnebm.chain.RunnerCache().compile_estimate_s == 20.0
    assert fnebm.chain.RunnerCache(backend="aot_eager").compile_estimate_s == 0.0
    with pytest.raises(ValueError, match="compile_estimate_s"):
        fnebm.chain.RunnerCache(compile_estimate_s=-1)
    with pytest.raises(ValueError, match="compile must be"):
        fnebm.sample_chain(mala_alg.step, mala_state, fr.key(0), 3, compile="yes", progress=False)
    with pytest.raises(TypeError, match="on_plan"):
        fnebm.sample_chain(mala_alg.step, mala_state, fr.key(0), 3, on_plan=1, progress=False)


def test_a_tensor_of_positions_where_a_sampler_state_belongs_is_named(mala_alg, start):
    """The slip of forgetting vmap(alg.init): fnebm's steps name their state type, a user's step that reads
    fields of a tensor gets the same hint, and a user's step whose state is a tensor still runs."""
    key = fr.key(0)
    for alg in (mala_alg, fnebm.langevin(mala_alg.init.keywords["energy_fn"], 0.1)):
        name = type(torch.func.vmap(alg.init)(start[:2])).__name__
        with pytest.raises(TypeError, match=rf"state must be the sampler's {name} \(fields position, energy, grad\), "
                                            r"got a tensor of shape \(4096, 2\).*torch.func.vmap\(alg.init\)"):
            fnebm.sample_chain(alg.step, start, key, 3, progress=False)
    with pytest.raises(TypeError, match=r"state must be the sampler's MALAState .*got a tuple"):
        fnebm.sample_chain(mala_alg.step, (start,), key, 3, progress=False)

    def reads_fields(state, keys):
        return state._replace(position=state.position + 1.0), ()

    with pytest.raises(TypeError, match=r"step failed on state, a plain tensor of shape \(4096, 2\) \('Tensor' object "
                                        r"has no attribute '_replace'\).*vmap\(alg.init\)"):
        fnebm.sample_chain(reads_fields, start, key, 3, compile=False, progress=False)

    def walk(x, key):  # a tensor state is this step's own
        return x + 0.1 * fr.normal(key, x.shape, x.dtype), ()

    _, trace, _ = fnebm.sample_chain(fnebm.vmap_chains(walk), start[:8], key, 3, compile=False, collect=lambda s: s,
                                     progress=False)
    assert trace.shape == (3, 8, 2)


def test_a_state_with_no_chains_is_named(mala_alg, mala_state):
    empty = type(mala_state)(*(x[:0] for x in mala_state))
    for key in (fr.key(0), torch.zeros(0, 2, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"state has 0 chains: state.position has shape \(0, 2\), whose chain "
                                             r"axes \(0,\) hold none"):
            fnebm.sample_chain(mala_alg.step, empty, key, 3, progress=False)
    with pytest.raises(ValueError, match="state has 0 chains"):
        fnebm.chain.init(empty, fr.key(0))


def test_a_state_of_mixed_dtypes_is_named_by_its_dtype(mala_alg, mala_state):
    mixed = mala_state._replace(energy=mala_state.energy.float())  # float64 positions, a float32 energy
    with pytest.raises(ValueError, match=r"step turned state.energy of dtype torch.float32 into torch.float64"):
        fnebm.sample_chain(mala_alg.step, mixed, fr.key(0), 3, compile=False, progress=False)


def test_auto_compiles_in_the_background_while_eager_steps_go_on(mala_alg, mala_state):
    # a cache that compiles in the background, as sample_chain's default one does
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    cache = fnebm.chain.RunnerCache(backend=counter, compile_estimate_s=0.0, background=True)
    plans = []
    kw = dict(progress=False, cache=cache, on_plan=plans.append)
    with pytest.warns(fnebm.chain.runner.CompileNotice, match="in the background"):
        first = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(3), 6, **kw)
    assert plans[0].background and not plans[0].compiled and plans[0].engine == "eager"
    assert cache.wait(timeout=300)  # the compile ran on its own thread, two steps, dropped
    frames = counter.frame_count
    # traced once: the step size, a 0-dim float64 tensor, once made Dynamo restart the analysis
    # (a frame counted twice, the first one empty); runner._lift passes it as (1,)
    assert frames == 1 and len(counter.graphs) == 1
    second = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(3), 6, **kw)
    assert plans[-1].compiled and plans[-1].engine == "compiled" and not plans[-1].compiles
    assert counter.frame_count == frames  # the graph compiled in the background serves the call
    _close(first[0].state, second[0].state)  # the same keys: the same draws, eager or compiled
    _close([first[1]], [second[1]])


def test_a_background_compile_that_fails_is_said_once_and_the_steps_stay_eager(mala_alg, mala_state):
    def refuses(gm, example_inputs):
        raise RuntimeError("this backend compiles nothing")

    cache = fnebm.chain.RunnerCache(backend=refuses, compile_estimate_s=0.0, background=True)
    plans = []
    kw = dict(progress=False, cache=cache, on_plan=plans.append)
    with pytest.warns(fnebm.chain.runner.CompileNotice):
        first = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(3), 6, **kw)
    assert cache.wait(timeout=300)
    with pytest.warns(fnebm.chain.CompileFallbackWarning, match="compiles nothing"):
        second = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(3), 6, **kw)
    assert plans[-1].fallback and "compiles nothing" in plans[-1].fallback and not plans[-1].compiled
    third = fnebm.sample_chain(mala_alg.step, mala_state, fr.key(3), 6, **kw)  # said once: no warning now
    _close([first[1], third[1]], [second[1], second[1]])


def test_the_compiled_loop_traces_the_step_once_in_its_body():
    """sample_chain's probe step gives the compiled loop the structure of the step's outputs: the
    step is traced once, inside the scan's body; the graph around it holds no copy of the step
    (a traced probe step there cost Dynamo and AOT autograd about a second on a neural energy)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def energy(x):
        return 0.5 * (x * x).sum(-1) + torch.sin(x).sum(-1)

    alg = fnebm.langevin(energy, 0.01)
    state = torch.func.vmap(alg.init)(torch.randn(8, 3, generator=torch.Generator().manual_seed(0)))
    cache = fnebm.chain.RunnerCache(backend=backend, compile_estimate_s=0.0)
    got = fnebm.sample_chain(alg.step, state, fr.key(0), 6, compile=True, cache=cache, progress=False)

    def calls(gm):
        return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]

    (gm,) = graphs
    assert "scan" in calls(gm) and not any("sin" in c for c in calls(gm))
    bodies = [m for _, m in gm.named_children() if isinstance(m, torch.fx.GraphModule)]
    assert sum(any("sin" in c for c in calls(m)) for m in bodies) == 1  # the energy, in the body
    want = fnebm.sample_chain(alg.step, state, fr.key(0), 6, compile=False, progress=False)
    _close([got[0].state], [want[0].state])
    # fnebm.chain.run inside a user's compiled function has no probe to learn from: it traces one
    user = torch.compile(lambda s, k: fnebm.chain.run(alg.step, s, k, 3), fullgraph=True, backend="eager")
    _close([user(state, fr.split(fr.key(0), 8))[0]],
           [fnebm.chain.run(alg.step, state, fr.split(fr.key(0), 8), 3)[0]])
