"""fnebm.samplers.evaluation: the energy and gradient of every chain at once, eager or compiled,
for the C NUTS kernel on energies it does not compute itself; and how sample_chain and
window_adaptation choose eager steps with it (compile= says whether its evaluations compile).
"""

import warnings

import pytest
import torch

import fnebm
from fnebm import _inductor
from fnebm import random as fr
from fnebm.kernels import cpu_nuts, cpu_trips, dispatch
from fnebm.samplers import evaluation

pytestmark = pytest.mark.skipif(cpu_nuts.available() is not None,
                                reason=f"the C NUTS kernel is unavailable here: {cpu_nuts.available()}")

P = torch.tensor([[2.0, 0.6], [0.6, 1.0]])


def energy(x):  # a log density written as a function: no closed form the kernels know
    return 0.5 * (x @ (P @ x))


class _FakeCompile:
    """Stands in for torch.compile (a real compile is tested once, below): counts, then runs eagerly."""

    def __init__(self, fail: bool = False):
        self.compiled, self.calls, self.fail = 0, 0, fail

    def __call__(self, fn, **kw):
        self.compiled += 1
        backend = kw.get("backend", "inductor")  # fnebm compiles with Inductor through fnebm._inductor
        name = getattr(backend, "__name__", "")  # the evaluator's own backends record the graph they build
        backend = {"_backend": "inductor", "_traced_backend": "aot_eager"}.get(name, backend)
        self.backends = getattr(self, "backends", []) + ["inductor" if backend is _inductor.inductor_backend else backend]

        def run(x):
            self.calls += 1
            if self.fail:
                raise RuntimeError("cannot trace this energy")
            return fn(x)

        return run


def _fresh(fn):
    return lambda x: fn(x)  # a new energy object: an evaluator of its own


def _auto(monkeypatch, estimate: float) -> _FakeCompile:
    """torch.compile faked, a compile expected to take ``estimate`` seconds, no traced tier."""
    fake = _FakeCompile()
    monkeypatch.setattr(torch, "compile", fake)
    monkeypatch.setattr(evaluation, "compile_estimate", lambda *a: estimate)
    monkeypatch.setattr(evaluation, "TRACE_AFTER_S", 1e9)
    return fake


def _rate(ev, x) -> float:
    """Seconds an evaluation takes, measured over the calls that choose the threads."""
    for _ in range(evaluation.TUNE_CALLS):
        ev(x)
    return ev.ev.recent[0] / ev.ev.recent[1]


def test_eager_evaluations_never_compile(monkeypatch):
    fake = _FakeCompile()
    monkeypatch.setattr(torch, "compile", fake)
    monkeypatch.setattr(evaluation, "compile_estimate", lambda *a: 0.0)
    f = _fresh(energy)
    ev = evaluation.evaluator(f, 1, False)
    x = fr.normal(fr.key(0), (3, 2))
    e, g = ev(x)
    torch.testing.assert_close(e, torch.stack([energy(r) for r in x]))
    torch.testing.assert_close(g, x @ P)
    assert fake.compiled == 0


