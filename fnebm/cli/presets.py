"""The names the command knows: energies (at CLI-sized defaults, with the step sizes and run
lengths that suit each, what is known of them, and whether they mix), samplers, dtypes and the
``fnebm demo`` preset. A new energy or sampler is one entry here (and a row in docs/cli.md)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

import fnebm
from fnebm import energies as E
from fnebm.adaptation.window import default_num_integration_steps
from fnebm.chain import position_and_energy
from fnebm.cli import plan as dispatch


class Truth(NamedTuple):
    """What is known exactly of a target, in float64 on the CPU: ``mean: (d,)``, ``cov: (d, d)``,
    and for a mixture ``weights: (K,)``, ``centres: (K, d)`` and ``assign(x: (..., d)) -> (..., K)``,
    the probability that ``x`` came from each component (its mean over the target is ``weights``)."""

    about: str
    mean: Tensor
    cov: Tensor
    weights: Tensor | None = None
    centres: Tensor | None = None
    assign: Callable[[Tensor], Tensor] | None = None


class EnergySpec(NamedTuple):
    """One energy of the command.

    build: ``build(dim, dtype, device) -> Energy`` at CLI-sized defaults.
    step_size: MALA's default step at dim <= 2 (also HMC/NUTS' without ``--adapt``); above dim 2
        it is scaled by ``(2 / dim)^(1/3)``, MALA's optimal scaling.
    about: one line for ``--help`` and docs.
    langevin_step_size: unadjusted Langevin's default at dim <= 2 (same scaling); ``None``:
        ``step_size / 4``. Smaller than MALA's: nothing rejects an overshoot, and the bias of the
        unadjusted chain grows with the step.
    steps: default ``--steps`` at dim <= 2 and at dim 10 (geometric in between, ``(dim/10)^(1/3)``
        above; 4x for unadjusted Langevin): about 200 autocorrelation times where the chains mix,
        so R-hat <= 1.01.
    multimodal: chains may sit in separate modes and never cross; ``mixing`` says what R-hat
        means then (docs/cli.md, the summary's note).
    ramp: the burn-in starts at smaller steps (walls so steep that a full step from a start in
        N(0, I)'s tails overshoots: see ``fnebm.cli.run._ramp``).
    truth: ``truth(energy, dim) -> Truth`` where the moments are known exactly.
    param_bytes: memory the energy's parameters take at ``dim`` (for the estimate before a run).
    """

    build: Callable[[int, torch.dtype, torch.device], Any]
    step_size: float
    about: str
    langevin_step_size: float | None = None
    steps: tuple[int, int] = (1000, 1000)
    multimodal: bool = False
    mixing: str = ""
    ramp: bool = False
    truth: Callable[[Any, int], Truth] | None = None
    param_bytes: Callable[[int], int] | None = None


# cov_ij = RHO^|i-j|: unit variances, neighbours correlated; eigenvalues in (1/3, 3) in every dim,
# so MALA mixes in ~5 (dim 2) to ~20 (dim 10) steps
RHO = 0.5


def _ar1_cov(dim: int) -> Tensor:
    idx = torch.arange(dim, dtype=torch.float64)
    return RHO ** (idx[:, None] - idx[None, :]).abs()


def _ar1_gaussian(dim: int, dtype: torch.dtype, device: torch.device) -> E.Gaussian:
    return E.gaussian(torch.zeros(dim, dtype=torch.float64), _ar1_cov(dim), dtype=dtype, device=device)


def _gaussian_truth(energy: E.Gaussian, dim: int) -> Truth:
    return Truth(f"N(0, cov_ij = {RHO}^|i-j|)", torch.zeros(dim, dtype=torch.float64), _ar1_cov(dim))


def _harmonic_truth(energy: E.Harmonic, dim: int) -> Truth:
    k = float(energy.k)
    return Truth("N(0, I)" if k == 1 else f"N(0, I / {k:g})", torch.zeros(dim, dtype=torch.float64),
                 torch.eye(dim, dtype=torch.float64) / k)


def _mixture(dim: int, dtype: torch.dtype, device: torch.device) -> E.GaussianMixture:
    # 4 modes at (+-2, +-2, 0, ...) (2 modes at +-2 in 1-D), std 0.5: 8 std apart
    corners = [[2.0], [-2.0]] if dim == 1 else [[2.0, 2.0], [2.0, -2.0], [-2.0, 2.0], [-2.0, -2.0]]
    means = torch.zeros(len(corners), dim, dtype=torch.float64)
    means[:, : len(corners[0])] = torch.tensor(corners, dtype=torch.float64)
    return E.gaussian_mixture(means, torch.full((len(corners),), 0.5), dtype=dtype, device=device)


def _mixture_truth(energy: E.GaussianMixture, dim: int) -> Truth:
    mu = energy.means.detach().to("cpu", torch.float64)
    s = energy.scales.detach().to("cpu", torch.float64)
    w = energy.weights.detach().to("cpu", torch.float64)
    mean = w @ mu
    # law of total covariance: E[cov within] + cov of the component means
    cov = torch.diag((w[:, None] * s * s).sum(0)) + (w[:, None, None] * mu[:, :, None] * mu[:, None, :]).sum(0)
    cov = cov - mean[:, None] * mean[None, :]
    log_coef = w.log() - s.log().sum(-1)

    def assign(x: Tensor) -> Tensor:
        z = (x.to(torch.float64)[..., None, :] - mu) / s
        return torch.softmax(log_coef - 0.5 * (z * z).sum(-1), -1)

    k = mu.shape[0]
    return Truth(f"{k} equal-weight modes, std 0.5", mean, cov, w, mu, assign)


def _family(constructor: Callable[..., Any]) -> Callable[[int, torch.dtype, torch.device], Any]:
    # a family that takes any dim, at its library defaults
    return lambda dim, dtype, device: constructor(dtype=dtype, device=device)


# One entry per energy / sampler: a new one is one entry here (and a row in docs/cli.md).
# Step sizes and run lengths were measured at dims 2 and 10 (docs/cli.md, "Energies").
ENERGIES: dict[str, EnergySpec] = {
    "gaussian": EnergySpec(
        _ar1_gaussian, 0.6, f"mean 0, cov_ij = {RHO}^|i-j| (dim 1: N(0, 1))", langevin_step_size=0.1,
        steps=(1000, 3000), truth=_gaussian_truth, param_bytes=lambda d: 8 * 8 * d * d),
    "double_well": EnergySpec(
        _family(E.double_well), 0.05, "h=2, b=1: wells at x_i = +-1", langevin_step_size=0.01,
        steps=(2000, 2000), multimodal=True, ramp=True,
        mixing="two wells per coordinate behind a barrier of height 2: chains cross it every few hundred "
               "steps, so R-hat reaches 1.01 only after ~27,000 steps (dim 2) or more"),
    "rosenbrock": EnergySpec(
        _family(E.rosenbrock), 0.001, "a=1, b=100; dim >= 2", langevin_step_size=0.0005, ramp=True,
        mixing="one mode, but a narrow curved ridge: steps must be tiny across it and chains creep "
               "along it (autocorrelation times of thousands of steps); NUTS with --adapt does better"),
    "harmonic": EnergySpec(
        _family(E.harmonic), 0.8, "k=1: N(0, I)", langevin_step_size=0.1, truth=_harmonic_truth),
    "rastrigin": EnergySpec(
        _family(E.rastrigin), 0.002, "a=10", langevin_step_size=0.001, multimodal=True, ramp=True,
        mixing="a local minimum near every integer point, behind barriers of height ~20: chains never "
               "leave the one they fall into"),
    "ackley": EnergySpec(
        _family(E.ackley), 0.15, "a=20, b=0.2, c=2 pi", langevin_step_size=0.02, steps=(5000, 5000),
        multimodal=True,
        mixing="rugged (a shallow local minimum near every integer point), and improper: E tends to "
               "a + e far out, so exp(-E) does not integrate and chains would drift away given time; "
               "at dim 2 chains mix within the central basin, at dim 10 they do not"),
    "gaussian_mixture": EnergySpec(
        _mixture, 0.2, "4 modes (+-2, +-2, 0, ...), std 0.5 (dim 1: 2 modes)", langevin_step_size=0.05,
        multimodal=True, truth=_mixture_truth, param_bytes=lambda d: 3 * 8 * 4 * d,
        mixing="modes 8 standard deviations apart: a chain never leaves the mode it starts in, so the "
               "draws weigh each mode by how many chains started near it, not by its weight"),
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

# The default energy of `fnebm sample`: one whose chains converge at the defaults.
DEFAULT_ENERGY = "gaussian"

# `fnebm demo` is `fnebm sample` with these arguments (documented in docs/cli.md): a target
# whose moments are known, a run that converges (R-hat ~1.005; 1 + tau / draws with tau ~3)
# and is short enough to run eagerly in a few seconds.
DEMO: dict[str, Any] = dict(
    energy="gaussian", dim=2, sampler="mala", chains=1024, steps=500, burn_in=100,
    thin=1, step_size=0.6, seed=0, dtype="float32",
)
DEMO_PLOT = "fnebm-demo.png"


def demo_command() -> str:
    """The ``fnebm sample`` command line that ``fnebm demo`` runs."""
    opts = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in DEMO.items())
    return f"fnebm sample {opts} --plot {DEMO_PLOT}"


def default_step_size(energy: str, sampler: str, dim: int) -> float:
    """The energy's step size for ``sampler`` at ``dim``: MALA's (or Langevin's) at dim <= 2,
    times ``(2 / dim)^(1/3)`` above (Roberts & Rosenthal's scaling for MALA)."""
    spec = ENERGIES[energy]
    base = spec.step_size
    if sampler == "langevin":
        base = spec.langevin_step_size if spec.langevin_step_size is not None else spec.step_size / 4
    return float(f"{base * min(1.0, (2 / dim) ** (1 / 3)):.3g}")


# Unadjusted Langevin runs at a smaller step than MALA (its bias grows with the step), so its
# chains need more steps to mix: measured on harmonic and gaussian, 4x as many keep R-hat <= 1.01.
LANGEVIN_STEPS = 4


def default_steps(energy: str, dim: int, sampler: str = "mala") -> int:
    """The energy's default ``--steps`` for ``sampler`` at ``dim`` (two significant digits)."""
    at2, at10 = (n * (LANGEVIN_STEPS if sampler == "langevin" else 1) for n in ENERGIES[energy].steps)
    if dim <= 2:
        steps = at2
    elif dim <= 10:
        steps = at2 * (at10 / at2) ** (math.log(dim / 2) / math.log(5))
    else:
        steps = at10 * (dim / 10) ** (1 / 3)
    return int(float(f"{steps:.2g}"))


# the position and the energy of each kept step: fnebm.chain.position_and_energy, which the CPU's
# whole-chain kernel writes itself (so `fnebm sample` with Langevin or MALA on a double well,
# harmonic, rastrigin or gaussian runs in it)
# dispatch: the families named here restate the C kernel's coverage
_collect = position_and_energy


def _extra(sampler: str, dim: int, compiled: bool = False, backend: str = "auto") -> dict[str, Any]:
    """The sampler's arguments beyond the step size: HMC's trajectory, ``ceil(sqrt(dim))`` steps;
    NUTS's backend (:func:`fnebm.cli.plan.sampler_backend`)."""
    if sampler == "hmc":
        return {"num_integration_steps": default_num_integration_steps(dim)}
    return dispatch.sampler_backend(sampler, compiled, backend)


def _algorithm(target: Any, sampler: str, step_size: float, dim: int, parameters: dict | None = None,
               compiled: bool = False):
    """The sampler on ``target``: at ``step_size``, or with adapted ``parameters``."""
    if parameters is not None:
        return SAMPLERS[sampler](target, **parameters)
    if sampler in ADAPTIVE:
        return SAMPLERS[sampler](target, step_size, None, **_extra(sampler, dim, compiled))
    return SAMPLERS[sampler](target, step_size)


def _build(energy: str, sampler: str, step_size: float, dim: int, dtype: torch.dtype, device: str,
           compiled: bool = False):
    """``(energy, algorithm)``. A rebuilt sampler of the same kind and shapes reuses the compiled
    graph (``sample_chain`` keys graphs by code, and parameters are graph inputs)."""
    target = ENERGIES[energy].build(dim, dtype, torch.device(device))
    target.check_dim(dim)
    return target, _algorithm(target, sampler, step_size, dim, compiled=compiled)


def truth_of(energy: str, target: Any, dim: int) -> Truth | None:
    """What is known exactly of ``target`` (``None`` where nothing is)."""
    spec = ENERGIES[energy]
    return None if spec.truth is None else spec.truth(target, dim)
