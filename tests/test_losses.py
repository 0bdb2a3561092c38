"""Training losses: what each computes, what flows where, and that training recovers known answers.

Recovery tests fit a Gaussian energy (``mean`` and the precision's factor ``L``, ``P = L Lᵀ``)
to N = 2,048 points from a correlated 2-D Gaussian, in float64, with a small functional Adam,
and compare with the known minimiser on that sample: the sample mean and covariance ``S``
(the maximum-likelihood estimate, which CD and PCD with an exact sampler (MALA) and exact and
sliced score matching all target), or ``S + σ² I`` for denoising score matching. The tolerance
is in units of the data's own standard errors, SE(mean_j) = sqrt(S_jj / N) and SE(S_jk) =
sqrt((S_jj S_kk + S_jk²) / N): training may add at most ``TOL_SE`` = 2 of them, i.e. less error
than twice what the data carry anyway. Measured over five training seeds, the largest error
of each loss, in SEs: CD 1.2, PCD 0.6, PCD with replay buffer 1.0, DSM 0.4 (one level) and 0.8
(two), SSM 0.9 (Rademacher) and 0.7 (Gaussian, variance-reduced). A loss that converges to
anything else — a missing factor, the wrong noise level, a gradient through the sampler,
chains that lag the model — misses by several SEs (PCD with one MALA step of 0.3 per
iteration, whose chains lag, misses the mean by 9). Keys are fixed: the tests are
deterministic.
"""

import functools
import io
import math

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils import _pytree as pytree

import fnebm
from fnebm import energies as E
from fnebm import losses as L
from fnebm import random as fr

F64 = torch.float64
MU = torch.tensor([1.0, -0.5], dtype=F64)
COV = torch.tensor([[1.0, 0.6], [0.6, 2.0]], dtype=F64)
N = 2048
TOL_SE = 2.0


@pytest.fixture(scope="module")
def data():
    return MU + fr.normal(fr.key(2024), (N, 2), F64) @ torch.linalg.cholesky(COV).T


def model(mean=(0.0, 0.0), tril=None, dtype=F64):
    """A Gaussian energy to train: ``__call__`` reads ``mean`` and ``precision_tril``."""
    tril = torch.eye(2, dtype=dtype) if tril is None else tril
    return E.Gaussian(torch.as_tensor(mean, dtype=dtype), tril @ tril.T, tril)


def adam_init(params):
    zeros = pytree.tree_map(torch.zeros_like, params)
    return zeros, zeros, 0


def adam(params, grads, state, lr, b1=0.9, b2=0.99, eps=1e-8):
    m, v, t = state
    t += 1
    m = pytree.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = pytree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    params = pytree.tree_map(
        lambda p, m, v: p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps), params, m, v
    )
    return params, (m, v, t)


def fit(loss, batch, seed, iters, lr=0.1, state=None):
    """Adam (lr, then lr/10 from 40%), Polyak-averaged over the last 40%: (mean, covariance = P⁻¹)."""
    energy = model()
    opt = adam_init(energy)
    start, avg = int(0.6 * iters), None
    grad = torch.func.grad(loss, has_aux=True)
    for i in range(iters):
        key = fr.fold_in(fr.key(seed), i)
        if state is None:
            g, aux = grad(energy, batch, key)
        else:
            g, aux = grad(energy, batch, key, state)
            state = aux.state
        energy, opt = adam(energy, g, opt, lr if i < int(0.4 * iters) else lr / 10)
        if i >= start:
            leaves = (energy.mean, energy.precision_tril)
            avg = leaves if avg is None else tuple(a + (x - a) / (i - start + 1) for a, x in zip(avg, leaves))
    mean, tril = avg
    return mean, torch.linalg.inv(tril @ tril.T)


def assert_recovers(fitted, data, cov_shift=0.0):
    mean, cov = fitted
    S = torch.cov(data.T, correction=0)
    se_mean = (S.diagonal() / N).sqrt()
    se_cov = ((S.diagonal().outer(S.diagonal()) + S * S) / N).sqrt()
    err_mean = ((mean - data.mean(0)).abs() / se_mean).max()
    err_cov = ((cov - S - cov_shift * torch.eye(2, dtype=F64)).abs() / se_cov).max()
    assert err_mean < TOL_SE and err_cov < TOL_SE, (err_mean, err_cov, mean, cov)


# -------------------------------------------------------------------- recovery by training


def test_cd_recovers_mean_and_covariance(data):
    loss = functools.partial(L.contrastive_divergence, sampler=lambda e: fnebm.mala(e, 0.3), n_steps=1)
    assert_recovers(fit(loss, data, seed=1, iters=100), data)


def test_pcd_recovers_mean_and_covariance(data):
    # classic persistent chains (no buffer, no restarts), 1,024 of them started from N(0, I)
    loss = functools.partial(L.persistent_contrastive_divergence, sampler=lambda e: fnebm.mala(e, 0.6), n_steps=3,
                             reinit_prob=0.0)
    state = L.pcd_init(fr.normal(fr.key(7), (1024, 2), F64))
    assert_recovers(fit(loss, data, seed=2, iters=100, state=state), data)


