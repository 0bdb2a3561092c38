"""The C NUTS kernel (fnebm/kernels/_cpu_nuts.c): the same transition as the torch kernel (its twin,
itself checked against a textbook reference in tests/test_nuts.py) from the same keys, for every
energy family, metric and integrator it covers; the dispatch of fnebm.nuts(backend=...); the op
under vmap and torch.compile; and, statistically, an ill-conditioned Gaussian recovered after
window adaptation run on it (fixed keys, bounds from the Monte Carlo standard error).
"""

import math

import pytest
import torch

import fnebm
from fnebm import diagnostics
from fnebm import energies as E
from fnebm import random as fr
from fnebm.integrators import mclachlan, yoshida
from fnebm.integrators.metrics import Dense, Diagonal
from fnebm.kernels import cpu_nuts

pytestmark = pytest.mark.skipif(cpu_nuts.available() is not None,
                                reason=f"the C NUTS kernel is unavailable here: {cpu_nuts.available()}")

F32 = torch.float32
FIELDS = ("position", "energy", "grad", "acceptance_rate", "is_divergent", "is_turning", "energy_error",
          "tree_depth", "num_integration_steps")


def _correlated(d: int, seed: int = 0, condition: float = 30.0) -> tuple[torch.Tensor, torch.Tensor]:
    q, _ = torch.linalg.qr(fr.normal(fr.key(seed), (d, d), torch.float64))
    cov = q @ torch.diag(torch.logspace(-math.log10(condition), 0, d, dtype=torch.float64)) @ q.T
    return torch.linspace(-1.0, 1.0, d, dtype=torch.float64), 0.5 * (cov + cov.T)


def _energies(d: int) -> dict[str, object]:
    mean, cov = _correlated(d)
    return {
        "gaussian full": E.gaussian(mean.float(), cov.float()),
        "gaussian diagonal": E.Gaussian(torch.linspace(-1, 1, d), torch.linspace(0.5, 2.0, d)),
        "double well": E.double_well(2.0, 1.0),
        "harmonic": E.harmonic(3.0),
        "rastrigin": E.rastrigin(),
    }


def _both(energy, x0, keys, h, imm=None, depth=8, **kw):
    """One transition by the C kernel and by the torch kernel: two lists of the nine fields."""
    out = []
    for backend in ("c", "torch"):
        alg = fnebm.nuts(energy, h, imm, depth, backend=backend, **kw)
        state = torch.func.vmap(alg.init)(x0)
        new, info = alg.step(state, keys)
        out.append([*new, *info])
    return out


EXACT = (4, 5, 7, 8)  # is_divergent, is_turning, tree_depth, num_integration_steps
CLOSE = (0, 1, 2, 3, 6)  # position, energy, grad, acceptance_rate, energy_error


def _assert_same(c, t, *, atol=1e-4, mismatches=0):
    """Positions and scalars to float tolerance; the tree's integers and flags equal, except for up
    to ``mismatches`` chains whose tree decision sat within rounding of its threshold."""
    for name, a, b in zip(FIELDS, c, t):
        assert a.dtype == b.dtype and a.shape == b.shape, name
    differ = torch.zeros(c[0].shape[:-1], dtype=torch.bool)
    for i in EXACT:
        differ |= c[i] != t[i]
    assert int(differ.sum()) <= mismatches, {FIELDS[i]: int((c[i] != t[i]).sum()) for i in EXACT}
    same = ~differ
    for i in CLOSE:
        torch.testing.assert_close(c[i][same], t[i][same], rtol=1e-4, atol=atol, msg=FIELDS[i])
    return differ


@pytest.mark.parametrize("family", ["gaussian full", "gaussian diagonal", "double well", "harmonic", "rastrigin"])
def test_each_family_takes_the_same_transition_as_the_torch_kernel(family):
    d, n = 6, 96
    energy = _energies(d)[family]
    x0 = fr.normal(fr.key(1), (n, d))
    # per chain, shallow to deep trees, some stopped by the depth limit rather than a U-turn; within
    # the leapfrog's stability (Rastrigin's curvature reaches 4 pi^2 a = 395, the double
    # well's 88 at |x| = 2): past it a trajectory is
    # chaotic and a last-bit difference grows until a U-turn falls on another step
    top = {"rastrigin": 0.06, "double well": 0.2}.get(family, 0.6)
    h = torch.linspace(top / 20, top, n)
    c, t = _both(energy, x0, fr.split(fr.key(2), n), h, depth=5)
    _assert_same(c, t)
    steps = c[8]
    assert steps.unique().numel() >= 4, steps.unique()  # trees of several sizes: the bookkeeping matters
    assert c[5].any() and not c[5].all()


