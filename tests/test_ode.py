"""ODE/SDE solvers: measured orders, adaptive accuracy (and against torchdiffeq), compiled ≡ eager
without recompiles, buffers, keyed SDE draws, argument checks."""

import functools

import math

import numpy as np
import pytest
import torch
import torch._dynamo.testing

from fnebm import random as fr
from fnebm.integrators import ode, sde

F64 = torch.float64
FIXED = [ode.euler, ode.midpoint, ode.heun, ode.rk4, ode.bosh3, ode.dopri5]


def decay(t, x):
    """dx/dt = -t x: x(t) = x0 exp(-t^2 / 2), time-dependent so c (the stage times) matter.
    ``t`` is 0-dim, or ``(batch,)`` under per-sample control."""
    return -(t.reshape(-1, *(1,) * (x.ndim - 1)) if t.ndim else t) * x


def exact_decay(x0, t):
    return x0 * math.exp(-0.5 * t * t)


@pytest.mark.parametrize("method", FIXED, ids=lambda m: m.name)
def test_measured_order_within_0_3_of_nominal(method):
    x0 = torch.tensor([[1.0, -0.5], [2.0, 0.25]], dtype=F64)
    ns = [8, 16, 32, 64] if method.order >= 4 else [16, 32, 64, 128]
    errs = []
    for n in ns:
        x, info = ode.odeint(decay, x0, torch.linspace(0.0, 2.0, n + 1, dtype=F64), method, trajectory=False)
        errs.append((x - exact_decay(x0, 2.0)).abs().max().item())
        stages = len(method.c)
        assert int(info.nfe) == (stages + (stages - 1) * (n - 1) if method.fsal else stages * n)
    slope = np.polyfit(np.log(2.0 / np.array(ns)), np.log(errs), 1)[0]
    assert abs(slope - method.order) < 0.3, (method.name, slope, errs)


@pytest.mark.parametrize("method", [ode.bosh3, ode.dopri5], ids=lambda m: m.name)
@pytest.mark.parametrize("per_sample", [False, True])
def test_adaptive_meets_tolerance_and_tightens(method, per_sample):
    x0 = torch.tensor([[1.0, -0.5], [2.0, 0.25], [0.1, 3.0]], dtype=F64)
    t = torch.tensor([0.0, 2.0], dtype=F64)
    errors, nfes = [], []
    for tol in (1e-4, 1e-7):
        x, info = ode.odeint(decay, x0, t, method, rtol=tol, atol=tol, trajectory=False, per_sample=per_sample)
        assert bool(info.success)
        errors.append((x - exact_decay(x0, 2.0)).abs().max().item())
        nfes.append(int(info.nfe.max()))
        assert errors[-1] < 100 * tol  # the local-error control keeps the global error near tol here
    assert errors[1] < errors[0] / 30 and nfes[1] > nfes[0]


def test_adaptive_trajectory_hits_every_output_time_and_runs_backward():
    x0 = torch.tensor([[1.0], [-2.0]], dtype=F64)
    t = torch.linspace(0.0, 2.0, 5, dtype=F64)
    xs, _ = ode.odeint(decay, x0, t, ode.dopri5, rtol=1e-9, atol=1e-9)
    assert xs.shape == (5, 2, 1)
    for i, ti in enumerate(t.tolist()):
        torch.testing.assert_close(xs[i], exact_decay(x0, ti), rtol=1e-7, atol=1e-8)
    back, _ = ode.odeint(decay, xs[-1], t.flip(0), ode.dopri5, rtol=1e-9, atol=1e-9, trajectory=False)
    torch.testing.assert_close(back, x0, rtol=1e-7, atol=1e-8)
    fixed_back, _ = ode.odeint(decay, xs[-1], t.flip(0).double(), ode.rk4, trajectory=False)
    assert (fixed_back - x0).abs().max() < 1e-2


