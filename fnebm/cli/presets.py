"""The names the command knows: energies (at CLI-sized defaults, with a step size that suits
each), samplers, dtypes and the ``fnebm demo`` preset. A new energy or sampler is one entry here
(and a row in docs/cli.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

import fnebm
from fnebm import energies as E
from fnebm.adaptation.window import default_num_integration_steps


class EnergySpec(NamedTuple):
    """``build(dim, dtype, device) -> Energy`` at CLI-sized defaults, and a step size that suits it."""

    build: Callable[[int, torch.dtype, torch.device], Any]
    step_size: float
    about: str


def _ar1_gaussian(dim: int, dtype: torch.dtype, device: torch.device) -> E.Gaussian:
    # cov_ij = 0.8^|i-j|: unit variances, neighbours correlated; SPD in every dim
    idx = torch.arange(dim, dtype=torch.float64)
    cov = 0.8 ** (idx[:, None] - idx[None, :]).abs()
    return E.gaussian(torch.zeros(dim, dtype=torch.float64), cov, dtype=dtype, device=device)


def _mixture(dim: int, dtype: torch.dtype, device: torch.device) -> E.GaussianMixture:
    # 4 modes at (+-2, +-2, 0, ...) (2 modes at +-2 in 1-D), std 0.5: 8 std apart
    corners = [[2.0], [-2.0]] if dim == 1 else [[2.0, 2.0], [2.0, -2.0], [-2.0, 2.0], [-2.0, -2.0]]
    means = torch.zeros(len(corners), dim, dtype=torch.float64)
    means[:, : len(corners[0])] = torch.tensor(corners, dtype=torch.float64)
    return E.gaussian_mixture(means, torch.full((len(corners),), 0.5), dtype=dtype, device=device)


def _family(constructor: Callable[..., Any]) -> Callable[[int, torch.dtype, torch.device], Any]:
    # a family that takes any dim, at its library defaults
    return lambda dim, dtype, device: constructor(dtype=dtype, device=device)


# One line per energy / sampler: a new one is one entry here (and a row in docs/cli.md).
ENERGIES: dict[str, EnergySpec] = {
    "gaussian": EnergySpec(_ar1_gaussian, 0.1, "mean 0, cov_ij = 0.8^|i-j| (dim 1: N(0, 1))"),
    "double_well": EnergySpec(_family(E.double_well), 0.01, "h=2, b=1: wells at x_i = +-1"),
    "rosenbrock": EnergySpec(_family(E.rosenbrock), 0.001, "a=1, b=100; dim >= 2"),
    "harmonic": EnergySpec(_family(E.harmonic), 0.3, "k=1: N(0, I)"),
    "rastrigin": EnergySpec(_family(E.rastrigin), 0.002, "a=10"),
    "ackley": EnergySpec(_family(E.ackley), 0.01, "a=20, b=0.2, c=2 pi"),
    "gaussian_mixture": EnergySpec(_mixture, 0.1, "4 modes (+-2, +-2, 0, ...), std 0.5 (dim 1: 2 modes)"),
}

SAMPLERS: dict[str, Callable[..., fnebm.SamplingAlgorithm]] = {
    "langevin": fnebm.langevin,
    "mala": fnebm.mala,
    "hmc": fnebm.hmc,
    "nuts": fnebm.nuts,
}
# samplers with a mass matrix, which --adapt tunes with fnebm.window_adaptation
ADAPTIVE = ("hmc", "nuts")

DTYPES = {"float32": torch.float32, "float64": torch.float64}

# `fnebm demo` is `fnebm sample` with these arguments (documented in docs/cli.md).
DEMO: dict[str, Any] = dict(
    energy="gaussian_mixture", dim=2, sampler="mala", chains=1024, steps=1000, burn_in=250,
    thin=1, step_size=0.1, seed=0, dtype="float32",
)
DEMO_PLOT = "fnebm-demo.png"


def demo_command() -> str:
    """The ``fnebm sample`` command line that ``fnebm demo`` runs."""
    opts = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in DEMO.items())
    return f"fnebm sample {opts} --plot {DEMO_PLOT}"


def _collect(state: Any) -> tuple[Tensor, Tensor]:
    return state.position, state.energy


def _extra(sampler: str, dim: int) -> dict[str, Any]:
    """The sampler's arguments beyond the step size: HMC's trajectory, ``ceil(sqrt(dim))`` steps."""
    return {"num_integration_steps": default_num_integration_steps(dim)} if sampler == "hmc" else {}


def _build(energy: str, sampler: str, step_size: float, dim: int, dtype: torch.dtype, device: str):
    """``(energy, algorithm)``. A rebuilt sampler of the same kind and shapes reuses the compiled
    graph (``sample_chain`` keys graphs by code, and parameters are graph inputs)."""
    target = ENERGIES[energy].build(dim, dtype, torch.device(device))
    target.check_dim(dim)
    if sampler in ADAPTIVE:
        return target, SAMPLERS[sampler](target, step_size, None, **_extra(sampler, dim))
    return target, SAMPLERS[sampler](target, step_size)

