"""Window adaptation's iterations in C around the NUTS kernel (``fnebm.kernels.cpu_nuts.nuts_warmup``,
taken by ``window_adaptation(...).run`` for an energy the kernel evaluates in torch).

The C iterations are the torch ones to float rounding: each transition is the C kernel's from the
same state, step size, metric and key, bit for bit, and each iteration's dual averaging and Welford
update is torch's (``window._adapt_update``) applied to that transition, to a few ulps. These tests
check both, iteration by iteration, on the C run's own states (so a rounding difference cannot grow
through the chaotic trajectories into a vacuous tolerance).
"""

import math

import pytest
import torch
import torch.utils._pytree as pytree

import fnebm
from fnebm import random as fr
from fnebm.adaptation import window as W
from fnebm.kernels import cpu_nuts

pytestmark = pytest.mark.skipif(cpu_nuts.available() is not None, reason="the C NUTS kernel does not build here")

SCALES = torch.tensor([0.5, 1.0, 2.0, 4.0, 0.25, 1.5])


def energy(x):  # a user's function: no family the C kernel computes itself
    z = x / SCALES
    return 0.5 * (z * z).sum() + 0.1 * torch.log1p(z[0] ** 2)


def _x0(chains=4, seed=3):
    return fr.normal(fr.key(seed), (chains, SCALES.numel()))


def _run(warmup, x0, key, c_path: bool, monkeypatch=None):
    if not c_path:
        monkeypatch.setattr(W._adapt_step, "kernel_many", None)
    out = warmup.run(x0, key, compile=False)
    if not c_path:
        monkeypatch.undo()
    return out


def _stacked_run(warmup, x0, key):
    """The C path's stacked states and infos for the whole warm-up, from ``_adapt_many`` directly."""
    adapt = warmup.init(x0)
    step, _, evaluated = W._eager_transitions(warmup.step, adapt, False)
    assert evaluated
    n = int(warmup.schedule.slow_stop) + 5  # past the last window
    keys = fr.fold_in(key, torch.arange(n))
    states, infos, a = [], [], 0
    state = adapt
    while a < n:
        ran = W._adapt_many(step, state, keys[a:])
        assert ran is not None, "the C warm-up did not take this run"
        s, i = ran
        states.append(s)
        infos.append(i)
        m = i.acceptance_rate.shape[0]
        state = pytree.tree_map(lambda f: f[m - 1], s)
        a += m
    cat = lambda *xs: torch.cat(xs)  # noqa: E731
    return adapt, pytree.tree_map(cat, *states), pytree.tree_map(cat, *infos), step


def _at(stacked, t):
    return pytree.tree_map(lambda f: f[t], stacked)


@pytest.mark.parametrize("pooled,diagonal,chains", [(True, True, (4,)), (False, True, (4,)), (True, False, (4,)),
                                                    (False, False, (2, 2)), (True, True, (2, 3))])
