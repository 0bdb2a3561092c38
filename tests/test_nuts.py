"""NUTS: the target's moments, a textbook one-chain reference, batched == alone, BlackJAX's
tree sizes, divergences on Neal's funnel, and bad input. NUTS also runs the conformance suite
(tests/test_conformance.py).

Statistics use fixed keys and bounds from the Monte Carlo standard error (|z| < 4.5: a false
alarm about once in 150,000 per check). Eager runs: NUTS's loop runs as many iterations as the
longest trajectory, so the trees are kept shallow (max_tree_depth) where the target allows it.
"""

import math

import pytest
import torch

import fnebm
from fnebm import energies as E
from fnebm import random as fr
from fnebm.gradients import value_and_grad
from fnebm.integrators.metrics import Dense, Diagonal
from fnebm.samplers.nuts import NUTSInfo, NUTSState, build_kernel
from fnebm.samplers.nuts import init as nuts_init

F64 = torch.float64
Z = 4.5
MEAN = torch.tensor([1.0, -1.0], dtype=F64)
COV = torch.tensor([[1.0, 0.8], [0.8, 1.0]], dtype=F64)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # NUTS's eager loop is hundreds of small ops per leapfrog step: on a shared 2-core machine,
    # intra-op threads only add synchronisation (measured 30x slower under load). Results do not
    # depend on it; restored after this module.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cov5():
    q, _ = torch.linalg.qr(fr.normal(fr.key(50), (5, 5), F64))
    return q @ torch.diag(torch.tensor([0.2, 0.5, 1.0, 2.0, 4.0], dtype=F64)) @ q.T


COV5 = _cov5()
MEAN5 = torch.linspace(-1.0, 1.0, 5, dtype=F64)


def _exact(mean, cov, n, seed):
    return mean + fr.normal(fr.key(seed), (n, mean.shape[0]), F64) @ torch.linalg.cholesky(cov).mT


def _check_moments(x, mean, cov):
    n = x.shape[0]
    assert ((x.mean(0) - mean).abs() < Z * torch.sqrt(torch.diagonal(cov) / n)).all(), x.mean(0)
    se_cov = torch.sqrt((torch.outer(torch.diagonal(cov), torch.diagonal(cov)) + cov**2) / n)
    assert ((torch.cov(x.T) - cov).abs() < Z * se_cov).all(), torch.cov(x.T)


def _check_info(info, max_tree_depth):
    assert info.tree_depth.dtype == torch.int64 and info.num_integration_steps.dtype == torch.int64
    assert (info.tree_depth >= 1).all() and (info.tree_depth <= max_tree_depth).all()
    # the trajectory fills the last expansion's subtree at most
    assert ((2 ** (info.tree_depth - 1) <= info.num_integration_steps)
            & (info.num_integration_steps <= 2**info.tree_depth - 1)).all()
    assert ((info.acceptance_rate >= 0) & (info.acceptance_rate <= 1)).all()
    assert torch.isfinite(info.energy_error).all()


# ---------------------------------------------------------------- invariance of the target

# chains started at exact draws must stay distributed as the target; the final states of
# independent chains are independent draws. Step sizes near the leapfrog's stability limit
# (2 / sqrt(5) in the whitened 2-D case), where the multinomial weights matter.
@pytest.mark.parametrize("case", ["2d identity", "2d BlackJAX criterion", "5d dense per chain", "5d diagonal"])
def test_final_states_have_the_target_moments(case):
    n = 2048
    if case.startswith("2d"):
        mean, cov, h, imm = MEAN, COV, 0.8, None
    elif case == "5d dense per chain":
        mean, cov, h = MEAN5, COV5, 1.0
        imm = COV5 * torch.linspace(0.7, 1.3, n, dtype=F64)[:, None, None]
    else:
        mean, cov, h, imm = MEAN5, COV5, 0.4, torch.diagonal(COV5)
    target = E.gaussian(mean, cov)
    alg = fnebm.nuts(target, h, imm, 6)
    if case == "2d BlackJAX criterion":  # the plain criterion keeps the target too
        kernel = build_kernel(uturn_extra_checks=False)
        alg = alg._replace(step=lambda s, k: kernel(s, k, target, torch.tensor(h, dtype=F64),
                                                    torch.ones(2, dtype=F64), 6))
    state = torch.func.vmap(alg.init)(_exact(mean, cov, n, 7))
    chain, _, info = fnebm.sample_chain(alg.step, state, fr.key(8), 3, compile=False, progress=False)
    _check_moments(chain.state.position, mean, cov)
    _check_info(info, 6)
    assert not info.is_divergent.any()
    assert 0.5 < float(info.acceptance_rate.mean()) < 0.99  # the energy error is not negligible


