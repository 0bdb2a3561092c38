"""MALA's fused step on a CUDA device (fnebm.kernels.mala_step) against the sampler's torch operations.

The kernels run under TRITON_INTERPRET=1 on CPU tensors (the module's ``_DEVICES`` widened to
the CPU). The proposal's normals come from the interpreter's log/cos/sin, so it matches the
torch path to a few ulps; the accept/reject's decisions and the selected state match exactly.
"""

import importlib
import math
import os
import types

import pytest
import torch

import fnebm
from fnebm import random as fr
from fnebm.chain import engines
from fnebm.integrators.diffusion import euler_maruyama
from fnebm.kernels import mala_step
from fnebm.samplers import proposal as mh
from fnebm.samplers.base import all_finite
from fnebm.samplers.mala import log_acceptance_ratio

triton = pytest.importorskip("triton")  # tests/conftest.py set TRITON_INTERPRET=1 where there is no GPU
mala_module = importlib.import_module("fnebm.samplers.mala")


# On a GPU (no interpreter) the kernels run on CUDA tensors; under the interpreter on CPU ones.
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 or a GPU")


@pytest.fixture
def on_cpu(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(mala_step, "_DEVICES", ("cpu",))


def _state(chains, event, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)  # test data only
    x = torch.randn(chains + event, generator=g, dtype=dtype)
    grad = torch.randn(chains + event, generator=g, dtype=dtype)
    energy = torch.randn(chains, generator=g, dtype=dtype)
    keys = fr.split(fr.key(seed + 3), max(math.prod(chains), 1))[: math.prod(chains)].reshape(chains + (2,))
    return x.to(DEVICE), energy.to(DEVICE), grad.to(DEVICE), keys.to(DEVICE)


def _h(kind, chains, dtype):
    if kind == "host":  # a 0-dim CPU step size: passed by value
        return torch.tensor(0.05, dtype=dtype)
    return torch.linspace(0.01, 0.2, math.prod(chains), dtype=dtype, device=DEVICE).reshape(chains + (1,))


_CASES = [((5,), (3,)), ((2, 3), (2, 5)), ((4,), (1,)), ((3,), (300,)), ((7,), (6,))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hkind", ["host", "chain"])
def test_the_proposal_is_the_torch_paths_to_an_ulp_or_two(on_cpu, dtype, hkind):
    for chains, event in _CASES:
        x, energy, grad, keys = _state(chains, event, dtype)
        h = _h(hkind, chains, dtype)
        h_full = h if h.ndim == 0 else h.reshape(chains + (1,) * len(event))
        assert mala_step.eligible(x, energy, grad, keys, h_full)
        got = mala_step.propose(x, grad, keys, h_full)
        want = euler_maruyama(x, grad, h_full, fr.normal(fr.split(keys)[..., 0, :], event, dtype))
        assert got.shape == want.shape and got.dtype == dtype
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got, want, rtol=8 * eps, atol=8 * eps, msg=str((chains, event)))


def _torch_accept(x, energy, grad, prop, e_new, g_new, keys, h):
    n_batch = energy.ndim
    h_chain = h if h.ndim == 0 else h.reshape(h.shape[:n_batch])
    log_alpha = log_acceptance_ratio(x, energy, grad, prop, e_new, g_new, h_chain)
    d = mh.metropolis_hastings(fr.split(keys)[..., 1, :], log_alpha, all_finite(e_new, g_new, n_batch=n_batch))
    new = mh.select(d.is_accepted, (prop, e_new, g_new), (x, energy, grad))
    return new, (d.acceptance_rate, d.is_accepted, d.is_divergent), log_alpha


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hkind", ["host", "chain"])
def test_the_accept_reject_takes_the_torch_paths_decisions(on_cpu, dtype, hkind):
    n_accepted = n_rejected = 0
    for chains, event in _CASES:
        x, energy, grad, keys = _state(chains, event, dtype)
        h = _h(hkind, chains, dtype)
        h_full = h if h.ndim == 0 else h.reshape(chains + (1,) * len(event))
        _, e_new, g_new, _ = _state(chains, event, dtype, seed=1)
        prop = x + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=dtype).to(DEVICE)
        g_new = grad + 0.1 * g_new
        e_new = energy + 0.5 * e_new
        want_state, want_info, log_alpha = _torch_accept(x, energy, grad, prop, e_new, g_new, keys, h_full)
        got_state, got_info = mala_step.accept(x, energy, grad, prop, e_new, g_new, keys, h_full)
        assert torch.equal(got_info[1], want_info[1]), (chains, event)  # the decisions
        assert torch.equal(got_info[2], want_info[2])
        for got, want in zip(got_state, want_state):  # the selected values, copied
            assert got.dtype == want.dtype and torch.equal(got, want), (chains, event)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got_info[0], want_info[0], rtol=64 * eps, atol=64 * eps)
        n_accepted += int(want_info[1].sum())
        n_rejected += int((~want_info[1]).sum())
        assert torch.isfinite(log_alpha).all()
    assert n_accepted > 3 and n_rejected > 3  # both branches exercised


