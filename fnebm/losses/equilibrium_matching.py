"""Equilibrium matching (EqM; Wang, Du et al. 2025): a time-invariant gradient field of an energy landscape.

The model learns one field ``f(x)`` with no time input whose target along the path
``x_t = alpha(t) x1 + sigma(t) x0`` is ``-u_t c(t)`` — for the linear path ``(x0 - x1) c(t)``,
pointing from the data ``x1`` to the noise ``x0`` — scaled by the truncated decay

    ``c(t) = lambda min(1, (1 - t) / (1 - a))``        (``a = threshold``, ``lambda = multiplier``)

which vanishes on the data (``t = 1``), so the data are the field's equilibria.
``L = mean_i mean_event |f(x_t_i) - target_i|^2``. Two forms:

* **implicit** (``form="field"``): the model *is* the field, ``model(x) -> f`` for one sample;
* **explicit energy** (``form="energy"``): the model is a scalar energy ``E(x)`` (an fnebm
  energy) and ``f = grad_x E``: the field is a gradient, ``exp(-E)`` a density whose modes are
  the data; the loss differentiates through ``grad_x E`` (a second-order backward).

**Conventions.** fnebm's energies define ``p ∝ exp(-E)``, so descending the learned field,
``x <- x - eta f(x)`` (:func:`fnebm.samplers.eqm`), walks to the data; the field is ``+grad E``
and the probability-flow velocity toward the data is ``-f``. TorchEBM 0.8.9's
``EquilibriumMatchingLoss(prediction="velocity")`` computes the same loss: its
``energy_type="none"`` is ``form="field"`` (its model gets a zeroed clock,
``time_invariant=True``; here the field takes no time at all), and its ``energy_type="dot"``,
``g(x) = x · net(x, 0)``, is ``form="energy"`` with ``E(x) = x · net(x)``. Its defaults
(``ct="truncated"``, ``ct_threshold=0.8``, ``ct_multiplier=4``, uniform ``t``) are these.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import _checks
from fnebm.interpolants import Interpolant, expand_time, interpolate
from fnebm.losses import _common, _generative

__all__ = ["EqMAux", "equilibrium_matching", "eqm_decay"]


class EqMAux(NamedTuple):
    """per_sample: ``(n,)`` squared errors averaged over the event; t: ``(n,)`` the times;
    energy: ``(n,)`` ``E(x_t)`` for ``form="energy"``, else empty ``(0,)`` (all detached)."""

    per_sample: Tensor
    t: Tensor
    energy: Tensor


def eqm_decay(t: Tensor, threshold: float | Tensor = 0.8, multiplier: float | Tensor = 4.0) -> Tensor:
    """EqM's truncated decay ``c(t) = multiplier * min(1, (1 - t) / (1 - threshold))``, elementwise."""
    return torch.clamp((1.0 - t) / (1.0 - threshold), max=1.0) * multiplier