def test_pcd_with_replay_buffer_recovers_mean_and_covariance(data):
    # Du & Mordatch: chains start from a buffer of 4 x 1,024 past negatives, 5% from N(0, I) noise
    loss = functools.partial(L.persistent_contrastive_divergence, sampler=lambda e: fnebm.mala(e, 0.6), n_steps=5,
                             reinit_prob=0.05)
    state = L.pcd_init(fr.normal(fr.key(8), (1024, 2), F64), buffer_size=4096)
    assert_recovers(fit(loss, data, seed=3, iters=100, state=state), data)


@pytest.mark.parametrize("sigma,shift,iters", [(0.5, 0.25, 100),
                                               (torch.tensor([0.5, 1.0], dtype=F64), (0.5**4 + 1) / 1.25, 150)],
                         ids=["one-level", "two-levels"])
def test_denoising_score_matching_recovers_the_smoothed_gaussian(data, sigma, shift, iters):
    # the minimiser is the data convolved with the noise: S + sigma^2 I (sigma-bar^2 = sum sigma^4 / sum sigma^2
    # for levels drawn uniformly); four noise draws per point (the batch repeated) to average the noise
    loss = functools.partial(L.denoising_score_matching, sigma=sigma)
    assert_recovers(fit(loss, data.repeat(4, 1), seed=4, iters=iters), data, cov_shift=shift)


@pytest.mark.parametrize("kw", [dict(n_projections=4), dict(projection="gaussian", variance_reduction=True)],
                         ids=["rademacher", "gaussian-vr"])
def test_sliced_score_matching_recovers_mean_and_covariance(data, kw):
    assert_recovers(fit(functools.partial(L.sliced_score_matching, **kw), data, seed=5, iters=100), data)


# --------------------------------------------------------------------- exact score matching


def test_exact_score_matching_is_hyvarinens_objective_and_stationary_at_the_sample_moments(data):
    # for a Gaussian energy: ½ tr(P² C) - tr P with C the second moment about the model mean
    energy = model((0.3, -0.2), torch.tensor([[1.2, 0.0], [0.4, 0.9]], dtype=F64))
    loss, aux = L.exact_score_matching(energy, data)
    d = data - energy.mean
    P = energy.precision_tril @ energy.precision_tril.T
    expected = 0.5 * torch.trace(P @ P @ (d.T @ d / N)) - torch.trace(P)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    assert aux.per_sample.shape == (N,)
    # the minimiser on the sample is (mean, S⁻¹): the gradient vanishes there
    S = torch.cov(data.T, correction=0)
    best = model(data.mean(0), torch.linalg.cholesky(torch.linalg.inv(S)))
    g, _ = torch.func.grad(L.exact_score_matching, has_aux=True)(best, data)
    assert g.mean.abs().max() < 1e-12 and g.precision_tril.abs().max() < 1e-12


def _mlp_energy(seed=0):
    torch.manual_seed(seed)  # the test's own weights; the library never touches the global RNG
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    energy_fn, params = E.from_module(net)
    return E.bind(energy_fn, params)