def test_state_caches_energy_and_gradient():
    target = E.gaussian(MEAN, COV)
    alg = fnebm.nuts(target, 0.5)
    state, info = alg.step(alg.init(torch.zeros(2, dtype=F64)), fr.key(0))
    assert state.position.shape == (2,) and info.tree_depth.shape == ()
    torch.testing.assert_close(state.energy, target(state.position))
    torch.testing.assert_close(state.grad, target.grad(state.position))


def test_tiny_steps_stop_at_max_tree_depth():
    alg = fnebm.nuts(E.gaussian(MEAN, COV), 0.01, None, 3)
    state = torch.func.vmap(alg.init)(_exact(MEAN, COV, 16, 1))
    _, info = alg.step(state, fr.split(fr.key(2), 16))
    assert (info.tree_depth == 3).all() and (info.num_integration_steps == 7).all()
    assert not info.is_turning.any() and not info.is_divergent.any()
    assert (info.acceptance_rate > 0.999).all()


# ----------------------------------------------------------- a textbook one-chain reference

def _reference(energy, x0, key, h, inv, depth, extra=True, threshold=1000.0):
    """Iterative NUTS for one chain, written plainly: Python loops and lists of states, every
    balanced subtree checked by slicing the list (Stan's checks across halves with ``extra``),
    the same random stream as the kernel. Returns (position, tree_depth, steps, divergent,
    turning, acceptance_rate, energy_error)."""
    vg = value_and_grad(energy)
    keys = fr.split(key, 2)
    p0 = inv.rsqrt() * fr.normal(keys[0], x0.shape, x0.dtype)

    def draws(t):
        return fr.uniform(fr.fold_in(keys[1], t), (3,), x0.dtype)

    def point(x, p):
        u, g = vg(x)
        return dict(x=x, p=p, u=u, g=g, H=float(u + 0.5 * (p * inv * p).sum()))

    def leapfrog(s, eps):
        p = s["p"] - (0.5 * eps) * s["g"]
        x = s["x"] + eps * (inv * p)
        s = point(x, p)
        s["p"] = p - (0.5 * eps) * s["g"]
        s["H"] = float(s["u"] + 0.5 * (s["p"] * inv * s["p"]).sum())
        return s

    def turning(span):  # a contiguous span (either time direction): ends and momentum sum
        rho = sum(s["p"] for s in span) - 0.5 * (span[0]["p"] + span[-1]["p"])
        return bool((inv * span[0]["p"] @ rho <= 0) | (inv * span[-1]["p"] @ rho <= 0))

    def uturn(a, b):  # a and b adjacent, a's last point next to b's first
        return turning(a + b) or (extra and (turning(a + b[:1]) or turning(a[-1:] + b)))

    start = point(x0, p0)
    h0 = start["H"]
    traj, prop, weight = [start], start, 0.0
    steps, accept, divergent, turned = 0, 0.0, False, False
    for k in range(depth):
        forward = bool(draws(steps)[2] < 0.5)
        new = []
        for n in range(2**k):
            u = draws(steps)
            s = leapfrog(new[-1] if new else (traj[-1] if forward else traj[0]), h if forward else -h)
            steps += 1
            finite = math.isfinite(s["H"]) and bool(torch.isfinite(s["g"]).all() & torch.isfinite(s["x"]).all())
            delta = h0 - s["H"] if finite else -math.inf
            accept += math.exp(min(delta, 0.0))
            if not finite or -delta > threshold:
                divergent = True
                break
            if n == 0:
                sub, sub_weight = s, delta
            else:
                if float(u[0]) < 1.0 / (1.0 + math.exp(sub_weight - delta)):
                    sub = s
                sub_weight = float(torch.logaddexp(torch.tensor(sub_weight), torch.tensor(delta)))
            new.append(s)
            j = 1
            while (n + 1) % 2**j == 0:
                span = new[-(2**j):]
                turned = turned or uturn(span[: 2 ** (j - 1)], span[2 ** (j - 1):])
                j += 1
            if turned:
                break
        if divergent or turned:
            break
        if float(u[1]) < math.exp(min(sub_weight - weight, 0.0)):
            prop = sub
        weight = float(torch.logaddexp(torch.tensor(weight), torch.tensor(sub_weight)))
        if uturn(traj if forward else traj[::-1], new):
            turned = True
            break
        traj = traj + new if forward else new[::-1] + traj
    return prop["x"], k + 1, steps, divergent, turned, accept / steps, prop["H"] - h0


