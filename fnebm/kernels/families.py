"""The analytic energy families the hand-written kernels compute in closed form, declared once.

Each :class:`Family` says which energies it is (an exact type from :mod:`fnebm.energies`, and a
test on the instance where one type holds two families), the integer the kernels switch on (the
C kernels' ``enum`` in ``_cpu_common.h``, the Triton kernel's ``ENERGY`` constexpr), how its
parameters are packed into the kernels' two arrays, and which engines compute it:

* ``double_well`` (0): :class:`~fnebm.energies.DoubleWell` — C chain, C NUTS, Triton;
* ``harmonic`` (1): :class:`~fnebm.energies.Harmonic` — C chain, C NUTS, Triton;
* ``gaussian`` (2): a diagonal :class:`~fnebm.energies.Gaussian` — C chain, C NUTS, Triton;
* ``rastrigin`` (3): :class:`~fnebm.energies.Rastrigin` — C chain, C NUTS, Triton;
* ``gaussian_full`` (4): a :class:`~fnebm.energies.Gaussian` with a full precision factor — C
  chain, C NUTS.

Engines: ``"c_chain"`` (:mod:`fnebm.kernels.cpu_chain`, whole Langevin/MALA chains in C),
``"c_nuts"`` (:mod:`fnebm.kernels.cpu_nuts`, one NUTS transition in C) and ``"triton"``
(:mod:`fnebm.kernels.langevin_chain`). Their ``covers(energy)`` and parameter packing read this
table; ``tests/test_kernel_families.py`` checks the ids against the C and Triton sources.

**Adding a separable family** (one whose energy is a sum of per-element terms with an
elementwise gradient) to every engine: a :class:`Family` here; its line in ``FNEBM_SEPARABLE``
in ``_cpu_common.h`` (id, the element's term and gradient, the total: the C chain and NUTS
kernels switch on that list); in the Triton kernel, its constexpr (made from this table) and
its branches in ``_terms`` and ``_energy``. Five sites in three files (docs/kernels.md).

The packing: ``scalars`` ``(2,)`` holds a scalar family's parameters (the C and Triton code
read ``scalars[0]`` as ``pa`` and ``scalars[1]`` as ``pb``), ``vectors`` the per-element ones
(the diagonal Gaussian: ``mean, precision, sqrt(precision)`` as ``(3, d)``; the full Gaussian:
``mean (d)`` then its factor ``L`` row-major). A family with scalar parameters only passes its
``scalars`` as ``vectors`` too (not read). Torch ops only: the packing traces under
``torch.compile`` and does not sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from fnebm.energies import analytic

__all__ = ["Family", "FAMILIES", "ENGINES", "C_CHAIN", "C_NUTS", "TRITON", "find", "covers", "pack", "ids"]

C_CHAIN, C_NUTS, TRITON = "c_chain", "c_nuts", "triton"
ENGINES = {C_CHAIN: "the C kernel", C_NUTS: "the C NUTS kernel", TRITON: "the Triton kernel"}
_ALL = frozenset(ENGINES)
_C = frozenset({C_CHAIN, C_NUTS})


@dataclass(frozen=True)
class Family:
    """One analytic family: ``id`` (what the kernels switch on), ``name`` (lower case; its
    upper-case form ``const`` names it in the C and Triton sources), ``energy_type`` (matched
    exactly: a subclass may override ``__call__`` or ``grad``), ``when`` (a test on the instance,
    metadata only, where one type holds several families), ``pack(energy, d) -> (scalars,
    vectors)``, ``engines`` and ``label`` (how a message names it)."""

    id: int
    name: str
    energy_type: type
    pack: Callable[[Any, int], tuple[Tensor, Tensor]]
    engines: frozenset
    label: str
    when: Callable[[Any], bool] | None = None

    @property
    def const(self) -> str:
        return self.name.upper()

    def matches(self, energy: Any) -> bool:
        return type(energy) is self.energy_type and (self.when is None or self.when(energy))


def _scalar(*params: Tensor) -> tuple[Tensor, Tensor]:
    # pa, pb (a one-parameter family repeats it: scalars[1] is not read)
    p = torch.stack([params[0], params[-1]])
    return p, p


def _gaussian_diagonal(energy: analytic.Gaussian, d: int) -> tuple[Tensor, Tensor]:
    vectors = torch.stack([energy.mean, energy.precision, energy.precision_tril]).reshape(3, d)
    return vectors.new_zeros(2), vectors


def _gaussian_full(energy: analytic.Gaussian, d: int) -> tuple[Tensor, Tensor]:  # mean, then L row-major
    vectors = torch.cat([energy.mean.reshape(d), energy.precision_tril.reshape(d * d)])
    return vectors.new_zeros(2), vectors


FAMILIES: tuple[Family, ...] = (
    Family(0, "double_well", analytic.DoubleWell, lambda e, d: _scalar(e.barrier_height, e.b), _ALL,
           "a double well"),
    Family(1, "harmonic", analytic.Harmonic, lambda e, d: _scalar(e.k), _ALL, "a harmonic energy"),
    Family(2, "gaussian", analytic.Gaussian, _gaussian_diagonal, _ALL, "a diagonal Gaussian",
           lambda e: e.is_diagonal),
    Family(3, "rastrigin", analytic.Rastrigin, lambda e, d: _scalar(e.a), _ALL, "a Rastrigin energy"),
    Family(4, "gaussian_full", analytic.Gaussian, _gaussian_full, _C, "a Gaussian with a full precision matrix",
           lambda e: not e.is_diagonal),
)


def find(energy: Any) -> Family | None:
    """The family ``energy`` belongs to, or ``None``."""
    return next((f for f in FAMILIES if f.matches(energy)), None)


def covers(energy: Any, engine: str) -> str | None:
    """``None`` when ``engine`` computes ``energy`` in closed form, else why not (one phrase)."""
    family = find(energy)
    if family is not None and engine in family.engines:
        return None
    kernel = ENGINES[engine]
    if family is not None:
        return (f"the energy is {family.label} ({family.name}), which {kernel} does not compute "
                f"({', '.join(ENGINES[e] for e in sorted(family.engines))} do)")
    names = ", ".join(f.label for f in FAMILIES if engine in f.engines)
    return f"the energy {type(energy).__name__} is not one {kernel} computes in closed form ({names})"


def pack(energy: Any, d: int) -> tuple[int, Tensor, Tensor]:
    """``(id, scalars (2,), vectors)`` for a covered ``energy`` of ``d`` elements per sample, in
    its parameters' dtype and device (the caller has checked :func:`covers`)."""
    family = find(energy)
    return (family.id, *family.pack(energy, d))


def ids(engine: str | None = None) -> dict[str, int]:
    """``{const: id}`` of the families ``engine`` computes (all when ``None``)."""
    return {f.const: f.id for f in FAMILIES if engine is None or engine in f.engines}