def test_auto_compiles_after_its_eager_budget_and_says_so(monkeypatch):
    fake = _auto(monkeypatch, 1e9)
    f = _fresh(energy)
    x = fr.normal(fr.key(1), (3, 2))
    ev = evaluation.evaluator(f, 1, "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = ev(x)  # under budget: eager, silent
    assert fake.compiled == 0
    monkeypatch.setattr(evaluation, "compile_estimate", lambda *a: 0.0)
    with pytest.warns(evaluation.EnergyCompileNotice, match="compiling this energy's value and gradient now"):
        got = evaluation.evaluator(f, 1, "auto")(x)  # a new step of the same energy: the same clock
    assert fake.compiled == 1 and fake.calls == 1
    torch.testing.assert_close(got, want)
    evaluation.evaluator(f, 1, "auto")(x)  # compiled once, reused
    assert fake.compiled == 1 and fake.calls == 2


def test_auto_compiles_at_once_when_a_loop_expects_more_than_twice_a_compile(monkeypatch):
    # a kernel's loop says how many evaluations it still expects (Evaluate.expect): once they would take
    # EXPECTED_FACTOR times a compile at the current rate, "auto" compiles without spending its budget first
    fake = _auto(monkeypatch, 100.0)  # a budget these calls never spend
    f = _fresh(energy)
    x = fr.normal(fr.key(12), (3, 2))
    ev = evaluation.evaluator(f, 1, "auto")
    with ev.scope(), warnings.catch_warnings():
        warnings.simplefilter("error")
        rate = _rate(ev, x)
        ev.expect(0.5 * evaluation.EXPECTED_FACTOR * 100.0 / rate)  # half of what would pay: still eager
        ev(x)
        assert fake.compiled == 0
        ev.expect(2.0 * evaluation.EXPECTED_FACTOR * 100.0 / rate)
        with pytest.warns(evaluation.EnergyCompileNotice, match="this run expects about"):
            got = ev(x)
    assert fake.compiled == 1 and fake.backends == ["inductor"]
    torch.testing.assert_close(got, evaluation.evaluator(f, 1, False)(x))
    assert ev.ev.expected_calls is None  # the expectation ends with the loop


def test_new_code_keeps_the_threads_the_tier_below_chose(monkeypatch):
    # a scope on one thread (measured faster for the eager tier) that compiles: the compiled code runs on
    # that thread too, inside and outside the scope, and is not timed on the others (Dynamo guards on
    # torch's thread count: each count timed would be a compile of its own)
    fake = _FakeCompile()
    monkeypatch.setattr(torch, "compile", fake)
    monkeypatch.setattr(evaluation, "compile_estimate", lambda *a: 1e9)
    monkeypatch.setattr(evaluation, "TRACE_AFTER_S", 1e9)
    ev = evaluation.evaluator(_fresh(energy), 1, "auto")
    x = fr.normal(fr.key(15), (3, 2))
    restore = torch.get_num_threads()
    torch.set_num_threads(2)  # the tests run on one thread (conftest); a scope needs more to give one up
    seen = []
    real = ev.ev.entry
    ev.ev.entry = lambda z: seen.append(torch.get_num_threads()) or real(z)
    try:
        with ev.scope():
            ev.ev.one_thread = True
            ev.ev._scope_one_thread()
            assert torch.get_num_threads() == 1
            ev.ev.compile_now(announce=False)
            for _ in range(evaluation.TUNE_CALLS + 1):
                ev(x)
            assert ev.ev.compile_s is not None and ev.ev.one_thread is True
        assert torch.get_num_threads() == 2
        ev(x)  # outside a scope: one thread around the call
        assert seen == [1] * (evaluation.TUNE_CALLS + 2) and fake.compiled == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(restore)


def test_the_first_compiled_call_outside_a_scope_runs_on_the_threads_chosen(monkeypatch):
    # its graph is built for the thread count its later calls run on (one Dynamo graph, not two)
    fake = _FakeCompile()
    monkeypatch.setattr(torch, "compile", fake)
    ev = evaluation.evaluator(_fresh(energy), 1, "auto")
    x = fr.normal(fr.key(16), (3, 2))
    seen = []
    real = ev.ev.entry
    ev.ev.entry = lambda z: seen.append(torch.get_num_threads()) or real(z)
    restore = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ev.ev.one_thread = True
        ev.ev.compile_now(announce=False)
        ev(x)
        ev(x)
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(restore)


def test_a_spent_budget_lets_a_loop_that_ends_sooner_than_a_compile_finish_first(monkeypatch):
    # ski rental's budget spent, but the loop's remaining evaluations take less than the compile: no
    # compile mid-way; the next loop compiles at its first call (it has no expectation yet)
    fake = _auto(monkeypatch, 100.0)
    f = _fresh(energy)
    x = fr.normal(fr.key(13), (3, 2))
    ev = evaluation.evaluator(f, 1, "auto")
    with ev.scope(), warnings.catch_warnings():
        warnings.simplefilter("error")
        rate = _rate(ev, x)
        ev.ev.eager_s = 150.0  # what earlier loops of this energy spent: past the budget
        ev.expect(0.5 * 100.0 / rate)  # this loop's rest: half a compile
        ev(x)
        ev.expect(0.0)  # its last call
        ev(x)
        assert fake.compiled == 0
    with ev.scope():
        with pytest.warns(evaluation.EnergyCompileNotice, match="compiling this energy's value and gradient now"):
            got = ev(x)  # the next loop's first call
    assert fake.compiled == 1
    torch.testing.assert_close(got, evaluation.evaluator(f, 1, False)(x))
    g = _fresh(energy)  # and a loop whose rest outlasts the compile compiles at once
    ev = evaluation.evaluator(g, 1, "auto")
    with ev.scope():
        rate = _rate(ev, x)
        ev.ev.eager_s = 150.0
        ev.expect(1.5 * 100.0 / rate)
        with pytest.warns(evaluation.EnergyCompileNotice):
            ev(x)
    assert fake.compiled == 2


def test_a_long_kernel_loop_tells_its_evaluator_what_it_expects(monkeypatch):
    seen = []

    class Recording:
        def __call__(self, x):
            return evaluation.evaluator(energy, 1, False)(x)

        def expect(self, calls):
            seen.append(calls)

    monkeypatch.setattr(cpu_nuts, "_HINT_EVERY", 4)
    x0 = fr.normal(fr.key(13), (4, 2))
    e0, g0 = evaluation.evaluator(energy, 1, False)(x0)
    keys = fr.split(fr.key(14), 200 * 4).reshape(200, 4, 2)
    out = cpu_nuts.nuts_transitions(Recording(), x0, e0, g0, keys, torch.tensor(0.2), torch.ones(2), False,
                                    max_tree_depth=6, coefficients=(0.5, 1.0, 0.5), divergence_threshold=1000.0)
    trips = int(out[-1].sum(0).max())  # the longest chain's integrator steps: at least the loop's trips
    assert len(seen) > 10 and all(s >= 0 for s in seen)
    # every estimate is of the same order as what was left when it was made (the trees are alike here)
    assert seen[0] < 2 * trips and seen[-1] < seen[0]


def test_auto_traces_before_it_compiles(monkeypatch):
    fake = _FakeCompile()
    monkeypatch.setattr(torch, "compile", fake)
    monkeypatch.setattr(evaluation, "compile_estimate", lambda *a: 1e9)
    monkeypatch.setattr(evaluation, "TRACE_AFTER_S", 0.0)
    f = _fresh(energy)
    x = fr.normal(fr.key(11), (3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the trace is not announced: a second or two, no code generation
        got = evaluation.evaluator(f, 1, "auto")(x)
        evaluation.evaluator(f, 1, "auto")(x)
    assert fake.backends == ["aot_eager"] and fake.calls == 2
    torch.testing.assert_close(got, evaluation.evaluator(f, 1, False)(x))
    monkeypatch.setattr(evaluation, "compile_estimate", lambda *a: 0.0)
    with pytest.warns(evaluation.EnergyCompileNotice):
        evaluation.evaluator(f, 1, "auto")(x)
    assert fake.backends == ["aot_eager", "inductor"]


def test_auto_expects_a_compile_to_take_what_one_took_here(monkeypatch):
    monkeypatch.setattr(evaluation, "_kept", type(evaluation._kept)())
    assert evaluation.compile_estimate() == evaluation.AUTO_COMPILE_AFTER_S  # nothing measured yet
    ev = evaluation._evaluation(_fresh(energy), 1)
    ev.compile_s = 3.5
    assert evaluation.compile_estimate() == 3.5


def test_auto_expects_a_compile_this_machine_made_before_to_cost_what_such_compiles_took(monkeypatch):
    # a graph Inductor's on-disk cache holds (fnebm._inductor.compiled_before) is mostly a cache hit to compile
    # again: "auto" expects what such compiles took here (else CACHED_COMPILE_S), not a first compile's time
    monkeypatch.setattr(evaluation, "_kept", type(evaluation._kept)())
    ev = evaluation._evaluation(_fresh(energy), 1)
    x = fr.normal(fr.key(5), (3, 2))
    before = {}
    monkeypatch.setattr(_inductor, "compiled_before", lambda sig: before.get(sig, False))
    monkeypatch.setattr(_inductor, "machine_compile_s", lambda kind: {"energy": 11.0}.get(kind))
    assert ev.signature(x) is None and not ev.compiled_before(x)  # the threads not chosen yet: not looked up
    ev.one_thread = True
    assert evaluation.compile_estimate(ev, x) == 11.0  # not compiled before: a first compile's time
    before[ev.signature(x)] = True
    assert evaluation.compile_estimate(ev, x) == 11.0  # looked up once per layout and threads
    ev._before.clear()
    assert evaluation.compile_estimate(ev, x) == evaluation.CACHED_COMPILE_S
    monkeypatch.setattr(_inductor, "machine_compile_s", lambda kind: {"energy": 11.0, "energy-cached": 2.5}.get(kind))
    assert evaluation.compile_estimate(ev, x) == 2.5
    assert not ev.compiled_before(fr.normal(fr.key(5), (4, 2)))  # another layout: another graph


def test_a_compile_that_fails_is_said_once_and_stays_eager(monkeypatch):
    fake = _FakeCompile(fail=True)
    monkeypatch.setattr(torch, "compile", fake)
    f = _fresh(energy)
    x = fr.normal(fr.key(2), (3, 2))
    with pytest.warns(RuntimeWarning, match="compiling the energy's value and gradient failed .*cannot trace"):
        e, g = evaluation.evaluator(f, 1, True)(x)
    torch.testing.assert_close(g, x @ P)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluation.evaluator(f, 1, True)(x)
    assert fake.compiled == 1


def test_bad_compile_energy_is_refused():
    with pytest.raises(ValueError, match="compile_energy must be True, False or 'auto', got 'yes'"):
        fnebm.nuts(energy, 0.3, compile_energy="yes")


def test_a_real_compile_gives_the_eager_transition(monkeypatch):
    # the one real compile here: torch.compile of the batched value and gradient, called from the
    # C kernel's loop (its input buffer rewritten between calls); same trees, float-close draws;
    # and the traced tier of "auto" (aot_eager), on a fresh energy object of its own
    monkeypatch.setattr(evaluation, "TRACE_AFTER_S", 0.0)
    recorded = []  # the graphs the compiles record (_inductor.record_graph), for a later process
    monkeypatch.setattr(_inductor, "record_graph", lambda sig, keys: recorded.append((sig, list(keys))))
    direct = []
    real_direct = evaluation._direct
    monkeypatch.setattr(evaluation, "_direct", lambda *a: direct.append(real_direct(*a)) or direct[-1])
    wrappers = []  # the C++ wrapper asked of Inductor, per compile
    real_backend = _inductor.inductor_backend

    def backend(gm, example_inputs, extra=None):
        wrappers.append((extra or {}).get("cpp_wrapper", False))
        return real_backend(gm, example_inputs, extra)

    monkeypatch.setattr(_inductor, "inductor_backend", backend)
    f = _fresh(energy)
    x0 = fr.normal(fr.key(3), (8, 2))
    keys = fr.split(fr.key(4), 8)
    out, native = [], []  # native: the trips each run made in C++ (cpu_trips)
    for compile_energy in (False, True, "wrapped", "python", "auto"):
        made = cpu_trips.made
        if compile_energy == "python":  # Inductor's Python wrapper: a compile of its own, on an energy of its own
            compiled_f, f = f, _fresh(energy)
        if compile_energy == "auto":
            f = _fresh(energy)
            # the traced tier only: a compile is never worth it here (else "auto" compiles whenever the
            # compile above was quick against the kernel's expected evaluations, as on a warm Inductor cache)
            monkeypatch.setattr(evaluation, "compile_estimate", lambda *a: float("inf"))
        # "wrapped": the same compiled graph, its pinned calls through AOTAutograd's wrapper
        monkeypatch.setattr(evaluation, "DIRECT", compile_energy != "wrapped")
        monkeypatch.setattr(evaluation, "CPP_WRAPPER", compile_energy != "python")
        alg = fnebm.nuts(f, 0.5, compile_energy=compile_energy in (True, "wrapped", "python") or compile_energy)
        state = torch.func.vmap(alg.init)(x0)
        trips = 0  # a transition's trips: its longest tree's integrator steps (the chains in lockstep)
        for i in range(3):
            state, info = alg.step(state, fr.fold_in(keys, i))
            trips += int(info.num_integration_steps.max())
        out.append((state, info))
        native.append((cpu_trips.made - made, trips))
    (a, ia), (b, ib), (w, iw), (p, ip), (c, ic) = out
    # the compiled run's trips after each transition's first ran in C++ (the C++ wrapper's entry, called
    # without Python: cpu_trips), where the library builds; the others' from Python: the same draws bit for bit
    if cpu_trips.available() is None:
        # (each transition's first trip from Python, which pins the graph; a transition's trips number
        # about its longest tree's steps)
        assert native[1][1] - 6 <= native[1][0] < native[1][1]
        assert [n for n, _ in native[:1] + native[2:]] == [0] * 4
    else:
        assert [n for n, _ in native] == [0] * 5
    # the energy's products (x @ (P @ x)) gave the first compile Inductor's C++ wrapper, the "python"
    # one its Python wrapper: the same kernels, the same draws bit for bit
    assert wrappers == [True, False]
    # the kernel's trips called Inductor's graph directly (checked once against the wrapper, then
    # taken): the same draws bit for bit as through the wrapper; "auto"'s traced tier (aot_eager)
    # has no Inductor graph and keeps its wrapper
    assert len(direct) == 3 and direct[0] is not None and direct[1] is not None and direct[2] is None
    for u, v, q in zip(*(torch.utils._pytree.tree_leaves(o) for o in ((b, ib), (w, iw), (p, ip)))):
        assert torch.equal(u, v) and torch.equal(u, q)
    for other, info in ((b, ib), (c, ic)):
        torch.testing.assert_close(a.position, other.position, rtol=1e-4, atol=1e-5)
        assert torch.equal(ia.num_integration_steps, info.num_integration_steps)
    assert evaluation._evaluation(f, 1).traced is not None
    # window adaptation's C loop (fnebm_nuts_adapt_resume, which stops at each window's end) on the
    # compiled graph: its trips in C++ (the same graph, no new compile) or from Python, the same bits;
    # and cpu_trips.run gives back the handles it makes of its inputs (their storage as referenced as before)
    warm = fnebm.window_adaptation(fnebm.nuts, compiled_f, 120, compile_energy=True)
    results, made = [], []
    for on in (True, False):
        monkeypatch.setattr(cpu_trips, "NATIVE", on)
        n0 = cpu_trips.made
        results.append(warm.run(x0, fr.key(5)))
        made.append(cpu_trips.made - n0)
    monkeypatch.setattr(cpu_trips, "NATIVE", True)
    assert (made[0] > 100 if cpu_trips.available() is None else made[0] == 0) and made[1] == 0
    leaves = [torch.utils._pytree.tree_leaves(r) for r in results]
    assert len(leaves[0]) == len(leaves[1]) and sum(isinstance(u, torch.Tensor) for u in leaves[0]) >= 4
    for u, v in zip(*leaves):
        assert torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v
    if cpu_trips.available() is None:
        pending = torch.zeros(8, 2)
        uses = torch._C._storage_Use_Count(pending.untyped_storage()._cdata)
        resume = cpu_nuts.LIBRARY.load().fnebm_nuts_resume
        entry = evaluation._evaluation(compiled_f, 1).pin_entry
        assert entry is not None
        assert cpu_trips.run(entry, [pending, P], resume, 0, 0, pending, 10) == (0, 0, False)  # no chain waits
        assert torch._C._storage_Use_Count(pending.untyped_storage()._cdata) == uses
    # the compiled graph's outputs are contiguous (its products of 8 x 2 are computed transposed, which
    # left the gradient with strides (1, 8), copied by the kernel's loop at every trip)
    e, g = evaluation.evaluator(compiled_f, 1, True)(x0)
    compiled_ev = evaluation._evaluation(compiled_f, 1)
    assert compiled_ev.compile_s is not None
    # the compile recorded its Inductor graph: a later process knows this machine compiled it (a cache hit)
    assert compiled_ev.graph_keys != [] and (compiled_ev.signature(x0), compiled_ev.graph_keys) in recorded
    assert e.is_contiguous() and g.is_contiguous()


def test_an_evaluation_with_products_asks_for_the_cpp_wrapper(monkeypatch):
    # the rule, without compiling: a traced evaluation that calls a matrix product (or a convolution,
    # a linear layer) is compiled with Inductor's C++ wrapper on the CPU; one without too where the
    # kernels' trips run in C++ (cpu_trips), else with its Python wrapper, as with the switch off
    monkeypatch.setattr(evaluation, "_native_trips", lambda: False)
    asked = []
    monkeypatch.setattr(_inductor, "inductor_backend", lambda gm, ex, extra=None: asked.append(extra) or gm)
    ev = evaluation._evaluation(_fresh(energy), 1)
    x = torch.zeros(4, 2)
    cases = [(lambda x: x @ P, True), (lambda x: torch.nn.functional.linear(x, P), True),
             (torch.nn.Sequential(torch.nn.Linear(2, 1)), True), (lambda x: (x * x).sum(-1), False),
             (lambda x: torch.einsum("cd,de->ce", x, P), True), (lambda x: x.mm(P), True)]
    for fn, products in cases:
        gm = torch.fx.symbolic_trace(fn)
        assert _inductor.has_products(gm) is products
        ev._backend(gm, [x])
        assert asked[-1].get("cpp_wrapper", False) is products and asked[-1]["size_asserts"] is False
    monkeypatch.setattr(evaluation, "_native_trips", lambda: True)
    for fn, products in cases:
        ev._backend(torch.fx.symbolic_trace(fn), [x])
        assert asked[-1].get("cpp_wrapper", False) is True
    monkeypatch.setattr(evaluation, "CPP_WRAPPER", False)
    ev._backend(torch.fx.symbolic_trace(lambda x: x @ P), [x])
    assert "cpp_wrapper" not in asked[-1]
    monkeypatch.setattr(evaluation, "CPP_WRAPPER", True)
    ev._backend(torch.fx.symbolic_trace(lambda x: x @ P), [torch.zeros(4, 2, device="meta")])
    assert "cpp_wrapper" not in asked[-1]  # not on the CPU: left as Inductor makes it

    def refuses_cpp(gm, ex, extra=None):  # a graph the C++ wrapper cannot build: the Python wrapper's
        asked.append(extra)
        if extra.get("cpp_wrapper"):
            raise RuntimeError("no C shim for this operation")
        return gm

    monkeypatch.setattr(_inductor, "inductor_backend", refuses_cpp)
    del asked[:]
    ev._backend(torch.fx.symbolic_trace(lambda x: x @ P), [x])
    assert [a.get("cpp_wrapper", False) for a in asked] == [True, False]


def test_a_graph_that_writes_its_inputs_is_called_through_its_wrapper():
    # AOTAutograd's runtime wrapper is skipped only for a plain CPU graph that leaves its inputs alone
    # (fnebm._inductor.innermost_call); a graph that writes one keeps it
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(_inductor.inductor_backend(gm, example_inputs))
        return graphs[-1]

    def bump(x):
        x.add_(1.0)
        return x.sum(), x * 2.0

    x = torch.zeros(3)
    torch.compile(bump, backend=backend, dynamic=False)(x)
    assert torch.equal(x, torch.ones(3))
    assert len(graphs) == 1 and _inductor.innermost_call(graphs[0]) is None
    assert _inductor.innermost_call(lambda x: x) is None  # no Inductor graph inside


def _request(alg, state, keys):
    return dispatch.RunRequest(alg.step, state, keys, torch.zeros((), dtype=torch.int64), "position", False)


def test_sample_chain_runs_the_evaluated_transition_eagerly_and_compile_picks_the_evaluations():
    alg = fnebm.nuts(energy, 0.5)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(5), (4, 2)))
    keys = fr.split(fr.key(6), 4)
    for compile, want in (("auto", "auto"), (True, True), (False, False)):
        decision = dispatch.choose(_request(alg, state, keys), "auto", compile)
        assert decision.compile is False and decision.transition == "c"
        assert decision.step.keywords["compile_energy"] == want and decision.step.keywords["backend"] == "c"
    plans = []
    fnebm.sample_chain(alg.step, state, fr.key(7), 3, progress=False, on_plan=plans.append)
    assert plans[0].engine == "eager" and plans[0].transition == "c"
    # a family stays one op inside compiled code: compile is left as asked
    family = fnebm.nuts(fnebm.energies.harmonic(2.0), 0.5)
    decision = dispatch.choose(_request(family, state, keys), "auto", True)
    assert decision.compile is True and decision.transition == "c"


def test_window_adaptation_on_a_plain_function_recovers_the_target():
    # a 2-D Gaussian written as a function; warm-up (compile=True, its default: here the sampler's
    # evaluations would compile, so compile_energy=False keeps this test eager), then 300 draws of
    # 16 chains: means and variances within 4.5 MCSE of the truth
    warm = fnebm.window_adaptation(fnebm.nuts, energy, 200, compile_energy=False)
    plans = []
    result = warm.run(fr.normal(fr.key(8), (16, 2)), fr.key(9), on_plan=plans.append)
    assert plans[0].engine == "eager"
    alg = fnebm.nuts(energy, **result.parameters)
    _, trace, info = fnebm.sample_chain(alg.step, result.state, fr.key(10), 300, progress=False)
    cov = torch.linalg.inv(P).double()
    trace = trace.double()
    stats = torch.cat([trace, trace ** 2], -1)
    truth = torch.cat([torch.zeros(2, dtype=torch.float64), torch.diagonal(cov)])
    z = (stats.mean((0, 1)) - truth) / fnebm.diagnostics.mcse_mean(stats, layout="draws_chains")
    assert (z.abs() < 4.5).all(), z
    assert abs(float(info.acceptance_rate.mean()) - 0.8) < 0.08


def test_eager_chains_run_many_transitions_per_call_with_the_same_draws(monkeypatch):
    # sample_chain's eager loop hands a NUTS step on an evaluated energy several transitions at once
    # (each chain goes on without waiting for the others' trees): the same draws as one at a time
    import importlib

    nuts_module = importlib.import_module("fnebm.samplers.nuts")
    scales = torch.linspace(0.05, 0.6, 8)  # trees of different sizes
    alg = fnebm.nuts(_fresh(energy), scales, compile_energy=False)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(12), (8, 2)))
    calls = []
    many = nuts_module._step.kernel_many

    def counted(step, state, keys):
        calls.append(keys.shape[0])
        return many(step, state, keys)

    monkeypatch.setattr(nuts_module._step, "kernel_many", counted)
    got = fnebm.sample_chain(alg.step, state, fr.key(13), 30, burn_in=5, thin=3, progress=False)
    assert calls and max(calls) > 1
    # blocks of 7 transitions (kept steps sliced from each block, then joined), and a collect of the
    # user's own (kept one row at a time): the same draws
    from fnebm.chain import engines

    monkeypatch.setattr(engines, "_MANY_FLOATS", 7 * 8 * 2)
    calls.clear()
    blocks = fnebm.sample_chain(alg.step, state, fr.key(13), 30, burn_in=5, thin=3, progress=False)
    assert max(calls) == 7
    own = fnebm.sample_chain(alg.step, state, fr.key(13), 30, burn_in=5, thin=3, progress=False,
                             collect=lambda s: (s.position, s.energy))
    monkeypatch.setattr(nuts_module._step, "kernel_many", None)  # one transition per call
    want = fnebm.sample_chain(alg.step, state, fr.key(13), 30, burn_in=5, thin=3, progress=False)
    for run in (got, blocks):
        assert torch.equal(run[1], want[1]) and run[1].shape == (10, 8, 2)
        for a, b in zip(run[2], want[2]):
            assert torch.equal(a, b)
        for a, b in zip(run[0].state, want[0].state):
            assert torch.equal(a, b)
    assert torch.equal(own[1][0], want[1]) and own[1][1].shape == (10, 8)
    for a, b in zip(own[2], want[2]):
        assert torch.equal(a, b)
    # the kernel again: a trace of every step is new memory, not a view the final state shares; and a
    # collect that cannot be hashed (a dataclass instance) is applied row by row
    import dataclasses

    @dataclasses.dataclass
    class Pick:
        field: str = "position"

        def __call__(self, s):
            return getattr(s, self.field)

    monkeypatch.setattr(nuts_module._step, "kernel_many", many)
    final, trace, _ = fnebm.sample_chain(alg.step, state, fr.key(13), 6, progress=False)
    kept = trace.clone()
    final.state.position.add_(1.0)
    assert torch.equal(trace, kept)
    picked = fnebm.sample_chain(alg.step, state, fr.key(13), 6, progress=False, collect=Pick())
    assert torch.equal(picked[1], kept)
    assert got[2].num_integration_steps.unique().numel() > 1


