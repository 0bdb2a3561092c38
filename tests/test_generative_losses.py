"""Flow, equilibrium and energy matching; EMA; EqM's sampler; the MCMC correction of a flow's draws."""

import functools
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils import _pytree as pytree

import fnebm
from fnebm import couplings as C
from fnebm import energies as E
from fnebm import interpolants as I
from fnebm import losses as L
from fnebm import random as fr

F64 = torch.float64
N, D, H = 16, 2, 8


def params(seed=0, din=D + 1, dout=D):
    k = fr.split(fr.key(seed), 3)
    return {"w0": fr.normal(k[0], (din, H), F64) / math.sqrt(din), "b0": fr.normal(k[1], (H,), F64),
            "w1": fr.normal(k[2], (H, dout), F64) / math.sqrt(H)}


def field_xt(p, x, t):
    return torch.tanh(torch.cat([x, t[None]]) @ p["w0"] + p["b0"]) @ p["w1"]


def field_x(p, x):
    return torch.tanh(x @ p["w0"] + p["b0"]) @ p["w1"]


def energy_x(p, x):
    return (torch.tanh(x @ p["w0"] + p["b0"]) @ p["w1"]).sum() + 0.5 * (x * x).sum()


def fixed(t):
    return lambda key, n, dtype: t


@pytest.fixture(scope="module")
def pair():
    x1 = fr.normal(fr.key(1), (N, D), F64) + 2.0
    x0 = fr.normal(fr.key(2), (N, D), F64)
    t = fr.uniform(fr.key(3), (N,), F64)
    return x0, x1, t


# ------------------------------------------------------------------------- references


def test_flow_matching_equals_the_hand_written_loss(pair):
    x0, x1, t = pair
    p = params()
    for interp in (I.linear(), I.cosine()):
        loss, aux = L.flow_matching(L.bind_field(field_xt, p), x1, fr.key(0), x0=x0, time=fixed(t), interpolant=interp)
        a, da, s, ds = interp.coefficients(t[:, None])
        xt, ut = a * x1 + s * x0, da * x1 + ds * x0
        pred = torch.stack([field_xt(p, xt[i], t[i]) for i in range(N)])
        ref = ((pred - ut) ** 2).mean(1)
        torch.testing.assert_close(aux.per_sample, ref)
        torch.testing.assert_close(loss, ref.mean())
    neg, _ = L.flow_matching(L.bind_field(field_xt, p), x1, fr.key(0), x0=x0, time=fixed(t), negate=True)
    xt = t[:, None] * x1 + (1 - t[:, None]) * x0
    pred = torch.stack([field_xt(p, xt[i], t[i]) for i in range(N)])
    torch.testing.assert_close(neg, ((pred + (x1 - x0)) ** 2).mean())


def test_a_batched_field_gives_the_per_sample_loss(pair):
    x0, x1, t = pair
    p = params()

    def batch_fn(p, x, t):
        return torch.tanh(torch.cat([x, t[:, None]], 1) @ p["w0"] + p["b0"]) @ p["w1"]

    a, _ = L.flow_matching(L.bind_field(field_xt, p), x1, fr.key(0), x0=x0, time=fixed(t))
    b, _ = L.flow_matching(L.bind_field(batch_fn, p, batched=True), x1, fr.key(0), x0=x0, time=fixed(t))
    torch.testing.assert_close(a, b)
    pf = params(din=D)
    a, _ = L.equilibrium_matching(L.bind_field(field_x, pf), x1, fr.key(0), x0=x0, time=fixed(t))
    b, _ = L.equilibrium_matching(L.bind_field(lambda p, x: torch.tanh(x @ p["w0"] + p["b0"]) @ p["w1"], pf,
                                               batched=True), x1, fr.key(0), x0=x0, time=fixed(t))
    torch.testing.assert_close(a, b)


def test_flow_matching_with_ot_coupling_uses_the_coupled_pairs(pair):
    x0, x1, t = pair
    p = params()
    loss, _ = L.flow_matching(L.bind_field(field_xt, p), x1, fr.key(0), x0=x0, time=fixed(t), coupling=C.exact_ot)
    _, x1c = C.exact_ot(x0, x1)
    ref, _ = L.flow_matching(L.bind_field(field_xt, p), x1c, fr.key(0), x0=x0, time=fixed(t))
    torch.testing.assert_close(loss, ref)


