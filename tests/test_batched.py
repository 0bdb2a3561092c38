"""Import cost, and the batched form of energies: one forward and one backward for all chains.

* ``import fnebm`` loads nothing heavy (Dynamo, Inductor, sympy, triton) until it is used: a
  behavioural check in a fresh process, not a time.
* An energy that evaluates a whole batch in one call (``from_module``, ``bind(batch_fn=)``,
  ``batched``) gives the same values, gradients and draws as its one-sample form.
"""

import os
import subprocess
import sys

import torch

from fnebm.kernels import _assume_constant_result

HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "triton")


def _heavy_after(code: str) -> tuple[str, str]:
    """``code`` run in a fresh process, then which of HEAVY it loaded (a printed list), and its stderr."""
    code += "\nimport sys; print(sorted(m for m in %r if m in sys.modules))" % (HEAVY,)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ), cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return out.stdout.strip().splitlines()[-1], out.stderr


def test_import_fnebm_loads_no_compiler_stack():
    loaded, err = _heavy_after("import fnebm")
    assert loaded == "[]", loaded + err


def test_import_fnebm_leaves_the_garbage_collector_as_it_found_it():
    # the collector is paused while fnebm's modules load (a full collection walks torch's heap)
    code = ("import gc, sys\nwas = sys.argv[1] == 'on'\n(gc.enable if was else gc.disable)()\n"
            "import fnebm\nprint(gc.isenabled() == was, fnebm.sample_chain is not None)")
    for state in ("on", "off"):
        out = subprocess.run([sys.executable, "-c", code, state], capture_output=True, text=True, check=True,
                             env=dict(os.environ), cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr


def test_sampling_a_network_eagerly_loads_no_compiler_stack():
    # the first eager run of a neural energy (init under vmap, steps) uses no torch.func.grad,
    # whose first call would import Dynamo (1-3 s)
    code = ("import fnebm, torch; from fnebm import energies as E\n"
            "net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.SiLU(), torch.nn.Linear(8, 1))\n"
            "alg = fnebm.mala(E.bind(*E.from_module(net)), 0.1)\n"
            "state = torch.func.vmap(alg.init)(torch.zeros(4, 3))\n"
            "fnebm.sample_chain(alg.step, state, fnebm.random.key(0), 3, compile=False, progress=False)")
    loaded, err = _heavy_after(code)
    assert loaded == "[]", loaded + err


def test_sampling_a_log_density_written_as_a_function_eagerly_loads_no_compiler_stack():
    # a one-sample function (a posterior a user wrote): its gradients for all chains by vmap's forward
    # pass and torch.autograd.grad, not torch.func's backward, whose first use imports Dynamo (on the
    # lent H100 they were most of a MALA call's first 4.6-7.7 s, with sympy and FSDP)
    # (the route of CUDA devices, taken here on the CPU)
    code = ("import fnebm, torch\nfnebm.gradients._AUTOGRAD_DEVICES = ('cpu',)\n"
            "X = torch.linspace(-1, 1, 30).reshape(10, 3)\n"
            "energy = lambda b: torch.nn.functional.softplus(X @ b).sum() + 0.5 * (b * b).sum()\n"
            "for alg in (fnebm.mala(energy, 0.1), fnebm.hmc(energy, 0.1, torch.ones(3), 3)):\n"
            "    state = torch.func.vmap(alg.init)(torch.zeros(4, 3))\n"
            "    fnebm.sample_chain(alg.step, state, fnebm.random.key(0), 3, compile=False, progress=False)")
    loaded, err = _heavy_after(code)
    assert loaded == "[]", loaded + err


def test_an_eager_run_that_finds_its_runner_compiled_before_loads_no_compiler_stack(tmp_path, monkeypatch):
    # compile="auto" looks its runner up in the record of graphs this machine compiled (fnebm._inductor):
    # where it is found, the check of Inductor's cache folder and options must not import Inductor (with
    # Dynamo, about 4 s of a first call that then stays eager)
    monkeypatch.setenv("FNEBM_CACHE_DIR", str(tmp_path / "fnebm"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    code = ("import os, fnebm, torch; from fnebm import energies as E, _inductor\n"
            "net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.SiLU(), torch.nn.Linear(8, 1))\n"
            "alg = fnebm.langevin(E.bind(*E.from_module(net)), 0.1)\n"
            "state = torch.func.vmap(alg.init)(torch.zeros(4, 3))\n"
            "cache = fnebm.chain.default_cache\n"
            "fnebm.sample_chain(alg.step, state, fnebm.random.key(0), 3, progress=False)\n"
            "(sig,) = [led.signature for led in cache._ledgers.values()]\n"
            "_inductor.record_graph(sig, ['fabcdef'])\n"
            "entry = os.path.join(os.environ['TORCHINDUCTOR_CACHE_DIR'], 'fxgraph', 'ab', 'fabcdef')\n"
            "os.makedirs(entry); open(os.path.join(entry, 'graph'), 'w').close()\n"
            "for led in cache._ledgers.values(): led.before = None\n"
            "fnebm.sample_chain(alg.step, state, fnebm.random.key(0), 3, progress=False)\n"
            "assert [led.before for led in cache._ledgers.values()] == [True]")
    loaded, err = _heavy_after(code)
    assert loaded == "[]", loaded + err


def test_a_function_gives_torch_funcs_values_and_gradients_and_keeps_a_closures_graph(monkeypatch):
    import pytest

    import fnebm.gradients
    from fnebm import value_and_grad

    monkeypatch.setattr(fnebm.gradients, "_AUTOGRAD_DEVICES", ("cpu",))  # the route of CUDA devices
    passes = []
    real = fnebm.gradients._autograd_pair
    monkeypatch.setattr(fnebm.gradients, "_autograd_pair", lambda *a: passes.append(1) or real(*a))

    g = torch.Generator().manual_seed(0)
    X = torch.randn(20, 4, generator=g, dtype=torch.float64)
    w = torch.randn(4, generator=g, dtype=torch.float64)

    def energy(b):
        return torch.nn.functional.softplus(X @ (b * w)).sum() + 0.5 * (b * b).sum()

    xs = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    want_v, want_g = torch.func.vmap(torch.func.vmap(torch.func.grad_and_value(energy)))(xs)[::-1]
    for got_v, got_g in (value_and_grad(energy, 2)(xs), torch.func.vmap(value_and_grad(energy))(xs.flatten(0, 1))):
        torch.testing.assert_close(got_v.reshape(3, 5), want_v, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(got_g.reshape(xs.shape), want_g, rtol=1e-13, atol=1e-13)
        assert not got_v.requires_grad and not got_g.requires_grad
    assert len(passes) == 2  # each by the forward pass and torch.autograd.grad

    # a parameter in the closure that requires grad: the torch.func path, whose values keep their graph
    w.requires_grad_(True)
    v, gr = value_and_grad(energy, 2)(xs)
    assert v.requires_grad and gr.requires_grad
    (dw,) = torch.autograd.grad(v.sum() + gr.sum(), w)
    assert torch.isfinite(dw).all() and dw.abs().sum() > 0

    # what the one-sample form refuses, the function path refuses in the same words
    with pytest.raises(ValueError, match="0-dim tensor for one sample"):
        value_and_grad(lambda b: X @ b, 1)(xs[0])


def test_choosing_an_engine_for_a_network_imports_no_kernel_module():
    # backend="auto" turns the whole-chain kernels down for an energy outside their families before
    # importing them: on a GPU, importing the Triton kernels registered torch operators that loaded
    # Dynamo, sympy and FSDP in the first call (4.7 s on the lent H100). Here the Triton path is
    # asked about CPU chains (its device check would answer first otherwise).
    code = ("import fnebm, sys, torch; from fnebm import energies as E; from fnebm.kernels import dispatch\n"
            "net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.SiLU(), torch.nn.Linear(8, 1))\n"
            "alg = fnebm.langevin(E.bind(*E.from_module(net)), 0.1)\n"
            "state = torch.func.vmap(alg.init)(torch.zeros(4, 3))\n"
            "keys = fnebm.random.split(fnebm.random.key(0), 4)\n"
            "for path in dispatch.FAST_PATHS[:2]:\n"
            "    path = path._replace(device='cpu')\n"
            "    print(dispatch.why_not(path, dispatch.RunRequest(alg.step, state, keys, torch.zeros((), dtype=torch.int64),"
            " 'position', False)))\n"
            "print(sorted(m for m in ('fnebm.kernels.langevin_chain', *%r) if m in sys.modules))"
            % (HEAVY,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ), cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "[]", out.stdout + out.stderr
    assert all("closed form" in line or "family" in line or "families" in line for line in lines[:2]), lines


def test_the_fast_paths_name_engines_of_the_families_table():
    from fnebm.kernels import dispatch, families

    named = [p.families for p in dispatch.FAST_PATHS if p.families is not None]
    assert named and all(f in families.ENGINES for f in named)


def test_the_constant_mark_is_the_one_dynamo_sets():
    import torch._dynamo

    def ours():
        return None

    def theirs():
        return None

    _assume_constant_result(ours)
    torch._dynamo.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) == {"_dynamo_marked_constant": True}


# ------------------------------------------------------------------ the batched form

import pytest  # noqa: E402
from torch import nn  # noqa: E402

import fnebm  # noqa: E402
from fnebm import energies as E  # noqa: E402
from fnebm import random as fr  # noqa: E402
from fnebm.gradients import value_and_grad  # noqa: E402

F64 = torch.float64


def _net(d=6, h=16, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)  # the test's own generator: weights only
    net = nn.Sequential(nn.Linear(d, h), nn.SiLU(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1)).to(dtype)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=dtype))
    return net


def _pair(net):
    """The same network as a batched energy and as a one-sample one."""
    fn, params = E.from_module(net)
    one_fn, _ = E.from_module(net, batched=False)
    return E.bind(fn, params), E.bind(one_fn, params)


def _xs(*shape, seed=1, dtype=F64):
    return fr.normal(fr.key(seed), shape, dtype)


def test_from_module_declares_its_batch_form_and_one_sample_calls_are_unchanged():
    fast, slow = _pair(_net())
    assert fast.batched and E.batch_form(fast) is not None
    assert not slow.batched and E.batch_form(slow) is None
    assert E.batch_form(E.gaussian([0.0, 1.0], torch.eye(2))) is None
    xs = _xs(5, 6)
    torch.testing.assert_close(fast.batch(xs), torch.func.vmap(slow)(xs))
    assert torch.equal(fast(xs[2]), slow(xs[2]))  # one sample: the same module call as before
    E.check_batched(fast, xs)


def test_init_under_vmap_takes_the_whole_batch_and_agrees_with_one_sample_calls():
    fast, slow = _pair(_net())
    x = _xs(5, 6)
    a = torch.func.vmap(fnebm.mala(fast, 0.1).init)(x)
    b = torch.func.vmap(fnebm.mala(slow, 0.1).init)(x)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)
    # a gradient through init w.r.t. the weights (torch.func.grad): the one-sample path, same values
    g1 = torch.func.grad(lambda p: torch.func.vmap(fnebm.mala(E.bind(fast.energy_fn, p), 0.1).init)(x).grad.sum())(
        fast.params)
    g2 = torch.func.grad(lambda p: torch.func.vmap(fnebm.mala(E.bind(slow.energy_fn, p), 0.1).init)(x).grad.sum())(
        slow.params)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-9, atol=1e-9)
    # nested vmap (a grid of chains): the one-sample path under the outer level
    grid = torch.func.vmap(torch.func.vmap(fnebm.mala(fast, 0.1).init))(x.reshape(5, 1, 6))
    torch.testing.assert_close(grid.grad.reshape(5, 6), b.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chains", [(7,), (2, 3)])
def test_one_forward_and_backward_equal_the_mapped_one_sample_gradients(chains):
    fast, slow = _pair(_net())
    x = _xs(*chains, 6)
    v1, g1 = value_and_grad(fast, len(chains))(x)
    v2, g2 = value_and_grad(slow, len(chains))(x)
    assert v1.shape == chains and g1.shape == x.shape
    torch.testing.assert_close(v1, v2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)
    # the functorch path (taken when a graph is asked for, or under vmap/grad/compile) agrees too
    params = {k: v.clone().requires_grad_(True) for k, v in fast.params.items()}
    v3, g3 = value_and_grad(E.bind(fast.energy_fn, params), len(chains))(x)
    assert g3.requires_grad  # differentiable w.r.t. the parameters, as the one-sample form is
    torch.testing.assert_close(v3.detach(), v2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g3.detach(), g2, rtol=1e-12, atol=1e-12)


def _run(alg, n=4, steps=5, d=6, seed=3):
    state = torch.func.vmap(alg.init)(_xs(n, d, seed=seed))
    return fnebm.sample_chain(alg.step, state, fr.key(seed), steps, compile=False, progress=False)


@pytest.mark.parametrize("make", [
    lambda e: fnebm.langevin(e, 0.05),
    lambda e: fnebm.mala(e, 0.1),
    lambda e: fnebm.hmc(e, 0.1, torch.ones(6, dtype=F64), 3),
    lambda e: fnebm.nuts(e, 0.1, torch.ones(6, dtype=F64), max_tree_depth=3),
])
def test_batched_and_one_sample_energies_give_the_same_draws(make):
    # Not bit-identical: a matrix product over the batch may sum in another order than the
    # mapped one-sample products, so gradients differ by rounding (float64 here: ~1e-16).
    fast, slow = _pair(_net())
    (s1, t1, i1), (s2, t2, i2) = _run(make(fast)), _run(make(slow))
    torch.testing.assert_close(t1, t2, rtol=1e-9, atol=1e-9)
    for a, b in zip(i1, i2):
        if a.dtype == torch.bool:
            assert torch.equal(a, b)


def test_gradients_through_a_chain_wrt_the_network_weights_agree():
    fast, slow = _pair(_net())
    x0 = _xs(3, 6)

    def loss(params, fn):
        alg = fnebm.langevin(E.bind(fn, params), 0.05)
        state = torch.func.vmap(alg.init)(x0)
        keys = fr.split(fr.key(4), 3)
        for t in range(3):
            state, _ = alg.step(state, fr.fold_in(keys, t))
        return state.position.square().sum()

    g1 = torch.func.grad(loss)(fast.params, fast.energy_fn)
    g2 = torch.func.grad(loss)(slow.params, slow.energy_fn)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-9, atol=1e-9)


