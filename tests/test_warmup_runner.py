"""Warm-ups reach chains through the runner of fnebm._loop (adaptation sits below fnebm.chain), and
window adaptation reads a sampler's defaults from a table keyed by its constructor's name. Eager
and small: nothing here compiles."""

import functools

import pytest
import torch
import torch.utils._pytree as pytree

import fnebm
from fnebm import _loop
from fnebm import random as fr
from fnebm.adaptation import chees_adaptation, window_adaptation
from fnebm.adaptation.window import SAMPLER_DEFAULTS, default_target_acceptance_rate, sampler_name

F64 = torch.float64
TARGET = fnebm.energies.gaussian(torch.tensor([1.0, -1.0], dtype=F64), torch.tensor([[1.0, 0.5], [0.5, 2.0]], dtype=F64))
X0 = fr.normal(fr.key(0), (4, 2), F64)


def _same(a, b) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def test_importing_fnebm_installs_sample_chain_as_the_runner():
    from fnebm.chain.warmup import ensemble_runner

    assert _loop.default_runner() is ensemble_runner


@pytest.mark.parametrize("algorithm", [fnebm.hmc, functools.partial(fnebm.nuts, max_tree_depth=4)])
def test_the_plain_loop_gives_sample_chains_warm_up(algorithm):
    """sample_chain's runner (eager) and the plain loop of fnebm._loop: the same iterations, to the bit."""
    warm = window_adaptation(algorithm, TARGET, 25)
    by_chain = warm.run(X0, fr.key(1), compile=False)
    plain = warm.run(X0, fr.key(1), compile=False, runner=_loop.eager_runner)
    assert _same(by_chain, plain)


def test_chees_runs_through_the_runner_it_is_given():
    calls = []

    def spy(step, state, key, n_steps, **options):
        calls.append((n_steps, sorted(options)))
        return _loop.eager_runner(step, state, key, n_steps, **options)

    a = chees_adaptation(TARGET, 5, compile=False).run(X0, fr.key(2))
    b = chees_adaptation(TARGET, 5, compile=False, runner=spy).run(X0, fr.key(2))
    assert calls == [(5, ["cache", "collect", "compile", "on_plan", "progress"])]
    assert _same(a, b)
    with pytest.raises(TypeError, match="runner"):
        chees_adaptation(TARGET, 5, runner="sample_chain")


def test_the_plain_loop_refuses_what_it_cannot_do():
    warm = window_adaptation(fnebm.hmc, TARGET, 5)
    for options in ({}, {"compile": True}, {"compile": False, "on_plan": print}, {"compile": False, "progress": True}):
        with pytest.raises(ValueError, match="fnebm.chain"):
            warm.run(X0, fr.key(3), runner=_loop.eager_runner, **options)
    with pytest.raises(TypeError, match="runner"):
        warm.run(X0, fr.key(3), runner=42)


def hmc(energy_fn, step_size, inverse_mass_matrix, **extra):
    """A constructor of this module that happens to be called hmc: not fnebm's."""
    return fnebm.hmc(energy_fn, step_size, inverse_mass_matrix, num_integration_steps=3, **extra)


def test_defaults_come_from_the_table_by_the_constructors_name():
    assert sampler_name(fnebm.nuts) == "fnebm.samplers.nuts.nuts" and sampler_name(fnebm.hmc) == "fnebm.samplers.hmc.hmc"
    assert set(SAMPLER_DEFAULTS) == {sampler_name(fnebm.nuts), sampler_name(fnebm.hmc)}
    assert default_target_acceptance_rate(functools.partial(functools.partial(fnebm.nuts), max_tree_depth=3)) == 0.8
    # HMC's trajectory rule follows the name through partials; a same-named function elsewhere gets neither
    warm = window_adaptation(functools.partial(fnebm.hmc), TARGET, 5)
    assert warm.final(warm.init(X0))[1]["num_integration_steps"] == 2  # ceil(sqrt(2))
    assert default_target_acceptance_rate(hmc) == 0.65
    warm = window_adaptation(hmc, TARGET, 5)
    assert "num_integration_steps" not in warm.final(warm.init(X0))[1]
    declared = functools.partial(hmc)
    declared.target_acceptance_rate = 0.9
    assert default_target_acceptance_rate(declared) == 0.9