def test_dopri5_matches_torchdiffeq_nfe_and_error():
    """A damped rotation dx/dt = A x (x(t) = exp(A t) x0): at each tolerance no more evaluations than
    torchdiffeq's dopri5 and the same error (the same steps but the last, which fnebm cuts to land
    on t1 where torchdiffeq overshoots and interpolates; measured ratios 0.8-1.2)."""
    torchdiffeq = pytest.importorskip("torchdiffeq")
    x0 = torch.tensor([[1.0, -0.5], [2.0, 0.25]], dtype=F64)
    a = torch.tensor([[-0.5, 2.0], [-2.0, -0.5]], dtype=F64)
    exact = x0 @ torch.linalg.matrix_exp(2.0 * a).T
    t = torch.tensor([0.0, 2.0], dtype=F64)
    for tol in (1e-3, 1e-6, 1e-9):
        calls = []

        def counted(t, x):
            calls.append(1)
            return x @ a.T

        theirs = torchdiffeq.odeint(counted, x0, t, method="dopri5", rtol=tol, atol=tol)[-1]
        ours, info = ode.odeint(lambda t, x: x @ a.T, x0, t, ode.dopri5, rtol=tol, atol=tol, trajectory=False)
        assert int(info.nfe) <= len(calls)
        e_ours, e_theirs = (ours - exact).abs().max().item(), (theirs - exact).abs().max().item()
        assert e_ours < 1.5 * e_theirs, (tol, e_ours, e_theirs)


def test_trajectory_buffer_and_out():
    x0 = torch.ones(4, 3, dtype=F64)
    t = torch.linspace(0.0, 1.0, 11, dtype=F64)
    xs, info = ode.odeint(decay, x0, t, ode.heun)
    assert xs.shape == (11, 4, 3) and int(info.n_accepted) == 10
    torch.testing.assert_close(xs[0], x0)
    buf = torch.full((11, 4, 3), math.nan, dtype=F64)
    same, _ = ode.odeint(decay, x0, t, ode.heun, out=buf)
    assert same is buf
    torch.testing.assert_close(buf, xs)
    last = torch.empty(4, 3, dtype=F64)
    end, _ = ode.odeint(decay, x0, t, ode.heun, trajectory=False, out=last)
    assert end is last
    torch.testing.assert_close(last, xs[-1])
    buf_a = torch.empty(3, 4, 3, dtype=F64)
    got, _ = ode.odeint(decay, x0, t[[0, 5, 10]], ode.dopri5, rtol=1e-6, atol=1e-6, out=buf_a)
    assert got is buf_a and torch.isfinite(buf_a).all()


def test_bad_arguments_name_the_argument():
    x0 = torch.ones(2, 2)
    t = torch.linspace(0.0, 1.0, 3)
    with pytest.raises(TypeError, match="method"):
        ode.odeint(decay, x0, t, "rk4")
    with pytest.raises(TypeError, match="f must be callable"):
        ode.odeint(1.0, x0, t)
    with pytest.raises(ValueError, match="rtol and atol"):
        ode.odeint(decay, x0, t, ode.dopri5, rtol=1e-3)
    with pytest.raises(ValueError, match="method rk4"):
        ode.odeint(decay, x0, t, ode.rk4, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="rtol"):
        ode.odeint(decay, x0, t, ode.dopri5, rtol=-1.0, atol=1e-3)
    with pytest.raises(ValueError, match="^t must"):
        ode.odeint(decay, x0, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="strictly"):
        ode.odeint(decay, x0, torch.tensor([0.0, 1.0, 0.5]))
    with pytest.raises(ValueError, match="^out must"):
        ode.odeint(decay, x0, t, out=torch.empty(2, 2, 2))
    with pytest.raises(ValueError, match="per_sample"):
        ode.odeint(decay, x0, t, per_sample=True)
    with pytest.raises(TypeError, match="x0"):
        ode.odeint(decay, torch.ones(2, 2, dtype=torch.int64), t)
    with pytest.raises(ValueError, match="max_steps"):
        ode.odeint(decay, x0, t, ode.dopri5, rtol=1e-3, atol=1e-3, max_steps=0)


def test_max_steps_reports_failure():
    x0 = torch.ones(2, 2, dtype=F64)
    _, info = ode.odeint(decay, x0, torch.tensor([0.0, 10.0], dtype=F64), ode.dopri5, rtol=1e-12, atol=1e-12,
                         max_steps=3)
    assert not bool(info.success)


# --- compiled ≡ eager, no recompile for new parameters (one small compile each) ---------------


def mlp(params, t, x):
    w1, b1, w2 = params
    tt = t.expand(x.shape[0]) if t.ndim == 0 else t
    return torch.tanh(torch.cat((x, tt[:, None]), 1) @ w1 + b1) @ w2


def mlp_params(seed):
    k1, k2, k3 = fr.split(fr.key(seed), 3)
    return fr.normal(k1, (3, 16)), 0.1 * fr.normal(k2, (16,)), 0.5 * fr.normal(k3, (16, 2))


