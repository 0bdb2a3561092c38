"""fnebm.profile_sampling: structure, counts and argument errors (never a time).

Costs: every profile here is eager on a few chains and a few steps (well under a second each),
except ``compiled``, one ``aot_eager`` profile of a tiny Langevin run (the run's graph and the
three piece graphs: the only compiles in this file), and one eager run of 100,000 chains (about
2 s) whose 40 MB trace shows its page faults.
"""

import math

import subprocess
import sys

import pytest
import torch

import fnebm
from fnebm import energies as E
from fnebm import random as fr
from fnebm.profiling import COMPONENTS, SamplingProfile, _probe, _replay_plan

F64 = torch.float64
TARGET = E.gaussian(torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64))


def check_structure(p, steps, chains):
    assert isinstance(p, SamplingProfile)
    assert p.steps == steps and p.chains == chains
    assert tuple(p.component_s) == COMPONENTS and tuple(p.shares) == COMPONENTS
    assert all(v >= 0 and math.isfinite(v) for v in p.component_s.values())
    assert all(0 <= v <= 1 for v in p.shares.values())
    assert sum(p.shares.values()) == pytest.approx(1.0, abs=1e-9)
    assert p.warm_s > 0 and p.step_s == pytest.approx(p.warm_s / steps)
    assert p.first_result_s > 0 and p.parts_over_step > 0
    # the remainder is what the measured parts leave of the step (none when they exceed it)
    parts = sum(p.component_s[k] for k in ("gradient", "random", "trace"))
    assert p.component_s["update"] == pytest.approx(max(p.step_s - parts, 0.0))
    assert p.parts_over_step == pytest.approx(parts / p.step_s)


@pytest.fixture(scope="module")
def mala_profile():
    alg = fnebm.mala(TARGET, 0.3)
    return fnebm.profile_sampling(alg, fr.normal(fr.key(0), (16, 3), F64), fr.key(1), 4, burn_in=2,
                                  compile=False, repeats=2)


def test_eager_profile_structure(mala_profile):
    p = mala_profile
    check_structure(p, steps=6, chains=(16,))
    assert p.mode == "eager" and p.compile_s is None and p.device == "cpu" and p.repeats == 2
    assert p.energy_evals_per_step == 1  # MALA caches the gradient: one evaluation per step
    assert p.draws_per_step >= 1  # at least the proposal's normals


def test_table_and_repr(mala_profile):
    text = str(mala_profile)
    for label in ("energy and gradient", "random draws", "update and checks", "trace write",
                  "time to first result", "warm time per step", "method:"):
        assert label in text
    assert "eager loops of 6 steps" in mala_profile.method
    assert "method=" in repr(mala_profile)


def test_hmc_counts_its_leapfrog_gradients():
    alg = fnebm.hmc(TARGET, 0.2, num_integration_steps=3)
    p = fnebm.profile_sampling(alg, fr.normal(fr.key(2), (8, 3), F64), fr.key(3), 3, compile=False, repeats=1)
    check_structure(p, steps=3, chains=(8,))
    assert p.energy_evals_per_step == 3  # L gradients per transition, the first one cached


def one_chain_step(energy):
    """A one-chain step that evaluates the gradient twice and draws one normal."""
    def step(x, key):
        _, g = fnebm.value_and_grad(energy)(x)
        _, g2 = fnebm.value_and_grad(energy)(x - 0.01 * g)
        return x - 0.01 * g2 + 0.1 * fr.normal(key, x.shape, x.dtype), g2.abs().sum()

    return step


def test_user_step_closure_and_vmap_chains():
    step = fnebm.vmap_chains(one_chain_step(TARGET))  # the energy is found in the closure
    x0 = fr.normal(fr.key(4), (5, 3), F64)
    p = fnebm.profile_sampling(step, x0, fr.key(5), 3, collect=lambda x: x, compile=False, repeats=1)
    check_structure(p, steps=3, chains=(5,))
    assert p.energy_evals_per_step == 2 and p.draws_per_step == 1

    # inside vmap the draw's key is (2,) per chain; it is recorded as the whole batch of keys
    chain = fnebm.chain.init(x0, fr.key(5))
    probe = _probe(step, chain, TARGET, 2)
    assert probe.evals == 4
    ((name, args), count), = probe.draws.items()
    assert name == "normal" and count == 2
    assert dict(args)["key"][1] == (5, 2) and tuple(dict(args)["shape"]) == (3,)
    assert probe.x[:2] == ((5, 3), 1)  # one mapped axis of 5 chains, the event of 3


def test_two_chain_axes_and_chain_state():
    alg = fnebm.langevin(TARGET, 0.05)
    p = fnebm.profile_sampling(alg, fr.normal(fr.key(6), (2, 4, 3), F64), fr.key(7), 3, chain_ndim=2,
                               compile=False, repeats=1)
    check_structure(p, steps=3, chains=(2, 4))

    state = torch.func.vmap(alg.init)(fr.normal(fr.key(8), (6, 3), F64))
    chain, _, _ = fnebm.sample_chain(alg.step, state, fr.key(9), 2, compile=False, progress=False)
    p = fnebm.profile_sampling(alg.step, chain, None, 3, compile=False, repeats=1)
    check_structure(p, steps=3, chains=(6,))