def test_eqm_decay_is_the_truncated_decay():
    t = torch.tensor([0.0, 0.5, 0.8, 0.9, 1.0], dtype=F64)
    torch.testing.assert_close(L.eqm_decay(t), torch.tensor([4.0, 4.0, 4.0, 2.0, 0.0], dtype=F64))
    torch.testing.assert_close(L.eqm_decay(t, 0.5, 1.0), torch.tensor([1.0, 1.0, 0.4, 0.2, 0.0], dtype=F64))


def test_equilibrium_matching_equals_the_hand_written_loss(pair):
    x0, x1, t = pair
    pf, pe = params(din=D), params(din=D, dout=1)
    c = 4.0 * torch.clamp((1 - t) / 0.2, max=1.0)[:, None]
    xt = t[:, None] * x1 + (1 - t[:, None]) * x0
    target = (x0 - x1) * c
    loss, aux = L.equilibrium_matching(L.bind_field(field_x, pf), x1, fr.key(0), x0=x0, time=fixed(t))
    pred = torch.stack([field_x(pf, xt[i]) for i in range(N)])
    torch.testing.assert_close(loss, ((pred - target) ** 2).mean())
    assert aux.energy.shape == (0,)
    loss, aux = L.equilibrium_matching(E.bind(energy_x, pe), x1, fr.key(0), form="energy", x0=x0, time=fixed(t))
    grads = torch.stack([torch.func.grad(functools.partial(energy_x, pe))(xt[i]) for i in range(N)])
    torch.testing.assert_close(loss, ((grads - target) ** 2).mean())
    torch.testing.assert_close(aux.energy, torch.stack([energy_x(pe, xt[i]) for i in range(N)]))
    # a custom decay, and a time-conditioned field
    loss, _ = L.equilibrium_matching(L.bind_field(field_xt, params()), x1, fr.key(0), x0=x0, time=fixed(t),
                                     decay=torch.ones_like, time_conditioned=True)
    fm, _ = L.flow_matching(L.bind_field(field_xt, params()), x1, fr.key(0), x0=x0, time=fixed(t), negate=True)
    torch.testing.assert_close(loss, fm)  # constant c = 1 with a clock: the negated flow-matching loss


def test_energy_matching_flow_term_equals_the_hand_written_loss(pair):
    x0, x1, t = pair
    pe = params(din=D, dout=1)
    loss, aux = L.energy_matching(E.bind(energy_x, pe), x1, fr.key(0), x0=x0, time=fixed(t), coupling=None,
                                  smoothing=0.0, lambda_cd=0.0)
    xt = t[:, None] * x1 + (1 - t[:, None]) * x0
    v = -torch.stack([torch.func.grad(functools.partial(energy_x, pe))(xt[i]) for i in range(N)])
    w = torch.clamp((1 - t) / 0.2, 0, 1)
    torch.testing.assert_close(loss, (w * ((v - (x1 - x0)) ** 2).mean(1)).mean())
    assert aux.negatives.shape == (0, D) and float(aux.cd_loss) == 0.0