def test_threads_are_chosen_by_timing_under_auto_only(monkeypatch):
    # a thread count can change a reduction's rounding: True/False keep torch's threads (same bits
    # every run); "auto" times its first calls both ways
    set_to = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: set_to.append(n))
    monkeypatch.setattr(evaluation, "TRACE_AFTER_S", 1e9)
    # no compile measured (another test's counted compile takes no time): auto stays eager here
    monkeypatch.setattr(evaluation, "_kept", type(evaluation._kept)())
    x = fr.normal(fr.key(14), (3, 2))
    f = _fresh(energy)
    for _ in range(evaluation.TUNE_CALLS):
        evaluation.evaluator(f, 1, False)(x)
    with evaluation.evaluator(f, 1, False).scope():
        pass
    assert set_to == []
    for _ in range(evaluation.TUNE_CALLS):
        evaluation.evaluator(f, 1, "auto")(x)
    assert 1 in set_to and evaluation._evaluation(f, 1).one_thread is not None
    assert real is not torch.set_num_threads


def test_inside_a_users_fullgraph_compile_a_plain_function_takes_the_torch_kernel():
    # the C transition on an evaluated energy returns to Python, so a user's compiled region traces
    # the torch kernel instead (one graph, no break); new step sizes reuse it; the same trees as
    # the eager C transition from the same keys, positions to float tolerance
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    f = _fresh(energy)
    x0, keys = fr.normal(fr.key(15), (8, 2)), fr.split(fr.key(16), 8)

    def run(h, x0, keys):
        alg = fnebm.nuts(f, h, max_tree_depth=4, compile_energy=False)
        return alg.step(torch.func.vmap(alg.init)(x0), keys)

    compiled = torch.compile(run, fullgraph=True, backend=counter)
    frames = None
    for h in (0.3, 0.5):
        (got, got_info), (want, want_info) = compiled(torch.tensor(h), x0, keys), run(torch.tensor(h), x0, keys)
        torch.testing.assert_close(got.position, want.position, rtol=1e-4, atol=1e-5)
        assert torch.equal(got_info.num_integration_steps, want_info.num_integration_steps)
        frames = counter.frame_count if frames is None else frames
        assert counter.frame_count == frames == 1, "a new step size recompiled"
    # the torch kernel's loop is in the graph
    assert any(n.op == "call_function" and str(n.target).split(".")[-1] == "while_loop"
               for g in counter.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)