def test_a_step_vmapped_over_more_chains_equals_the_batch():
    fast, _ = _pair(_net())
    alg = fnebm.langevin(fast, 0.05)
    state = torch.func.vmap(alg.init)(_xs(2, 3, 6).reshape(6, 6))
    keys = fr.split(fr.key(5), 6)
    flat, _ = alg.step(state, keys)
    grid = type(state)(*(x.reshape((2, 3) + x.shape[1:]) for x in state))
    outer, _ = torch.func.vmap(alg.step)(grid, keys.reshape(2, 3, 2))
    torch.testing.assert_close(outer.position.reshape(6, 6), flat.position, rtol=1e-12, atol=1e-12)


def test_batched_functions_with_and_without_params():
    w = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    e = E.batched(lambda xs: 0.5 * (w * xs * xs).sum(-1))
    xs = _xs(4, 3)
    assert e.batched and torch.equal(e(xs[1]), e.batch(xs[1:2])[0])
    v, g = value_and_grad(e, 1)(xs)
    torch.testing.assert_close(g, w * xs)
    b = E.batched(lambda p, xs: 0.5 * (p["w"] * xs * xs).sum(-1, keepdim=True), {"w": w})
    assert isinstance(b, E.BoundEnergy) and b.batched
    torch.testing.assert_close(value_and_grad(b, 1)(xs)[1], w * xs)
    # one form per function: rebuilt with new parameters, the same pytree context (and graph)
    fn = b.energy_fn.fn
    assert E.batched(fn, {"w": 2 * w}).energy_fn is b.energy_fn
    with pytest.raises(ValueError, match="one energy per sample"):
        E.batched(lambda xs: xs.sum())(xs[0])
    with pytest.raises(TypeError, match="fn must be callable"):
        E.batched(3)