@pytest.mark.parametrize("form", ["identity", "diagonal shared", "diagonal per chain", "dense shared",
                                  "dense per chain"])
def test_every_metric_form_takes_the_same_transition(form):
    d, n = 5, 64
    energy = _energies(d)["gaussian full"]
    _, cov = _correlated(d)
    cov = cov.float()
    scales = torch.linspace(0.6, 1.4, n)
    imm = {"identity": None,
           "diagonal shared": torch.diagonal(cov),
           "diagonal per chain": Diagonal(torch.diagonal(cov) * scales[:, None]),
           "dense shared": Dense(cov),
           "dense per chain": Dense(cov * scales[:, None, None])}[form]
    c, t = _both(energy, fr.normal(fr.key(3), (n, d)), fr.split(fr.key(4), n), 0.4, imm)
    _assert_same(c, t)


@pytest.mark.parametrize("integrator", [mclachlan, yoshida], ids=["mclachlan", "yoshida"])
def test_other_integrators_take_the_same_transition(integrator):
    energy = _energies(4)["gaussian full"]
    c, t = _both(energy, fr.normal(fr.key(5), (48, 4)), fr.split(fr.key(6), 48), 0.5, integrator=integrator)
    _assert_same(c, t)


def test_max_tree_depth_and_divergences_match():
    energy = _energies(4)["gaussian full"]
    x0 = fr.normal(fr.key(7), (32, 4))
    keys = fr.split(fr.key(8), 32)
    # tiny steps: every tree stops at max_tree_depth, 2^depth - 1 steps
    c, t = _both(energy, x0, keys, 0.001, depth=3)
    _assert_same(c, t)
    assert (c[7] == 3).all() and (c[8] == 7).all() and not c[5].any()
    # depth 1: one step
    c, t = _both(energy, x0, keys, 0.1, depth=1)
    _assert_same(c, t)
    assert (c[8] == 1).all()
    # steps far past stability: the energy error explodes; every flag as the torch kernel says
    c, t = _both(energy, x0, keys, torch.linspace(0.2, 4.0, 32), divergence_threshold=50.0)
    _assert_same(c, t, atol=1e-3)
    assert c[4].any() and not c[4].all()
    assert torch.isfinite(c[0]).all() and torch.isfinite(c[6]).all()


def test_a_grid_of_chains_equals_a_flat_batch_and_each_chain_alone():
    energy = _energies(3)["gaussian full"]
    alg = fnebm.nuts(energy, torch.linspace(0.2, 0.7, 6), None, 6, backend="c")
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(9), (6, 3)))
    keys = fr.split(fr.key(10), 6)
    flat = [*alg.step(state, keys)[0], *alg.step(state, keys)[1]]
    grid_alg = fnebm.nuts(energy, torch.linspace(0.2, 0.7, 6).reshape(2, 3), None, 6, backend="c")
    grid_state = type(state)(*(f.reshape(2, 3, *f.shape[1:]) for f in state))
    grid = grid_alg.step(grid_state, keys.reshape(2, 3, 2))
    for a, b in zip(flat, [*grid[0], *grid[1]], strict=True):
        assert torch.equal(a, b.reshape(a.shape))
    for i in range(6):
        one = fnebm.nuts(energy, torch.linspace(0.2, 0.7, 6)[i:i + 1], None, 6, backend="c")
        alone = one.step(type(state)(*(f[i:i + 1] for f in state)), keys[i:i + 1])
        for a, b in zip(flat, [*alone[0], *alone[1]], strict=True):
            assert torch.equal(a[i:i + 1], b)


def test_the_state_caches_the_energy_and_gradient_at_the_new_position():
    energy = _energies(5)["gaussian full"]
    alg = fnebm.nuts(energy, 0.3, backend="c")
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(11), (16, 5)))
    new, _ = alg.step(state, fr.split(fr.key(12), 16))
    torch.testing.assert_close(new.energy, energy(new.position))
    torch.testing.assert_close(new.grad, energy.grad(new.position))
    # no chains: nothing to do, shapes kept
    empty, info = alg.step(type(state)(*(f[:0] for f in state)), fr.split(fr.key(12), 16)[:0])
    assert empty.position.shape == (0, 5) and info.tree_depth.shape == (0,)


