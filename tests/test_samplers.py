import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fnebm
from fnebm import diagnostics, energies as E, random as fr
from fnebm.samplers.mala import log_acceptance_ratio

from conftest import COV, MEAN, N_CHAINS, walled

F64 = torch.float64
Z = 4.5  # |z| bound for moment checks: a false alarm about once in 150,000 per check


def _check_moments(x, mean, cov):
    """x: (n, d) independent draws. Mean and covariance within Z standard errors."""
    n = x.shape[0]
    se_mean = torch.sqrt(torch.diagonal(cov) / n)
    assert ((x.mean(0) - mean).abs() < Z * se_mean).all(), (x.mean(0), mean, se_mean)
    # Var of a Gaussian sample covariance entry: (S_ii S_jj + S_ij^2) / n
    se_cov = torch.sqrt((torch.outer(torch.diagonal(cov), torch.diagonal(cov)) + cov**2) / n)
    assert ((torch.cov(x.T) - cov).abs() < Z * se_cov).all(), (torch.cov(x.T), cov, se_cov)


def test_mala_final_states_have_target_moments(mala_run):
    final, trace, info = mala_run
    # the final states of independent chains, long after burn-in, are independent draws
    _check_moments(final.state.position, MEAN, COV)
    assert final.state.position.shape == (N_CHAINS, 2) and trace.shape == (300, N_CHAINS, 2)
    assert 0.5 < info.acceptance_rate.mean() < 0.95
    assert not info.is_divergent.any()


def test_mala_trace_mean_within_mcse(mala_run):
    _, trace, _ = mala_run
    # the whole trace: autocorrelated, so the standard error comes from its ESS
    mcse = diagnostics.mcse_mean(trace)
    assert ((trace.mean((0, 1)) - MEAN).abs() < Z * mcse).all()
    # 300 draws with an autocorrelation time of ~15 steps put split-R-hat near 1.05 even when
    # converged (R-hat^2 ~ 1 + 1/ESS per split chain); unconverged chains from the 3-sigma start
    # would be far above 1.1.
    assert (diagnostics.rhat(trace) < 1.1).all()


def test_langevin_matches_its_discretised_stationary_law(langevin_run):
    # ULA on E = x'Px/2 is a Gaussian AR(1): its stationary covariance is exactly
    # 2 (P (2I - eta P))^-1, which differs from COV by O(eta). Test against that, not COV.
    final, _, info = langevin_run
    eta = 0.05
    P = torch.linalg.inv(COV)
    ula_cov = 2 * torch.linalg.inv(P @ (2 * torch.eye(2, dtype=F64) - eta * P))
    _check_moments(final.state.position, MEAN, ula_cov)
    assert not info.is_divergent.any()


def test_batched_step_rejects_keys_that_do_not_match_the_chains(target):
    alg = fnebm.mala(target, 0.3)
    states = torch.func.vmap(alg.init)(torch.zeros(4, 2, dtype=F64))
    with pytest.raises(ValueError, match="one key per chain"):
        alg.step(states, fr.split(fr.key(0), 3))


def test_state_caches_energy_and_gradient(target):
    alg = fnebm.mala(target, 0.2)
    state, _ = alg.step(alg.init(torch.zeros(2, dtype=F64)), fr.key(0))
    torch.testing.assert_close(state.energy, target(state.position))
    torch.testing.assert_close(state.grad, target.grad(state.position))


def test_one_gradient_per_step():
    calls = []

    def energy(x):
        calls.append(1)
        return 0.5 * (x * x).sum()

    for alg in (fnebm.mala(energy, 0.1), fnebm.langevin(energy, 0.1)):
        state = alg.init(torch.zeros(3))
        calls.clear()
        alg.step(state, fr.key(0))
        assert len(calls) == 1


