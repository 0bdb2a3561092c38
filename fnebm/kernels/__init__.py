"""Hand-written Triton kernels, each beside the pure-torch twin that defines it, registered as
torch ops (``torch.ops.fnebm.*``) so they sit inside ``torch.compile`` graphs.

* :mod:`fnebm.kernels.langevin_update` — the fused Langevin/MALA proposal
  ``x' = x - h grad + noise_scale sqrt(2 h) xi`` with the noise drawn in-kernel from the
  :mod:`fnebm.random` Philox stream (same key, same noise as the twin).
* :mod:`fnebm.kernels.langevin_chain` — whole Langevin or MALA chains in one launch for the
  separable analytic energies (double well, harmonic, diagonal Gaussian, Rastrigin): positions
  in registers, noise and uniforms in-kernel, kept draws written straight into the trace.
* :mod:`fnebm.kernels.gaussian` — energy and score of a Gaussian with a full precision matrix
  for a batch in one pass (``tl.dot``).

The twins import without triton; the kernels and ops need it (``HAS_TRITON``).
``fnebm.sample_chain(..., backend=)`` (:mod:`fnebm.chain.backend`) dispatches to the whole-chain
kernels; see docs/kernels.md for the rules.
"""

from fnebm.kernels.gaussian import gaussian_energy_score, gaussian_energy_score_torch
from fnebm.kernels.langevin_chain import (
    LangevinChain,
    MALAChain,
    langevin_chain,
    langevin_chain_torch,
    mala_chain,
    mala_chain_torch,
)
from fnebm.kernels.langevin_update import HAS_TRITON, langevin_update, langevin_update_torch

__all__ = [
    "HAS_TRITON",
    "langevin_update",
    "langevin_update_torch",
    "LangevinChain",
    "MALAChain",
    "langevin_chain",
    "langevin_chain_torch",
    "mala_chain",
    "mala_chain_torch",
    "gaussian_energy_score",
    "gaussian_energy_score_torch",
]