def test_exact_score_matching_gradient_matches_finite_differences():
    energy = _mlp_energy()
    x = fr.normal(fr.key(11), (32, 3), F64)
    g, _ = torch.func.grad(L.exact_score_matching, has_aux=True)(energy, x)
    leaves, spec = pytree.tree_flatten(energy)
    grads = pytree.tree_leaves(g)
    h = 1e-6
    for i, (leaf, gl) in enumerate(zip(leaves, grads)):
        for j in (0, leaf.numel() // 2, leaf.numel() - 1):
            def value(delta):
                bumped = leaf.clone().reshape(-1)
                bumped[j] += delta
                new = list(leaves)
                new[i] = bumped.reshape(leaf.shape)
                return L.exact_score_matching(pytree.tree_unflatten(new, spec), x)[0]
            fd = (value(h) - value(-h)) / (2 * h)
            torch.testing.assert_close(gl.reshape(-1)[j], fd, rtol=1e-6, atol=1e-8)


def test_sliced_averages_to_exact():
    # E_v[-vᵀHv + ½(vᵀg)²] = -tr H + ½|g|² for Rademacher and Gaussian v: with 4,096 projections the
    # Monte Carlo error of the mean is below 0.05 for this network (std of one term ≈ 1.5)
    energy = _mlp_energy(1)
    x = fr.normal(fr.key(12), (8, 3), F64)
    exact = L.exact_score_matching(energy, x)[1].per_sample
    for projection in ("rademacher", "gaussian"):
        sliced = L.sliced_score_matching(energy, x, fr.key(13), n_projections=4096, projection=projection)[1].per_sample
        assert (sliced - exact).abs().max() < 0.15, projection
        vr = L.sliced_score_matching(energy, x, fr.key(13), n_projections=4096, projection=projection,
                                     variance_reduction=True)[1].per_sample
        assert (vr - exact).abs().max() < 0.15, projection


def test_denoising_loss_by_hand():
    energy = model((0.3, -0.2), torch.tensor([[1.2, 0.0], [0.4, 0.9]], dtype=F64))
    x = fr.normal(fr.key(14), (16, 2), F64)
    loss, aux = L.denoising_score_matching(energy, x, fr.key(15), sigma=0.4)
    eps = fr.normal(fr.split(fr.key(15))[1], (16, 2), F64)
    P = energy.precision_tril @ energy.precision_tril.T
    r = eps - 0.4 * (x + 0.4 * eps - energy.mean) @ P
    torch.testing.assert_close(aux.per_sample, 0.5 * (r * r).sum(1))
    torch.testing.assert_close(loss, aux.per_sample.mean())
    assert torch.equal(aux.sigma, torch.full((16,), 0.4, dtype=F64))
    levels = torch.tensor([0.1, 0.5, 2.0], dtype=F64)
    _, aux = L.denoising_score_matching(energy, fr.normal(fr.key(16), (3000, 2), F64), fr.key(17), sigma=levels)
    counts = torch.stack([(aux.sigma == s).sum() for s in levels])
    assert counts.sum() == 3000 and ((counts - 1000).abs() < 5 * math.sqrt(3000 * 2 / 9)).all()


# ------------------------------------------------------------------------------------- CD


def test_cd_gradient_is_the_energy_difference_with_negatives_held_fixed():
    energy = _mlp_energy(2)
    x = fr.normal(fr.key(20), (64, 3), F64)
    kw = dict(sampler=lambda e: fnebm.langevin(e, 0.05), n_steps=3, alpha=0.1)
    g, aux = torch.func.grad(L.contrastive_divergence, has_aux=True)(energy, x, fr.key(21), **kw)

    def by_hand(e):
        ep, en = torch.func.vmap(lambda y: e(y))(x), torch.func.vmap(lambda y: e(y))(aux.negatives)
        return ep.mean() - en.mean() + 0.1 * ((ep**2).mean() + (en**2).mean())

    for a, b in zip(pytree.tree_leaves(g), pytree.tree_leaves(torch.func.grad(by_hand)(energy))):
        torch.testing.assert_close(a, b)
    # the same with torch.autograd
    params = {k: v.clone().requires_grad_() for k, v in energy.params.items()}
    loss, _ = L.contrastive_divergence(E.bind(energy.energy_fn, params), x, fr.key(21), **kw)
    loss.backward()
    for k in params:
        torch.testing.assert_close(params[k].grad, g.params[k])
    # asked for, the gradient also flows through the chain: a different gradient, same loss value
    g2, aux2 = torch.func.grad(L.contrastive_divergence, has_aux=True)(energy, x, fr.key(21),
                                                                       grad_through_sampler=True, **kw)
    # the same chain to the last bit or so: differentiated through, the energy's batched gradient is
    # torch.func's vjp rather than autograd.grad (one ulp apart in float64, measured)
    torch.testing.assert_close(aux2.negatives, aux.negatives, rtol=0, atol=1e-14)
    assert max((a - b).abs().max() for a, b in zip(pytree.tree_leaves(g), pytree.tree_leaves(g2))) > 1e-3


def test_cd_loss_value_inits_and_determinism():
    energy = model((0.3, -0.2))
    x = fr.normal(fr.key(22), (32, 2), F64)
    loss, aux = L.contrastive_divergence(energy, x, fr.key(23), n_steps=2, alpha=0.5)
    ep, en = aux.positive_energy, aux.negative_energy
    torch.testing.assert_close(loss, ep.mean() - en.mean() + 0.5 * ((ep**2).mean() + (en**2).mean()))
    assert aux.negatives.shape == (32, 2) and aux.info.is_divergent.shape == (2, 32)
    again = L.contrastive_divergence(energy, x, fr.key(23), n_steps=2, alpha=0.5)
    assert torch.equal(again[0], loss) and torch.equal(again[1].negatives, aux.negatives)
    assert not torch.equal(L.contrastive_divergence(energy, x, fr.key(24), n_steps=2)[1].negatives, aux.negatives)
    # init: data (default), noise from the given function, or given points (any number of chains)
    descent = lambda e: fnebm.langevin(e, 1e-9, 0.0)   # (almost) no move: shows where chains start
    _, a = L.contrastive_divergence(energy, x, fr.key(25), sampler=descent, n_steps=1)
    torch.testing.assert_close(a.negatives, x)
    noise = functools.partial(fr.uniform, minval=10.0, maxval=11.0)
    _, a = L.contrastive_divergence(energy, x, fr.key(25), sampler=descent, n_steps=1, init="noise", noise=noise)
    assert a.negatives.shape == (32, 2) and (a.negatives >= 10).all() and (a.negatives < 11).all()
    start = torch.full((5, 2), 3.0, dtype=F64)
    _, a = L.contrastive_divergence(energy, x, fr.key(25), sampler=descent, n_steps=1, init=start)
    torch.testing.assert_close(a.negatives, start)
    # any sampler: HMC
    hmc = functools.partial(fnebm.hmc, step_size=0.2, num_integration_steps=3)
    _, a = L.contrastive_divergence(energy, x, fr.key(25), sampler=hmc, n_steps=2)
    assert a.info.acceptance_rate.shape == (2, 32)


def _reference_cd(energy, batch, key, sampler, n_steps, alpha):
    """CD-k written out the long way: the chains from a detached copy of the energy, then both
    batches' energies evaluated afresh (the positives' forward pass twice with init="data")."""
    frozen = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, energy)
    alg = sampler(frozen)
    state = torch.func.vmap(alg.init)(batch.detach())
    final, _, _ = fnebm.chain.run(alg.step, state, fr.split(fr.split(key)[1], batch.shape[0]), n_steps)
    ep = torch.func.vmap(lambda y: energy(y))(batch)
    en = torch.func.vmap(lambda y: energy(y))(final.position.detach())
    return ep.mean() - en.mean() + alpha * ((ep**2).mean() + (en**2).mean())