@given(
    st.lists(st.floats(-3, 3), min_size=4, max_size=4),
    st.floats(0.01, 1.0),
)
@settings(max_examples=50, deadline=None)
def test_mala_acceptance_ratio_is_antisymmetric(vals, eta):
    # detailed balance: log alpha(x -> y) = -log alpha(y -> x)
    e = E.double_well(1.0, 1.0, dtype=F64)
    x, y = torch.tensor(vals[:2], dtype=F64), torch.tensor(vals[2:], dtype=F64)
    fwd = log_acceptance_ratio(x, e(x), e.grad(x), y, e(y), e.grad(y), eta)
    bwd = log_acceptance_ratio(y, e(y), e.grad(y), x, e(x), e.grad(x), eta)
    torch.testing.assert_close(fwd, -bwd)


def test_mala_on_a_flat_energy_accepts_everything():
    # symmetric proposal and equal energies: alpha = 1 exactly
    alg = fnebm.mala(lambda x: 0.0 * x.sum(), 0.5)
    states = torch.func.vmap(alg.init)(torch.zeros(64, 3))
    _, info = torch.func.vmap(alg.step)(states, fr.split(fr.key(0), 64))
    assert torch.equal(info.acceptance_rate, torch.ones(64)) and info.is_accepted.all()


def _nan_beyond(x):
    return torch.where(x[0] < 0.5, 0.5 * (x * x).sum(), torch.tensor(math.nan))


@pytest.mark.parametrize("energy", [walled, _nan_beyond])
def test_mala_rejects_non_finite_proposals(energy):
    alg = fnebm.mala(energy, 0.5)
    state = torch.func.vmap(alg.init)(torch.full((256, 2), 0.3))
    step = torch.func.vmap(alg.step)
    divergent = 0
    for t in range(5):
        state, info = step(state, fr.split(fr.fold_in(fr.key(0), t), 256))
        assert not (info.is_divergent & info.is_accepted).any()
        assert (info.acceptance_rate[info.is_divergent] == 0).all()
        divergent += int(info.is_divergent.sum())
        assert torch.isfinite(state.position).all() and torch.isfinite(state.energy).all()
        assert (state.position[:, 0] < 0.5).all()
    assert divergent > 0  # the wall was hit, so the check above was exercised


def test_langevin_flags_divergence_and_stays_put():
    alg = fnebm.langevin(walled, 0.5)
    start = torch.func.vmap(alg.init)(torch.full((256, 2), 0.3))
    state, info = torch.func.vmap(alg.step)(start, fr.split(fr.key(0), 256))
    assert info.is_divergent.any() and not info.is_divergent.all()
    torch.testing.assert_close(state.position[info.is_divergent], start.position[info.is_divergent])
    assert torch.isfinite(state.position).all()


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16])
@pytest.mark.parametrize("chains", [(), (7,), (2, 3)])
def test_all_finite_flags_exactly_the_chains_with_a_nan_or_inf(dtype, chains):
    # the eager forms (NumPy on the CPU; sum(x - x) == 0 for bfloat16, under vmap and with autograd)
    # against isfinite masks, with NaN, inf and -inf dotted about and huge finite values (no overflow)
    from fnebm.samplers.base import all_finite

    g = torch.Generator().manual_seed(len(chains) + 10 * int(dtype == F64))
    big = torch.finfo(dtype).max
    e, a, b = (torch.randn(chains + shape, generator=g).to(dtype) for shape in ((), (5,), (5,)))
    a[..., :2] = big  # a sum of these overflows: the check must not call them non-finite
    for t, bad in ((e, math.nan), (a, math.inf), (b, -math.inf), (a, math.nan)):
        flat = t.reshape(-1)
        flat[torch.randint(flat.numel(), (1,), generator=g)] = bad
    want = torch.isfinite(e) & torch.isfinite(a).flatten(len(chains)).all(-1) & torch.isfinite(b).flatten(len(chains)).all(-1)
    assert not want.all() if chains else True
    got = all_finite(e, a, b, n_batch=len(chains))
    assert got.dtype == torch.bool and torch.equal(got, want)
    tracked = [t.clone().requires_grad_(dtype != torch.bfloat16) for t in (e, a, b)]
    assert torch.equal(all_finite(*tracked, n_batch=len(chains)), want)
    if chains:
        mapped = torch.func.vmap(lambda u, v, w: all_finite(u, v, w, n_batch=len(chains) - 1))(e, a, b)
        assert torch.equal(mapped, want)