def test_a_scope_pins_the_compiled_graph_and_the_next_scope_checks_again():
    # inside a kernel's loop (scope) the graph Dynamo chose at the first call runs directly; the
    # next scope goes through torch.compile's guards again, so a rebound tensor is seen there
    P_now = {"P": P.clone()}

    def energy_of_global(x):
        return 0.5 * (x @ (P_now["P"] @ x))

    ev = evaluation.evaluator(energy_of_global, 1, True)
    xs = [fr.normal(fr.key(30 + i), (3, 2)) for i in range(4)]
    with ev.scope():
        outs = [ev(x) for x in xs]
        assert ev.ev.pin is not None  # the first call's graph, kept for this scope
        odd = fr.normal(fr.key(40), (5, 2))  # another shape: through torch.compile, right values
        e5, g5 = ev(odd)
    assert ev.ev.pin is None
    for x, (e, g) in zip(xs, outs):
        torch.testing.assert_close(g, x @ P_now["P"])
        torch.testing.assert_close(e, 0.5 * ((x @ P_now["P"]) * x).sum(-1))
    torch.testing.assert_close(g5, odd @ P_now["P"])
    P_now["P"] = 2.0 * P  # rebound between two loops: the next scope's guards see it
    with ev.scope():
        for x in xs:
            torch.testing.assert_close(ev(x)[1], x @ P_now["P"])
        # a kernel's trips: one positions buffer, rewritten in place between calls (the pinned graph runs
        # at once on it): every call sees the buffer's new values
        buf = xs[0].clone()
        ev(buf)
        assert ev.ev.pin[1][ev.ev.pin[2]] is buf  # the pin runs on this buffer from now on
        for x in xs[1:]:
            buf.copy_(x)
            e, g = ev(buf)
            torch.testing.assert_close(g, x @ P_now["P"])
            torch.testing.assert_close(e, 0.5 * ((x @ P_now["P"]) * x).sum(-1))
    assert ev.ev.pin is None


