"""Step size by dual averaging (Hoffman & Gelman 2014, section 3.2.1; Stan's ``stepsize_adaptation``).

The step size ``h`` is tuned so that the sampler's acceptance statistic ``alpha`` averages to
a target ``delta``. With ``H_t = delta - alpha_t``, after ``t`` iterations

.. code-block:: text

    Hbar_t      = (1 - 1/(t + t0)) Hbar_{t-1} + H_t / (t + t0)
    log h_t     = mu - sqrt(t) / gamma * Hbar_t
    log hbar_t  = t^-kappa log h_t + (1 - t^-kappa) log hbar_{t-1}

with ``mu = log(10 h_0)``. ``h_t`` is the step size to use next (it explores); ``hbar_t``, the
iterate average, is the one to keep after warm-up. Defaults are Stan's: ``gamma = 0.05``,
``t0 = 10``, ``kappa = 0.75``.

A :class:`DualAveragingState` is a ``NamedTuple`` of tensors of one shape: 0-dim for one step
size (pooled over chains), or one per chain. The update is arithmetic only (no branch, no
``.item()``), so it traces under ``torch.compile`` and the target is a tensor input.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import _checks

__all__ = ["DualAveragingState", "DualAveraging", "dual_averaging", "init", "update", "final", "safe_acceptance"]


class DualAveragingState(NamedTuple):
    """Dual averaging's state; every field has the step size's shape (0-dim, or per chain).

    log_step_size: ``log h_t``, the step size to use at the next iteration;
    log_step_size_avg: ``log hbar_t``, the iterate average (:func:`final` returns its exp);
    avg_error: ``Hbar_t``, the running average of ``target - acceptance``;
    mu: ``log(10 h_0)``, the point ``log h`` is shrunk towards;
    count: ``t``, iterations since (re)start, as a float.
    """

    log_step_size: Tensor
    log_step_size_avg: Tensor
    avg_error: Tensor
    mu: Tensor
    count: Tensor


torch.serialization.add_safe_globals([DualAveragingState])


class DualAveraging(NamedTuple):
    """``init(initial_step_size) -> state``, ``update(state, acceptance_rate) -> state``,
    ``final(state) -> step_size``."""

    init: Callable[[Tensor], DualAveragingState]
    update: Callable[[DualAveragingState, Tensor], DualAveragingState]
    final: Callable[[DualAveragingState], Tensor]


def init(initial_step_size: Tensor, shrink_factor: float = 10.0) -> DualAveragingState:
    """A fresh state at ``h_0 = initial_step_size`` (a floating tensor, 0-dim or per chain),
    shrinking towards ``mu = log(shrink_factor h_0)`` (Stan: 10, which makes the first
    iterations try larger steps). :func:`final` of a fresh state is ``h_0``."""
    log_h = torch.log(initial_step_size)
    zero = torch.zeros_like(log_h)
    return DualAveragingState(log_h, log_h.clone(), zero, log_h + math.log(shrink_factor), zero.clone())


def safe_acceptance(acceptance_rate: Tensor) -> Tensor:
    """The acceptance statistic clamped to [0, 1], a NaN (a divergent or failed step) counted as 0."""
    return torch.nan_to_num(acceptance_rate, nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0)


def _pool(acceptance_rate: Tensor, shape: torch.Size) -> Tensor:
    """Average the trailing axes of ``acceptance_rate: (*chains)`` beyond the state's ``shape``
    (a prefix of the chain axes: ``()`` pools every chain)."""
    k = len(shape)
    if acceptance_rate.ndim < k or tuple(acceptance_rate.shape[:k]) != tuple(shape):
        raise ValueError(
            f"acceptance_rate has shape {tuple(acceptance_rate.shape)}, which does not lead with the dual "
            f"averaging state's shape {tuple(shape)}: give one acceptance per step size, or a batch of chains "
            "whose leading axes are the step size's"
        )
    if acceptance_rate.ndim > k:
        acceptance_rate = acceptance_rate.mean(dim=tuple(range(k, acceptance_rate.ndim)))
    return acceptance_rate


def update(state: DualAveragingState, acceptance_rate: Tensor, target: Tensor | float,
           t0: float = 10.0, gamma: float = 0.05, kappa: float = 0.75) -> DualAveragingState:
    """One iteration of dual averaging towards ``target``.

    ``acceptance_rate``: the sampler's acceptance statistic with the state's shape, or with more
    trailing axes (a batch of chains), which are averaged first: a 0-dim state pools every chain.
    NaN counts as 0 (see :func:`safe_acceptance`). ``target``: a number or a tensor broadcasting
    against the state.
    """
    shape = state.log_step_size.shape
    dtype = state.log_step_size.dtype
    acc = _pool(safe_acceptance(acceptance_rate), shape).to(dtype)
    target = torch.as_tensor(target, device=acc.device).to(dtype)  # a float64 target keeps a float32 state float32
    t = state.count + 1.0
    eta = 1.0 / (t + t0)
    avg_error = (1.0 - eta) * state.avg_error + eta * (target - acc)
    log_h = state.mu - torch.sqrt(t) / gamma * avg_error
    weight = t ** (-kappa)
    log_h_avg = weight * log_h + (1.0 - weight) * state.log_step_size_avg
    return DualAveragingState(log_h, log_h_avg, avg_error, state.mu, t)


def final(state: DualAveragingState) -> Tensor:
    """The step size to keep: ``exp(log_step_size_avg)``."""
    return torch.exp(state.log_step_size_avg)


def check_target(name: str, target: object) -> Tensor:
    """A target acceptance rate: a number or a 0-dim floating tensor in (0, 1) (checked where concrete)."""
    if isinstance(target, Tensor):
        if not target.is_floating_point() or target.ndim != 0:
            raise TypeError(f"{name} must be a number or a 0-dim floating tensor, got a tensor of dtype "
                            f"{target.dtype} and shape {tuple(target.shape)}")
        t = target
    else:
        t = torch.tensor(_checks.check_real(name, target), dtype=torch.float64)
    if _checks.is_concrete(t) and not bool((t > 0) & (t < 1)):
        raise ValueError(f"{name} must be in (0, 1), got {float(t)}")
    return t


def dual_averaging(target: float | Tensor, *, t0: float = 10.0, gamma: float = 0.05,
                   kappa: float = 0.75) -> DualAveraging:
    """Dual averaging of the step size towards the acceptance statistic ``target`` (e.g. 0.8 for
    NUTS, 0.65 for HMC), as the triple ``DualAveraging(init, update, final)``:

    * ``init(initial_step_size: Tensor) -> DualAveragingState`` (0-dim: one step size; per chain);
    * ``update(state, acceptance_rate) -> state`` — ``acceptance_rate`` of the chains, averaged
      over the axes the state does not have (pooled), NaN counted as 0;
    * ``final(state) -> step_size``, the averaged iterate; ``state.log_step_size.exp()`` is the
      step size to use during warm-up.

    ``t0 >= 0`` stabilises the first iterations, ``gamma > 0`` sets the speed, ``kappa`` in
    (0.5, 1] the forgetting of early iterates. The functions are pure and trace under
    ``torch.compile``; ``target`` (a tensor) is a graph input.
    """
    target = check_target("target", target)
    t0 = _checks.check_real("t0", t0)
    gamma = _checks.check_real("gamma", gamma)
    kappa = _checks.check_real("kappa", kappa)
    if not t0 >= 0:
        raise ValueError(f"t0 must be >= 0, got {t0}")
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    if not 0.5 < kappa <= 1:
        raise ValueError(f"kappa must be in (0.5, 1], got {kappa}")
    return DualAveraging(init, functools.partial(update, target=target, t0=t0, gamma=gamma, kappa=kappa), final)