def _energy_grad(energy: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    g, e = torch.func.grad_and_value(energy)(x)
    return g, e


def _time_free(model: Callable, x: Tensor, t: Tensor) -> Tensor:
    return model(x)


def equilibrium_matching(
    model: Callable[[Tensor], Tensor],
    batch: Tensor,
    key: Tensor,
    *,
    form: str = "field",
    interpolant: Interpolant | None = None,
    coupling: Callable | None = None,
    time: Callable | None = None,
    threshold: float | Tensor = 0.8,
    multiplier: float | Tensor = 4.0,
    decay: Callable[[Tensor], Tensor] | None = None,
    time_conditioned: bool = False,
    x0: Tensor | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[Tensor, EqMAux]:
    """Equilibrium matching: ``mean_i mean_event |f(x_t_i) + u_t_i c(t_i)|^2``.

    Args:
        model: ``form="field"``: the field ``model(x) -> f`` for one sample (a pytree of its
            parameters, ``losses.bind_field(field_fn, params)``); ``form="energy"``: an fnebm
            energy ``E(x) -> ()`` (``energies.bind(energy_fn, params)``), ``f = grad_x E``.
        batch: data ``x1: (n, *event)``.
        key: one key ``(2,)``, split as ``k_noise, k_couple, k_time = split(key, 3)``.
        form: ``"field"`` (implicit EqM) or ``"energy"`` (explicit EqM-E).
        interpolant, coupling, time, x0: as :func:`fnebm.losses.flow_matching` (defaults:
            linear path, independent pairs, ``t ~ U[0, 1]``, ``x0 ~ N(0, I)``).
        threshold: ``a`` in ``(0, 1)``; multiplier: ``lambda > 0`` (numbers or tensors).
        decay: ``t -> c(t)`` in place of the truncated decay (then ``threshold`` and
            ``multiplier`` are not used): e.g. ``lambda t: 1 - t``, or ``torch.ones_like``
            (with ``time_conditioned=True``, the negated flow-matching loss).
        time_conditioned: give the field ``t`` as well, ``model(x, t)`` (TorchEBM's
            ``time_invariant=False``); sample such a field at ``t = 0``.
        autocast: run the model's forward under ``torch.autocast(dtype)``.

    Returns:
        ``(loss, EqMAux)``; the loss is 0-dim in the batch's dtype.
    """
    if form not in ("field", "energy"):
        raise ValueError(f"form must be 'field' (implicit EqM) or 'energy' (explicit EqM-E), got {form!r}")
    if form == "energy":
        _common.check_energy(model)
    else:
        _generative.check_field("model", model)
    batch = _common.check_batch(batch)
    _common.check_loss_key(key)
    interpolant = _generative.check_interpolant(interpolant)
    coupling = _generative.check_coupling(coupling)
    time = _generative.check_time(time)
    if x0 is not None:
        x0 = _generative.check_source(x0, batch)
    if decay is None:
        _check_threshold(threshold)
        multiplier = _checks.tunable("multiplier", multiplier) if isinstance(multiplier, Tensor) else \
            float(_checks.tunable("multiplier", multiplier))
        decay = functools.partial(eqm_decay, threshold=threshold, multiplier=multiplier)
    else:
        _checks.check_callable("decay", decay, "t -> c(t), elementwise")
    if not isinstance(time_conditioned, bool):
        raise TypeError(f"time_conditioned must be a bool, got {type(time_conditioned).__name__}")
    if form == "energy" and time_conditioned:
        raise ValueError("time_conditioned=True is for form='field'; an energy E(x) takes one sample")
    dtype = _common.check_autocast(autocast)

    x0, x1, t = _generative.pairs(batch, key, x0, coupling, time)
    xt, ut = interpolate(interpolant, x0, x1, t)
    c = decay(t)
    if isinstance(c, Tensor):
        c = expand_time(c.to(xt.dtype), xt)
    target = -ut * c
    if form == "energy":
        f, energy = torch.func.vmap(functools.partial(_energy_grad, _common.with_autocast(model, dtype)))(xt)
        energy = energy.detach()
    else:
        field = _generative.with_autocast(model, dtype)
        if time_conditioned:
            f = _generative.batched(field)(xt, t)
        else:
            f = (field(xt) if _generative._is_batched(field) else
                 _generative.batched(functools.partial(_time_free, field))(xt, t))
        energy = xt.new_zeros(0)
    per = _generative.mean_flat((f - target) ** 2)
    return per.mean(), EqMAux(per.detach(), t.detach(), energy)


def _check_threshold(a: Any) -> None:
    if isinstance(a, Tensor):
        _checks.tunable("threshold", a)
        if _checks.is_concrete(a) and not bool((a < 1).all()):
            raise ValueError("threshold must be in (0, 1)")
        return
    v = _checks.check_real("threshold", a)
    if not 0.0 < v < 1.0:
        raise ValueError(f"threshold must be in (0, 1), got {v} (decay=lambda t: 1 - t is the a -> 0 end, "
                         "decay=torch.ones_like the a -> 1 end)")