def test_each_iteration_is_the_kernels_transition_and_torchs_adaptation(pooled, diagonal, chains):
    warmup = fnebm.window_adaptation(fnebm.nuts, energy, 120, pooled=pooled, is_mass_matrix_diagonal=diagonal,
                                     initial_buffer=10, first_window=10, final_buffer=10)
    x0 = _x0(math.prod(chains)).reshape(chains + (SCALES.numel(),))
    adapt, states, infos, step = _stacked_run(warmup, x0, fr.key(11))
    kw = step.keywords
    T = infos.acceptance_rate.shape[0]
    ends = [t for t in range(T) if bool(W.stages(adapt.schedule, torch.tensor(t))[1])]
    assert len(ends) >= 3, "the run should cross window ends"
    keys = fr.fold_in(fr.key(11), torch.arange(T))
    wrap = W.Diagonal if diagonal else W.Dense
    checked_transitions = 0
    for t in range(T):
        prev = adapt if t == 0 else _at(states, t - 1)
        now = _at(states, t)
        # the step size the iteration took is the previous state's
        assert torch.equal(infos.step_size[t], prev.step_size)
        assert int(now.step) == t + 1
        # the adaptation: torch's update on the C run's transition, to float rounding
        want = W._adapt_update(prev, now.state, infos.acceptance_rate[t], kw["t0"], kw["gamma"], kw["kappa"])
        for name in ("step_size", "inverse_mass_matrix"):
            torch.testing.assert_close(getattr(now, name), getattr(want, name), rtol=2e-5, atol=1e-6,
                                       msg=f"{name} at iteration {t}")
        for got, exp in zip(now.dual_averaging + now.welford, want.dual_averaging + want.welford):
            torch.testing.assert_close(got, exp, rtol=2e-5, atol=1e-5, msg=f"adaptation state at iteration {t}")
        # the transition: the C kernel's from the previous state, its step size, metric and key, bit for bit
        if t < 12 or t in ends or t - 1 in ends:
            chains = prev.state.position.shape[:-1]
            alg = fnebm.nuts(energy, prev.step_size, wrap(prev.inverse_mass_matrix), compile_energy=False)
            one, info = alg.step(prev.state, fr.split(keys[t], math.prod(chains)).reshape(chains + (2,)))
            assert torch.equal(one.position, now.state.position), f"transition {t}"
            assert torch.equal(one.grad, now.state.grad) and torch.equal(one.energy, now.state.energy)
            assert torch.equal(info.acceptance_rate, infos.acceptance_rate[t])
            assert torch.equal(info.is_divergent, infos.is_divergent[t])
            checked_transitions += 1
    assert checked_transitions >= 12 + len(ends)
    # pooled: one step size and metric; else one per chain
    assert infos.step_size.shape == ((T,) if pooled else (T,) + chains)
    assert infos.acceptance_rate.shape == (T,) + chains


def test_the_warmup_takes_the_c_iterations_and_agrees_with_torchs(monkeypatch):
    calls = []
    real = cpu_nuts.nuts_warmup

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_nuts, "nuts_warmup", counted)
    warmup = fnebm.window_adaptation(fnebm.nuts, energy, 120)
    plans = []
    c = warmup.run(_x0(), fr.key(5), compile=False, on_plan=plans.append)
    assert calls, "window_adaptation.run did not take the C iterations"
    assert plans and "the adaptation (dual averaging, Welford) in the C kernel" in plans[0].reason
    monkeypatch.setattr(W._adapt_step, "kernel_many", None)
    py = warmup.run(_x0(), fr.key(5), compile=False)
    assert len(calls) == 1
    # the same structure, shapes and dtypes
    assert pytree.tree_structure(c) == pytree.tree_structure(py)
    for a, b in zip(pytree.tree_leaves(c), pytree.tree_leaves(py)):
        assert a.shape == b.shape and a.dtype == b.dtype
    # the same iterations until a rounding difference tips a tree decision: the first ones agree closely
    torch.testing.assert_close(c.info.step_size[:15], py.info.step_size[:15], rtol=1e-5, atol=0)
    assert torch.equal(c.info.acceptance_rate[:5], py.info.acceptance_rate[:5])


def test_blocks_give_the_same_iterations_as_one_call(monkeypatch):
    warmup = fnebm.window_adaptation(fnebm.nuts, energy, 100, is_mass_matrix_diagonal=False)
    whole = warmup.run(_x0(), fr.key(9), compile=False)
    monkeypatch.setattr(W, "_MANY_FLOATS", 2000)  # a few iterations per call
    calls = []
    real = cpu_nuts.nuts_warmup
    monkeypatch.setattr(cpu_nuts, "nuts_warmup", lambda *a, **k: calls.append(a[4].shape[0]) or real(*a, **k))
    cut = warmup.run(_x0(), fr.key(9), compile=False)
    assert len(calls) > 5 and max(calls) < 100
    for a, b in zip(pytree.tree_leaves(whole), pytree.tree_leaves(cut)):
        assert torch.equal(a, b)


def test_a_float64_warmup_takes_the_torch_iterations(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_nuts, "nuts_warmup", lambda *a, **k: calls.append(1))
    warmup = fnebm.window_adaptation(fnebm.nuts, energy, 30)
    out = warmup.run(_x0().double(), fr.key(1), compile=False)
    assert not calls and out.state.position.dtype == torch.float64
