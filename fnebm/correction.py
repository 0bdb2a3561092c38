"""A flow's draws corrected by MCMC on a learned energy: the draws then target ``exp(-E)`` exactly.

A flow (an ODE integrated from noise, :mod:`fnebm.samplers.flow`) gives draws fast but from
its own distribution, off ``exp(-E)`` by the training error and the integration error.
Started at those draws, a Metropolis-adjusted chain (:func:`fnebm.mala`, :func:`fnebm.hmc`)
leaves ``exp(-E)`` invariant: each step can only bring the draws' distribution closer to it,
and a flow that is already close needs few steps. The flow does the transport between modes,
which local MCMC cannot, and MCMC removes the bias, which the flow cannot.

This sits above :mod:`fnebm.chain` (it runs :func:`fnebm.sample_chain`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import Tensor

from fnebm import _checks
from fnebm.chain.sample import sample_chain
from fnebm.samplers.mala import mala

__all__ = ["mcmc_correct"]


def mcmc_correct(
    energy: Callable[[Tensor], Tensor],
    draws: Tensor,
    key: Tensor,
    *,
    sampler: Callable[[Callable[[Tensor], Tensor]], Any] | None = None,
    n_steps: int = 100,
    burn_in: int = 0,
    **sample_chain_kwargs: Any,
) -> tuple[Any, Any, Any]:
    """Run ``sampler(energy)`` from every draw: one chain per draw, ``burn_in + n_steps`` steps.

    Args:
        energy: the learned energy ``E(x)`` for one sample (an fnebm energy).
        draws: ``(m, *event)``, e.g. a flow sampler's final positions (detached here).
        key: one key ``(2,)``: chain ``c`` takes ``split(key, m)[c]`` (:func:`fnebm.sample_chain`).
        sampler: ``energy -> SamplingAlgorithm``, a Metropolis-adjusted one for exactness;
            default ``fnebm.mala(energy, 0.1)``. E.g. ``functools.partial(fnebm.hmc,
            step_size=0.1, num_integration_steps=10)``.
        n_steps, burn_in, and any other keyword: :func:`fnebm.sample_chain`'s (``collect``,
            ``thin``, ``compile``, ...).

    Returns:
        :func:`fnebm.sample_chain`'s ``(chain, trace, info)``: ``chain.state.position`` holds the
        corrected draws ``(m, *event)``; ``trace`` the kept positions ``(n_kept, m, *event)``;
        ``info`` the sampler's (acceptance rates).
    """
    _checks.check_callable("energy", energy, "x -> E(x) for one sample")
    if not isinstance(draws, Tensor) or not draws.is_floating_point():
        raise TypeError(f"draws must be a floating tensor (m, *event), got {type(draws).__name__}")
    if draws.ndim < 2 or draws.shape[0] == 0:
        raise ValueError(f"draws must have shape (m, *event) with m >= 1, got {tuple(draws.shape)}")
    if sampler is None:
        sampler = functools.partial(mala, step_size=0.1)
    _checks.check_callable("sampler", sampler, "energy -> SamplingAlgorithm (e.g. lambda e: fnebm.mala(e, 0.1))")
    alg = sampler(energy)
    if not (callable(getattr(alg, "init", None)) and callable(getattr(alg, "step", None))):
        raise TypeError(f"sampler(energy) must return a SamplingAlgorithm(init, step), got {type(alg).__name__}")
    state = torch.func.vmap(alg.init)(draws.detach())
    return sample_chain(alg.step, state, key, n_steps, burn_in=burn_in, **sample_chain_kwargs)