def test_energy_matching_contrastive_term():
    x1 = fr.normal(fr.key(4), (N, D), F64)
    pe = params(din=D, dout=1)
    energy = E.bind(energy_x, pe)
    loss, aux = L.energy_matching(energy, x1, fr.key(5), n_steps=5, cd_clamp=None, trim_fraction=0.25)
    assert aux.negatives.shape == (N, D) and torch.isfinite(aux.negatives).all()
    pos = torch.func.vmap(energy)(x1).mean()
    neg = torch.sort(torch.func.vmap(energy)(aux.negatives)).values[: N - N // 4].mean()
    torch.testing.assert_close(aux.cd_loss, 2.0 * (pos - neg))
    torch.testing.assert_close(loss, aux.flow_loss + aux.cd_loss)
    clamped, aux2 = L.energy_matching(energy, x1, fr.key(5), n_steps=5, trim_fraction=0.25, cd_clamp=0.0)
    torch.testing.assert_close(aux2.cd_loss, torch.clamp(aux.cd_loss, min=0.0))
    # the temperature profile
    assert L.energy_matching.__module__ == "fnebm.losses.energy_matching"
    from fnebm.losses.energy_matching import temperature
    assert [temperature(x, 0.15, 0.8) for x in (0.5, 0.9, 1.0)] == [0.0, pytest.approx(0.075), 0.15]


# ----------------------------------------------------------------------- vs TorchEBM


class Net(torch.nn.Module):
    def __init__(self, din, dout):
        super().__init__()
        self.l0, self.l1 = torch.nn.Linear(din, 16), torch.nn.Linear(16, dout)

    def forward(self, x, t=None):
        h = x if t is None or self.l0.in_features == x.shape[1] else torch.cat([x, t[:, None]], 1)
        return self.l1(torch.tanh(self.l0(h)))


def functional(net):
    def fn(p, x, *t):
        return torch.func.functional_call(net, p, (x[None], *(s[None] for s in t)))[0]
    return fn, {k: v.detach() for k, v in net.named_parameters()}


def test_losses_agree_with_torchebm(pair):
    tl = pytest.importorskip("torchebm.losses")
    x0, x1, t = (v.float() for v in pair)
    ts = lambda batch, **kw: t  # noqa: E731  (TorchEBM's callable time sampler)
    torch.manual_seed(0)
    net = Net(D + 1, D)
    fn, p = functional(net)
    theirs = tl.FlowMatchingLoss(net, t_sampler=ts).training_losses(x1, x0=x0)["loss"].mean()
    ours, _ = L.flow_matching(L.bind_field(fn, p), x1, fr.key(0), x0=x0, time=fixed(t))
    torch.testing.assert_close(ours, theirs.detach())

    net = Net(D, D)  # a time-invariant field: TorchEBM hands it a zeroed clock, which it ignores
    fn, p = functional(net)
    theirs = tl.EquilibriumMatchingLoss(net, t_sampler=ts).training_losses(x1, x0=x0)["loss"].mean()
    ours, _ = L.equilibrium_matching(L.bind_field(fn, p), x1, fr.key(0), x0=x0, time=fixed(t))
    torch.testing.assert_close(ours, theirs.detach())

    # explicit energy: TorchEBM's energy_type="dot" is E(x) = x . net(x)
    dot = lambda p, x: (x * fn(p, x)).sum()  # noqa: E731
    theirs = tl.EquilibriumMatchingLoss(net, t_sampler=ts, energy_type="dot").training_losses(x1, x0=x0)
    ours, aux = L.equilibrium_matching(E.bind(dot, p), x1, fr.key(0), form="energy", x0=x0, time=fixed(t))
    torch.testing.assert_close(ours, theirs["loss"].mean().detach())
    torch.testing.assert_close(aux.energy, theirs["energy"].detach())

    # energy matching's flow term (no smoothing noise, no chains, independent pairs)
    from torchebm.core import BaseModel

    class Potential(BaseModel):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x)[:, 0]

    net1 = Net(D, 1)
    fn1, p1 = functional(net1)
    em = tl.EnergyMatchingLoss(Potential(net1), coupling="independent", sigma=0.0, lambda_cd=0.0, t_sampler=ts)
    theirs = em.training_losses(x1, x0=x0)["loss"]
    ours, _ = L.energy_matching(E.bind(lambda p, x: fn1(p, x)[0], p1), x1, fr.key(0), x0=x0, time=fixed(t),
                                coupling=None, smoothing=0.0, lambda_cd=0.0)
    torch.testing.assert_close(ours, theirs.detach())


# ----------------------------------------------------------------- keys, gradients, compile


def test_keyed_reproducible_and_key_dependent():
    x1 = fr.normal(fr.key(6), (N, D), F64)
    model = L.bind_field(field_xt, params())
    for f in (L.flow_matching, functools.partial(L.flow_matching, coupling=functools.partial(C.sinkhorn_ot, n_iters=5)),
              functools.partial(L.flow_matching, time=L.logit_normal_time(1.2, 1.2))):
        a, b, c = f(model, x1, fr.key(1)), f(model, x1, fr.key(1)), f(model, x1, fr.key(2))
        assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_grad_over_the_field_pytree_matches_autograd():
    x1 = fr.normal(fr.key(7), (N, D), F64)
    p = params(din=D, dout=1)
    energy = E.bind(energy_x, p)
    loss = functools.partial(L.equilibrium_matching, form="energy")
    grads, _ = torch.func.grad(loss, has_aux=True)(energy, x1, fr.key(8))
    leaves = {k: v.clone().requires_grad_(True) for k, v in p.items()}
    value, _ = loss(E.bind(energy_x, leaves), x1, fr.key(8))
    ref = torch.autograd.grad(value, tuple(leaves.values()))
    for g, r in zip(grads.params.values(), ref):
        torch.testing.assert_close(g, r)