@pytest.mark.parametrize("extra", [True, False], ids=["stan_checks", "plain"])
def test_batched_kernel_equals_the_textbook_reference(extra):
    target = E.gaussian(MEAN, COV)
    inv = torch.tensor([0.7, 1.3], dtype=F64)
    n, depth = 48, 6
    h = torch.linspace(0.3, 1.1, n, dtype=F64)  # per chain, up to where the energy error is large
    x0 = _exact(MEAN, COV, n, 3)
    keys = fr.split(fr.key(4), n)
    state = torch.func.vmap(nuts_init, in_dims=(0, None))(x0, target)
    new, info = build_kernel(uturn_extra_checks=extra)(state, keys, target, h, inv, depth)
    for c in range(n):
        x, tree_depth, steps, divergent, turned, rate, error = _reference(target, x0[c], keys[c], float(h[c]), inv,
                                                                          depth, extra)
        torch.testing.assert_close(new.position[c], x, rtol=1e-12, atol=1e-12)
        assert (int(info.tree_depth[c]), int(info.num_integration_steps[c])) == (tree_depth, steps)
        assert (bool(info.is_divergent[c]), bool(info.is_turning[c])) == (divergent, turned)
        assert math.isclose(float(info.acceptance_rate[c]), rate, rel_tol=1e-12)
        assert math.isclose(float(info.energy_error[c]), error, rel_tol=1e-9, abs_tol=1e-12)
    assert info.tree_depth.unique().numel() >= 3 and info.is_turning.any() and not info.is_turning.all()


def test_stan_checks_only_stop_trees_earlier():
    # same keys: same momentum, directions and trajectory; the extra checks can only add stops
    target = E.gaussian(MEAN, COV)
    n = 512
    state = torch.func.vmap(nuts_init, in_dims=(0, None))(_exact(MEAN, COV, n, 5), target)
    keys, h, ones = fr.split(fr.key(6), n), torch.tensor(0.5, dtype=F64), torch.ones(2, dtype=F64)
    _, stan = build_kernel()(state, keys, target, h, ones, 6)
    _, plain = build_kernel(uturn_extra_checks=False)(state, keys, target, h, ones, 6)
    assert (stan.num_integration_steps <= plain.num_integration_steps).all()
    assert (stan.num_integration_steps < plain.num_integration_steps).any()


# ------------------------------------------------------------- batched == each chain alone

def _one_chain_each(make, state, keys):
    outs = [make(c).step(type(state)(*(f[c] for f in state)), keys[c]) for c in range(keys.shape[0])]
    return [torch.stack(xs) for xs in zip(*(list(s) + list(i) for s, i in outs))]


