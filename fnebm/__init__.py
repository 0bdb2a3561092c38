"""fnebm: functional energy-based models and MCMC on torch.func, compile-first.

Keys are data (:mod:`fnebm.random`), energies are pure functions (:mod:`fnebm.energies`),
samplers are ``SamplingAlgorithm(init, step)`` pairs (:mod:`fnebm.samplers`), and
:func:`sample_chain` runs a whole chain as one compiled region.
"""

import gc as _gc
import os as _os
import sys as _sys

if "torch" not in _sys.modules:
    # OpenMP threads that spin at barriers turn a busy neighbour core into a 3-5x slowdown of
    # every compiled step (docs/performance.md); sleeping threads cost little on a quiet
    # machine. Only possible before torch loads OpenMP, and never over a user's own setting.
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The cyclic garbage collector is paused while fnebm's modules load: with torch's objects in the
# heap, each full collection that the import's new classes and functions set off walks all of them
# (about 0.1 s of the 0.13-0.23 s that importing fnebm after torch took here). Nothing is kept from
# a collection: the next one, after the import, finds what this one would have.
_gc_was_enabled = _gc.isenabled()
_gc.disable()
try:
    from fnebm import adaptation, chain, diagnostics, energies, integrators, random, samplers  # noqa: E402
    from fnebm.adaptation import window_adaptation  # noqa: E402
    from fnebm.chain import ChainState, sample_chain  # noqa: E402
    from fnebm.gradients import score, value_and_grad  # noqa: E402
    from fnebm.samplers import SamplingAlgorithm, hmc, langevin, mala, nuts, vmap_chains  # noqa: E402
    from fnebm import datasets, interpolants, losses  # noqa: E402
    from fnebm import couplings  # noqa: E402
    from fnebm.samplers import eqm  # noqa: E402
    from fnebm.correction import mcmc_correct  # noqa: E402
    from fnebm.memory import reuse_freed_memory  # noqa: E402

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
        "interpolants",
        "losses",
        "couplings",
        "eqm",
        "mcmc_correct",
        "reuse_freed_memory",
    ]
    from fnebm import distributed  # noqa: E402  (chains across processes; the identity in one)
    from fnebm.profiling import SamplingProfile, profile_sampling  # noqa: E402  (times a run; above chain)
finally:
    if _gc_was_enabled:
        _gc.enable()