def test_cd_from_the_data_equals_the_reference_to_the_bit():
    # With init="data" the positives' energy is read off the chains' initial state (evaluated under
    # the live parameters) instead of a second forward pass: the same loss and parameter gradient,
    # to the bit, under torch.func.grad and torch.autograd, for any fnebm sampler. ~1 s eager.
    energy = _mlp_energy(3)
    x = fr.normal(fr.key(26), (32, 3), F64)
    samplers = {"langevin": lambda e: fnebm.langevin(e, 0.05, 0.5), "mala": lambda e: fnebm.mala(e, 0.1),
                "hmc": functools.partial(fnebm.hmc, step_size=0.1, num_integration_steps=2)}
    for name, sampler in samplers.items():
        for alpha in (0.0, 0.1):
            kw = dict(sampler=sampler, n_steps=3, alpha=alpha)
            g, (loss, aux) = torch.func.grad_and_value(L.contrastive_divergence, has_aux=True)(energy, x, fr.key(27), **kw)
            ref_g, ref = torch.func.grad_and_value(_reference_cd)(energy, x, fr.key(27), sampler, 3, alpha)
            assert torch.equal(loss, ref), name
            assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(g), pytree.tree_leaves(ref_g))), name
            assert torch.equal(aux.positive_energy, torch.func.vmap(lambda y: energy(y))(x))
    params = {k: v.clone().requires_grad_() for k, v in energy.params.items()}
    bound = E.bind(energy.energy_fn, params)
    loss, _ = L.contrastive_divergence(bound, x, fr.key(27), sampler=samplers["langevin"], n_steps=3)
    ref = _reference_cd(bound, x, fr.key(27), samplers["langevin"], 3, 0.0)
    assert torch.equal(loss.detach(), ref.detach())
    grads = torch.autograd.grad(loss, list(params.values()))
    ref_grads = torch.autograd.grad(ref, list(params.values()))
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def _taking_grad(y):
    """Whether dE/dy is being taken: by torch.func (a grad-tracking y) or, eagerly, by
    torch.autograd.grad (under vmap, a y whose batch requires grad)."""
    if torch._C._functorch.is_gradtrackingtensor(y):
        return True
    while torch._C._functorch.is_batchedtensor(y):
        y = torch._C._functorch.get_unwrapped(y)
    return y.requires_grad and not torch._C._functorch.is_functorch_wrapped_tensor(y)


def test_cd_evaluates_the_positives_once():
    # A counting energy: `traced` says whether dE/dx is being taken (the sampler's evaluations) or
    # only E (the loss's). With init="data" the loss evaluates E(x⁻) alone: E(x⁺) comes from the
    # sampler's init; with noise it evaluates both. The sampler's own share (init, k steps) is
    # counted on the sampler directly, so a change there does not break this test. ~0.3 s eager.
    calls = []
    net = _mlp_energy(4)

    def counting(params, y):
        calls.append(_taking_grad(y))
        return net.energy_fn(params, y)

    energy = E.bind(counting, net.params)
    x = fr.normal(fr.key(28), (16, 3), F64)
    sampler = lambda e: fnebm.langevin(e, 0.05, 0.5)  # noqa: E731
    alg = sampler(energy)
    state = torch.func.vmap(alg.init)(x)
    init_calls = list(calls)
    calls.clear()
    alg.step(state, fr.split(fr.key(29), 16))
    step_calls = list(calls)
    assert step_calls == [True]          # one evaluation of E and dE/dx per Langevin step
    k = 4
    for init, loss_forwards in (("data", 1), ("noise", 2)):
        calls.clear()
        torch.func.grad(L.contrastive_divergence, has_aux=True)(energy, x, fr.key(30), sampler=sampler,
                                                               n_steps=k, init=init)
        assert calls.count(True) == init_calls.count(True) + k * step_calls.count(True), init
        assert calls.count(False) == init_calls.count(False) + loss_forwards, init