@pytest.mark.parametrize("form", ["diagonal", "dense", "identity"])
def test_per_chain_tunables_equal_each_chain_run_alone(form):
    target = E.gaussian(MEAN, COV)
    diag = torch.tensor([[0.5, 2.0], [1.0, 1.0], [2.0, 0.7], [1.0, 0.3]], dtype=F64)
    dense = torch.stack([COV, torch.eye(2, dtype=F64), torch.linalg.inv(COV), 2 * COV])
    imm = {"diagonal": Diagonal(diag), "dense": Dense(dense), "identity": None}[form]
    h = torch.tensor([0.2, 0.5, 0.9, 0.7], dtype=F64)
    alg = fnebm.nuts(target, h, imm, 5)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(1), (4, 2), F64))
    keys = fr.split(fr.key(2), 4)
    got = [*alg.step(state, keys)[0], *alg.step(state, keys)[1]]
    alone = {"diagonal": lambda c: diag[c], "dense": lambda c: dense[c], "identity": lambda c: None}[form]
    want = _one_chain_each(lambda c: fnebm.nuts(target, float(h[c]), alone(c), 5), state, keys)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_grid_of_chains_equals_a_flat_batch():
    alg = fnebm.nuts(E.gaussian(MEAN, COV), 0.6, None, 5)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(1), (6, 2), F64))
    keys = fr.split(fr.key(2), 6)
    flat = alg.step(state, keys)
    grid = alg.step(NUTSState(*(f.reshape(2, 3, *f.shape[1:]) for f in state)), keys.reshape(2, 3, 2))
    for a, b in zip([*flat[0], *flat[1]], [*grid[0], *grid[1]], strict=True):
        torch.testing.assert_close(a, b.reshape(a.shape), rtol=0, atol=0)


# ------------------------------------------------------------------- BlackJAX's tree sizes

def test_tree_sizes_match_blackjax():
    jax = pytest.importorskip("jax")
    blackjax = pytest.importorskip("blackjax")
    jnp = jax.numpy
    n, h = 2000, 0.5
    prec = torch.linalg.inv(COV)
    mean_j, prec_j = jnp.asarray(MEAN.numpy()), jnp.asarray(prec.numpy())

    def logdensity(x):
        d = x - mean_j
        return -0.5 * d @ prec_j @ d

    exact = _exact(MEAN, COV, n, 11)
    bj = blackjax.nuts(logdensity, h, jnp.ones(2), max_num_doublings=6)
    states = jax.vmap(bj.init)(jnp.asarray(exact.numpy(), dtype=jnp.float32))
    _, bj_info = jax.jit(jax.vmap(bj.step))(jax.random.split(jax.random.key(0), n), states)
    bj_steps = torch.from_numpy(bj_info.num_integration_steps.__array__().copy()).to(F64)
    bj_depth = torch.from_numpy(bj_info.num_trajectory_expansions.__array__().copy()).to(F64)

    target = E.gaussian(MEAN, COV)
    state = torch.func.vmap(nuts_init, in_dims=(0, None))(exact, target)
    _, info = build_kernel(uturn_extra_checks=False)(state, fr.split(fr.key(12), n), target,
                                                      torch.tensor(h, dtype=F64), torch.ones(2, dtype=F64), 6)
    # independent chains: two-sample z of the means
    for ours, theirs in ((info.num_integration_steps.to(F64), bj_steps), (info.tree_depth.to(F64), bj_depth)):
        se = math.sqrt(ours.var() / n + theirs.var() / n)
        assert abs(float(ours.mean() - theirs.mean())) < Z * se, (ours.mean(), theirs.mean())
    # the whole distribution of depths: each depth's frequency within its binomial error
    ours = torch.bincount(info.tree_depth, minlength=8)[:8].to(F64) / n
    theirs = torch.bincount(bj_depth.long(), minlength=8)[:8] / n
    pooled = (ours + theirs) / 2
    assert ((ours - theirs).abs() <= Z * torch.sqrt(2 * pooled * (1 - pooled) / n) + 1e-12).all(), (ours, theirs)
    acc = float(torch.from_numpy(bj_info.acceptance_rate.__array__().copy()).to(F64).mean())
    assert abs(float(info.acceptance_rate.mean()) - acc) < 0.02


# ------------------------------------------------------------ divergences on Neal's funnel

def funnel(z):
    """Neal's funnel in 1 + 5 dimensions: v ~ N(0, 3^2), x_i | v ~ N(0, e^v)."""
    v, x = z[0], z[1:]
    return v * v / 18.0 + 0.5 * torch.exp(-v) * (x * x).sum() + 0.5 * x.shape[0] * v


