"""Compiles that fail never lose a run, and a state whose fields share memory compiles.

The failures are injected cheaply: a backend that raises (Dynamo traces, then the backend
refuses, as Inductor does on a graph it cannot lower) or an energy Dynamo cannot trace with
``fullgraph=True`` (it fails before any backend runs). The one real compile is ``aot_eager``:
Dynamo and AOTAutograd's functionalisation, where torch checks a scan for aliasing, without
Inductor's C++ compile.
"""

import warnings
from typing import NamedTuple

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fnebm
from fnebm import random as fr
from fnebm._control import while_loop
from fnebm.chain import CompileFallbackWarning

# ------------------------------------------------------------------ the item-response posterior

PERSONS, ITEMS = 40, 25  # 66 dimensions: above the 64 below which sample_chain copies the state anyway


def _responses():
    logits = fr.normal(fr.key(5), (PERSONS, 1)) - fr.normal(fr.key(6), (1, ITEMS))
    return (fr.uniform(fr.key(7), (PERSONS, ITEMS)) < torch.sigmoid(logits)).float()


Y = _responses()


def item_response(u):
    """A 1PL item-response log posterior written as a plain function of one vector (the user's form)."""
    msa, csa, qd = u[0], u[1:PERSONS + 1], u[PERSONS + 1:]
    logits = msa + csa[:, None] - qd[None, :]
    log_lik = (Y * logits - torch.nn.functional.softplus(logits)).sum()
    return -log_lik + 0.5 * (msa * msa + (csa * csa).sum() + (qd * qd).sum())


def _shares_memory(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.compile
def test_the_item_response_posterior_samples_compiled_from_a_state_whose_fields_share_memory():
    # An eager NUTS step returns its position and gradient as views of one stacked tensor (a
    # compiled warm-up returns them as slices of one buffer): torch's scan refused such a carry
    # ("scan might be aliasing the input or the output!"), after the whole trace.
    d = 1 + PERSONS + ITEMS
    # the torch kernel: under compile=True the C transition (eager, on this function energy) would
    # compile only the energy's evaluations, and this test is about the compiled scan's carry
    alg = fnebm.nuts(item_response, 0.1, max_tree_depth=4, backend="torch")
    state = torch.func.vmap(alg.init)(0.1 * fr.normal(fr.key(8), (4, d)))
    state, _ = alg.step(state, fr.split(fr.key(9), 4))
    assert _shares_memory(state.position, state.grad)  # the case under test
    counter = CompileCounterWithBackend("aot_eager")
    cache = fnebm.chain.RunnerCache(backend=counter)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)  # compiled, not fallen back
        chain, trace, info = fnebm.sample_chain(alg.step, state, fr.key(10), 4, compile=True, progress=False,
                                                cache=cache)
    assert counter.frame_count >= 1
    _, eager, eager_info = fnebm.sample_chain(alg.step, state, fr.key(10), 4, compile=False, progress=False)
    torch.testing.assert_close(trace, eager)
    assert torch.equal(info.num_integration_steps, eager_info.num_integration_steps)
    assert trace.shape == (4, 4, d) and bool(torch.isfinite(trace).all())


class Walk(NamedTuple):
    position: torch.Tensor
    double: torch.Tensor


def _walk(state, keys):
    """A cheap step to trace: a Gaussian random walk carrying two fields, through a while_loop
    whose carry starts from the state (as HMC's trajectory with lengths as data does)."""
    noise = 0.1 * fr.normal(keys, (3,), state.position.dtype)

    def body(i, x, double):
        return i + 1, x + noise, 2.0 * x

    _, x, double = while_loop(lambda i, x, double: i < 2, body,
                              (torch.zeros((), dtype=torch.int64), state.position, state.double))
    return Walk(x, double), x[..., 0]


def test_chain_run_compiles_a_carry_whose_fields_share_memory():
    # fnebm.chain.run inside your own compiled function: the state is copied in the graph before
    # the scan's carry and the traced step's while_loop see it
    both = torch.zeros(2, 5, 3)
    state = Walk(both[0], both[1])  # two fields, one storage
    run = torch.compile(lambda s, k: fnebm.chain.run(_walk, s, k, 3), fullgraph=True, backend="aot_eager")
    final, trace, info = run(state, fr.split(fr.key(1), 5))
    want = fnebm.chain.run(_walk, state, fr.split(fr.key(1), 5), 3)
    torch.testing.assert_close(trace, want[1])
    torch.testing.assert_close(final.double, want[0].double)


# -------------------------------------------------------------------- a compile that fails


