"""Samplers in three layers: ``init`` (one chain), ``build_kernel`` (a pure kernel over any chain
axes) and a constructor returning ``SamplingAlgorithm(init, step)``. See :mod:`fnebm.samplers.base`."""

from fnebm.samplers.base import SamplingAlgorithm, vmap_chains
from fnebm.samplers.eqm import EqMInfo, EqMState, energy_field, eqm
from fnebm.samplers.flow import flow_sample, log_likelihood, sample_and_log_prob
from fnebm.samplers.hmc import HMCInfo, HMCState, hmc
from fnebm.samplers.langevin import LangevinInfo, LangevinState, langevin
from fnebm.samplers.mala import MALAInfo, MALAState, mala
from fnebm.samplers.nuts import NUTSInfo, NUTSState, nuts

__all__ = [
    "SamplingAlgorithm",
    "vmap_chains",
    "langevin",
    "LangevinState",
    "LangevinInfo",
    "mala",
    "MALAState",
    "MALAInfo",
    "hmc",
    "HMCState",
    "HMCInfo",
    "nuts",
    "NUTSState",
    "NUTSInfo",
    "eqm",
    "EqMState",
    "EqMInfo",
    "energy_field",
    "flow_sample",
    "log_likelihood",
    "sample_and_log_prob",
]