@pytest.mark.compile
def test_cd_evaluates_the_positives_once_under_compile():
    # Inside torch.compile a sampler's step is a plain partial (Step.of), so the loss asks its
    # kernel whether the state caches E (samplers.base.caches_energy_of). Dynamo runs the
    # energy's Python once per traced call site: init, k unrolled steps, the loss's E(x⁻) (and,
    # for a sampler that does not say so, E(x⁺)). backend="eager": tracing only, a few seconds.
    from fnebm.samplers import base

    net = _mlp_energy(4)
    sites = []

    def counting(params, y):
        sites.append(1)  # a side effect Dynamo replays once per traced call
        return net.energy_fn(params, y)

    energy = E.bind(counting, net.params)
    x = fr.normal(fr.key(28), (16, 3), F64)
    k = 2

    def opaque(e):  # Langevin behind a step Step.of does not make: the loss cannot trust its state
        alg = fnebm.langevin(e, 0.05, 0.5)
        return fnebm.SamplingAlgorithm(alg.init, functools.partial(lambda s, key: alg.step(s, key)))

    for sampler, loss_forwards in ((lambda e: fnebm.langevin(e, 0.05, 0.5), 1),
                                   (lambda e: fnebm.mala(e, 0.05), 1), (opaque, 2)):
        sites.clear()
        alg = sampler(energy)
        state = torch.func.vmap(alg.init)(x)
        init_sites = len(sites)  # the init's checks call the energy too (a dead value under compile)
        alg.step(state, fr.split(fr.key(29), 16))
        step_sites = len(sites) - init_sites

        def grad_cd(energy, x, key):
            return torch.func.grad(L.contrastive_divergence, has_aux=True)(energy, x, key, sampler=sampler,
                                                                          n_steps=k)[0]

        sites.clear()
        grads = torch.compile(grad_cd, fullgraph=True, backend="eager")(energy, x, fr.key(30))
        assert len(sites) == init_sites + k * step_sites + loss_forwards, (loss_forwards, sites)
        for a, b in zip(pytree.tree_leaves(grads), pytree.tree_leaves(grad_cd(energy, x, fr.key(30)))):
            torch.testing.assert_close(a, b)
    # what the loss reads: the kernels say which state caches E; a kernel that says nothing, no
    assert base.state_caches_energy(functools.partial(fnebm.langevin(energy, 0.1).step.func),
                                    fnebm.langevin(energy, 0.1).init(x[0])) is False  # eager: only a Step says so


# ------------------------------------------------------------------------------------ PCD


def test_pcd_state_chains_and_ring_buffer():
    energy = model()
    x = fr.normal(fr.key(30), (16, 2), F64)
    state = L.pcd_init(torch.zeros(4, 2, dtype=F64), buffer_size=10)
    assert state.buffer.shape == (10, 2) and int(state.count) == 0 and int(state.pointer) == 0
    seen = []
    for i in range(4):
        _, aux = L.persistent_contrastive_divergence(energy, x, fr.key(31 + i), state, n_steps=1, reinit_prob=0.0)
        new = aux.state
        assert torch.equal(new.positions, aux.negatives)
        slots = [(4 * i + j) % 10 for j in range(4)]
        assert torch.equal(new.buffer[slots], aux.negatives)
        assert int(new.count) == min(4 * (i + 1), 10) and int(new.pointer) == 4 * (i + 1) % 10
        seen.append(aux.negatives)
        state = new
    # with the buffer filled, every chain starts from some buffer entry (a move of ~0 shows where)
    frozen = lambda e: fnebm.langevin(e, 1e-12, 0.0)
    _, aux = L.persistent_contrastive_divergence(energy, x, fr.key(40), state, sampler=frozen, n_steps=1,
                                                 reinit_prob=0.0)
    dist = torch.cdist(aux.negatives, state.buffer).min(1).values
    assert dist.max() < 1e-9
    # reinit_prob=1: every chain restarts from the noise
    noise = functools.partial(fr.uniform, minval=10.0, maxval=11.0)
    _, aux = L.persistent_contrastive_divergence(energy, x, fr.key(41), state, sampler=frozen, n_steps=1,
                                                 reinit_prob=1.0, noise=noise)
    assert (aux.negatives >= 10).all()
    # without a buffer the chains continue where they stopped
    plain = L.pcd_init(seen[-1])
    _, aux = L.persistent_contrastive_divergence(energy, x, fr.key(42), plain, sampler=frozen, n_steps=1,
                                                 reinit_prob=0.0)
    torch.testing.assert_close(aux.negatives, seen[-1], rtol=0, atol=1e-9)
    # the state is plain tensors: torch.save / torch.load(weights_only=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert isinstance(loaded, L.PCDState) and all(torch.equal(a, b) for a, b in zip(loaded, state))