class Refusing:
    """A backend that refuses every graph (Dynamo wraps its error in BackendCompilerFailed)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.calls += 1
        raise RuntimeError("injected: this backend refuses every graph")


def _mala_setup():
    alg = fnebm.mala(lambda x: 0.5 * (x * x).sum(), 0.3)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(0), (8, 3)))
    return alg, state


def test_a_failed_compile_falls_back_once_with_the_eager_draws():
    alg, state = _mala_setup()
    backend = Refusing()
    cache = fnebm.chain.RunnerCache(backend=backend)
    plans = []
    kw = dict(burn_in=3, thin=2, progress=False, cache=cache, on_plan=plans.append)
    with pytest.warns(CompileFallbackWarning, match="injected: this backend refuses") as record:
        got = fnebm.sample_chain(alg.step, state, fr.key(1), 10, compile=True, **kw)
    assert len(record) == 1 and record[0].filename == __file__  # the warning names the caller's line
    assert backend.calls == 1
    first, revised = plans
    assert first.compiles and first.fallback is None and not first.revised
    assert revised.revised and not revised.compiled and "injected" in revised.fallback
    assert revised.reason.startswith("eager from step 0: the compile failed (BackendCompilerFailed")
    eager = fnebm.sample_chain(alg.step, state, fr.key(1), 10, compile=False, burn_in=3, thin=2, progress=False)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(eager)):
        assert torch.equal(a, b)  # the same eager steps from the same inputs: the same bits
    # remembered: the next calls run eagerly without trying the compile again, and say why
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        again = fnebm.sample_chain(alg.step, state, fr.key(1), 10, compile="auto", **kw)
        fnebm.sample_chain(alg.step, state, fr.key(1), 10, compile=True, **kw)
    assert backend.calls == 1
    assert all(p.fallback == revised.fallback and not p.compiled and not p.revised for p in plans[2:])
    assert plans[2].reason.startswith("eager: the compile failed earlier")
    assert torch.equal(again[1], eager[1])
    # clear() forgets the failure: the next call tries again
    cache.clear()
    with pytest.warns(CompileFallbackWarning):
        fnebm.sample_chain(alg.step, state, fr.key(1), 10, compile=True, **kw)
    assert backend.calls == 2


def test_a_failure_mid_run_restarts_that_chunk_eagerly():
    # a compiled chunk, then a compiled call that fails (as a recompile might): that chunk runs
    # again eagerly from its own inputs, and so does the rest
    alg, state = _mala_setup()
    calls = []

    def fails_on_its_second_call(gm, example_inputs):
        def run(*args):
            calls.append(len(calls))
            if len(calls) == 2:
                raise RuntimeError("injected: the second call")
            return gm.forward(*args)
        return run

    cache = fnebm.chain.RunnerCache(backend=fails_on_its_second_call)
    plans = []
    with pytest.warns(CompileFallbackWarning, match="from step 4 "):
        _, got, _ = fnebm.sample_chain(alg.step, state, fr.key(2), 10, chunk_size=4, compile=True, progress=False,
                                       cache=cache, on_plan=plans.append)
    assert len(calls) == 2  # the third chunk ran eagerly
    assert plans[-1].revised and plans[-1].reason.startswith("eager from step 4:")
    _, eager, _ = fnebm.sample_chain(alg.step, state, fr.key(2), 10, compile=False, progress=False)
    torch.testing.assert_close(got, eager)  # compiled then eager: the same chain to float rounding


def test_an_error_the_eager_steps_raise_too_is_raised_as_they_raise_it():
    # Dynamo cannot trace the Python branch (fullgraph); eagerly the step raises at its third step
    def step(x, keys):
        if bool((x > 2.5).any()):
            raise ValueError("the walk left its box")
        return x + 1.0, x[..., 0]

    cache = fnebm.chain.RunnerCache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        with pytest.raises(ValueError, match="left its box"):
            fnebm.sample_chain(step, torch.zeros(4, 2), fr.key(3), 6, collect=lambda x: x, compile=True,
                               progress=False, cache=cache)


@torch.compiler.disable
def _opaque_square_norm(x):
    return (x * x).sum()


def _untraceable(x):
    """An energy Dynamo refuses under fullgraph (it calls a function compiled code may not enter)."""
    return 0.5 * _opaque_square_norm(x)


def test_window_adaptation_falls_back_when_its_compile_fails():
    # the warm-up is one sample_chain call: Dynamo fails before any backend, the warm-up runs eagerly
    warm = fnebm.window_adaptation(fnebm.hmc, _untraceable, 12, num_integration_steps=3)
    x0 = fr.normal(fr.key(4), (6, 2), torch.float64)
    plans = []
    # Dynamo's reason, found inside the loop's body (the step traced once, there: no probe step before it)
    with pytest.warns(CompileFallbackWarning, match="in the step, inside the compiled loop: Skip calling") as record:
        got = warm.run(x0, fr.key(5), cache=fnebm.chain.RunnerCache(), on_plan=plans.append)
    assert len(record) == 1 and record[0].filename == __file__
    assert plans[-1].revised and "disable()`d function" in plans[-1].fallback
    eager = warm.run(x0, fr.key(5), compile=False)
    assert torch.equal(got.state.position, eager.state.position)
    assert torch.equal(got.parameters["step_size"], eager.parameters["step_size"])
    assert torch.equal(got.info.acceptance_rate, eager.info.acceptance_rate)


def test_the_command_line_reports_the_fallback_as_the_path_of_its_call():
    # fnebm sample's summary: a revised plan replaces its call's first plan, and the path says why
    from types import SimpleNamespace

    from fnebm.cli.report import _Calls
    from fnebm.chain import RunPlan

    calls = _Calls(SimpleNamespace(progress=False, compile=True), 10)
    first = RunPlan(True, True, "compile=True", None, 20.0, 10)
    calls.on_plan(first)
    calls.on_plan(first._replace(compiled=False, compiles=False, reason="eager from step 0: ...",
                                 fallback="BackendCompilerFailed: boom", revised=True))
    assert len(calls.plans) == 1
    assert calls.path(0) == (False, "the compile failed (BackendCompilerFailed: boom), so the steps ran eagerly")
