"""Hand-written kernels (Triton, and one in C for the CPU), each beside the pure-torch twin that defines it, registered as
torch ops (``torch.ops.fnebm.*``) so they sit inside ``torch.compile`` graphs.

* :mod:`fnebm.kernels.langevin_update` — the fused Langevin/MALA proposal
  ``x' = x - h grad + noise_scale sqrt(2 h) xi`` with the noise drawn in-kernel from the
  :mod:`fnebm.random` Philox stream (same key, same noise as the twin).
* :mod:`fnebm.kernels.langevin_chain` — whole Langevin or MALA chains in one launch for the
  separable analytic energies (double well, harmonic, diagonal Gaussian, Rastrigin): positions
  in registers, noise and uniforms in-kernel, kept draws written straight into the trace.
* :mod:`fnebm.kernels.gaussian` — energy and score of a Gaussian with a full precision matrix
  for a batch in one pass (``tl.dot``).
* :mod:`fnebm.kernels.cpu_chain` — the CPU counterpart of ``langevin_chain``: whole Langevin or
  MALA chains in C (``_cpu_chain.c``, OpenMP, vectorised over blocks of 16 chains) for the
  double well, harmonic, Rastrigin and Gaussian energies, built with the system C compiler on
  first use and called through ctypes; the op ``torch.ops.fnebm.cpu_chain``
  (``cpu_chain.langevin_chain`` / ``cpu_chain.mala_chain``) puts it in compiled graphs.

The twins import without triton; the kernels and ops need it (``HAS_TRITON``).
``fnebm.sample_chain(..., backend=)`` (:mod:`fnebm.chain.backend`) dispatches to the whole-chain
kernels; see docs/kernels.md for the rules.
"""

import importlib as _importlib
import sys as _sys
import types as _types

# Names load on first use (PEP 562): importing triton and registering the Triton ops takes about
# 1.5 s, which a CPU run of the C kernel (fnebm.kernels.cpu_chain) should not pay.
_WHERE = {
    "gaussian_energy_score": "gaussian",
    "gaussian_energy_score_torch": "gaussian",
    "LangevinChain": "langevin_chain",
    "MALAChain": "langevin_chain",
    "langevin_chain": "langevin_chain",
    "langevin_chain_torch": "langevin_chain",
    "mala_chain": "langevin_chain",
    "mala_chain_torch": "langevin_chain",
    "HAS_TRITON": "langevin_update",
    "langevin_update": "langevin_update",
    "langevin_update_torch": "langevin_update",
}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'fnebm.kernels' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"fnebm.kernels.{module}"), name)
    globals()[name] = value
    return value


def _assume_constant_result(fn):
    """``torch._dynamo.assume_constant_result(fn)`` without importing ``torch._dynamo`` (about 1.2 s).

    Dynamo reads the mark when it traces a call of ``fn`` (and is imported by then); setting it
    at import time keeps ``import fnebm`` as cheap as ``import torch``. tests/test_batched.py
    checks that the mark is the one torch's decorator sets.
    """
    fn._dynamo_marked_constant = True
    return fn


def __dir__():
    return sorted({n for n in globals() if not n.startswith("_")} | set(_WHERE))


# Two submodules share their names with functions they define (langevin_chain, langevin_update).
# The import system records a loaded submodule on its package; this package keeps those two
# names for the functions, as it always has (import the modules with importlib.import_module).
_SHADOWED = {"langevin_chain", "langevin_update"}


class _Package(_types.ModuleType):
    def __setattr__(self, name, value):
        if name in _SHADOWED and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


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