def test_fixed_grid_compiles_to_one_region_equal_to_eager_without_recompiles():
    x0 = fr.normal(fr.key(0), (64, 2))
    t = torch.linspace(0.0, 1.0, 9)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def solve(params, x0):
        return ode.odeint(functools.partial(mlp, params), x0, t, ode.rk4)[0]

    compiled = torch.compile(solve, backend=counter, fullgraph=True)
    p1, p2 = mlp_params(1), mlp_params(2)
    torch.testing.assert_close(compiled(p1, x0), solve(p1, x0), rtol=1e-5, atol=1e-5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(p2, x0), solve(p2, x0), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_adaptive_compiled_chunks_equal_eager_without_recompiles():
    x0 = fr.normal(fr.key(0), (64, 2))
    t = torch.tensor([0.0, 1.0])
    p1, p2 = mlp_params(1), mlp_params(2)
    ode._COMPILED.clear()
    for params, rtol in ((p1, 1e-4), (p2, torch.tensor(1e-3))):
        f = functools.partial(mlp, params)
        eager, ie = ode.odeint(f, x0, t, ode.dopri5, rtol=rtol, atol=1e-5, trajectory=False)
        with torch._dynamo.config.patch(error_on_recompile=params is p2):
            comp, ic = ode.odeint(f, x0, t, ode.dopri5, rtol=rtol, atol=1e-5, trajectory=False,
                                  compile="aot_eager", check_every=2)  # Dynamo's graph; Inductor is the bench's
        torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-5)
        assert int(ic.nfe) == int(ie.nfe) and int(ic.n_accepted) == int(ie.n_accepted)
    assert len(ode._COMPILED) <= 2  # one graph per chunk length (2, and single steps near the end)


# --- SDE --------------------------------------------------------------------------------------


def ou_drift(t, x):
    return -x


@pytest.mark.parametrize("method", [sde.euler_maruyama_step, sde.heun_step], ids=["em", "heun"])
def test_sde_is_keyed_and_has_the_ou_moments(method):
    """dX = -X dt + sqrt(2) dW from X0 = 0: Var X_1 = 1 - exp(-2); bounds from the MC standard error
    (4 sigma) plus the discretisation bias (EM: Var ~ (1 + h / 2)-scaled, about 0.5% at h = 0.01)."""
    n, steps = 20_000, 100
    x0 = torch.zeros(n, 1, dtype=F64)
    t = torch.linspace(0.0, 1.0, steps + 1, dtype=F64)
    key = fr.key(5)
    xs, info = sde.sdeint(ou_drift, math.sqrt(2.0), x0, t, key, method)
    again, _ = sde.sdeint(ou_drift, math.sqrt(2.0), x0, t, key, method)
    torch.testing.assert_close(again, xs, rtol=0, atol=0)
    other, _ = sde.sdeint(ou_drift, math.sqrt(2.0), x0, t, fr.key(6), method, trajectory=False)
    assert not torch.equal(other, xs[-1])
    assert int(info.nfe) == steps * (2 if method is sde.heun_step else 1)
    var = 1.0 - math.exp(-2.0)
    x = xs[-1, :, 0]
    assert abs(x.mean().item()) < 4 * math.sqrt(var / n)
    assert abs(x.var().item() - var) < 4 * var * math.sqrt(2.0 / n) + 0.006 * var
    # split at step 40 and continued with start=40: the uninterrupted run
    first, _ = sde.sdeint(ou_drift, math.sqrt(2.0), x0, t[:41], key, method, trajectory=False)
    rest, _ = sde.sdeint(ou_drift, math.sqrt(2.0), first, t[40:], key, method, start=40, trajectory=False)
    torch.testing.assert_close(rest, xs[-1], rtol=1e-12, atol=1e-12)


# sdeint's compiled scan: tests/test_flow_sampler.py (the whole flow SDE draw as one graph)


def test_sde_bad_arguments():
    x0 = torch.zeros(4, 2)
    t = torch.linspace(0.0, 1.0, 5)
    with pytest.raises(TypeError, match="key"):
        sde.sdeint(ou_drift, 1.0, x0, t, 3)
    with pytest.raises(ValueError, match="key"):
        sde.sdeint(ou_drift, 1.0, x0, t, fr.split(fr.key(0), 2))
    with pytest.raises(ValueError, match="strictly increasing"):
        sde.sdeint(ou_drift, 1.0, x0, t.flip(0), fr.key(0))
    with pytest.raises(TypeError, match="diffusion"):
        sde.sdeint(ou_drift, "big", x0, t, fr.key(0))