def test_pcd_first_accept_reject_after_an_update_uses_the_new_parameters():
    # A sampler state caches E and dE/dx. Reusing the chains' cached values after a parameter
    # update makes the first accept/reject compare energies of two different models. PCD keeps
    # positions only and re-evaluates them: its first MALA step equals a fresh init under the new
    # parameters, and differs from the stale one.
    x = fr.normal(fr.key(50), (256, 2), F64)
    before = model((0.0, 0.0))
    after = model((1.5, -1.0), torch.tensor([[1.6, 0.0], [0.5, 0.7]], dtype=F64))
    mala = lambda e: fnebm.mala(e, 0.5)
    state = L.pcd_init(fr.normal(fr.key(51), (256, 2), F64))
    _, aux = L.persistent_contrastive_divergence(before, x, fr.key(52), state, sampler=mala, n_steps=3, reinit_prob=0.0)
    positions = aux.state.positions
    key = fr.key(53)
    _, aux = L.persistent_contrastive_divergence(after, x, key, aux.state, sampler=mala, n_steps=1, reinit_prob=0.0)

    step_keys = fr.fold_in(fr.split(fr.split(key)[1], 256), 0)   # chain c's key at step 0
    fresh = torch.func.vmap(fnebm.mala(after, 0.5).init)(positions)
    stale = torch.func.vmap(fnebm.mala(before, 0.5).init)(positions)   # what a kept sampler state would hold
    _, fresh_info = fnebm.mala(after, 0.5).step(fresh, step_keys)
    _, stale_info = fnebm.mala(after, 0.5).step(stale, step_keys)
    assert (stale.energy - fresh.energy).abs().max() > 1.0     # the cached energies are off by this much
    torch.testing.assert_close(aux.info.acceptance_rate[0], fresh_info.acceptance_rate)
    assert (aux.info.acceptance_rate[0] - stale_info.acceptance_rate).abs().max() > 0.1


# --------------------------------------------------------------------------- mixed precision


def test_autocast_runs_the_forward_in_bf16_and_the_rest_in_float32():
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(2, 32), nn.SiLU(), nn.Linear(32, 1))
    energy_fn, params = E.from_module(net)
    energy = E.bind(energy_fn, params)
    x = fr.normal(fr.key(60), (64, 2))
    kw = dict(n_steps=3, sampler=lambda e: fnebm.langevin(e, 0.01))
    loss32, aux32 = L.contrastive_divergence(energy, x, fr.key(61), **kw)
    loss16, aux16 = L.contrastive_divergence(energy, x, fr.key(61), autocast=torch.bfloat16, **kw)
    assert loss16.dtype == aux16.negatives.dtype == aux16.positive_energy.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: the energies differ, by about 2^-8 of their size
    diff = (aux16.positive_energy - aux32.positive_energy).abs()
    assert diff.max() > 0 and diff.max() < 0.05 * aux32.positive_energy.abs().max() + 0.05
    torch.testing.assert_close(aux16.negatives, aux32.negatives, rtol=0, atol=0.02)
    g16, _ = torch.func.grad(L.denoising_score_matching, has_aux=True)(energy, x, fr.key(62), autocast=torch.bfloat16)
    assert all(t.dtype == torch.float32 for t in pytree.tree_leaves(g16))
    for loss in (L.exact_score_matching, functools.partial(L.sliced_score_matching, key=fr.key(63))):
        value, _ = loss(energy, x, autocast=torch.bfloat16)
        assert value.dtype == torch.float32 and torch.isfinite(value)


# -------------------------------------------------------------------------------- checks