def test_a_module_is_called_as_it_is_only_while_it_holds_the_params_tensors(monkeypatch):
    # value_and_grad's eager path calls the module directly while the params are its own tensors,
    # else functional_call on the params (what they mean); the values are the same either way
    net = _net()
    fn, params = E.from_module(net)
    xs = _xs(5, 6)
    real = torch.func.functional_call

    def check(p, direct):
        calls = []
        monkeypatch.setattr(torch.func, "functional_call", lambda *a, **k: calls.append(1) or real(*a, **k))
        v, g = value_and_grad(E.bind(fn, p), 1)(xs)
        monkeypatch.setattr(torch.func, "functional_call", real)
        assert (not calls) == direct
        want = torch.func.vmap(torch.func.grad_and_value(lambda x: real(net, p, (x[None],)).reshape(())))(xs)
        torch.testing.assert_close((g, v), want, rtol=1e-12, atol=1e-12)
        assert not v.requires_grad and not g.requires_grad

    value_and_grad(E.bind(fn, params), 1)(xs)  # the batch check (one-sample calls) runs once
    check(params, True)
    assert all(p.requires_grad and p.grad is None for p in net.parameters())  # a module being trained: untouched
    check({k: 2 * v for k, v in params.items()}, False)  # other values
    with torch.no_grad():
        net[0].weight.mul_(3.0)  # in place: the params share the module's memory and see it
    check(params, True)
    old = net[2].weight
    net[2].weight = nn.Parameter(old.detach() + 1.0)  # a new tensor in the module: the params keep the old one
    check(params, False)
    net[2].weight = old
    check(params, True)
    net[4] = nn.Linear(16, 1).to(F64)  # a submodule replaced: its params no longer match
    check(params, False)
    # energy.batch itself is unchanged: functional_call, no graph through the module's parameters
    assert not fn.batch(params, xs).requires_grad


