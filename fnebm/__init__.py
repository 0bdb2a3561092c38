"""fnebm: functional energy-based models and MCMC on torch.func, compile-first.

Keys are data (:mod:`fnebm.random`), energies are pure functions (:mod:`fnebm.energies`),
samplers are ``SamplingAlgorithm(init, step)`` pairs (:mod:`fnebm.samplers`), and
:func:`sample_chain` runs a whole chain as one compiled region.
"""

from fnebm import adaptation, chain, diagnostics, energies, integrators, random, samplers
from fnebm.adaptation import window_adaptation
from fnebm.chain import ChainState, sample_chain
from fnebm.gradients import score, value_and_grad
from fnebm.samplers import SamplingAlgorithm, hmc, langevin, mala, nuts, vmap_chains
from fnebm import datasets, losses

__version__ = "0.1.0"

__all__ = [
    "random",
    "energies",
    "samplers",
    "adaptation",
    "window_adaptation",
    "diagnostics",
    "chain",
    "integrators",
    "sample_chain",
    "ChainState",
    "vmap_chains",
    "value_and_grad",
    "score",
    "SamplingAlgorithm",
    "langevin",
    "mala",
    "hmc",
    "nuts",
    "datasets",
    "losses",
]
from fnebm import distributed  # noqa: E402  (chains across processes; the identity in one)
