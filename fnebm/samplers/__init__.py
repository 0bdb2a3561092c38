"""Samplers as pure functions: ``SamplingAlgorithm(init, step)`` with ``step(state, key) -> (state, info)``."""

from fnebm.samplers.base import SamplingAlgorithm
from fnebm.samplers.langevin import LangevinInfo, LangevinState, langevin
from fnebm.samplers.mala import MALAInfo, MALAState, mala

__all__ = ["SamplingAlgorithm", "langevin", "LangevinState", "LangevinInfo", "mala", "MALAState", "MALAInfo"]