def test_a_module_is_checked_once_per_train_and_eval_modes(monkeypatch):
    from fnebm.energies import neural

    net = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.0), nn.Linear(8, 1)).to(F64)
    checks = []
    real = neural._agree
    monkeypatch.setattr(neural, "_agree", lambda *a: checks.append(1) or real(*a))
    xs = _xs(4, 6)
    for _ in range(3):  # from_module anew each time, as a training loop calls it
        value_and_grad(E.bind(*E.from_module(net)), 1)(xs)
    assert len(checks) == 1
    net.eval()  # another mode: checked again, once
    for _ in range(2):
        value_and_grad(E.bind(*E.from_module(net)), 1)(xs)
    assert len(checks) == 2


class _Centre(nn.Module):
    def forward(self, h):
        return h - h.mean(0)  # across the batch: each sample's output depends on the others


def test_an_energy_that_depends_on_the_rest_of_its_batch_is_refused():
    net = nn.Sequential(nn.Linear(6, 8), _Centre(), nn.Tanh(), nn.Linear(8, 1)).to(F64)
    e = E.bind(*E.from_module(net))
    xs = _xs(5, 6)
    with pytest.raises(ValueError, match="depends on the other samples"):
        value_and_grad(e, 1)(xs)
    with pytest.raises(ValueError, match="depends on the other samples"):
        E.check_batched(e, xs)
    one = E.bind(*E.from_module(net, batched=False))  # one sample at a time: what E(x) means
    assert value_and_grad(one, 1)(xs)[0].shape == (5,)
    # batch normalisation in training mode cannot even take one sample: torch says so
    bn = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)).to(F64)
    with pytest.raises(ValueError):
        value_and_grad(E.bind(*E.from_module(bn)), 1)(xs)
    bn.eval()
    value_and_grad(E.bind(*E.from_module(bn)), 1)(xs)  # running statistics: accepted
    cross = E.batched(lambda xs: xs.sum(-1) - xs.sum(-1).mean())
    with pytest.raises(ValueError, match="depends on the other samples"):
        value_and_grad(cross, 1)(xs)