def test_an_eager_block_keeps_the_pin_across_scopes_until_it_ends():
    # sample_chain's eager engine holds an eager block around a chunk's steps (a warm-up's iterations,
    # each a transition with a scope of its own): the pin is kept from one scope to the next there,
    # so the guards run once a block; at the block's end it is dropped, and a rebound tensor is seen
    from fnebm import _checks

    P_now = {"P": P.clone()}

    def energy_of_global(x):
        return 0.5 * (x @ (P_now["P"] @ x))

    ev = evaluation.evaluator(energy_of_global, 1, True)
    xs = [fr.normal(fr.key(60 + i), (3, 2)) for i in range(3)]
    ev(xs[0])  # the compile
    with _checks.eager_block():
        for x in xs:
            with ev.scope():
                torch.testing.assert_close(ev(x)[1], x @ P_now["P"])
            pin = ev.ev.pin
            assert pin is not None
            assert x is xs[0] or pin[0] is first[0]  # the same recorded graph: no new trip through the guards
            first = pin
    assert ev.ev.pin is None
    P_now["P"] = 2.0 * P  # rebound between two blocks: seen by the next
    with _checks.eager_block():
        with ev.scope():
            torch.testing.assert_close(ev(xs[0])[1], xs[0] @ P_now["P"])


