"""Equilibrium matching's sampler: gradient descent on a learned field, with optional Nesterov momentum.

EqM (Wang, Du et al. 2025) learns a time-invariant field ``f(x)`` whose equilibria are the data
(:func:`fnebm.losses.equilibrium_matching`); samples come from descending it,

    ``y = x + mu v``,   ``v' = mu v - eta f(y)``,   ``x' = x + v'``

(Nesterov's accelerated gradient; ``mu = 0`` is plain gradient descent ``x' = x - eta f(x)``;
TorchEBM's ``NesterovSampler`` and ``GradientDescentSampler``). For an explicit energy the field
is ``grad E`` (:func:`energy_field`). The step is deterministic: it takes keys only to fit
``SamplingAlgorithm`` (and :func:`fnebm.sample_chain`), and reads their shape for the chain axes.

Three layers: :func:`init` (one chain), :func:`build_kernel`, :func:`eqm` (the constructor).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import _checks
from fnebm.samplers.base import SamplingAlgorithm, Step, all_finite, over_batch, per_chain
from fnebm.samplers.proposal import select

__all__ = ["EqMState", "EqMInfo", "init", "build_kernel", "eqm", "energy_field"]


class EqMState(NamedTuple):
    """position: ``(*chains, *event)``; velocity: the momentum ``v``, like position (zero at ``init``)."""

    position: Tensor
    velocity: Tensor


class EqMInfo(NamedTuple):
    """field_norm: ``chains``, ``|f(y)|`` at the look-ahead point (it falls to 0 at an equilibrium);
    is_divergent: the move gave a non-finite field or position, and the chain stayed where it was."""

    field_norm: Tensor
    is_divergent: Tensor


torch.serialization.add_safe_globals([EqMState, EqMInfo])


def _grad(energy: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    return torch.func.grad(energy)(x)


def energy_field(energy: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``x -> grad E(x)``: the EqM field of an explicit energy (``form="energy"``), for one sample."""
    _checks.check_callable("energy", energy, "x -> E(x) for one sample")
    return functools.partial(_grad, energy)


def init(position: Tensor) -> EqMState:
    """One chain's state at ``position: event`` (zero velocity); ``torch.func.vmap`` it for many."""
    if not isinstance(position, Tensor) or not position.is_floating_point():
        raise TypeError(f"position must be a floating tensor, got {type(position).__name__}")
    if _checks.is_concrete(position) and not bool(torch.isfinite(position).all()):
        raise ValueError("position must be finite (no NaN or inf)")
    return EqMState(position, torch.zeros_like(position))


def build_kernel() -> Callable[..., tuple[EqMState, EqMInfo]]:
    """The pure kernel ``kernel(state, key, field, step_size, momentum) -> (state, info)``.

    key: ``(*chains, 2)`` (its shape gives the chain axes); step_size ``> 0``, momentum in
    ``[0, 1)``: tensors, 0-dim or one per chain.
    """

    def kernel(state: EqMState, key: Tensor, field: Callable[[Tensor], Tensor], step_size: Tensor,
               momentum: Tensor):
        _checks.check_key(key)
        batch = tuple(key.shape[:-1])
        x, v = state.position, state.velocity
        if tuple(x.shape[: len(batch)]) != batch:
            raise ValueError(f"key has chain shape {batch} but the state's position has shape {tuple(x.shape)}: "
                             "pass one key per chain, with the chain axes leading both")
        eta = per_chain("step_size", step_size, batch, x)
        mu = per_chain("momentum", momentum, batch, x)
        look = x + mu * v
        f = over_batch(field, len(batch))(look)
        v_new = mu * v - eta * f
        x_new = x + v_new
        n = len(batch)
        norm = f.reshape(f.shape[:n] + (-1,)).norm(dim=-1)
        finite = all_finite(norm, x_new, n_batch=n)
        new = select(finite, EqMState(x_new, v_new), state)
        return EqMState(*new), EqMInfo(norm, ~finite)

    return kernel


_kernel = build_kernel()


def eqm(field: Callable[[Tensor], Tensor], step_size: float | Tensor, momentum: float | Tensor = 0.0) -> SamplingAlgorithm:
    """Descend the field ``f``: ``SamplingAlgorithm(init, step)``.

    field: ``x -> f(x)`` for one sample (a learned EqM field, or :func:`energy_field` of an
    energy). step_size ``eta > 0``, momentum ``mu`` in ``[0, 1)`` (0: gradient descent; the EqM
    paper's Nesterov sampler uses e.g. 0.3): numbers or tensors, 0-dim or one per chain; a new
    value of the same shape recompiles nothing. ``init(position: event) -> EqMState``;
    ``step(state, keys: (*chains, 2)) -> (EqMState, EqMInfo)``.
    """
    _checks.check_callable("field", field, "x -> f(x) for one sample (an EqM field, or samplers.energy_field(E))")
    step_size = _checks.tunable("step_size", step_size)
    momentum = _checks.tunable("momentum", momentum, allow_zero=True)
    if _checks.is_concrete(momentum) and not bool((momentum < 1).all()):
        raise ValueError("momentum must be in [0, 1)")
    return SamplingAlgorithm(init, Step.of("eqm", _kernel, state_type=EqMState, info_type=EqMInfo,
                                           tunables=("step_size", "momentum"), field=field, step_size=step_size,
                                           momentum=momentum))