def test_time_samplers():
    t = L.uniform_time(0.1)(fr.key(9), 20000, F64)
    assert float(t.min()) >= 0.1 and float(t.max()) <= 0.9
    t = L.logit_normal_time(1.2, 0.5)(fr.key(10), 20000, F64)
    z = torch.logit(t)
    assert abs(float(z.mean()) - 1.2) < 5 * 0.5 / math.sqrt(20000)
    assert abs(float(z.std()) - 0.5) < 5 * 0.5 / math.sqrt(2 * 20000)


@pytest.mark.compile
def test_compiled_training_step_equals_eager_and_compiles_once():
    counter = CompileCounterWithBackend("aot_eager")
    loss = functools.partial(L.flow_matching, time=L.logit_normal_time(), coupling=functools.partial(
        C.sinkhorn_ot, epsilon=0.1, n_iters=3))

    def step(model, ema, batch, key, lr, decay):
        grads, aux = torch.func.grad(loss, has_aux=True)(model, batch, key)
        model = pytree.tree_map(lambda p, g: p - lr * g, model, grads)
        return model, L.ema_update(ema, model, decay), aux.per_sample.mean()

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    model = eager = L.bind_field(field_xt, params())
    ema = eager_ema = pytree.tree_map(torch.clone, model)
    batch = fr.normal(fr.key(11), (N, D), F64)
    for i in range(4):  # new parameters, key, learning rate and decay each time: one compile
        # (1,), not 0-dim: Dynamo reads 0-dim CPU float inputs as Python scalars (see test_losses.py)
        key, lr, decay = fr.fold_in(fr.key(12), i), torch.tensor([0.1 / (i + 1)], dtype=F64), \
            torch.tensor([0.9 + 0.01 * i], dtype=F64)
        model, ema, v = compiled(model, ema, batch, key, lr, decay)
        eager, eager_ema, ve = step(eager, eager_ema, batch, key, lr, decay)
        torch.testing.assert_close(v, ve, rtol=1e-9, atol=1e-12)
    assert counter.frame_count == 1
    for a, b in zip(pytree.tree_leaves((model, ema)), pytree.tree_leaves((eager, eager_ema))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------ EMA


def test_ema_update_is_pure_and_exact():
    ema = {"a": torch.zeros(3), "b": torch.ones(2, 2)}
    new = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    out = L.ema_update(ema, new, torch.tensor(0.75))
    torch.testing.assert_close(out["a"], torch.full((3,), 0.25))
    torch.testing.assert_close(out["b"], torch.full((2, 2), 0.75))
    assert torch.equal(ema["a"], torch.zeros(3))  # inputs untouched
    assert torch.equal(L.ema_update(ema, new, 1.0)["a"], ema["a"])
    with pytest.raises(ValueError, match="decay"):
        L.ema_update(ema, new, 1.5)
    with pytest.raises(ValueError, match="same structure"):
        L.ema_update(ema, {"a": torch.ones(3)}, 0.5)
    with pytest.raises(ValueError, match="same shapes"):
        L.ema_update(ema, {"a": torch.ones(4), "b": torch.zeros(2, 2)}, 0.5)


# ------------------------------------------------------------------------ samplers


def test_eqm_sampler_descends_to_the_equilibrium_and_nesterov_is_faster():
    target = E.gaussian(torch.tensor([1.0, -2.0], dtype=F64), torch.diag(torch.tensor([0.1, 1.0], dtype=F64)))
    field = fnebm.samplers.energy_field(target)
    x = 3.0 * fr.normal(fr.key(13), (64, D), F64)
    keys = fr.split(fr.key(14), 64)
    errors = {}
    for mu in (0.0, 0.5):
        alg = fnebm.eqm(field, 0.05, mu)
        state = torch.func.vmap(alg.init)(x)
        for _ in range(150):
            state, info = alg.step(state, keys)
        errors[mu] = float((state.position - target.mean).norm(dim=1).max())
        assert not info.is_divergent.any()
    assert errors[0.5] < 1e-5 < 1e-4 < errors[0.0]
    # one plain gradient step by hand
    alg = fnebm.eqm(field, torch.tensor(0.05, dtype=F64))
    s, info = alg.step(torch.func.vmap(alg.init)(x), keys)
    torch.testing.assert_close(s.position, x - 0.05 * torch.func.vmap(field)(x))
    torch.testing.assert_close(info.field_norm, torch.func.vmap(field)(x).norm(dim=1))
    # through sample_chain, one chain axis, per-chain step sizes
    chain, trace, _ = fnebm.sample_chain(fnebm.eqm(field, torch.full((64,), 0.05, dtype=F64), 0.5).step,
                                         torch.func.vmap(alg.init)(x), fr.key(15), 150, compile=False)
    torch.testing.assert_close(chain.state.position, state.position)


def test_eqm_sampler_holds_a_chain_whose_field_is_not_finite():
    field = lambda x: torch.where(x[0] > 0, x, torch.full_like(x, math.nan))  # noqa: E731
    alg = fnebm.eqm(field, 0.1)
    x = torch.tensor([[1.0, 1.0], [-1.0, 1.0]], dtype=F64)
    s, info = alg.step(torch.func.vmap(alg.init)(x), fr.split(fr.key(0), 2))
    assert info.is_divergent.tolist() == [False, True]
    assert torch.equal(s.position[1], x[1])


def test_mcmc_correction_of_a_wrong_flow_targets_the_energy_exactly():
    # a Gaussian energy, and "flow" draws from a deliberately wrong distribution N(0, 3^2 I)
    mean, var = torch.tensor([1.0, -2.0], dtype=F64), torch.tensor([0.5, 2.0], dtype=F64)
    target = E.gaussian(mean, torch.diag(var))
    m = 4000
    draws = 3.0 * fr.normal(fr.key(16), (m, D), F64)
    for sampler in (lambda e: fnebm.mala(e, 0.6),
                    functools.partial(fnebm.hmc, step_size=0.4, num_integration_steps=5)):
        chain, trace, info = fnebm.mcmc_correct(target, draws, fr.key(17), sampler=sampler, n_steps=150,
                                                compile=False)
        x = chain.state.position  # one independent chain per draw: m independent draws
        mcse_mean = (var / m).sqrt()
        mcse_var = var * math.sqrt(2 / (m - 1))
        assert ((x.mean(0) - mean).abs() < 4 * mcse_mean).all(), (x.mean(0), mean)
        assert ((x.var(0) - var).abs() < 4 * mcse_var).all(), (x.var(0), var)
    # the uncorrected draws fail the same check: the test can fail
    assert not ((draws.var(0) - var).abs() < 4 * mcse_var).all()


# -------------------------------------------------------------------------- checks


def test_argument_checks():
    x1 = fr.normal(fr.key(18), (N, D), F64)
    model = L.bind_field(field_xt, params())
    with pytest.raises(TypeError, match="model must be callable"):
        L.flow_matching(3, x1, fr.key(0))
    with pytest.raises(ValueError, match="one key"):
        L.flow_matching(model, x1, fr.split(fr.key(0), 2))
    with pytest.raises(TypeError, match="interpolant"):
        L.flow_matching(model, x1, fr.key(0), interpolant="linear")
    with pytest.raises(TypeError, match="coupling must be callable"):
        L.flow_matching(model, x1, fr.key(0), coupling="ot")
    with pytest.raises(ValueError, match="x0 must have the batch's shape"):
        L.flow_matching(model, x1, fr.key(0), x0=x1[:3])
    with pytest.raises(ValueError, match="form"):
        L.equilibrium_matching(model, x1, fr.key(0), form="dot")
    with pytest.raises(ValueError, match="threshold"):
        L.equilibrium_matching(model, x1, fr.key(0), threshold=1.0)
    with pytest.raises(ValueError, match="multiplier"):
        L.equilibrium_matching(model, x1, fr.key(0), multiplier=-1.0)
    with pytest.raises(ValueError, match="tau_star"):
        L.energy_matching(E.bind(energy_x, params(din=D, dout=1)), x1, fr.key(0), tau_star=1.0)
    with pytest.raises(ValueError, match="noise_fraction"):
        L.energy_matching(E.bind(energy_x, params(din=D, dout=1)), x1, fr.key(0), noise_fraction=2.0)
    with pytest.raises(ValueError, match="std"):
        L.logit_normal_time(0.0, 0.0)
    with pytest.raises(ValueError, match="momentum"):
        fnebm.eqm(lambda x: x, 0.1, 1.0)
    with pytest.raises(ValueError, match="draws"):
        fnebm.mcmc_correct(E.gaussian(torch.zeros(2), torch.eye(2)), torch.zeros(2), fr.key(0))