def test_funnel_neck_is_reported_as_divergent():
    n = 512
    v = 3.0 * fr.normal(fr.key(20), (n,), F64)  # exact draws: 88 chains below v = -3, 250 above 0
    z = torch.cat([v[:, None], torch.exp(v / 2)[:, None] * fr.normal(fr.key(21), (n, 5), F64)], 1)
    alg = fnebm.nuts(funnel, 0.5, None, 5)
    start = torch.func.vmap(alg.init)(z)
    new, info = alg.step(start, fr.split(fr.key(22), n))
    divergent = info.is_divergent
    # a step size that fits the mouth cannot follow the neck (curvature e^-v): there the chains
    # barely move, which would bias v upwards unnoticed; NUTS flags those transitions instead
    # (measured: 68% of the chains below v = -3, 0.4% of those above 0)
    assert divergent[v < -3].float().mean() > 0.4
    assert divergent[v > 0].float().mean() < 0.03
    assert float(v[divergent].median()) < -3
    assert torch.isfinite(new.position).all() and torch.isfinite(info.energy_error).all()
    assert ((info.acceptance_rate >= 0) & (info.acceptance_rate <= 1)).all()
    # the state is a valid point of the trajectory: its cached energy is the energy there
    torch.testing.assert_close(new.energy, torch.vmap(funnel)(new.position))
    # a smaller step size leaves fewer of them
    _, small = fnebm.nuts(funnel, 0.25, None, 5).step(start, fr.split(fr.key(22), n))
    assert small.is_divergent.sum() < divergent.sum() / 2


# -------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("call,exc,match", [
    (lambda e: fnebm.nuts(e, 0.1, None, 0), ValueError, "max_tree_depth must be >= 1"),
    (lambda e: fnebm.nuts(e, 0.1, None, 2.5), TypeError, "max_tree_depth must be an int"),
    (lambda e: fnebm.nuts(e, 0.1, None, True), TypeError, "max_tree_depth must be an int"),
    (lambda e: fnebm.nuts(e, 0.1, None, 31), ValueError, "max_tree_depth must be <= 30"),
    (lambda e: fnebm.nuts(e, 0.0), ValueError, "step_size must be a finite number > 0"),
    (lambda e: fnebm.nuts(e, "0.1"), TypeError, "step_size must be a real number"),
    (lambda e: fnebm.nuts(e, torch.tensor([0.1, -0.1], dtype=F64)), ValueError, "step_size must be a finite number > 0"),
    (lambda e: fnebm.nuts(e, 0.1, torch.tensor([1.0, -1.0], dtype=F64)), ValueError, "> 0 everywhere"),
    (lambda e: fnebm.nuts(e, 0.1, torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=F64)), ValueError, "positive definite"),
    (lambda e: fnebm.nuts(e, 0.1, [1.0, 1.0]), TypeError, "inverse_mass_matrix must be a floating tensor"),
    (lambda e: fnebm.nuts(e, 0.1, divergence_threshold=0), ValueError, "divergence_threshold must be > 0"),
    (lambda e: fnebm.nuts(e, 0.1, divergence_threshold="big"), TypeError, "divergence_threshold must be a real"),
    (lambda e: fnebm.nuts(e, 0.1, integrator=(0.5, 1.0)), ValueError, "palindrome"),
    (lambda e: fnebm.nuts("not an energy", 0.1), TypeError, "energy_fn must be callable"),
])
def test_bad_input_raises(call, exc, match):
    with pytest.raises(exc, match=match):
        call(E.gaussian(MEAN, COV))


def test_bad_input_at_the_step_is_refused():
    alg = fnebm.nuts(E.gaussian(MEAN, COV), 0.1, torch.ones(3, dtype=F64))
    state = torch.func.vmap(alg.init)(torch.zeros(4, 2, dtype=F64))
    with pytest.raises(ValueError, match="inverse_mass_matrix has shape"):
        alg.step(state, fr.split(fr.key(0), 4))
    alg = fnebm.nuts(E.gaussian(MEAN, COV), 0.1)
    with pytest.raises(ValueError, match="key has chain shape"):
        alg.step(state, fr.split(fr.key(0), 3))
    with pytest.raises(ValueError, match="step_size has shape"):
        fnebm.nuts(E.gaussian(MEAN, COV), torch.full((3,), 0.1, dtype=F64)).step(state, fr.split(fr.key(0), 4))


# ------------------------------------------------------------------ states, info, diagnostics