def test_select_returns_the_new_state_itself_only_when_every_chain_takes_it():
    from fnebm.samplers.langevin import LangevinState
    from fnebm.samplers.proposal import select

    old = LangevinState(torch.zeros(4, 3), torch.zeros(4), torch.zeros(4, 3))
    new = LangevinState(torch.ones(4, 3), torch.ones(4), torch.ones(4, 3))
    assert select(torch.ones(4, dtype=torch.bool), new, old) is new
    mask = torch.tensor([True, False, True, True])
    got = select(mask, new, old)
    assert type(got) is type(new) and torch.equal(got.energy, mask.to(torch.float32))
    assert torch.equal(got.position, mask[:, None].expand(4, 3).to(torch.float32))
    # a large field when some chains keep the old state: NumPy's where on one thread, torch.where's values
    big_new, big_old = LangevinState(torch.randn(64, 1000), torch.randn(64), torch.randn(64, 1000)), \
        LangevinState(torch.randn(64, 1000), torch.randn(64), torch.randn(64, 1000))
    some = torch.arange(64) % 3 == 0
    for a, n, o in zip(select(some, big_new, big_old), big_new, big_old):
        assert torch.equal(a, torch.where(some.reshape((64,) + (1,) * (n.ndim - 1)), n, o))
    # autograd through the choice: torch.where (the old state stays in the graph)
    tracked = new._replace(position=new.position.requires_grad_(True))
    assert select(torch.ones(4, dtype=torch.bool), tracked, old) is not tracked


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("per_chain", [False, True])
def test_euler_maruyama_on_one_thread_gives_torchs_bits(dtype, per_chain):
    # a large eager update runs as NumPy's four operations on one thread (the torch threads' start cost
    # more than the work): the same bits as torch's; and torch's own operations wherever autograd or a
    # transform could see it
    from fnebm import _one_thread
    from fnebm.integrators import diffusion
    from fnebm.samplers.mala import log_acceptance_ratio

    g = torch.Generator().manual_seed(0)
    x, grad, noise, y, grad2 = (torch.randn(64, 1000, generator=g, dtype=dtype) for _ in range(5))
    h = torch.rand((64, 1) if per_chain else (), generator=g, dtype=dtype) * 0.1 + 1e-3
    s = torch.rand((64, 1) if per_chain else (), generator=g, dtype=dtype) + 0.1
    want = x - h * grad + (s * (2.0 * h).sqrt()) * noise
    assert x.numel() >= _one_thread.GRAIN
    assert _one_thread.views(x, grad, h, noise) is not None
    assert torch.equal(diffusion.euler_maruyama(x, grad, h, noise, s), want)
    # in one C pass (no fused multiply-add: 64,000 values would show one), and NumPy's passes alike
    from fnebm import random as fr

    lib = fr._c_library()
    assert lib is not None
    assert torch.equal(_one_thread.euler_maruyama(lib, x, h, grad, s * (2.0 * h).sqrt(), noise), want)
    for sign in (1.0, -1.0):  # the leapfrog's steps: one C pass each
        assert torch.equal(_one_thread.axpy(x, sign, 0.5 * h, grad, lib), x + sign * ((0.5 * h) * grad))
    _one_thread._C = False
    try:
        assert _one_thread.euler_maruyama(lib, x, h, grad, s, noise) is None
        assert torch.equal(diffusion.euler_maruyama(x, grad, h, noise, s), want)
    finally:
        _one_thread._C = True
    # the leapfrog's steps and MALA's proposal densities, the same way
    assert torch.equal(_one_thread.axpy(x, -1.0, 0.5 * h, grad), x - (0.5 * h) * grad)
    assert torch.equal(_one_thread.axpy(x, 1.0, 0.5 * h, grad), x + (0.5 * h) * grad)
    e, e2 = torch.randn(64, generator=g, dtype=dtype), torch.randn(64, generator=g, dtype=dtype)
    hc = h.reshape(h.shape[:1])
    forward, backward = y - x + h * grad, x - y + h * grad2
    ratio = e - e2 + (forward * forward - backward * backward).sum(-1) / (4.0 * hc)
    assert torch.equal(log_acceptance_ratio(x, e, grad, y, e2, grad2, hc), ratio)
    assert torch.equal(_one_thread.mala_diff(lib, x, y, grad, grad2, h), forward * forward - backward * backward)
    for tracked in (x.clone().requires_grad_(True), h.clone().requires_grad_(True)):
        args = [tracked if a.shape == tracked.shape and a.equal(tracked) else a for a in (x, grad, h, noise)]
        out = diffusion.euler_maruyama(*args, s)
        assert out.requires_grad and torch.equal(out.detach(), want)
    h0, s0 = (h, s) if not per_chain else (h[0], s[0])
    batched = torch.func.vmap(lambda a: diffusion.euler_maruyama(a, grad[0], h0, noise[0], s0))(x)
    assert torch.equal(batched, x - h0 * grad[0] + (s0 * (2.0 * h0).sqrt()) * noise[0])
    small = x[:8]  # below the grain size: torch's operations
    assert _one_thread.views(small, grad[:8]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_small_eager_state_takes_the_c_update_with_torchs_bits(dtype):
    # below torch's grain size (NumPy's passes are not worth it there) the C helpers still replace torch's
    # two to four operations: 5,000 chains of a 2-D position; a lazily negated operand steps aside (C would
    # read its memory un-negated)
    from fnebm import _one_thread
    from fnebm import random as fr
    from fnebm.integrators import diffusion

    g = torch.Generator().manual_seed(1)
    x, grad, noise = (torch.randn(5000, 2, generator=g, dtype=dtype) for _ in range(3))
    h, s = torch.tensor(0.01, dtype=dtype), torch.tensor(0.05, dtype=dtype)
    assert _one_thread.C_MIN <= x.numel() < _one_thread.GRAIN
    lib = fr._c_helpers(x)
    assert lib is not None and fr._c_helpers(x[:10]) is None  # a handful of values: torch's operations
    scale = s * (2.0 * h).sqrt()
    want = x - h * grad + scale * noise
    assert torch.equal(_one_thread.euler_maruyama(lib, x, h, grad, scale, noise), want)
    assert torch.equal(diffusion.euler_maruyama(x, grad, h, noise, s), want)
    assert torch.equal(_one_thread.axpy(x, -1.0, h, grad, lib), x - h * grad)
    assert _one_thread.views(x, grad) is None  # NumPy's passes: from the grain size only
    negated = torch._neg_view(noise)
    assert negated.is_neg() and not _one_thread.plain(x, h, grad, scale, negated, min_size=1)
    assert _one_thread.euler_maruyama(lib, x, h, grad, scale, negated) is None
    assert torch.equal(diffusion.euler_maruyama(x, grad, h, negated, s), x - h * grad + scale * (-noise))


def test_the_divergence_check_of_finite_values_looks_at_no_row(monkeypatch):
    # every value finite (every step but a divergent one's): one flat C pass a tensor, all true
    from fnebm import _one_thread
    from fnebm.samplers.base import all_finite

    monkeypatch.setattr(_one_thread, "rows_finite", lambda *a: pytest.fail("a row was looked at"))
    e, a = torch.randn(3, 7), torch.randn(3, 7, 4)
    got = all_finite(e, a, a.double().float(), n_batch=2)
    assert got.dtype == torch.bool and got.shape == (3, 7) and bool(got.all())
    assert all_finite(e[0, 0], a[0, 0], n_batch=0).shape == ()
    # a scalar of fewer axes than the batch broadcasts, as the rows' answer does (not its own shape)
    monkeypatch.undo()
    square = torch.randn(7, 7, 4)
    assert all_finite(e[0], square, n_batch=2).shape == (7, 7) and bool(all_finite(e[0], square, n_batch=2).all())
    a[1, 2, 3] = math.nan  # then the rows say which chain
    want = torch.ones(3, 7, dtype=torch.bool)
    want[1, 2] = False
    assert torch.equal(all_finite(e, a, n_batch=2), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [2000, 2, 15, 16])  # short rows (under 16) take the C helper's flat loop
def test_the_divergence_checks_rows_in_c_give_numpys_answer(dtype, width):
    from fnebm import _one_thread
    from fnebm.samplers.base import all_finite

    g = torch.Generator().manual_seed(3)
    e, a, b = torch.randn(6, 4, generator=g, dtype=dtype), torch.randn(6, 4, width, generator=g, dtype=dtype), \
        torch.randn(6, 4, width, generator=g, dtype=dtype)
    a[1, 2, 1], a[5, 0, width - 1], b[0, 0, 0], b[3, 3, width // 2], e[2, 1] = math.nan, math.inf, -math.inf, math.nan, math.inf
    b[4, 1, width - 1] = torch.finfo(dtype).max  # huge but finite
    want = torch.isfinite(e) & torch.isfinite(a).all(-1) & torch.isfinite(b).all(-1)
    assert int(want.sum()) == 19
    for c in (True, False):
        _one_thread._C = c
        try:
            assert torch.equal(all_finite(e, a, b, n_batch=2), want)
            assert torch.equal(all_finite(e, a.transpose(0, 1).contiguous().transpose(0, 1), b, n_batch=2), want)
            # a scalar in another memory order (its mask must still be the one C writes into)
            assert torch.equal(all_finite(e.t().contiguous().t(), a, b, n_batch=2), want)
            # a scalar of fewer axes broadcasts, as NumPy's answer does
            assert torch.equal(all_finite(e[0], a, b, n_batch=2),
                               torch.isfinite(e[0]) & torch.isfinite(a).all(-1) & torch.isfinite(b).all(-1))
            assert all_finite(e[0, 0], a[0, 0], n_batch=0).shape == ()
        finally:
            _one_thread._C = True
    import numpy as np

    from fnebm import random as fr

    ok = np.ones(6 * 4, dtype=np.bool_)
    assert _one_thread.rows_finite(fr._c_library(), ok, a.numpy().reshape(24, width)) and ok.sum() == 22
    assert not _one_thread.rows_finite(fr._c_library(), ok, a.numpy().reshape(24, width)[:, ::2])  # not contiguous: NumPy's turn
    ok[3] = False  # a row flagged already stays flagged
    assert _one_thread.rows_finite(fr._c_library(), ok, b.numpy().reshape(24, width)) and not ok[3] and ok.sum() == 19


def test_the_one_thread_path_steps_aside_wherever_torch_must_see_the_operations():
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import TorchDispatchMode

    from fnebm import _one_thread

    x, g = torch.randn(64, 1000), torch.randn(64, 1000)
    h = torch.tensor(0.1)
    assert _one_thread.views(x, h, g) is not None and _one_thread.views(x, torch.ones(64, 1), g) is not None
    assert _one_thread.views(x, torch.ones(64), g) is None  # does not broadcast to x's shape
    assert _one_thread.views(x, h, g.t().contiguous().t()) is None  # not contiguous: torch's strides
    # make_fx would bake a NumPy result into its graph as a constant
    gm = make_fx(lambda a, b: _one_thread.axpy(a, 1.0, h, b))(x, g)
    assert torch.equal(gm(2 * x, g), 2 * x + h * g)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        assert torch.equal(fwAD.unpack_dual(_one_thread.axpy(dual, 1.0, h, g)).tangent, torch.ones_like(x))

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    with Seen() as mode:
        _one_thread.axpy(x, 1.0, h, g)
    assert mode.ops >= 2
    # the divergence check's NumPy path too: traced, the graph checks the values it is given
    from fnebm.samplers.base import all_finite

    gm = make_fx(lambda e, a: all_finite(e, a, n_batch=1))(torch.zeros(64), x)
    bad = x.clone()
    bad[3, 5] = float("nan")
    assert gm(torch.zeros(64), bad).tolist() == [i != 3 for i in range(64)]


def test_float32_chain_follows_the_inputs():
    e = E.double_well()
    alg = fnebm.langevin(e, 0.01)
    state, _ = alg.step(alg.init(torch.zeros(4)), fr.key(0))
    assert state.position.dtype == torch.float32 and state.energy.dtype == torch.float32


BAD = [
    (lambda e: fnebm.mala(e, 0.0), ValueError, "step_size must be a finite number > 0"),
    (lambda e: fnebm.mala(e, -0.1), ValueError, "step_size"),
    (lambda e: fnebm.mala(e, float("nan")), ValueError, "step_size"),
    (lambda e: fnebm.langevin(e, float("inf")), ValueError, "step_size"),
    (lambda e: fnebm.langevin(e, "0.1"), TypeError, "step_size must be a real number or a floating tensor"),
    (lambda e: fnebm.langevin(e, torch.tensor([0.1, -0.2])), ValueError, "step_size must be a finite number > 0 everywhere"),
    (lambda e: fnebm.langevin(e, torch.tensor([1, 2])), TypeError, "step_size must be a real number or a floating tensor"),
    (lambda e: fnebm.langevin(e, 0.1, noise_scale=-1.0), ValueError, "noise_scale"),
    (lambda e: fnebm.mala("energy", 0.1), TypeError, "energy_fn must be callable"),
    (lambda e: fnebm.mala(e, 0.1).init(torch.zeros(2, dtype=torch.float32)), TypeError, "dtype"),
    (lambda e: fnebm.mala(e, 0.1).init(torch.zeros(2, dtype=torch.int64)), TypeError, "floating"),
    (lambda e: fnebm.mala(e, 0.1).init([0.0, 0.0]), TypeError, "position must be a torch.Tensor"),
    (
        lambda e: fnebm.mala(e, 0.1).step(fnebm.mala(e, 0.1).init(torch.zeros(2, dtype=F64)), torch.zeros(3, dtype=torch.int64)),
        ValueError,
        r"key must have shape \(\.\.\., 2\)",
    ),
    (
        lambda e: fnebm.langevin(e, 0.1).step(fnebm.langevin(e, 0.1).init(torch.zeros(2, dtype=F64)), torch.zeros(2)),
        TypeError,
        "key must have dtype torch.int64",
    ),
]


@pytest.mark.parametrize("call,exc,match", BAD)
def test_bad_input_raises(call, exc, match, target):
    with pytest.raises(exc, match=match):
        call(target)


def test_step_size_as_tensor_is_accepted(target):
    alg = fnebm.mala(target, torch.tensor(0.1))
    state, _ = alg.step(alg.init(torch.zeros(2, dtype=F64)), fr.key(0))
    assert state.position.shape == (2,)


_compiled_all_finite = None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 63), st.integers(0, 2),
                          st.sampled_from([math.inf, -math.inf, math.nan, 3.0e38])), max_size=12))
