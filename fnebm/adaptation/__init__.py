"""Adaptation: tuning a sampler's parameters during warm-up, as pure ``(init, update, final)`` triples.

* :mod:`fnebm.adaptation.step_size` — dual averaging of the step size towards a target
  acceptance statistic (:func:`dual_averaging`);
* :mod:`fnebm.adaptation.mass_matrix` — Welford's covariance, diagonal or dense, pooled over
  chains or per chain (:func:`welford`);
* :mod:`fnebm.adaptation.window` — Stan's windowed warm-up composing them on a schedule held as
  data (:func:`window_adaptation`, :func:`build_schedule`);
* :mod:`fnebm.adaptation.chees` — ChEES-HMC: step size and a jittered trajectory length tuned
  across an ensemble of chains (:func:`chees_adaptation`).

This layer sits above the samplers and below :mod:`fnebm.chain`, and never imports it: a warm-up
runs its steps through a runner (an argument, by default :func:`fnebm._loop.default_runner`,
which :mod:`fnebm.chain` sets to ``sample_chain``'s: compiled, cached, with ``compile="auto"`` and
the eager fallback).
"""

from fnebm.adaptation.chees import ChEESAdaptation, ChEESInfo, ChEESState, chees_adaptation
from fnebm.adaptation.mass_matrix import Welford, WelfordState, welford
from fnebm.adaptation.step_size import DualAveraging, DualAveragingState, dual_averaging
from fnebm.adaptation.window import (
    AdaptationResults,
    Schedule,
    WindowAdaptation,
    WindowAdaptationInfo,
    WindowAdaptationState,
    build_schedule,
    window_adaptation,
)

__all__ = [
    "window_adaptation",
    "WindowAdaptation",
    "WindowAdaptationState",
    "WindowAdaptationInfo",
    "AdaptationResults",
    "build_schedule",
    "Schedule",
    "dual_averaging",
    "DualAveraging",
    "DualAveragingState",
    "welford",
    "Welford",
    "WelfordState",
    "chees_adaptation",
    "ChEESAdaptation",
    "ChEESState",
    "ChEESInfo",
]