def test_the_traced_tier_is_pinned_too(monkeypatch):
    # "auto"'s middle tier (aot_eager) goes through torch.compile per call too: pinned the same way
    monkeypatch.setattr(evaluation, "TRACE_AFTER_S", 0.0)
    monkeypatch.setattr(evaluation, "_kept", type(evaluation._kept)())
    f = _fresh(energy)
    ev = evaluation.evaluator(f, 1, "auto")
    xs = [fr.normal(fr.key(50 + i), (3, 2)) for i in range(4)]
    ev(xs[0])  # eager, then traced from the next call on
    with ev.scope():
        outs = [ev(x) for x in xs]
        assert ev.ev.traced is not None and ev.ev.compiled is None and ev.ev.pin is not None
    for x, (e, g) in zip(xs, outs):
        torch.testing.assert_close(g, x @ P)


@pytest.mark.parametrize("two, one, want_one", [
    # the 100-D Gaussian's trials in a run that chose two threads by the middle of each way's four
    # calls (one slow one-thread call), and then ran its compiled evaluations on two: 4x slower
    ([963, 431, 388, 400], [443, 538, 315, 318], True),
    ([200, 210, 190, 205], [400, 390, 410, 395], False),  # two threads clearly faster: kept
    ([300, 310, 320, 305], [305, 320, 330, 310], True),  # within the noise: one thread
])
def test_the_threads_are_chosen_by_each_ways_fastest_call(monkeypatch, two, one, want_one):
    threads = [2]
    clock = [0.0]
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads[0])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: threads.__setitem__(0, n))
    monkeypatch.setattr(evaluation.time, "perf_counter", lambda: clock[0])
    ev = evaluation._Evaluation(_fresh(energy), 1)
    durations = {False: iter(two), True: iter(one)}

    def fn(x):
        clock[0] += next(durations[threads[0] == 1]) * 1e-6
        return x

    for _ in range(evaluation.TUNE_CALLS):
        ev.run(fn, torch.zeros(1))
    assert ev.one_thread is want_one and threads[0] == 2  # set around its own calls only