def test_all_finite_is_an_all_of_isfinite_eager_and_compiled(spots):
    # the samplers' divergence check is a max-of-|.| float reduction (it compiles to plain vector
    # code on CPU); it must say exactly what isfinite says, NaN and -inf included, compiled too
    global _compiled_all_finite
    from fnebm.samplers.base import all_finite, event_all

    if _compiled_all_finite is None:
        _compiled_all_finite = torch.compile(lambda s, a, b: all_finite(s, a, b, n_batch=1), fullgraph=True)
    s, a, b = torch.randn(64), torch.randn(64, 3), torch.randn(64, 3)
    for which, chain, j, value in spots:
        if which == 0:
            s[chain] = value
        else:
            (a, b)[which - 1][chain, j] = value
    want = s.isfinite() & event_all(a.isfinite() & b.isfinite(), 1)
    assert torch.equal(all_finite(s, a, b, n_batch=1), want)
    assert torch.equal(_compiled_all_finite(s, a, b), want)
    # several chain axes, and no event tensors at all
    assert torch.equal(all_finite(s.reshape(8, 8), a.reshape(8, 8, 3), n_batch=2),
                       (s.isfinite() & event_all(a.isfinite(), 1)).reshape(8, 8))
    assert torch.equal(all_finite(s, n_batch=1), s.isfinite())