# --------------------------------------------------------------------------------- the dispatch


def _used_c(alg, state, keys) -> bool:
    """Whether ``alg.step`` ran the C kernel: the op shows in a profile."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        alg.step(state, keys)
    return any("cpu_nuts" in e.name for e in prof.events())


def test_auto_takes_the_c_kernel_where_it_applies_and_falls_back_elsewhere():
    energy = _energies(3)["harmonic"]
    x0 = fr.normal(fr.key(13), (8, 3))
    keys = fr.split(fr.key(14), 8)
    auto = fnebm.nuts(energy, 0.3)
    state = torch.func.vmap(auto.init)(x0)
    assert _used_c(auto, state, keys)
    assert not _used_c(fnebm.nuts(energy, 0.3, backend="torch"), state, keys)
    # float64, a plain function, a gradient through the step, inside vmap: the torch kernel runs
    auto64 = fnebm.nuts(energy.to(dtype=torch.float64), 0.3)
    assert not _used_c(auto64, torch.func.vmap(auto64.init)(x0.double()), keys)
    plain = fnebm.nuts(lambda x: 1.5 * (x * x).sum(), 0.3)
    assert _used_c(plain, state, keys)  # a plain function: the C kernel, evaluating it in torch
    h = torch.tensor(0.3, requires_grad=True)
    new, _ = fnebm.nuts(energy, h).step(state, keys)
    assert new.position.requires_grad  # the torch kernel: gradients flow to the step size
    got = torch.func.vmap(auto.step)(type(state)(*(f[:, None] for f in state)), keys[:, None])
    want = auto.step(state, keys)
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        torch.testing.assert_close(a.reshape(b.shape), b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case,match", [
    ("float64", "float32"),
    ("grad", "gradient flows"),
    ("vmap", "torch.func transform"),
    ("integrator", "coefficients"),
])
def test_backend_c_says_why_it_cannot_run(case, match):
    energy = (lambda x: (x * x).sum()) if case == "function" else _energies(3)["harmonic"]
    if case == "float64":
        energy = energy.to(dtype=torch.float64)
    h = torch.tensor(0.3, requires_grad=case == "grad")
    integrator = (0.1,) * 17 if case == "integrator" else fnebm.integrators.velocity_verlet
    alg = fnebm.nuts(energy, h, backend="c", integrator=integrator)
    x0 = fr.normal(fr.key(15), (4, 3), torch.float64 if case == "float64" else F32)
    state = torch.func.vmap(alg.init)(x0)
    keys = fr.split(fr.key(16), 4)
    with pytest.raises(ValueError, match=match):
        if case == "vmap":
            torch.func.vmap(alg.step)(state, keys)
        else:
            alg.step(state, keys)


def test_bad_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'c', 'torch'"):
        fnebm.nuts(E.harmonic(), 0.1, backend="triton")


def test_the_op_under_vmap_is_more_chains():
    energy = _energies(4)["gaussian full"]
    alg = fnebm.nuts(energy, 0.4, backend="c")
    x0 = fr.normal(fr.key(17), (3, 5, 4))
    state = torch.func.vmap(torch.func.vmap(alg.init))(x0)
    keys = fr.split(fr.key(18), 15).reshape(3, 5, 2)
    h = torch.tensor([0.2, 0.4, 0.6])
    imm = torch.linspace(0.5, 1.5, 4)
    fam, sc, vec = cpu_nuts.cpu_chain._params(energy, 4)
    coef = torch.tensor([0.5, 1.0, 0.5], dtype=torch.float64)

    def op(x, e, g, k, hh, m=imm):
        return torch.ops.fnebm.cpu_nuts(x, e, g, k, hh, m, m.rsqrt(), sc, vec, coef, fam, False, 8, 1000.0, True)

    flat_args = (state.position.reshape(15, 4), state.energy.reshape(15), state.grad.reshape(15, 4),
                 keys.reshape(15, 2), h.repeat_interleave(5))
    mapped = torch.func.vmap(op)(state.position, state.energy, state.grad, keys, h)
    flat = op(*flat_args)
    for a, b in zip(mapped, flat):
        assert torch.equal(a.reshape(b.shape), b)
    # a metric per mapped index (shared by that index's chains), and one per chain inside
    per_index = torch.stack([imm, 2 * imm, 0.5 * imm])
    mapped = torch.func.vmap(op)(state.position, state.energy, state.grad, keys, h, per_index)
    flat = op(*flat_args, per_index.repeat_interleave(5, 0))
    for a, b in zip(mapped, flat):
        assert torch.equal(a.reshape(b.shape), b)
    per_chain = imm * torch.linspace(0.5, 1.5, 15).reshape(3, 5, 1)
    mapped = torch.func.vmap(op)(state.position, state.energy, state.grad, keys, h, per_chain)
    flat = op(*flat_args, per_chain.reshape(15, 4))
    for a, b in zip(mapped, flat):
        assert torch.equal(a.reshape(b.shape), b)
    assert not torch.equal(mapped[0], op(*flat_args)[0].reshape(mapped[0].shape))  # the metric was read


def test_the_op_refuses_inconsistent_arguments():
    energy = _energies(3)["harmonic"]
    fam, sc, vec = cpu_nuts.cpu_chain._params(energy, 3)
    x, keys, coef = torch.zeros(4, 3), fr.split(fr.key(0), 4), torch.tensor([0.5, 1.0, 0.5], dtype=torch.float64)
    e, g, h, imm = torch.zeros(4), torch.zeros(4, 3), torch.tensor(0.1), torch.ones(3)
    ok = (x, e, g, keys, h, imm, imm, sc, vec, coef, fam, False, 4, 1000.0, True)
    torch.ops.fnebm.cpu_nuts(*ok)
    bad = {4: torch.full((2,), 0.1), 6: torch.ones(4, 3), 3: keys.to(torch.int32), 1: torch.zeros(4, 1)}
    for i, value in bad.items():
        args = list(ok)
        args[i] = value
        with pytest.raises(ValueError, match="inconsistent arguments"):
            torch.ops.fnebm.cpu_nuts(*args)


def test_keys_are_checked_before_the_c_kernel_reads_them():
    alg = fnebm.nuts(_energies(3)["harmonic"], 0.3, backend="c")
    state = torch.func.vmap(alg.init)(torch.zeros(4, 3))
    keys = fr.split(fr.key(0), 4)
    with pytest.raises(TypeError, match="int64"):
        alg.step(state, keys.to(torch.int32))
    with pytest.raises(ValueError, match="outside"):
        alg.step(state, keys + 2**32)


def test_the_plain_criterion_takes_the_same_transition():
    # the op with Stan's extra checks off against build_kernel(uturn_extra_checks=False)
    from fnebm.samplers.nuts import build_kernel

    energy = _energies(4)["gaussian full"]
    n = 128
    alg = fnebm.nuts(energy, 0.5, backend="torch")
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(25), (n, 4)))
    keys = fr.split(fr.key(26), n)
    imm = torch.ones(4)
    h = torch.tensor(0.15)
    c = cpu_nuts.nuts_step(energy, state.position, state.energy, state.grad, keys, h, imm, False, max_tree_depth=8,
                           coefficients=(0.5, 1.0, 0.5), divergence_threshold=1000.0, uturn_extra_checks=False)
    new, info = build_kernel(uturn_extra_checks=False)(state, keys, energy, h, imm, 8)
    _assert_same(c, [*new, *info])
    stan = cpu_nuts.nuts_step(energy, state.position, state.energy, state.grad, keys, h, imm, False, max_tree_depth=8,
                              coefficients=(0.5, 1.0, 0.5), divergence_threshold=1000.0)
    assert (stan[8] <= c[8]).all() and (stan[8] < c[8]).any()  # the extra checks only stop trees earlier


def test_a_start_with_an_infinite_energy_is_handled_as_the_torch_kernel_handles_it():
    # a double well at |x| = 1e10 overflows float32: H0 = inf; no trajectory point has a finite weight
    energy = _energies(3)["double well"]
    x0 = torch.tensor([[1e10, 0.0, 0.0], [0.5, 0.1, -0.2], [-1e10, 1.0, 1.0]])
    c, t = _both(energy, x0, fr.split(fr.key(27), 3), 0.1, depth=4)
    for name, a, b in zip(FIELDS, c, t):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, equal_nan=True, msg=name)


# ------------------------------------------------------------------------ compiled, and a warm-up


@pytest.mark.compile
def test_compiled_runs_equal_eager_and_new_step_sizes_do_not_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    energy = _energies(4)["gaussian full"]
    x0 = fr.normal(fr.key(19), (16, 4))
    counter = CompileCounterWithBackend("inductor")  # the real compiler, counted
    cache = fnebm.chain.RunnerCache(backend=counter)

    def run(h, compile):
        alg = fnebm.nuts(energy, h)
        state = torch.func.vmap(alg.init)(x0)
        return fnebm.sample_chain(alg.step, state, fr.key(20), 5, compile=compile, progress=False, cache=cache)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _, tc, ic = run(0.4, True)
    assert any("cpu_nuts" in e.name for e in prof.events())  # the op runs inside the compiled graph
    _, te, ie = run(0.4, False)
    assert torch.equal(tc, te) and torch.equal(ic.num_integration_steps, ie.num_integration_steps)
    before = counter.frame_count
    assert before >= 1
    (_, t2, _) = run(0.25, True)  # a new value of the same shape: the same graph
    assert counter.frame_count == before and not torch.equal(t2, tc)


def test_window_adaptation_on_the_c_kernel_recovers_an_ill_conditioned_gaussian():
    # condition number 100; NUTS with a dense metric adapted over 300 iterations, then 200 draws;
    # every mean and covariance entry within 4.5 MCSE of the truth, acceptance within 0.05 of 0.8
    d = 4
    mean, cov = _correlated(d, seed=21, condition=100.0)
    target = E.gaussian(mean.float(), cov.float())
    x0 = fr.normal(fr.key(22), (64, d))
    warm = fnebm.window_adaptation(fnebm.nuts, target, 300, is_mass_matrix_diagonal=False)
    result = warm.run(x0, fr.key(23), compile=False)
    alg = fnebm.nuts(target, **result.parameters)
    state = result.state
    assert _used_c(alg, state, fr.split(fr.key(0), 64))
    _, trace, info = fnebm.sample_chain(alg.step, state, fr.key(24), 200, compile=False, progress=False)
    trace = trace.double()
    i, j = torch.triu_indices(d, d)
    centred = trace - mean
    stats = torch.cat([trace, centred[..., i] * centred[..., j]], -1)
    truth = torch.cat([mean, cov[i, j]])
    z = (stats.mean((0, 1)) - truth) / diagnostics.mcse_mean(stats, layout="draws_chains")
    assert (z.abs() < 4.5).all(), z
    assert not info.is_divergent.any()
    assert abs(float(info.acceptance_rate.mean()) - 0.8) < 0.05, float(info.acceptance_rate.mean())
    # the metric learned the covariance: whitened condition near 1 (100 with the identity)
    eig = torch.linalg.eigvals(result.parameters["inverse_mass_matrix"].inverse_mass_matrix.double()
                               @ torch.linalg.inv(cov)).real
    assert float(eig.max() / eig.min()) < 1.5


def test_threads_do_not_change_the_draws():
    # each chain's transition is its own: any number of threads, any order, the same bits
    energy = _energies(5)["gaussian full"]
    alg = fnebm.nuts(energy, torch.linspace(0.1, 0.5, 40), backend="c")
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(28), (40, 5)))
    keys = fr.split(fr.key(29), 40)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            new, info = alg.step(state, keys)
            runs.append([*new, *info])
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


# ------------------------------------------------- energies the kernel evaluates in torch (yours)


def _function(energy):
    """The family ``energy`` written as a plain function: the C kernel calls back into torch for it."""
    return lambda x: energy(x)


@pytest.mark.parametrize("family", ["gaussian full", "double well", "rastrigin"])
def test_a_plain_function_takes_the_same_transition_as_the_torch_kernel(family):
    d, n = 6, 64
    energy = _function(_energies(d)[family])
    top = {"rastrigin": 0.06, "double well": 0.2}.get(family, 0.6)
    c, t = _both(energy, fr.normal(fr.key(31), (n, d)), fr.split(fr.key(32), n), torch.linspace(top / 20, top, n),
                 depth=5, compile_energy=False)
    _assert_same(c, t)
    assert c[8].unique().numel() >= 4  # trees of several sizes: chains finish at different evaluations


@pytest.mark.parametrize("case", ["dense per chain", "yoshida", "depth and divergences", "grid of chains"])
def test_a_plain_function_in_every_configuration(case):
    d, n = 5, 48
    energy = _energies(d)["gaussian full"]
    _, cov = _correlated(d)
    x0, keys = fr.normal(fr.key(33), (n, d)), fr.split(fr.key(34), n)
    h, kw = 0.4, {"compile_energy": False}
    if case == "dense per chain":
        kw["imm"] = Dense(cov.float() * torch.linspace(0.6, 1.4, n)[:, None, None])
    elif case == "yoshida":  # three evaluations per integrator step: the kernel resumes mid-step
        kw["integrator"] = yoshida
    elif case == "depth and divergences":
        h, kw["divergence_threshold"], kw["depth"] = torch.logspace(-2, 0.6, n), 50.0, 4
    elif case == "grid of chains":  # two chain axes: the evaluation gets (6, 8, d) positions
        x0, keys = x0.reshape(6, 8, d), keys.reshape(6, 8, 2)
    if case == "grid of chains":
        out = []
        for backend in ("c", "torch"):
            alg = fnebm.nuts(_function(energy), h, backend=backend, compile_energy=False)
            state = torch.func.vmap(torch.func.vmap(alg.init))(x0)
            out.append([f.reshape((n,) + f.shape[2:]) for f in (*alg.step(state, keys)[0], *alg.step(state, keys)[1])])
        c, t = out
    else:
        c, t = _both(_function(energy), x0, keys, h, **kw)
    _assert_same(c, t, atol=1e-3)
    if case == "depth and divergences":
        assert c[4].any() and not c[4].all() and (c[7] == 4).any()


def test_an_evaluation_of_the_wrong_shape_is_refused():
    energy = _energies(3)["harmonic"]
    alg = fnebm.nuts(energy, 0.3)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(35), (4, 3)))
    with pytest.raises(ValueError, match=r"must give energies \(4,\) and gradients \(4, 3\), got \(4,\) and \(4, 2\)"):
        cpu_nuts.nuts_step(lambda x: energy(x), state.position, state.energy, state.grad, fr.split(fr.key(36), 4),
                           torch.tensor(0.3), torch.ones(3), False, max_tree_depth=4, coefficients=(0.5, 1.0, 0.5),
                           divergence_threshold=1000.0, evaluate=lambda x: (x.sum(-1), x[..., :2]))


def test_under_torch_compile_a_plain_function_takes_the_torch_kernel(monkeypatch):
    energy = _energies(3)["harmonic"]
    alg = fnebm.nuts(energy, 0.3)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(35), (4, 3)))
    args = (state.position, state.energy, state.grad, fr.split(fr.key(36), 4), torch.tensor(0.3), torch.ones(3),
            False, (0.5, 1.0, 0.5))
    assert cpu_nuts.why_not(lambda x: energy(x), *args, evaluated=True) is None
    assert "not one the C NUTS kernel computes" in cpu_nuts.why_not(lambda x: energy(x), *args)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert "torch.compile is tracing the step" in cpu_nuts.why_not(lambda x: energy(x), *args, evaluated=True)
    assert cpu_nuts.why_not(energy, *args, evaluated=True) is None  # a family: one op in the graph


def test_a_first_nuts_init_on_cpu_float32_starts_building_the_kernel_on_a_thread(monkeypatch):
    # the library builds while the run's other first work does (the draws' own C library): once per
    # process, where it is not on disk, and only for positions the kernel runs on
    import threading

    from fnebm.kernels import cpu_nuts as cn

    class Library:
        def __init__(self, on_disk):
            self.on_disk, self.loads, self.done = on_disk, [], threading.Event()

        def built(self):
            return self.on_disk

        def load(self):
            self.loads.append(threading.current_thread().name)
            self.done.set()

    energy = lambda x: 0.5 * (x * x).sum()  # noqa: E731
    for on_disk, dtype, loads in ((False, torch.float64, []), (True, torch.float32, []),
                                  (False, torch.float32, ["fnebm-build-nuts"])):
        lib = Library(on_disk)
        monkeypatch.setattr(cn, "LIBRARY", lib)
        monkeypatch.setattr(cn, "_prefetched", False)
        alg = fnebm.nuts(energy, 0.1)
        torch.func.vmap(alg.init)(torch.zeros(3, 2, dtype=dtype))
        if loads:
            assert lib.done.wait(10)
        assert lib.loads == loads, (on_disk, dtype)
    torch.func.vmap(alg.init)(torch.zeros(3, 2))  # once per process
    assert lib.loads == ["fnebm-build-nuts"]
