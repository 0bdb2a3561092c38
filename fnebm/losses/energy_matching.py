"""Energy matching (Balcerak et al. 2025): one scalar potential that transports noise to data and is a Boltzmann density near it.

The model is an fnebm energy ``V(x)``. Two terms:

* **flow**: far from the data, ``-grad V`` regressed on the (OT-coupled) path velocity,
  ``L_OT = mean_i w(t_i) mean_event |-grad V(x~_i) - u_t_i|^2``, at the path points smoothed
  by noise, ``x~ = x_t + s eps``, with the gate ``w(t) = clamp((1 - t) / (1 - cutoff), 0, 1)``
  (``cutoff >= 1``: no gate) fading the flow supervision out near the data;
* **contrastive**: near the data, ``lambda_cd (mean V(x1) - trimmed mean V(x-))``, floored at
  ``-cd_clamp``, with negatives ``x-`` from ``n_steps`` unadjusted Langevin steps on ``V`` (no
  gradient through them): a fraction ``noise_fraction`` of them start at the source noise and
  sweep the temperature ``eps(k / n_steps)``, ``eps(t) = 0`` below ``tau_star``, rising linearly
  to ``epsilon_max`` at ``t = 1``; the rest start at data points and stay at ``epsilon_max``.
  The trimmed mean drops the ``int(trim_fraction m)`` highest negative energies.

The loss is their sum. With ``lambda_cd=0.0`` (a Python number) no chain runs: the warm-up
phase of the paper. TorchEBM 0.8.9's ``EnergyMatchingLoss`` computes the same terms with the
same defaults (its ``sigma`` is ``smoothing`` here, its ``langevin_dt`` ``step_size``, its
``cd_trim_fraction`` ``trim_fraction``); its Langevin step ``x - h grad V + sqrt(eps) sqrt(2h)
xi`` is :func:`fnebm.langevin`'s with ``noise_scale = sqrt(eps)``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import random as fr
from fnebm.couplings import exact_ot
from fnebm.interpolants import Interpolant, interpolate
from fnebm.losses import _common, _generative
from fnebm.samplers.langevin import build_kernel as _langevin_kernel, init as _langevin_init

__all__ = ["EnergyMatchingAux", "energy_matching", "temperature"]


class EnergyMatchingAux(NamedTuple):
    """flow_loss, cd_loss: ``()`` the two terms; negatives: ``(m, *event)`` (``(0, *event)``
    when the contrastive term is off); t: ``(n,)`` the flow term's times. All detached."""

    flow_loss: Tensor
    cd_loss: Tensor
    negatives: Tensor
    t: Tensor


def temperature(t: Tensor | float, epsilon_max: float, tau_star: float) -> Tensor | float:
    """``eps(t)``: 0 for ``t < tau_star``, ``epsilon_max (t - tau_star) / (1 - tau_star)`` up to 1, then ``epsilon_max``."""
    if isinstance(t, Tensor):
        ramp = epsilon_max * (t - tau_star) / (1.0 - tau_star)
        return torch.where(t < tau_star, torch.zeros_like(t), torch.where(t < 1.0, ramp, torch.full_like(t, epsilon_max)))
    if t < tau_star:
        return 0.0
    return epsilon_max * (t - tau_star) / (1.0 - tau_star) if t < 1.0 else epsilon_max