def test_state_and_info_save_and_load(tmp_path):
    alg = fnebm.nuts(E.gaussian(MEAN, COV), 0.5, None, 4)
    out = alg.step(torch.func.vmap(alg.init)(torch.zeros(3, 2, dtype=F64)), fr.split(fr.key(0), 3))
    torch.save(out, tmp_path / "nuts.pt")
    state, info = torch.load(tmp_path / "nuts.pt", weights_only=True)
    assert isinstance(state, NUTSState) and isinstance(info, NUTSInfo)
    for a, b in zip([*out[0], *out[1]], [*state, *info], strict=True):
        assert torch.equal(a, b)


def test_acceptance_summary_reads_the_nuts_fields():
    alg = fnebm.nuts(E.gaussian(MEAN, COV), 0.5, None, 5)
    state = torch.func.vmap(alg.init)(_exact(MEAN, COV, 8, 1))
    _, _, info = fnebm.sample_chain(alg.step, state, fr.key(3), 4, compile=False, progress=False)
    summary = fnebm.diagnostics.acceptance_summary(info)
    for key in ("mean_acceptance_rate", "n_divergent", "mean_tree_depth", "mean_num_integration_steps"):
        assert key in summary
    torch.testing.assert_close(summary["mean_tree_depth"], info.tree_depth.to(F64).mean())


# ---------------------------------------------------------------- the compiled loop under Inductor

def test_inductor_gets_its_cpp_wrapper_for_graphs_with_a_while_loop(monkeypatch):
    # the runner's backend hands Inductor cpp_wrapper=True for a CPU graph holding a while_loop
    # (NUTS: the Python wrapper's per-trip allocations were a fifth of a trip), and not otherwise
    import torch._inductor.compile_fx as cfx

    from fnebm._control import while_loop
    from fnebm.chain import runner

    seen = []

    def record(gm, example_inputs, config_patches=None):
        seen.append(dict(config_patches or {}))
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", record)

    def looped(x):
        return while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2.0), (torch.zeros((), dtype=torch.int64), x))[1]

    def plain(x):
        return x * 2.0

    # and, where OpenMP's threads sleep at barriers (fnebm's default policy), serial code for the
    # loop (a NUTS trip: 3x faster than parallel on an idle machine); spinning threads keep it parallel
    for policy in ("PASSIVE", "active", None):
        if policy is None:
            monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        else:
            monkeypatch.setenv("OMP_WAIT_POLICY", policy)
        for fn, looping in ((looped, True), (plain, False)):
            torch._dynamo.reset()
            out = torch.compile(fn, fullgraph=True, backend=runner.inductor_backend)(torch.ones(3))
            assert torch.equal(out, fn(torch.ones(3)))
            assert seen[-1].get("cpp_wrapper", False) is looping, seen[-1]
            assert seen[-1].get("cpp.threads") == (1 if looping and policy == "PASSIVE" else None), (policy, seen[-1])
            assert "unsafe_marked_cacheable_functions" in seen[-1]


@pytest.mark.compile
def test_nuts_compiled_by_inductor_equals_eager():
    # the real path: NUTS's while_loop compiled by Inductor (C++ wrapper on CPU) against the eager
    # loop, same keys; float64, so the compiled arithmetic may differ only in rounding
    target = E.gaussian(MEAN, COV)
    alg = fnebm.nuts(target, torch.tensor([0.6, 0.9, 1.2, 0.3], dtype=F64), max_tree_depth=5)
    state = torch.func.vmap(alg.init)(_exact(MEAN, COV, 4, 70))
    cache = fnebm.chain.RunnerCache()
    runs = [fnebm.sample_chain(alg.step, state, fr.key(71), 6, compile=c, progress=False, cache=cache)
            for c in (True, False)]
    (_, trace_c, info_c), (_, trace_e, info_e) = runs
    torch.testing.assert_close(trace_c, trace_e, rtol=1e-10, atol=1e-10)
    assert torch.equal(info_c.num_integration_steps, info_e.num_integration_steps)
    assert torch.equal(info_c.tree_depth, info_e.tree_depth)
    assert info_c.tree_depth.unique().numel() >= 2  # trees of several sizes: the masks matter
