"""Hand-written kernels (Triton, and C for the CPU), registered as torch ops (``torch.ops.fnebm.*``)
so they sit inside ``torch.compile`` graphs. What each computes is a sampler's step: the tests run
them against ``fnebm.chain.run`` of ``fnebm.langevin``, ``fnebm.mala`` and ``fnebm.nuts`` from the
same keys.

* :mod:`fnebm.kernels.families` — the analytic energy families the kernels compute in closed form:
  each family's id, energy type, parameter packing and engines, declared once.
* :mod:`fnebm.kernels.langevin_chain` — whole Langevin or MALA chains in one Triton launch for
  the separable families: positions in registers, noise and uniforms in-kernel, kept draws
  written straight into the trace.
* :mod:`fnebm.kernels.cpu_chain` — the CPU counterpart of ``langevin_chain``: whole Langevin or
  MALA chains in C (``_cpu_chain.c``, OpenMP, vectorised over blocks of 16 chains), built with
  the system C compiler on first use and called through ctypes; the op
  ``torch.ops.fnebm.cpu_chain`` (``cpu_chain.langevin_chain`` / ``cpu_chain.mala_chain``) puts
  it in compiled graphs.
* :mod:`fnebm.kernels.cpu_nuts` — one NUTS transition of every chain in C (``_cpu_nuts.c``).
* :mod:`fnebm.kernels.cpu_trips` — that kernel's trips on a compiled energy (a user's log density
  or network) run in C++ (``_cpu_trips.cpp``): the compiled graph's entry and the kernel's next
  step called one after the other without Python.

The Triton kernels and ops need triton (``HAS_TRITON``).
``fnebm.sample_chain(..., backend=)`` dispatches to the kernels (:mod:`fnebm.kernels.dispatch`, the
table of fast paths); see docs/kernels.md for the rules.
"""

import importlib as _importlib
import sys as _sys
import types as _types

# Names load on first use (PEP 562): importing triton and registering the Triton ops takes about
# 1.5 s, which a CPU run of the C kernel (fnebm.kernels.cpu_chain) should not pay.
_WHERE = {
    "LangevinChain": "langevin_chain",
    "MALAChain": "langevin_chain",
    "langevin_chain": "langevin_chain",
    "mala_chain": "langevin_chain",
    "HAS_TRITON": "langevin_chain",
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


# A submodule shares its name with a function it defines (langevin_chain). The import system
# records a loaded submodule on its package; this package keeps the name for the function, as it
# always has (import the module with importlib.import_module).
_SHADOWED = {"langevin_chain"}


class _Package(_types.ModuleType):
    def __setattr__(self, name, value):
        if name in _SHADOWED and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


__all__ = [
    "HAS_TRITON",
    "LangevinChain",
    "MALAChain",
    "langevin_chain",
    "mala_chain",
]