def test_a_non_finite_energy_or_gradient_is_rejected_and_reported(on_cpu):
    chains, event = (4,), (3,)
    x, energy, grad, keys = _state(chains, event, torch.float32)
    h = torch.tensor(0.01)
    e_new, g_new = energy.clone(), grad.clone()
    e_new[0] = math.inf  # noqa
    g_new[1, 2] = math.nan
    e_new[2] = math.nan
    (x1, e1, g1), (rate, acc, div) = mala_step.accept(x, energy, grad, x + 1e-3, e_new, g_new, keys, h)
    assert div.tolist() == [True, True, True, False]
    assert not acc[:3].any() and (rate[:3] == 0).all()
    assert torch.equal(x1[:3], x[:3]) and torch.equal(e1[:3], energy[:3]) and torch.equal(g1[:3], grad[:3])


def _energy(b):
    return 0.5 * (b * b).sum() + torch.log1p(torch.exp(b[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sample_chain_with_the_fused_step_gives_the_torch_steps_chain(monkeypatch, dtype):
    x0 = torch.linspace(-1, 1, 6 * 5, dtype=dtype, device=DEVICE).reshape(6, 5)
    alg = fnebm.mala(_energy, 0.3)
    state = torch.func.vmap(alg.init)(x0)

    def run(fused):
        with monkeypatch.context() as mp:
            mp.setattr(mala_step, "_DEVICES", (DEVICE,) if fused else ())
            mp.setattr(engines, "_CUDA_GRAPHS", False)  # a launch a step (a graph replays its capture)
            launches = []
            if fused:
                kernels = mala_step._load()
                mp.setattr(mala_step, "_kernels", tuple(_Counted(k, launches) for k in kernels))
                for name in ("euler_maruyama", "log_acceptance_ratio", "metropolis_hastings", "select"):
                    mp.setattr(mala_module, name, _refuse(name))
                mp.setattr(mala_module, "fr", types.SimpleNamespace(split=_refuse("split"), normal=_refuse("normal")))
            plans = []
            out = fnebm.sample_chain(alg.step, state, fr.key(5, device=DEVICE), 12, compile=False, on_plan=plans.append)
        assert (mala_step.NOTE in plans[0].reason) == fused, plans[0].reason  # the plan says which path ran
        return out, launches

    (s_t, trace_t, info_t), _ = run(False)
    (s_f, trace_f, info_f), launches = run(True)
    assert len(launches) == 2 * 12  # propose and accept, each one launch a step
    assert torch.equal(info_f.is_accepted, info_t.is_accepted) and 0 < info_t.is_accepted.float().mean() < 1
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(trace_f, trace_t, rtol=1e3 * eps, atol=1e3 * eps)
    torch.testing.assert_close(info_f.acceptance_rate, info_t.acceptance_rate, rtol=1e3 * eps, atol=1e3 * eps)


def test_a_gradient_through_the_step_takes_the_torch_path(on_cpu):
    # autograd tracking the state (or a step size that requires grad): not eligible, and the
    # step's result still carries the gradient
    x0 = torch.linspace(-1, 1, 8, dtype=torch.float64, device=DEVICE).reshape(4, 2)
    h = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    alg = fnebm.mala(_energy, h)
    state = torch.func.vmap(alg.init)(x0)
    keys = fr.split(fr.key(0, device=DEVICE), 4)
    assert not mala_step.eligible(state.position, state.energy, state.grad, keys, h)
    new, info = alg.step(state, keys)
    assert new.position.requires_grad
    new.position.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad)


def test_not_eligible_off_its_devices_or_for_other_dtypes():
    x, energy, grad, keys = _state((3,), (2,), torch.float32)
    x, energy, grad, keys = x.cpu(), energy.cpu(), grad.cpu(), keys.cpu()
    h = torch.tensor(0.1)
    assert not mala_step.eligible(x, energy, grad, keys, h)  # the CPU is not one of its devices
    mala_step._DEVICES, old = ("cpu",), mala_step._DEVICES
    try:
        assert mala_step.eligible(x, energy, grad, keys, h)
        assert not mala_step.eligible(x.half(), energy.half(), grad.half(), keys, h.half())
        assert not mala_step.eligible(x, energy, grad, keys, torch.full((2,), 0.1))  # neither one nor one per chain
        assert not mala_step.eligible(x, energy[:2], grad, keys, h)
        assert not mala_step.eligible(x.requires_grad_(), energy, grad, keys, h)
    finally:
        mala_step._DEVICES = old


class _Counted:
    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


def _refuse(name):
    def draw(*args, **kwargs):
        raise AssertionError(f"{name} ran: the fused step draws and decides in its kernels")

    return draw


def test_forward_mode_ad_and_large_events_take_the_torch_path(on_cpu, monkeypatch):
    import torch.autograd.forward_ad as fwAD

    x, energy, grad, keys = _state((4,), (3,), torch.float64)
    h = torch.tensor(0.1, dtype=torch.float64)
    assert mala_step.eligible(x, energy, grad, keys, h)
    with fwAD.dual_level():  # a dual step size: its tangent must reach the new position
        dual = fwAD.make_dual(h, torch.ones_like(h))
        assert not mala_step.eligible(x, energy, grad, keys, dual)
        alg = fnebm.mala(_energy, dual)
        state = mala_module.MALAState(x, torch.func.vmap(_energy)(x), torch.func.vmap(torch.func.grad(_energy))(x))
        new, _ = alg.step(state, keys)
        assert fwAD.unpack_dual(new.position).tangent is not None
    monkeypatch.setattr(mala_step, "MAX_EVENT", 2)  # one program a chain over a very large event: torch's turn
    assert not mala_step.eligible(x, energy, grad, keys, h)


def test_a_kernel_that_fails_turns_the_fused_step_off_with_a_warning(on_cpu, monkeypatch):
    x0 = torch.linspace(-1, 1, 12, dtype=torch.float64, device=DEVICE).reshape(4, 3)
    alg = fnebm.mala(_energy, 0.2)
    state = torch.func.vmap(alg.init)(x0)
    keys = fr.split(fr.key(1, device=DEVICE), 4)
    want, want_info = alg.step(state, keys)  # the fused step

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no kernel for this GPU")

            return launch

    monkeypatch.setattr(mala_step, "_kernels", (Broken(), Broken()))
    with pytest.warns(RuntimeWarning, match="MALA's fused step failed"):
        got, got_info = alg.step(state, keys)
    assert mala_step._kernels is False and not mala_step.runs_on(x0.device)
    assert torch.equal(got_info.is_accepted, want_info.is_accepted)
    torch.testing.assert_close(got.position, want.position, rtol=1e-12, atol=1e-12)
    plans = []
    fnebm.sample_chain(alg.step, state, fr.key(5, device=DEVICE), 3, compile=False, on_plan=plans.append)
    assert mala_step.NOTE not in plans[0].reason  # the plan follows


def test_the_plan_names_the_fused_step_only_where_the_state_takes_it(on_cpu):
    x0 = torch.linspace(-1, 1, 12, dtype=torch.float64, device=DEVICE).reshape(4, 3)
    for h, fused in ((0.2, True), (torch.tensor(0.2, dtype=torch.float64, requires_grad=True), False)):
        alg = fnebm.mala(_energy, h)
        state = torch.func.vmap(alg.init)(x0)
        plans = []
        fnebm.sample_chain(alg.step, state, fr.key(5, device=DEVICE), 3, compile=False, on_plan=plans.append)
        assert (mala_step.NOTE in plans[0].reason) == fused, plans[0].reason