def test_argument_checks():
    e, x, k = model(), torch.zeros(8, 2, dtype=F64), fr.key(0)
    state = L.pcd_init(torch.zeros(4, 2, dtype=F64))
    cases = [
        (lambda: L.contrastive_divergence(None, x, k), TypeError, "energy must be callable"),
        (lambda: L.contrastive_divergence(e, x.numpy(), k), TypeError, "batch must be a torch.Tensor"),
        (lambda: L.contrastive_divergence(e, x.long(), k), TypeError, "batch must be a floating"),
        (lambda: L.contrastive_divergence(e, x[:0], k), ValueError, "batch must have shape"),
        (lambda: L.contrastive_divergence(e, x * math.nan, k), ValueError, "finite"),
        (lambda: L.contrastive_divergence(e, x, fr.split(k, 2)), ValueError, "key must be one key"),
        (lambda: L.contrastive_divergence(e, x, torch.zeros(2)), TypeError, "key must have dtype"),
        (lambda: L.contrastive_divergence(e, x, k, n_steps=0), ValueError, "n_steps must be >= 1"),
        (lambda: L.contrastive_divergence(e, x, k, init="prior"), ValueError, "init must be"),
        (lambda: L.contrastive_divergence(e, x, k, init=torch.zeros(3, 5, dtype=F64)), ValueError, "init must have"),
        (lambda: L.contrastive_divergence(e, x, k, init=torch.zeros(3, 2)), TypeError, "init must have the batch"),
        (lambda: L.contrastive_divergence(e, x, k, alpha=-1.0), ValueError, "alpha must be"),
        (lambda: L.contrastive_divergence(e, x, k, alpha="big"), TypeError, "alpha must be"),
        (lambda: L.contrastive_divergence(e, x, k, sampler=3), TypeError, "sampler must be callable"),
        (lambda: L.contrastive_divergence(e, x, k, sampler=lambda e: 3), TypeError, "SamplingAlgorithm"),
        (lambda: L.contrastive_divergence(e, x, k, noise=3), TypeError, "noise must be callable"),
        (lambda: L.contrastive_divergence(e, x, k, autocast=torch.int8), TypeError, "autocast must be"),
        (lambda: L.contrastive_divergence(e, x, k, grad_through_sampler=1), TypeError, "grad_through_sampler"),
        (lambda: L.persistent_contrastive_divergence(e, x, k, None), TypeError, "state must be a PCDState"),
        (lambda: L.persistent_contrastive_divergence(e, x, k, state, reinit_prob=1.5), ValueError, "reinit_prob"),
        (lambda: L.persistent_contrastive_divergence(e, x.float(), k, state), TypeError, "state.positions"),
        (lambda: L.pcd_init(torch.zeros(4, 2), buffer_size=3), ValueError, "buffer_size must be 0"),
        (lambda: L.pcd_init(torch.zeros(4, 2), buffer_size=-1), ValueError, "buffer_size must be >= 0"),
        (lambda: L.pcd_init([0.0, 1.0]), TypeError, "positions must be a floating"),
        (lambda: L.denoising_score_matching(e, x, k, sigma=0.0), ValueError, "sigma must be"),
        (lambda: L.denoising_score_matching(e, x, k, sigma=torch.ones(2, 2)), ValueError, "sigma must be a number"),
        (lambda: L.sliced_score_matching(e, x, k, projection="sphere"), ValueError, "projection must be"),
        (lambda: L.sliced_score_matching(e, x, k, n_projections=0), ValueError, "n_projections must be >= 1"),
        (lambda: L.sliced_score_matching(e, x, k, variance_reduction="yes"), TypeError, "variance_reduction"),
        (lambda: L.exact_score_matching(e, x, key=torch.zeros(3, dtype=torch.int64)), ValueError, "key must have"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


LOSSES = {
    "cd": lambda e, x, k: L.contrastive_divergence(e, x, k, n_steps=1),
    "cd from noise": lambda e, x, k: L.contrastive_divergence(e, x, k, n_steps=1, init="noise"),
    "cd through the sampler": lambda e, x, k: L.contrastive_divergence(e, x, k, n_steps=1, grad_through_sampler=True),
    "pcd": lambda e, x, k: L.persistent_contrastive_divergence(e, x, k, L.pcd_init(x[:4]), n_steps=1),
    "esm": lambda e, x, k: L.exact_score_matching(e, x, k),
    "dsm": lambda e, x, k: L.denoising_score_matching(e, x, k),
    "ssm": lambda e, x, k: L.sliced_score_matching(e, x, k),
    "esm autocast": lambda e, x, k: L.exact_score_matching(e, x, k, autocast=torch.bfloat16),
}


@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_names_an_energy_that_is_not_one_number_per_sample(name):
    """fnebm's own errors, naming the energy, before any sampler or torch.func transform meets it."""
    loss, x, k = LOSSES[name], torch.randn(8, 2, dtype=F64), fr.key(0)
    per_sample = r"energy must return a 0-dim energy for one sample, got shape \(2,\) for a sample of shape \(2,\)"
    with pytest.raises(ValueError, match=per_sample):
        loss(lambda v: v * v, x, k)                       # a vector: one value per coordinate
    with pytest.raises(ValueError, match=r"got shape \(1,\).*lambda x: E\(x\[None\]\)\[0\]"):
        loss(lambda v: (v * v).sum(-1, keepdim=True), x, k)
    with pytest.raises(TypeError, match="energy must return a 0-dim tensor, got float"):
        loss(lambda v: 1.0, x, k)
    with pytest.raises(TypeError, match="energy must return a floating tensor, got dtype torch.int64"):
        loss(lambda v: (v * v).sum().long(), x, k)
    value, _ = loss(lambda v: 0.5 * (v * v).sum(), x, k)  # and the same loss runs on a good energy
    assert value.ndim == 0 and torch.isfinite(value)


@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_checks_the_batch_against_an_fnebm_energy(name):
    loss, k = LOSSES[name], fr.key(0)
    e3 = E.gaussian(torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match=r"batch of shape \(8, 2\) does not fit the energy: gaussian takes dim == 3"):
        loss(e3, torch.zeros(8, 2, dtype=F64), k)
    with pytest.raises(ValueError, match=r"batch must have shape \(n, dim\) for this energy.*got shape \(8, 1, 3\)"):
        loss(e3, torch.zeros(8, 1, 3, dtype=F64), k)
    with pytest.raises(TypeError, match="batch has dtype torch.float32 but the energy's parameters are torch.float64"):
        loss(e3, torch.zeros(8, 3), k)


def test_sampler_and_noise_must_take_the_arguments_the_loss_passes():
    e, x, k = model(), torch.zeros(8, 2, dtype=F64), fr.key(0)
    with pytest.raises(TypeError, match=r"sampler must be callable as sampler\(energy\) -> SamplingAlgorithm, but "
                                        r"mala\(energy_fn, step_size\) cannot be.*functools.partial\(fnebm.mala"):
        L.contrastive_divergence(e, x, k, sampler=fnebm.mala)
    with pytest.raises(TypeError, match=r"noise must be callable as noise\(key, shape, dtype\)"):
        L.contrastive_divergence(e, x, k, init="noise", noise=lambda key, shape: torch.zeros(shape))

    class Sampler:  # any callable of one energy is fine: a partial, a class, a function of **kwargs
        def __call__(self, energy):
            return fnebm.mala(energy, 0.1)

    for sampler in (functools.partial(fnebm.mala, step_size=0.1), Sampler(), lambda *a, **kw: fnebm.mala(a[0], 0.1)):
        value, _ = L.contrastive_divergence(e, x, k, sampler=sampler, n_steps=1)
        assert torch.isfinite(value)


def test_exact_score_matching_traces_under_compile_with_autograd_outside():
    """fnebm train's compiled path: the loss compiled (fullgraph), its parameter gradient taken by
    autograd outside. jacfwd of the score failed to trace there on torch 2.13 (fnebm train --loss sm
    crashed); Dynamo's trace alone (backend "eager") shows it, in seconds."""
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.SiLU(), torch.nn.Linear(8, 1, bias=False)).double()
    energy_fn, params = E.from_module(net)
    x = fr.normal(fr.key(3), (16, 2), F64)

    def loss(params, x):
        return L.exact_score_matching(E.bind(energy_fn, params), x)[0]

    compiled = torch.compile(loss, fullgraph=True, backend="eager")
    leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
    value, expected = compiled(leaves, x), loss(leaves, x)
    torch.testing.assert_close(value, expected)
    for a, b in zip(torch.autograd.grad(value, tuple(leaves.values())),
                    torch.autograd.grad(expected, tuple(leaves.values()))):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------- one compiled training step


@pytest.mark.compile
def test_functional_training_step_compiles_once():
    # torch.func.grad over the energy pytree, a functional Adam, all in one fullgraph call with the
    # parameters and optimiser state as inputs: five iterations, new values each time, one compile
    counter = CompileCounterWithBackend("aot_eager")
    loss = functools.partial(L.contrastive_divergence, sampler=lambda e: fnebm.mala(e, 0.3), n_steps=2)

    def train_step(energy, opt_state, step, batch, key):
        grads, aux = torch.func.grad(loss, has_aux=True)(energy, batch, key)
        m, v = opt_state
        m = pytree.tree_map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
        v = pytree.tree_map(lambda v, g: 0.99 * v + 0.01 * g * g, v, grads)
        t = step + 1
        energy = pytree.tree_map(
            lambda p, m, v: p - 0.05 * (m / (1 - 0.9**t)) / ((v / (1 - 0.99**t)).sqrt() + 1e-8), energy, m, v)
        return energy, (m, v), t, aux.negative_energy.mean()

    compiled = torch.compile(train_step, fullgraph=True, backend=counter)
    batch = MU + fr.normal(fr.key(70), (256, 2), F64)
    energy = eager = model()
    opt = eager_opt = tuple(pytree.tree_map(torch.zeros_like, energy) for _ in range(2))
    # the step counter is (1,), not 0-dim: Dynamo reads 0-dim CPU float inputs as Python scalars and
    # restarts its analysis once (two backend calls on the first iteration, still no recompile)
    step = eager_step = torch.zeros(1, dtype=F64)
    for i in range(5):
        key = fr.fold_in(fr.key(71), i)
        energy, opt, step, _ = compiled(energy, opt, step, batch, key)
        eager, eager_opt, eager_step, _ = train_step(eager, eager_opt, eager_step, batch, key)
    assert counter.frame_count == 1
    for a, b in zip(pytree.tree_leaves(energy), pytree.tree_leaves(eager)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert not torch.equal(energy.mean, model().mean)


@pytest.mark.compile
def test_module_training_step_with_torch_optim():
    # nn.Module + torch.optim on torch 2.13: optimizer.step() inserts graph breaks by design, so
    # the loss (sampling included, one scan body) is one fullgraph compile, backward runs on the
    # compiled graph's AOTAutograd backward, and opt.step() is compiled on its own
    counter = CompileCounterWithBackend("aot_eager")
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(2, 16), nn.SiLU(), nn.Linear(16, 1))
    energy_fn, _ = E.from_module(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)

    @torch.compile(fullgraph=True, backend=counter)
    def loss_fn(batch, key):
        energy = E.bind(energy_fn, dict(net.named_parameters()))
        loss, aux = L.contrastive_divergence(energy, batch, key, n_steps=3, unroll=False)
        return loss, aux.negative_energy.mean()

    opt_step = torch.compile(opt.step, backend="aot_eager")
    batch = fr.normal(fr.key(80), (128, 2))
    before = [p.detach().clone() for p in net.parameters()]
    for i in range(5):
        opt.zero_grad(set_to_none=True)
        loss, _ = loss_fn(batch, fr.fold_in(fr.key(81), i))
        loss.backward()
        opt_step()
    assert counter.frame_count == 1            # the loss and its sampler: compiled once for 5 steps
    # every weight moved (the last bias has no CD gradient: it cancels between E(x⁺) and E(x⁻))
    assert all(not torch.equal(a, b) for a, b in list(zip(before, net.parameters()))[:-1])