def test_energy_must_be_known():
    step = fnebm.vmap_chains(lambda x, key: (x + fr.normal(key, x.shape, x.dtype), x.sum()))
    x0 = fr.normal(fr.key(10), (4, 3), F64)
    with pytest.raises(ValueError, match="energy_fn"):
        fnebm.profile_sampling(step, x0, fr.key(11), 2, collect=lambda x: x, compile=False)
    # named explicitly, an energy the step never calls is counted as what it is: 0 evaluations
    p = fnebm.profile_sampling(step, x0, fr.key(11), 2, collect=lambda x: x, compile=False, repeats=1,
                               energy_fn=TARGET)
    check_structure(p, steps=2, chains=(4,))
    assert p.energy_evals_per_step == 0 and p.component_s["gradient"] == 0


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(n_steps=0), ValueError, "n_steps"),
    (dict(repeats=0), ValueError, "repeats"),
    (dict(probe_steps=0), ValueError, "probe_steps"),
    (dict(burn_in=-1), ValueError, "burn_in"),
    (dict(compile="yes"), TypeError, "compile"),
    (dict(compile_backend=3), TypeError, "compile_backend"),
    (dict(energy_fn=3), TypeError, "energy_fn"),
    (dict(step_or_algorithm=3), TypeError, "step_or_algorithm"),
    (dict(key=None), TypeError, "key"),
    (dict(state_or_positions=torch.zeros(3, dtype=F64)), ValueError, "positions"),
])
def test_bad_arguments(kwargs, error, match):
    args = dict(step_or_algorithm=fnebm.mala(TARGET, 0.3), state_or_positions=torch.zeros(4, 3, dtype=F64),
                key=fr.key(0), n_steps=2, compile=False)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        fnebm.profile_sampling(**args)


def test_chain_state_refuses_a_key():
    alg = fnebm.mala(TARGET, 0.3)
    state = torch.func.vmap(alg.init)(torch.zeros(4, 3, dtype=F64))
    chain = fnebm.chain.init(state, fr.key(0))
    with pytest.raises(ValueError, match="key=None"):
        fnebm.profile_sampling(alg, chain, fr.key(0), 2, compile=False)


def test_replay_plan():
    a, b = ("normal", ()), ("uniform", ())
    plan, scale = _replay_plan({a: 2, b: 2}, 2)  # once each per step: replayed as recorded
    assert sorted(plan) == [a, b] and scale == 1.0
    plan, scale = _replay_plan({a: 2, b: 5}, 2)  # 1 + 2.5 per step: 1 + 2 replayed, scaled to 3.5
    assert plan.count(b) == 2 and scale == pytest.approx(3.5 / 3)
    plan, scale = _replay_plan({a: 200, b: 2}, 2, cap=10)  # 101 per step: capped, then scaled back
    assert len(plan) <= 10 + 1 and b in plan and scale == pytest.approx(101 / len(plan))


def test_compiled_profile_keeps_to_its_own_cache():
    alg = fnebm.langevin(TARGET, 0.05)
    before = len(fnebm.chain.default_cache)
    p = fnebm.profile_sampling(alg, fr.normal(fr.key(12), (4, 3), F64), fr.key(13), 3, compile_backend="aot_eager",
                               repeats=1)
    check_structure(p, steps=3, chains=(4,))
    assert p.mode == "compiled (aot_eager)" and "compiled loops" in p.method
    assert p.compile_s is not None and 0 <= p.compile_s <= p.first_result_s
    assert p.energy_evals_per_step == 1
    assert len(fnebm.chain.default_cache) == before  # the user's runners are untouched


def test_page_faults_are_counted_and_named(mala_profile):
    n = mala_profile.page_faults_per_run
    assert isinstance(n, int) and n >= 0  # this platform counts them (Linux)
    assert f"page faults           {n:,} per warm run" in str(mala_profile)
    # the hint appears from 1,000 faults a run (4 MB of fresh pages), not below
    assert "reuse_freed_memory" in str(mala_profile._replace(page_faults_per_run=5000))
    assert "reuse_freed_memory" not in str(mala_profile._replace(page_faults_per_run=999))
    assert "page faults" not in str(mala_profile._replace(page_faults_per_run=None))


def _huge_pages_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(_huge_pages_always(), reason="transparent huge pages for every mapping: few faults to count")
def test_a_fresh_40_mb_trace_shows_its_page_faults():
    # 100,000 chains x 10 steps x 10 float32: a 40 MB trace, above glibc's largest adaptive mmap
    # threshold (32 MiB), so each warm run maps it afresh: about 9,800 pages. In a child process:
    # glibc serves even a block that large from free heap it already holds, and after hundreds of
    # tests this process may hold that much (a CI run once counted 0 faults here)
    code = (
        "import torch, fnebm\n"
        "from fnebm import energies as E, random as fr\n"
        "alg = fnebm.langevin(E.harmonic(torch.tensor(1.0)), 0.1)\n"
        "p = fnebm.profile_sampling(alg, fr.normal(fr.key(14), (100_000, 10)), fr.key(15), 10, compile=False,"
        " repeats=1)\n"
        "print(p.page_faults_per_run)\n"
        "print('hint' if 'fnebm.reuse_freed_memory()' in str(p) else 'no hint')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    faults, hint = done.stdout.strip().splitlines()[-2:]
    assert int(faults) >= 40 * 10**6 // 4096 // 2
    assert hint == "hint"
