"""Pure energy functions ``E(x) -> scalar`` for one sample ``x: (dim,)``.

Chains come from ``torch.func.vmap``; gradients from ``torch.func.grad`` or, for the
analytic families, the closed-form ``grad`` method. Every ``__call__`` and ``grad`` is
free of host syncs and data-dependent Python branches, so it traces under
``torch.compile(fullgraph=True)``.

Every energy is a pytree (``torch.utils._pytree``) whose leaves are its tensor
parameters: ``vmap`` and ``grad`` map and differentiate over energies, and a compiled
function taking an energy reuses its graph for new parameter values of the same shapes.

Layout: :mod:`~fnebm.energies.base` (the ``Energy`` protocol, checks, pytree registration,
``from_logdensity``), :mod:`~fnebm.energies.analytic` (closed-form families),
:mod:`~fnebm.energies.mixture` (``GaussianMixture``), :mod:`~fnebm.energies.neural`
(``from_module``, ``bind``, and ``batched``: energies that evaluate a whole batch in one call).
"""

import torch

from fnebm.energies.analytic import (
    Ackley,
    DoubleWell,
    Gaussian,
    Harmonic,
    Rastrigin,
    Rosenbrock,
    ackley,
    double_well,
    gaussian,
    harmonic,
    rastrigin,
    rosenbrock,
)
from fnebm.energies.base import Energy, LogDensityEnergy, from_logdensity, static_field
from fnebm.energies.mixture import GaussianMixture, gaussian_mixture
from fnebm.energies.neural import (
    BatchedEnergy,
    BoundEnergy,
    ModuleEnergy,
    batch_form,
    batched,
    bind,
    check_batched,
    from_module,
)

__all__ = [
    "Energy",
    "Gaussian",
    "DoubleWell",
    "Rosenbrock",
    "Harmonic",
    "Rastrigin",
    "Ackley",
    "GaussianMixture",
    "BoundEnergy",
    "LogDensityEnergy",
    "gaussian",
    "double_well",
    "rosenbrock",
    "harmonic",
    "rastrigin",
    "ackley",
    "gaussian_mixture",
    "from_module",
    "bind",
    "batched",
    "BatchedEnergy",
    "ModuleEnergy",
    "batch_form",
    "check_batched",
    "from_logdensity",
    "static_field",
]

# torch.load(weights_only=True), the default, rebuilds these from their tensors. A
# BoundEnergy or LogDensityEnergy holds a function, which weights_only never loads: save
# its params (or pytree leaves) instead and rebuild.
torch.serialization.add_safe_globals([Gaussian, DoubleWell, Rosenbrock, Harmonic, Rastrigin, Ackley, GaussianMixture])