@pytest.mark.compile
def test_compiled_step_traces_the_batched_gradient_and_new_weights_do_not_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    fast, slow = _pair(_net(dtype=torch.float32))
    alg = fnebm.langevin(fast, 0.05)
    state = torch.func.vmap(alg.init)(_xs(8, 6, dtype=torch.float32))
    keys = fr.split(fr.key(6), 8)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda e, s, k: fnebm.langevin(e, 0.05).step(s, k), fullgraph=True, backend=counter)
    got, _ = step(fast, state, keys)
    want, _ = alg.step(state, keys)
    torch.testing.assert_close(got.position, want.position, rtol=1e-5, atol=1e-6)
    new = E.bind(fast.energy_fn, {k: v * 1.1 for k, v in fast.params.items()})
    got, _ = step(new, state, keys)
    want, _ = fnebm.langevin(new, 0.05).step(state, keys)
    torch.testing.assert_close(got.position, want.position, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1


# ------------------------------------------- compile="auto": measured costs, announced compiles


def test_auto_uses_the_measured_compile_time_and_announces_a_compile():
    from fnebm.chain.runner import CompileNotice, RunnerCache

    cache = RunnerCache()  # Inductor, default estimate: measures its compiles
    cache.ledger("kind", "shapes").record(0.1, 1)  # an eager step takes 0.1 s
    with pytest.warns(CompileNotice, match="compiles this sampler now"):
        plan = cache.plan("kind", "shapes", 300, "auto")  # 30 s eagerly > the 20 s assumed: compile
    assert plan.compiles and "taken to cost" in plan.reason
    calls = []
    run = cache._timed("kind", lambda *args: calls.append(args) or "out")
    assert run(1, 2) == "out" and calls == [(1, 2)] and cache.compile_s["kind"] >= 0.0
    cache.compile_s["kind"] = 50.0  # as if its first compiled call had taken 50 s
    plan = cache.plan("kind", "shapes", 300, "auto")  # 30 s eagerly <= the 50 s measured: stay eager
    assert not plan.compiled and plan.compile_estimate_s == 50.0 and "took here" in plan.reason
    cache.ledger("other", "shapes").record(0.1, 1)
    other = cache.plan("other", "shapes", 300, "auto")  # another graph: the estimate, raised to 50 s
    assert not other.compiled and other.compile_estimate_s == 50.0
    cache.clear()
    assert cache.compile_s == {}
    fixed = RunnerCache(compile_estimate_s=12.0)  # an explicit estimate is kept: nothing measured
    assert fixed._timed("kind", len) is len


def test_an_eager_block_answers_an_energys_checks_once_and_only_inside_it(monkeypatch):
    # sample_chain's eager engine holds an eager block around a chunk's steps: the energy's checks
    # (its leaves, whether the module holds the params) run once there, at every call outside one
    import threading

    from fnebm import _checks
    from fnebm.energies import neural

    net = _net()
    fn, params = E.from_module(net)
    energy, xs = E.bind(fn, params), _xs(5, 6)
    calls = []
    real = neural.ModuleEnergy._holds_now
    monkeypatch.setattr(neural.ModuleEnergy, "_holds_now", lambda self, p: calls.append(1) or real(self, p))
    vg = value_and_grad(energy, 1)
    vg(xs)
    for _ in range(3):
        vg(xs)
    assert len(calls) == 4  # outside a block: every call
    calls.clear()
    with _checks.eager_block():
        want = vg(xs)
        for _ in range(3):
            torch.testing.assert_close(vg(xs), want, rtol=0, atol=0)
        seen = []
        t = threading.Thread(target=lambda: seen.append(_checks.block_memo("x", energy, lambda: "computed")))
        t.start()
        t.join()
        assert seen == ["computed"]  # another thread has no block
        with _checks.eager_block():  # a nested block answers afresh
            vg(xs)
    assert len(calls) == 2
    calls.clear()
    net[2].weight = nn.Parameter(net[2].weight.detach() + 1.0)  # between two blocks: seen by the next
    with _checks.eager_block():
        v, g = vg(xs)
    assert len(calls) == 1
    want = torch.func.vmap(torch.func.grad_and_value(
        lambda x: torch.func.functional_call(net, params, (x[None],)).reshape(())))(xs)
    torch.testing.assert_close((g, v), want, rtol=1e-12, atol=1e-12)


def test_a_number_step_size_stays_a_host_scalar_beside_device_tensors():
    # eagerly, per_chain keeps a 0-dim CPU tunable on the host for a device state when the kernel asks
    # (Langevin, MALA: elementwise use only; no copy to the device, which waits for it, at every
    # step); per-chain values go to the device. "meta" stands in for a GPU here.
    from fnebm.samplers.base import per_chain

    x = torch.empty(4, 3, device="meta")
    h = per_chain("step_size", torch.tensor(0.1, dtype=F64), (4,), x, host_scalar=True)
    assert h.device.type == "cpu" and h.dtype == torch.float32 and h.shape == ()
    assert per_chain("step_size", torch.tensor(0.1, dtype=F64), (4,), x).device.type == "meta"  # not asked: moved
    assert (x - h * x).device.type == "meta"
    per = per_chain("step_size", torch.full((4,), 0.1, dtype=F64), (4,), x, host_scalar=True)
    assert per.device.type == "meta" and per.shape == (4, 1)
    cpu = per_chain("step_size", torch.tensor(0.1, dtype=F64), (4,), torch.zeros(4, 3), host_scalar=True)
    assert cpu.dtype == torch.float32 and cpu.shape == (1,) * 2 and cpu.item() == torch.tensor(0.1).item()


def test_mala_takes_its_host_scalar_step_size_beside_device_tensors():
    # MALA's kernel passes the 0-dim host step size on to log_acceptance_ratio, which once reshaped it
    # to (1, 1): a CPU tensor that is no longer a scalar, refused beside a GPU state
    from fnebm.samplers.mala import log_acceptance_ratio

    x, e = torch.empty(4, 3, device="meta"), torch.empty(4, device="meta")
    assert log_acceptance_ratio(x, e, x, x, e, x, torch.tensor(0.1)).shape == (4,)
    xs, es = _xs(4, 3), _xs(4, seed=2)
    got = log_acceptance_ratio(xs, es, xs.cos(), xs.sin(), es.exp(), xs, torch.tensor(0.1, dtype=F64))
    want = log_acceptance_ratio(xs, es, xs.cos(), xs.sin(), es.exp(), xs, torch.full((4,), 0.1, dtype=F64))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_whole_batch_energy_keeps_its_small_state_chain_outermost_with_the_same_draws(monkeypatch):
    # the eager engine lays a small state out chain-innermost, except for an energy evaluated for all chains
    # at once (its gradient comes out chain-outermost): the layout changes no key, draw or decision, and the
    # values only by float rounding (a product over a transposed input sums in another order)
    from fnebm.chain import engines

    fast, slow = _pair(_net(d=2))
    assert engines._whole_batch_energy(fnebm.langevin(fast, 0.05).step)
    assert not engines._whole_batch_energy(fnebm.langevin(slow, 0.05).step)
    assert not engines._whole_batch_energy(lambda state, key: (state, None))  # a step of the user's: opaque
    layouts = []
    real = engines._chains_last
    monkeypatch.setattr(engines, "_chains_last", lambda state: layouts.append(True) or real(state))
    x = _xs(64, 2)
    runs = {}
    for layout, whole in (("outermost", engines._whole_batch_energy), ("innermost", lambda step: False)):
        monkeypatch.setattr(engines, "_whole_batch_energy", whole)
        for name, make in (("langevin", fnebm.langevin), ("mala", fnebm.mala)):
            alg = make(fast, 0.05)
            state = torch.func.vmap(alg.init)(x)
            runs[layout, name] = fnebm.sample_chain(alg.step, state, fr.key(3), 12, compile=False, progress=False)
    assert len(layouts) == 2  # only the runs told the energy is no whole-batch one laid the state out chains last
    monkeypatch.undo()
    # compiled (by Inductor: aot_eager accepted it), the runner's loop carries the state chain-innermost, the
    # layout its body gives the state back in (Inductor's scan refused a chain-outermost carry)
    plans, alg = [], fnebm.langevin(fast, 0.05)
    runs["compiled", "langevin"] = fnebm.sample_chain(
        alg.step, torch.func.vmap(alg.init)(x), fr.key(3), 12, compile=True, progress=False, on_plan=plans.append,
        cache=fnebm.chain.RunnerCache())
    assert [p.engine for p in plans] == ["compiled"] and plans[0].fallback is None
    for layout, name in (("innermost", "langevin"), ("innermost", "mala"), ("compiled", "langevin")):
        a, b = runs["outermost", name], runs[layout, name]
        leaves = list(zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)))
        assert len(leaves) > 3
        for u, v in leaves:
            if u.is_floating_point():
                torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)
            else:  # steps taken, acceptances, divergences, keys
                assert torch.equal(u, v)