def _neg_grad(energy: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    return -torch.func.grad(energy)(x)


def _trimmed_mean(values: Tensor, trim_fraction: float) -> Tensor:
    n = values.shape[0]
    k = int(trim_fraction * n)
    if k == 0:
        return values.mean()
    return torch.topk(values, n - k, largest=False, sorted=False).values.mean()


def _negatives(energy: Callable[[Tensor], Tensor], starts: Tensor, n_noise: int, key: Tensor, n_steps: int,
               step_size: float, epsilon_max: float, tau_star: float) -> Tensor:
    """``n_steps`` Langevin steps from ``starts``: the first ``n_noise`` chains at the swept temperature,
    the rest at ``epsilon_max``. Step ``k`` uses ``split(fold_in(key, k), m)``."""
    m = starts.shape[0]
    kernel = _langevin_kernel()
    state = torch.func.vmap(functools.partial(_langevin_init, energy_fn=energy))(starts)
    swept = torch.arange(m, device=starts.device) < n_noise
    hot = math.sqrt(epsilon_max)
    h = torch.tensor(step_size, dtype=starts.dtype, device=starts.device)
    for k in range(n_steps):
        cold = math.sqrt(temperature(min(k, n_steps) / n_steps, epsilon_max, tau_star))
        scale = torch.where(swept, cold, hot).to(starts.dtype)
        state, _ = kernel(state, fr.split(fr.fold_in(key, k), m), energy, h, scale)
    return state.position


def energy_matching(
    energy: Callable[[Tensor], Tensor],
    batch: Tensor,
    key: Tensor,
    *,
    interpolant: Interpolant | None = None,
    coupling: Callable | None = exact_ot,
    time: Callable | None = None,
    smoothing: float = 0.1,
    flow_weight_cutoff: float = 0.8,
    lambda_cd: float | Tensor = 2.0,
    epsilon_max: float = 0.15,
    tau_star: float = 0.8,
    n_steps: int = 200,
    step_size: float = 0.01,
    noise_fraction: float = 0.5,
    trim_fraction: float = 0.1,
    cd_clamp: float | None = 0.02,
    x0: Tensor | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[Tensor, EnergyMatchingAux]:
    """Energy matching: the flow term plus ``lambda_cd`` times the contrastive term (see the module docstring).

    Args:
        energy: the potential ``V`` and its parameters, an fnebm energy (``energies.bind``).
        batch: data ``x1: (n, *event)``.
        key: one key ``(2,)``, split as ``k_pairs, k_smooth, k_chains = split(key, 3)``; the
            pairs as :func:`flow_matching`'s ``key``; ``k_chains`` picks the data starts and
            drives the chains.
        interpolant, time, x0: as :func:`fnebm.losses.flow_matching`.
        coupling: default :func:`fnebm.couplings.exact_ot` (the paper's minibatch OT; host-side).
        smoothing: ``s >= 0``, the noise added to the path points.
        flow_weight_cutoff: the gate's onset ``a``; ``>= 1`` turns the gate off.
        lambda_cd: weight of the contrastive term; ``0.0`` (a number) runs no chains.
        epsilon_max, tau_star: the temperature profile (``epsilon_max >= 0``, ``tau_star`` in ``[0, 1)``).
        n_steps, step_size: the negatives' Langevin chains (``>= 1``, ``> 0``).
        noise_fraction: in ``[0, 1]``, the share of chains started at noise (rounded).
        trim_fraction: in ``[0, 1)``; cd_clamp: ``>= 0`` or ``None`` (no floor).
        autocast: the potential's forward under ``torch.autocast(dtype)``.

    Returns:
        ``(loss, EnergyMatchingAux)``.
    """
    _common.check_energy(energy)
    batch = _common.check_batch(batch)
    _common.check_loss_key(key)
    interpolant = _generative.check_interpolant(interpolant)
    coupling = _generative.check_coupling(coupling)
    time = _generative.check_time(time)
    if x0 is not None:
        x0 = _generative.check_source(x0, batch)
    smoothing = _common.nonnegative("smoothing", smoothing)
    cutoff = _checks.check_real("flow_weight_cutoff", flow_weight_cutoff)
    lambda_cd = _common.nonnegative("lambda_cd", lambda_cd)
    epsilon_max = float(_common.nonnegative("epsilon_max", epsilon_max))
    tau_star = _checks.check_real("tau_star", tau_star)
    if not 0.0 <= tau_star < 1.0:
        raise ValueError(f"tau_star must be in [0, 1), got {tau_star}")
    n_steps = _checks.check_int("n_steps", n_steps, 1)
    step_size = float(_checks.tunable("step_size", step_size))
    noise_fraction = _checks.check_real("noise_fraction", noise_fraction)
    if not 0.0 <= noise_fraction <= 1.0:
        raise ValueError(f"noise_fraction must be in [0, 1], got {noise_fraction}")
    trim_fraction = _checks.check_real("trim_fraction", trim_fraction)
    if not 0.0 <= trim_fraction < 1.0:
        raise ValueError(f"trim_fraction must be in [0, 1), got {trim_fraction}")
    if cd_clamp is not None:
        cd_clamp = float(_common.nonnegative("cd_clamp", cd_clamp))
    dtype = _common.check_autocast(autocast)
    model = _common.with_autocast(energy, dtype)

    k_pairs, k_smooth, k_chains = fr.split(key, 3)
    source, x1, t = _generative.pairs(batch, k_pairs, x0, coupling, time)
    xt, ut = interpolate(interpolant, source, x1, t)
    if not (isinstance(smoothing, float) and smoothing == 0.0):
        s = smoothing.to(xt.dtype) if isinstance(smoothing, Tensor) else smoothing
        xt = xt + s * fr.normal(k_smooth, tuple(xt.shape), xt.dtype)
    v = torch.func.vmap(functools.partial(_neg_grad, model))(xt.detach())
    w = torch.ones_like(t) if cutoff >= 1.0 else ((1.0 - t) / (1.0 - cutoff)).clamp(0.0, 1.0)
    flow_loss = (w * _generative.mean_flat((v - ut) ** 2)).mean()

    n = batch.shape[0]
    if isinstance(lambda_cd, float) and lambda_cd == 0.0:
        cd_loss = flow_loss.new_zeros(())
        negatives = batch.new_zeros((0, *batch.shape[1:]))
    else:
        n_noise = int(round(n * noise_fraction))
        k_pick, k_run = fr.split(k_chains)
        order = torch.argsort(fr.uniform(k_pick, (n,), torch.float32))
        starts = torch.cat([source[:n_noise], batch[order[: n - n_noise]]]).detach()
        frozen = _common.with_autocast(_common.stop_gradient(energy), dtype)
        negatives = _negatives(frozen, starts, n_noise, k_run, n_steps, step_size, epsilon_max, tau_star).detach()
        pos = _common.batched(model)(batch)
        neg = _common.batched(model)(negatives)
        lam = lambda_cd.to(pos.dtype) if isinstance(lambda_cd, Tensor) else lambda_cd
        cd_loss = lam * (pos.mean() - _trimmed_mean(neg, trim_fraction))
        if cd_clamp is not None:
            cd_loss = torch.clamp(cd_loss, min=-cd_clamp)
    loss = flow_loss + cd_loss
    return loss, EnergyMatchingAux(flow_loss.detach(), cd_loss.detach(), negatives, t.detach())
