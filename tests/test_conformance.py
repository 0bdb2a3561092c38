"""The conformance suite: the properties every fnebm sampler keeps. A new sampler adds one entry
to ``SAMPLERS`` and runs all of them.

Compiles use a counting ``aot_eager`` backend (Dynamo and AOTAutograd as with Inductor, no C++
code generation); test_chain.py runs Inductor itself.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, NamedTuple

import pytest
import torch
import torch.utils._pytree as pytree
from torch._dynamo.testing import CompileCounterWithBackend

import fnebm
from fnebm import energies as E
from fnebm import random as fr
from fnebm.samplers.base import over_batch

from conftest import walled

F64 = torch.float64
PREC = torch.tensor([[2.0, 0.3], [0.3, 1.0]], dtype=F64)
MEAN = torch.tensor([0.5, -0.3], dtype=F64)


class Entry(NamedTuple):
    """``make(energy, **tunables) -> SamplingAlgorithm``; ``tunables``: name -> a valid scalar;
    ``adjusted``: Metropolis-corrected (rejects non-finite proposals) or unadjusted (stays put)."""

    make: Callable[..., fnebm.SamplingAlgorithm]
    tunables: dict[str, float]
    adjusted: bool


SAMPLERS: dict[str, Entry] = {
    "mala": Entry(lambda e, step_size: fnebm.mala(e, step_size), {"step_size": 0.3}, True),
    "langevin": Entry(lambda e, step_size, noise_scale: fnebm.langevin(e, step_size, noise_scale),
                      {"step_size": 0.1, "noise_scale": 0.8}, False),
    "hmc": Entry(lambda e, step_size: fnebm.hmc(e, step_size, torch.tensor([1.0, 0.5], dtype=F64), 3),
                 {"step_size": 0.2}, True),
    # trajectory length as data (a while_loop under compile) and per-chain jitter
    "hmc_jittered": Entry(lambda e, step_size: fnebm.hmc(e, step_size, None, torch.tensor(4), step_size_jitter=0.3,
                                                         trajectory_jitter=True), {"step_size": 0.2}, True),
    # NUTS: a while_loop over leapfrog steps. Not "adjusted" in the MH sense: after a divergence
    # the proposal may be a valid earlier point of the trajectory (so neither is_accepted nor a
    # zero acceptance_rate on divergent transitions), but it never crosses into non-finite energy
    "nuts": Entry(lambda e, step_size: fnebm.nuts(e, step_size, torch.tensor([1.0, 0.5], dtype=F64), 4),
                  {"step_size": 0.3}, False),
}


def gaussian(mean=MEAN, prec=PREC):
    return E.Gaussian(mean, prec, torch.linalg.cholesky(prec))


def leaves(tree: Any) -> list[torch.Tensor]:
    return pytree.tree_leaves(tree)


def assert_same(a: Any, b: Any, tol: float = 1e-12) -> None:
    for x, y in zip(leaves(a), leaves(b), strict=True):
        assert x.shape == y.shape
        if x.is_floating_point():
            torch.testing.assert_close(x, y, rtol=tol, atol=tol)
        else:
            assert torch.equal(x, y)


@pytest.fixture(scope="module")
def counted():
    counter = CompileCounterWithBackend("aot_eager")
    return counter, fnebm.chain.RunnerCache(backend=counter)


samplers = pytest.mark.parametrize("name", list(SAMPLERS))


@samplers
@pytest.mark.parametrize("batch", [(5,), (2, 3)])
def test_batched_step_equals_vmap_equals_loop(name, batch):
    entry = SAMPLERS[name]
    alg = entry.make(gaussian(), **entry.tunables)
    n = math.prod(batch)
    x = fr.normal(fr.key(5), (n, 2), F64)
    keys = fr.split(fr.key(6), n)
    states = over_batch(alg.init, len(batch))(x.reshape(*batch, 2))
    direct = alg.step(states, keys.reshape(*batch, 2))
    mapped = over_batch(alg.step, len(batch))(states, keys.reshape(*batch, 2))
    assert_same(direct, mapped)
    for c in range(n):
        one = alg.step(alg.init(x[c]), keys[c])
        assert_same(one, pytree.tree_map(lambda t: t.reshape(n, *t.shape[len(batch):])[c], direct))


@samplers
def test_compiled_equals_eager_and_new_values_do_not_recompile(name, counted):
    counter, cache = counted
    entry = SAMPLERS[name]
    x0 = fr.normal(fr.key(0), (32, 2), F64)
    frames = None
    for i, scale in enumerate([1.0, 0.6, 1.3]):
        tunables = {k: v * scale for k, v in entry.tunables.items()}
        alg = entry.make(gaussian(MEAN * (i - 1), PREC * scale), **tunables)
        state = torch.func.vmap(alg.init)(x0)
        kw = dict(burn_in=3, thin=2, collect=lambda s: (s.position, s.energy), progress=False)
        got = fnebm.sample_chain(alg.step, state, fr.key(i), 8, cache=cache, **kw)
        want = fnebm.sample_chain(alg.step, state, fr.key(i), 8, compile=False, **kw)
        frames = counter.frame_count if frames is None else frames
        assert counter.frame_count == frames, f"new parameter values (sampler {i}) recompiled"
        assert_same(got, want, tol=1e-9)  # and the graph read the new values


@samplers
def test_traces_with_fullgraph_in_a_users_compiled_function(name, monkeypatch):
    entry = SAMPLERS[name]
    counter = CompileCounterWithBackend("aot_eager")

    def run(mean, tunables, x0, keys):
        alg = entry.make(gaussian(mean), **tunables)
        return fnebm.chain.run(alg.step, torch.func.vmap(alg.init)(x0), keys, 4)

    compiled = torch.compile(run, fullgraph=True, backend=counter)
    frames = None
    # Dynamo says each of its warnings once per process: start from none said, and let none name
    # fnebm's code (the constructors once met an lru_cache wrapper there: "Dynamo detected a call")
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            args = (MEAN * i, {k: torch.tensor(v * (1 + i), dtype=F64) for k, v in entry.tunables.items()},
                    fr.normal(fr.key(i), (8, 2), F64), fr.split(fr.key(9 + i), 8))
            assert_same(compiled(*args), run(*args), tol=1e-9)
            frames = counter.frame_count if frames is None else frames
            assert counter.frame_count == frames, "new argument values recompiled"
    # the chain is in a graph, not run eagerly: a scan whose body draws (fnebm.random's operators on
    # the CPU) and evaluates the energy
    targets = {str(n.target) for g in counter.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function"}
    assert any(t.split(".")[-1] == "scan" for t in targets), targets
    assert any(t.startswith("fnebm.") for t in targets), targets
    ours = [str(w.message) for w in caught if "fnebm" in str(w.message) or "/fnebm/" in w.filename]
    assert not ours, ours[0]


@samplers
def test_per_chain_tunables_equal_runs_with_each_value(name):
    entry = SAMPLERS[name]
    x0 = fr.normal(fr.key(1), (4, 2), F64)
    keys = fr.split(fr.key(2), 4)
    factors = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=F64)
    per_chain = entry.make(gaussian(), **{k: v * factors for k, v in entry.tunables.items()})
    _, trace, _ = fnebm.chain.run(per_chain.step, torch.func.vmap(per_chain.init)(x0), keys, 4)
    for c in range(4):
        one = entry.make(gaussian(), **{k: v * float(factors[c]) for k, v in entry.tunables.items()})
        _, single, _ = fnebm.chain.run(one.step, one.init(x0[c]), keys[c], 4)
        torch.testing.assert_close(trace[:, c], single, rtol=1e-12, atol=1e-12)


@samplers
def test_non_finite_proposals_are_flagged_and_never_taken(name):
    entry = SAMPLERS[name]
    alg = entry.make(walled, **{k: 5 * v for k, v in entry.tunables.items()})
    start = torch.func.vmap(alg.init)(torch.full((256, 2), 0.3))
    _, trace, info = fnebm.chain.run(alg.step, start, fr.split(fr.key(0), 256), 5)
    assert info.is_divergent.any()  # the wall was hit, so the checks below were exercised
    assert torch.isfinite(trace).all() and (trace[..., 0] < 0.5).all()
    if entry.adjusted:
        assert not (info.is_divergent & info.is_accepted).any()
        assert (info.acceptance_rate[info.is_divergent] == 0).all()


@samplers
def test_gradients_through_a_chain_match_finite_differences(name):
    entry = SAMPLERS[name]
    x0, keys = fr.normal(fr.key(3), (16, 2), F64), fr.split(fr.key(4), 16)
    names = list(entry.tunables)

    def loss(mean, *values):
        alg = entry.make(gaussian(mean), **dict(zip(names, values)))
        final, trace, _ = fnebm.chain.run(alg.step, torch.func.vmap(alg.init)(x0), keys, 6)
        return (trace**2).mean() + final.position.sum()

    args = (MEAN, *(torch.tensor(v, dtype=F64) for v in entry.tunables.values()))
    by_func = torch.func.grad(loss, argnums=tuple(range(len(args))))(*args)
    tracked = [a.clone().requires_grad_() for a in args]
    by_autograd = torch.autograd.grad(loss(*tracked), tracked)
    eps = 1e-6
    for i, a in enumerate(args):
        for j in range(a.numel()):
            bump = torch.zeros_like(a).reshape(-1)
            bump[j] = eps
            up = [*args[:i], a + bump.reshape(a.shape), *args[i + 1:]]
            down = [*args[:i], a - bump.reshape(a.shape), *args[i + 1:]]
            fd = (loss(*up) - loss(*down)) / (2 * eps)
            for grads in (by_func, by_autograd):
                torch.testing.assert_close(grads[i].reshape(-1)[j], fd, rtol=1e-5, atol=1e-6)
    assert by_func[1].abs() > 1e-3  # the step size matters: a zero gradient would be wrong


@samplers
@pytest.mark.parametrize("bad,exc,match", [
    (0.0, ValueError, "must be a finite number"),
    (-1.0, ValueError, "must be a finite number"),
    (math.nan, ValueError, "must be a finite number"),
    ("0.1", TypeError, "must be a real number or a floating tensor"),
    (torch.tensor([1, 2]), TypeError, "must be a real number or a floating tensor"),
])
def test_bad_tunables_raise_naming_the_argument(name, bad, exc, match):
    entry = SAMPLERS[name]
    for arg in entry.tunables:
        if arg == "noise_scale" and isinstance(bad, float) and bad == 0.0:
            continue  # noise_scale 0 is gradient descent, a valid choice
        with pytest.raises(exc, match=f"{arg} {match}"):
            entry.make(gaussian(), **{**entry.tunables, arg: bad})


@samplers
def test_per_chain_tunable_of_the_wrong_shape_is_refused(name):
    entry = SAMPLERS[name]
    arg = next(iter(entry.tunables))
    alg = entry.make(gaussian(), **{**entry.tunables, arg: torch.full((3,), entry.tunables[arg], dtype=F64)})
    state = torch.func.vmap(alg.init)(torch.zeros(4, 2, dtype=F64))
    with pytest.raises(ValueError, match=f"{arg} has shape \\(3,\\), which does not match the chain axes \\(4,\\)"):
        alg.step(state, fr.split(fr.key(0), 4))
