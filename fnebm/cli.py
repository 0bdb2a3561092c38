"""The ``fnebm`` command: ``fnebm sample`` runs a sampler on a named energy, ``fnebm demo`` a preset,
``fnebm train`` fits an MLP energy to a 2-D toy data set.

The top layer: it builds an energy from :mod:`fnebm.energies` and a sampler from
:mod:`fnebm.samplers` by name, runs :func:`fnebm.sample_chain`, prints a diagnostics summary
(:mod:`fnebm.diagnostics`) and optionally saves the draws and a plot. Every argument is
checked before sampling starts; a bad one gives one ``fnebm: error: ...`` line and exit
status 2. ``main(argv) -> int`` is the entry point of the console script and of
``python -m fnebm``. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, BinaryIO, NamedTuple

import torch
from torch import Tensor

import fnebm
from fnebm import diagnostics
from fnebm import energies as E
from fnebm import random as fr
from fnebm.adaptation.window import default_num_integration_steps

__all__ = ["main", "ENERGIES", "SAMPLERS", "DEMO", "demo_command", "TRAIN_LOSSES", "TRAIN_SAMPLERS"]

PROG = "fnebm"


# ------------------------------------------------------------------------------ names


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


# ----------------------------------------------------------------------------- errors


class UsageError(Exception):
    """A bad argument: one line on stderr, exit status 2."""


class RunError(Exception):
    """A failure after the arguments were accepted (e.g. a write failed): exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage over several lines and exit
        raise UsageError(message)


def _one_line(message: Any) -> str:
    return " ".join(str(message).split()) or "unknown error"


# ---------------------------------------------------------------------------- parsing


def _add_run_options(p: argparse.ArgumentParser, *, demo: bool) -> None:
    hide = argparse.SUPPRESS
    if demo:  # the preset's knobs stay reachable for tests and curious users, but unlisted
        for name in ("energy", "sampler", "dtype"):
            p.add_argument(f"--{name}", default=DEMO[name], help=hide)
        for name in ("dim", "chains", "steps", "burn_in", "thin", "seed"):
            p.add_argument(f"--{name.replace('_', '-')}", type=int, default=DEMO[name], help=hide)
        p.add_argument("--adapt", type=int, default=DEMO.get("adapt"), help=hide)
        p.add_argument("--step-size", type=float, default=DEMO["step_size"], help=hide)
        p.add_argument("--plot", default=DEMO_PLOT, metavar="PATH", help=f"PNG to write (default: {DEMO_PLOT})")
    else:
        p.add_argument("--energy", default="double_well", metavar="NAME",
                       help=f"one of {', '.join(ENERGIES)} (default: double_well)")
        p.add_argument("--dim", type=int, default=2, metavar="D", help="dimension of x (default: 2)")
        p.add_argument("--sampler", default="mala", metavar="NAME",
                       help=f"one of {', '.join(SAMPLERS)} (default: mala)")
        p.add_argument("--adapt", type=int, default=None, metavar="N",
                       help="hmc/nuts: warm-up steps of window adaptation (step size and diagonal mass "
                            "matrix) before burn-in and sampling (default: steps // 2; 0: none)")
        p.add_argument("--chains", type=int, default=1024, metavar="N", help="chains run in parallel (default: 1024)")
        p.add_argument("--steps", type=int, default=1000, metavar="N", help="steps after burn-in (default: 1000)")
        p.add_argument("--burn-in", type=int, default=None, metavar="N",
                       help="steps run first and not kept (default: steps // 4; 0 after --adapt)")
        p.add_argument("--thin", type=int, default=1, metavar="N", help="keep every N-th step (default: 1)")
        p.add_argument("--step-size", type=float, default=None, metavar="H",
                       help="sampler step size (default: the energy's, see docs/cli.md)")
        p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the key (default: 0)")
        p.add_argument("--dtype", default="float32", metavar="NAME", help="float32 or float64 (default: float32)")
        p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG plot of the draws")
    p.add_argument("--out", default=None, metavar="PATH", help="torch.save the draws, summary and arguments")
    p.add_argument("--device", default=None, metavar="NAME",
                   help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown on a terminal)")
    p.add_argument("--no-compile", action="store_true",
                   help="debugging aid: run the steps eagerly, without torch.compile (same draws, much slower)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Sample energy-based models with fnebm.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"fnebm {fnebm.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{sample,demo,train}", required=True, parser_class=_Parser)
    sample = sub.add_parser("sample", help="run a sampler on a named energy", allow_abbrev=False,
                            description="Run a sampler on a named energy and summarise the draws.")
    _add_run_options(sample, demo=False)
    demo = sub.add_parser("demo", help="MALA on a 2-D Gaussian mixture, with a plot", allow_abbrev=False,
                          description=f"The first thing to run. Equivalent to: {demo_command()}")
    _add_run_options(demo, demo=True)
    train = sub.add_parser("train", help="train an MLP energy on a 2-D toy data set", allow_abbrev=False,
                           description="Train a small MLP energy on a 2-D toy data set (CD, persistent CD or "
                                       "score matching), checkpoint it, plot it and measure its fit.")
    _add_train_options(train)
    return parser


# ------------------------------------------------------------------------- validation


class Config(NamedTuple):
    energy: str
    sampler: str
    dim: int
    chains: int
    steps: int
    adapt: int
    burn_in: int
    thin: int
    step_size: float
    seed: int
    dtype: str
    device: str
    out: str | None
    plot: str | None
    progress: bool
    compile: bool


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {name!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
        return dev
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != dev.type:
        raise UsageError(f"--device {name}: no {dev.type} device on this machine (use cpu or cuda)")
    return dev


def _destination(flag: str, path: str) -> str:
    """The file ``path`` will replace (symlinks followed), or UsageError; probes the directory."""
    if not path:
        raise UsageError(f"{flag}: empty path")
    real = os.path.realpath(path)
    if os.path.isdir(real):
        raise UsageError(f"{flag} {path}: is a directory")
    if os.path.lexists(real) and not os.path.isfile(real):
        raise UsageError(f"{flag} {path}: exists and is not a regular file")
    parent = os.path.dirname(real)
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: directory {os.path.dirname(path) or '.'} does not exist")
    try:  # os.access is wrong for root and for read-only mounts: try what the write will do
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".fnebm-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path}: directory {os.path.dirname(path) or '.'} is not writable ({e.strerror})") from None
    return real


def _config(args: argparse.Namespace) -> Config:
    if args.energy not in ENERGIES:
        raise UsageError(f"unknown energy {args.energy!r} (choose from {', '.join(ENERGIES)})")
    if args.sampler not in SAMPLERS:
        raise UsageError(f"unknown sampler {args.sampler!r} (choose from {', '.join(SAMPLERS)})")
    if args.dtype not in DTYPES:
        raise UsageError(f"unknown dtype {args.dtype!r} (choose from {', '.join(DTYPES)})")
    for flag, value in (("--dim", args.dim), ("--chains", args.chains), ("--steps", args.steps),
                        ("--thin", args.thin)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    adaptive = args.sampler in ADAPTIVE
    if args.adapt is not None and args.adapt < 0:
        raise UsageError(f"--adapt must be >= 0, got {args.adapt}")
    if args.adapt and not adaptive:
        raise UsageError(f"--adapt tunes a mass matrix: use it with --sampler {' or '.join(ADAPTIVE)}, "
                         f"not {args.sampler}")
    adapt = (args.steps // 2 if adaptive else 0) if args.adapt is None else args.adapt
    burn_in = (0 if adapt else args.steps // 4) if args.burn_in is None else args.burn_in
    if burn_in < 0:
        raise UsageError(f"--burn-in must be >= 0, got {burn_in}")
    if args.thin > args.steps:
        raise UsageError(f"--thin must be <= --steps to keep any draw, got --thin {args.thin} --steps {args.steps}")
    if args.step_size is not None:
        step_size = args.step_size
    elif adapt:  # the adaptation's starting point: the rule of thumb d^(-1/4)
        step_size = args.dim ** -0.25
    else:
        step_size = ENERGIES[args.energy].step_size
    if not (math.isfinite(step_size) and step_size > 0):
        raise UsageError(f"--step-size must be a finite number > 0, got {step_size}")
    try:
        fr.key(args.seed)
    except (TypeError, ValueError) as e:
        raise UsageError(f"--seed: {e}") from None
    device = _device(args.device)
    out = None if args.out is None else _destination("--out", args.out)
    plot = None if args.plot is None else _destination("--plot", args.plot)
    if out is not None and out == plot:
        raise UsageError(f"--out and --plot name the same file {args.out}")
    return Config(
        energy=args.energy, sampler=args.sampler, dim=args.dim, chains=args.chains, steps=args.steps,
        adapt=adapt, burn_in=burn_in, thin=args.thin, step_size=float(step_size), seed=args.seed, dtype=args.dtype,
        device=str(device), out=out, plot=plot,
        progress=not args.no_progress and sys.stderr.isatty(), compile=not args.no_compile,
    )


# ---------------------------------------------------------------------------- running


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _chunk_size(total: int, n_kept: int, progress: bool) -> int:
    # sample_chain's default, nudged so that no chunk is one step long: a length-1 scan is
    # specialised by the compiler and would compile a second graph in the middle of the run.
    size = min(total, max(2, -(-total // 20)) if progress else max(n_kept, min(total, 256)))
    while size < total and total % size == 1:
        size += 1
    return size


def _run(cfg: Config) -> tuple[dict[str, Any], Tensor, Tensor, Any]:
    """Sample; returns ``(summary, positions: (draws, chains, dim), energies: (draws, chains), energy)``."""
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    try:
        target, alg = _build(cfg.energy, cfg.sampler, cfg.step_size, cfg.dim, dtype, cfg.device)
    except (ValueError, TypeError) as e:  # the library's own checks of what we built
        raise UsageError(e) from None
    init_key, run_key = fr.split(fr.key(cfg.seed, device=device))
    x0 = fr.normal(init_key, (cfg.chains, cfg.dim), dtype)
    state = torch.func.vmap(alg.init)(x0)

    adapted, adapt_s = None, None
    if cfg.adapt:
        adapt_key, run_key = fr.split(run_key)
        t0 = time.perf_counter()
        warmup = fnebm.window_adaptation(SAMPLERS[cfg.sampler], target, cfg.adapt,
                                         initial_step_size=cfg.step_size, **_extra(cfg.sampler, cfg.dim))
        state, parameters, _ = warmup.run(state, adapt_key, compile=cfg.compile, progress=cfg.progress)
        _sync(device)
        adapt_s = time.perf_counter() - t0
        alg = SAMPLERS[cfg.sampler](target, **parameters)
        imm = parameters["inverse_mass_matrix"]
        imm = getattr(imm, "inverse_mass_matrix", imm)
        adapted = dict(step_size=float(parameters["step_size"]),
                       inverse_mass_matrix_range=(float(imm.min()), float(imm.max())))

    compile_s = None
    if cfg.compile:
        # sample_chain reuses one graph for every run length >= 2: a 2-step run compiles it
        # (a 1-step run has a graph of its own: then that one is compiled)
        t0 = time.perf_counter()
        fnebm.sample_chain(alg.step, state, run_key, min(2, cfg.burn_in + cfg.steps), collect=_collect, progress=False)
        _sync(device)
        compile_s = time.perf_counter() - t0
    n_kept = cfg.steps // cfg.thin
    t0 = time.perf_counter()
    _, (positions, energies), info = fnebm.sample_chain(
        alg.step, state, run_key, cfg.steps, burn_in=cfg.burn_in, thin=cfg.thin, collect=_collect,
        chunk_size=_chunk_size(cfg.burn_in + cfg.steps, n_kept, cfg.progress),
        compile=cfg.compile, progress=cfg.progress,
    )
    _sync(device)
    sampling_s = time.perf_counter() - t0
    summary = _summary(cfg, positions, info, compile_s, sampling_s)
    summary.update(adapt=cfg.adapt, adapt_s=adapt_s, adapted=adapted)
    return summary, positions, energies, target


def _summary(cfg: Config, positions: Tensor, info: Any, compile_s: float | None, sampling_s: float) -> dict:
    """Plain Python numbers (``None`` where not computed)."""
    acc = diagnostics.acceptance_summary(info, layout="draws_chains")
    rate = acc.get("mean_acceptance_rate")
    out: dict[str, Any] = dict(
        sampler=cfg.sampler, energy=cfg.energy, dim=cfg.dim, chains=cfg.chains, steps=cfg.steps,
        burn_in=cfg.burn_in, thin=cfg.thin, draws=positions.shape[0], step_size=cfg.step_size,
        dtype=cfg.dtype, device=cfg.device, seed=cfg.seed,
        acceptance=None if rate is None else float(rate),
        n_divergent=acc.get("n_divergent", 0),
        divergent_fraction=float(acc.get("divergent_fraction", 0.0)),
        mean_tree_depth=_float_or_none(acc.get("mean_tree_depth")),
        mean_integration_steps=_float_or_none(acc.get("mean_num_integration_steps")),
        ess_bulk_min=None, ess_bulk_median=None, ess_per_s=None, rhat_max=None,
        compile_s=compile_s, sampling_s=sampling_s,
    )
    if positions.shape[0] >= 4:  # the diagnostics need 4 draws
        ess = diagnostics.ess_bulk(positions, layout="draws_chains").double().cpu()
        out["ess_bulk_min"] = float(ess.min())
        out["ess_bulk_median"] = float(ess.quantile(0.5))
        out["ess_per_s"] = out["ess_bulk_min"] / sampling_s if sampling_s > 0 else math.inf
        out["rhat_max"] = float(diagnostics.rhat(positions, layout="draws_chains").max())
    return out


def _float_or_none(x: Any) -> float | None:
    return None if x is None else float(x)


def _fmt(x: float | None, spec: str = ".3g", missing: str = "n/a (needs >= 4 kept draws)") -> str:
    return missing if x is None else format(x, spec)


def format_summary(s: dict[str, Any]) -> list[str]:
    """The summary as aligned lines."""
    if s["acceptance"] is not None:
        acceptance = f"{s['acceptance']:.3f} (mean {s['sampler'].upper()} acceptance statistic)"
    else:
        acceptance = f"{1 - s['divergent_fraction']:.3f} (unadjusted: 1 - divergent fraction)"
    rows = [
        ("sampler", f"{s['sampler']}, step size {s['step_size']:g}" + (" (before adaptation)" if s.get("adapted") else "")),
        ("energy", f"{s['energy']}, dim {s['dim']}, {s['dtype']} on {s['device']}"),
        ("run", f"{s['chains']} chains x {s['steps']} steps (burn-in {s['burn_in']}, thin {s['thin']})"
                f" -> {s['draws']} draws"),
        *([("adaptation", f"{s['adapt']} warm-up steps: step size {s['adapted']['step_size']:.3g}, diagonal "
                          f"inverse mass matrix in [{s['adapted']['inverse_mass_matrix_range'][0]:.3g}, "
                          f"{s['adapted']['inverse_mass_matrix_range'][1]:.3g}] ({s['adapt_s']:.2f} s)")]
          if s.get("adapted") else []),
        ("acceptance", acceptance),
        *([("trajectory", f"mean tree depth {s['mean_tree_depth']:.2f}, mean {s['mean_integration_steps']:.1f} "
                          "leapfrog steps per draw")] if s.get("mean_tree_depth") is not None else
          [("trajectory", f"{s['mean_integration_steps']:.0f} leapfrog steps per draw")]
          if s.get("mean_integration_steps") is not None else []),
        ("divergences", f"{s['n_divergent']} ({100 * s['divergent_fraction']:.2f}% of kept steps)"),
        ("ESS bulk", "n/a (needs >= 4 kept draws)" if s["ess_bulk_min"] is None
         else f"min {s['ess_bulk_min']:.0f}, median {s['ess_bulk_median']:.0f} (over dims)"),
        ("ESS/s", _fmt(s["ess_per_s"], ".1f") + ("" if s["ess_per_s"] is None else " (min bulk ESS per sampling s)")),
        ("R-hat max", _fmt(s["rhat_max"], ".4f") + (" (needs >= 2 chains)" if s["chains"] == 1 else "")),
        ("compile", "skipped (--no-compile)" if s["compile_s"] is None else f"{s['compile_s']:.2f} s"),
        ("sampling", f"{s['sampling_s']:.2f} s"),
    ]
    lines = [f"{k:<12} {v}" for k, v in rows]
    if s["rhat_max"] is not None and s["rhat_max"] > 1.01:
        lines.append(f"{'note':<12} R-hat > 1.01: the chains disagree (not converged, or each stuck in its own mode)")
    return lines


# ---------------------------------------------------------------------------- outputs


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(files: list[tuple[str, Callable[[BinaryIO], None]]]) -> None:
    """Write each ``(path, write)`` to a temporary file beside ``path``; once all are complete,
    ``os.replace`` each onto its path. If a write fails, every temporary file is removed and
    no ``path`` is touched; an existing file is only ever replaced by a complete one."""
    temps: list[tuple[str, str]] = []
    mode = 0o666 & ~_umask()  # mkstemp makes 0600 files; give what open() would
    try:
        for path, write in files:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.", suffix=".tmp")
            temps.append((tmp, path))
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
        for tmp, path in temps:
            os.replace(tmp, path)
    finally:
        for tmp, _ in temps:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def plot(f: BinaryIO, target: Any, positions: Tensor, energies: Tensor, summary: dict[str, Any]) -> None:
    """A PNG into ``f``: for dim 2, energy contours with final draws over them; otherwise
    histograms of the first (up to 4) marginals. Beside it, the mean energy per kept draw."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg, without touching pyplot's backend
    from matplotlib.figure import Figure

    pos = positions.detach().to("cpu", torch.float64)
    dim = pos.shape[-1]
    steps = summary["burn_in"] + summary["thin"] * np.arange(1, pos.shape[0] + 1)
    mean_energy = energies.detach().to("cpu", torch.float64).mean(1).numpy()
    n_left = 1 if dim == 2 else min(dim, 4)
    fig = Figure(figsize=(5.2 * (n_left + 1) if dim == 2 else 3.4 * n_left + 4.5, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    ratios = [1.25, 1] if dim == 2 else [1] * n_left + [1.4]
    axes = fig.subplots(1, n_left + 1, width_ratios=ratios)
    fig.suptitle(
        f"{summary['energy']} (dim {dim}), {summary['sampler']} step {summary['step_size']:g}: "
        f"{summary['chains']} chains, {summary['steps']} steps (burn-in {summary['burn_in']})"
    )

    if dim == 2:
        ax = axes[0]
        final = pos[-1][:2000]  # chains are exchangeable: the first 2000 are a fair subsample
        # the grid covers 99% of the final draws: a few stray chains do not shrink the picture
        lo, hi = final.quantile(0.005, dim=0), final.quantile(0.995, dim=0)
        pad = 0.25 * (hi - lo) + 0.25
        xs = torch.linspace(float(lo[0] - pad[0]), float(hi[0] + pad[0]), 200, dtype=torch.float64)
        ys = torch.linspace(float(lo[1] - pad[1]), float(hi[1] + pad[1]), 200, dtype=torch.float64)
        gx, gy = torch.meshgrid(xs, ys, indexing="xy")
        grid = torch.stack([gx.reshape(-1), gy.reshape(-1)], -1)
        cpu_target = target.to(device="cpu")
        with torch.no_grad():
            e = torch.func.vmap(cpu_target)(grid.to(cpu_target.dtype)).double().reshape(gx.shape).numpy()
        e = np.where(np.isfinite(e), e, np.nan)
        # levels up to the 80th percentile of the grid, denser near the minimum: the
        # low-energy structure, where the draws are, gets most of the colours
        vmin, vmax = np.nanmin(e), np.nanquantile(e, 0.8)
        levels = vmin + (max(vmax - vmin, 1e-6)) * np.linspace(0, 1, 18) ** 2
        cs = ax.contourf(gx.numpy(), gy.numpy(), e, levels=levels, cmap="viridis", extend="max")
        fig.colorbar(cs, ax=ax, label="energy E(x)", format="%.3g")
        ax.scatter(final[:, 0].numpy(), final[:, 1].numpy(), s=4, c="#ff5a36", alpha=0.6, linewidths=0,
                   label=f"final draws ({final.shape[0]} chains)")
        ax.set(xlabel="x0", ylabel="x1", title="energy contours and final draws",
               xlim=(float(xs[0]), float(xs[-1])), ylim=(float(ys[0]), float(ys[-1])))
        ax.legend(loc="upper right", fontsize="small", markerscale=3)
    else:
        flat = pos.reshape(-1, dim)
        for i in range(n_left):
            ax = axes[i]
            ax.hist(flat[:, i].numpy(), bins=60, density=True, color="#3b75af")
            ax.set(xlabel=f"x{i}", ylabel="density" if i == 0 else None, title=f"marginal of x{i}")

    ax = axes[-1]
    ax.plot(steps, mean_energy, color="#3b75af", lw=1.2)
    ax.set(xlabel="step", ylabel="mean energy over chains", title="energy trace (kept draws)")
    ax.grid(alpha=0.3)
    fig.savefig(f, format="png", dpi=110)


# ------------------------------------------------------------------------------ main


def _sample(args: argparse.Namespace) -> int:
    cfg = _config(args)
    summary, positions, energies, target = _run(cfg)
    print("\n".join(format_summary(summary)), flush=True)

    files = []
    if cfg.out is not None:
        record = {
            "trace": positions.detach().cpu(),
            "energy": energies.detach().cpu(),
            "summary": summary,
            "args": {k: v for k, v in cfg._asdict().items() if k not in ("out", "plot", "progress")},
        }
        files.append((cfg.out, lambda f: torch.save(record, f)))
    if cfg.plot is not None:
        files.append((cfg.plot, lambda f: plot(f, target, positions, energies, summary)))
    try:
        write_atomic(files)
    except OSError as e:
        raise RunError(f"cannot write {e.filename or 'output'}: {e.strerror or e}") from None
    if cfg.out is not None:
        print(f"{'saved':<12} {args.out}")
    if cfg.plot is not None:
        print(f"{'plot':<12} {args.plot}")
    return 0


# ------------------------------------------------------------------------------ train
#
# `fnebm train`: an MLP energy fitted to a 2-D toy data set. Everything random comes from one
# key: k_params, k_chains, k_train, k_eval = split(key(seed), 4); training step t uses
# fold_in(k_train, t). The checkpoint holds the parameters, Adam's moments and count, the
# persistent chains, the key and the step, so a resumed run continues the same stream.

TRAIN_LOSSES = ("pcd", "cd", "dsm", "ssm", "sm")
TRAIN_SAMPLERS = ("langevin", "mala")
CHECKPOINT_FORMAT = "fnebm-train"
CHECKPOINT_VERSION = 1
# the training options a checkpoint fixes (a resumed run takes them from it), and their defaults
TRAIN_DEFAULTS: dict[str, Any] = dict(
    dataset="eight_gaussians", loss="pcd", sampler="langevin", batch=1024, lr=1e-3, k=10, step_size=0.01,
    noise_scale=1.0, sigma=0.1, buffer=0, hidden=128, seed=0, dtype="float32",
)
TETHER = 0.01         # E(x) = MLP(x) + TETHER |x|^2 / 2: exp(-E) stays normalisable whatever the MLP does
INIT_SCALE = 2.0      # fresh chains (PCD restarts, model samples) start from N(0, INIT_SCALE^2 I)
REINIT_PROB = 0.05    # PCD: chance that a chain restarts from noise at each step
ADAM = (0.9, 0.999, 1e-8)
SAMPLE_CHAINS = 2000  # chains run from noise after training: the plot's and the MMD's model samples
EVAL_POINTS = 10_000  # data points of the grid KL's density estimate (and a second set for its floor)
GRID = 100            # the grid KL's grid: GRID x GRID cells over the data's box
KDE_CELLS = 2.0       # the data density: a histogram smoothed by a Gaussian of this many cells


class TrainConfig(NamedTuple):
    dataset: str
    loss: str
    sampler: str
    batch: int
    lr: float
    k: int
    step_size: float
    noise_scale: float
    sigma: float
    buffer: int
    hidden: int
    seed: int
    dtype: str
    steps: int
    sample_steps: int
    device: str
    out: str | None
    plot: str | None
    resume: str | None
    progress: bool
    compile: bool

    def fixed(self) -> dict[str, Any]:
        """The options a checkpoint records and a resumed run must keep."""
        return {name: getattr(self, name) for name in TRAIN_DEFAULTS}


def _add_train_options(p: argparse.ArgumentParser) -> None:
    from fnebm import datasets

    d = TRAIN_DEFAULTS
    # default None: a resumed run takes each of these from its checkpoint, a new run from TRAIN_DEFAULTS
    p.add_argument("--dataset", default=None, metavar="NAME",
                   help=f"one of {', '.join(datasets.DATASETS)} (default: {d['dataset']})")
    p.add_argument("--loss", default=None, metavar="NAME",
                   help="pcd (persistent CD), cd (CD-k from the data), dsm (denoising score matching), "
                        f"ssm (sliced score matching), sm (exact score matching) (default: {d['loss']})")
    p.add_argument("--sampler", default=None, metavar="NAME",
                   help=f"langevin or mala: the negatives of cd/pcd and the model samples (default: {d['sampler']})")
    p.add_argument("--steps", type=int, default=2000, metavar="N",
                   help="training steps to run now (after --resume: more steps) (default: 2000)")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help=f"data points per step, and persistent chains for pcd (default: {d['batch']})")
    p.add_argument("--lr", type=float, default=None, metavar="LR", help=f"Adam learning rate (default: {d['lr']:g})")
    p.add_argument("--k", type=int, default=None, metavar="N",
                   help=f"cd/pcd: sampler steps per training step (default: {d['k']})")
    p.add_argument("--step-size", type=float, default=None, metavar="H",
                   help=f"sampler step size (default: {d['step_size']:g})")
    p.add_argument("--noise-scale", type=float, default=None, metavar="S",
                   help=f"langevin: noise scale, 1 targets exp(-E) (default: {d['noise_scale']:g})")
    p.add_argument("--sigma", type=float, default=None, metavar="S",
                   help=f"dsm: the noise level (default: {d['sigma']:g})")
    p.add_argument("--buffer", type=int, default=None, metavar="N",
                   help="pcd: replay buffer entries, 0 for none, else >= --batch (default: 0)")
    p.add_argument("--hidden", type=int, default=None, metavar="N",
                   help=f"width of the MLP's two hidden layers (default: {d['hidden']})")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="seed of the key (default: 0)")
    p.add_argument("--dtype", default=None, metavar="NAME", help="float32 or float64 (default: float32)")
    p.add_argument("--sample-steps", type=int, default=500, metavar="N",
                   help="sampler steps from noise for the model samples after training (default: 500)")
    p.add_argument("--out", default=None, metavar="PATH", help="torch.save the checkpoint here")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG: data, exp(-E), model samples")
    p.add_argument("--resume", default=None, metavar="PATH", help="continue from this checkpoint")
    p.add_argument("--device", default=None, metavar="NAME",
                   help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown on a terminal)")
    p.add_argument("--no-compile", action="store_true",
                   help="run the training step eagerly, without torch.compile (faster for short runs)")


def _positive(flag: str, value: float, *, integer: bool = False) -> None:
    ok = value >= 1 if integer else (math.isfinite(value) and value > 0)
    if not ok:
        raise UsageError(f"{flag} must be {'>= 1' if integer else 'a finite number > 0'}, got {value}")


def _load_checkpoint(path: str, device: torch.device) -> dict[str, Any]:
    """The checkpoint at ``path`` on ``device``, checked for the keys :func:`_train` needs; or UsageError."""
    if not os.path.exists(path):
        raise UsageError(f"--resume {path}: no such file")
    if not os.path.isfile(path):
        raise UsageError(f"--resume {path}: not a regular file")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # not a torch file, truncated, foreign pickle: all "not a checkpoint"
        raise UsageError(f"--resume {path}: not an fnebm train checkpoint ({type(e).__name__})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"--resume {path}: not an fnebm train checkpoint (written by fnebm train --out)")
    if ckpt.get("version") != CHECKPOINT_VERSION:
        raise UsageError(f"--resume {path}: checkpoint version {ckpt.get('version')!r}, this fnebm reads "
                         f"{CHECKPOINT_VERSION}")
    needed = ("config", "step", "key", "params", "optimizer", "chains", "losses")
    missing = [k for k in needed if k not in ckpt]
    config = ckpt.get("config")
    if missing or not isinstance(config, dict) or set(config) != set(TRAIN_DEFAULTS):
        raise UsageError(f"--resume {path}: damaged checkpoint (missing {', '.join(missing) or 'config entries'})")
    return ckpt


def _train_config(args: argparse.Namespace) -> tuple[TrainConfig, dict[str, Any] | None]:
    from fnebm import datasets

    device = _device(args.device)
    ckpt = None
    if args.resume is not None:
        ckpt = _load_checkpoint(args.resume, device)
    base = dict(TRAIN_DEFAULTS) if ckpt is None else dict(ckpt["config"])
    given = {name: getattr(args, name) for name in TRAIN_DEFAULTS if getattr(args, name) is not None}
    if ckpt is not None:
        for name, value in given.items():
            if value != base[name]:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"--resume {args.resume}: {flag} {value} differs from the checkpoint's {base[name]} "
                                 f"(leave it out to keep the checkpoint's)")
    opts = {**base, **given}
    if opts["dataset"] not in datasets.DATASETS:
        raise UsageError(f"unknown dataset {opts['dataset']!r} (choose from {', '.join(datasets.DATASETS)})")
    if opts["loss"] not in TRAIN_LOSSES:
        raise UsageError(f"unknown loss {opts['loss']!r} (choose from {', '.join(TRAIN_LOSSES)})")
    if opts["sampler"] not in TRAIN_SAMPLERS:
        raise UsageError(f"unknown sampler {opts['sampler']!r} (choose from {', '.join(TRAIN_SAMPLERS)})")
    if opts["dtype"] not in DTYPES:
        raise UsageError(f"unknown dtype {opts['dtype']!r} (choose from {', '.join(DTYPES)})")
    for flag, value in (("--steps", args.steps), ("--batch", opts["batch"]), ("--k", opts["k"]),
                        ("--hidden", opts["hidden"]), ("--sample-steps", args.sample_steps)):
        _positive(flag, value, integer=True)
    for flag, value in (("--lr", opts["lr"]), ("--step-size", opts["step_size"]), ("--sigma", opts["sigma"])):
        _positive(flag, value)
    if not (math.isfinite(opts["noise_scale"]) and opts["noise_scale"] >= 0):
        raise UsageError(f"--noise-scale must be a finite number >= 0, got {opts['noise_scale']}")
    if args.noise_scale is not None and opts["sampler"] != "langevin":
        raise UsageError(f"--noise-scale is Langevin's: use it with --sampler langevin, not {opts['sampler']}")
    if opts["buffer"] < 0 or 0 < opts["buffer"] < opts["batch"]:
        raise UsageError(f"--buffer must be 0 (none) or >= --batch {opts['batch']}, got {opts['buffer']}")
    if args.buffer is not None and opts["buffer"] and opts["loss"] != "pcd":
        raise UsageError(f"--buffer is persistent CD's replay buffer: use it with --loss pcd, not {opts['loss']}")
    try:
        fr.key(opts["seed"])
    except (TypeError, ValueError) as e:
        raise UsageError(f"--seed: {e}") from None
    out = None if args.out is None else _destination("--out", args.out)
    plot = None if args.plot is None else _destination("--plot", args.plot)
    if out is not None and out == plot:
        raise UsageError(f"--out and --plot name the same file {args.out}")
    opts = {k: (float(v) if isinstance(TRAIN_DEFAULTS[k], float) else v) for k, v in opts.items()}
    cfg = TrainConfig(**opts, steps=args.steps, sample_steps=args.sample_steps, device=str(device), out=out,
                      plot=plot, resume=args.resume, progress=not args.no_progress and sys.stderr.isatty(),
                      compile=not args.no_compile)
    return cfg, ckpt


# --------------------------------------------------------------------------- the model


def mlp_energy(params: dict[str, Tensor], x: Tensor) -> Tensor:
    """``E(x) = w2 · silu(W1 silu(W0 x + b0) + b1) + TETHER |x|² / 2`` for one point ``x: (2,)``.

    SiLU, not ReLU: score matching needs the energy's second derivatives. No output bias: no loss
    here sees a constant shift. The tether keeps ``exp(-E)`` normalisable (the MLP grows at most
    linearly), and is weak on the data's box (0.08 at radius 4).
    """
    h = torch.nn.functional.silu(x @ params["w0"] + params["b0"])
    h = torch.nn.functional.silu(h @ params["w1"] + params["b1"])
    return (h @ params["w2"]).reshape(()) + (0.5 * TETHER) * (x * x).sum()


def mlp_init(key: Tensor, hidden: int, dtype: torch.dtype) -> dict[str, Tensor]:
    """PyTorch's default ``nn.Linear`` initialisation, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, drawn from ``key``."""
    shapes = {"w0": ((2, hidden), 2), "b0": ((hidden,), 2), "w1": ((hidden, hidden), hidden),
              "b1": ((hidden,), hidden), "w2": ((hidden, 1), hidden)}
    keys = fr.split(key, len(shapes))
    return {name: (2 * fr.uniform(keys[i], shape, dtype) - 1) / math.sqrt(fan_in)
            for i, (name, (shape, fan_in)) in enumerate(shapes.items())}


def _fresh(key: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Where fresh chains start: ``N(0, INIT_SCALE² I)`` (the toy sets lie in about [-4, 4]²)."""
    return INIT_SCALE * fr.normal(key, shape, dtype)


def _train_sampler(cfg: TrainConfig) -> Callable[[Any], fnebm.SamplingAlgorithm]:
    if cfg.sampler == "mala":
        return lambda energy: fnebm.mala(energy, cfg.step_size)
    return lambda energy: fnebm.langevin(energy, cfg.step_size, cfg.noise_scale)


def _loss_function(cfg: TrainConfig) -> Callable[..., tuple[Tensor, Any]]:
    """``f(params, key, chains) -> (loss, chains)``: draws the step's batch and evaluates the loss.

    ``chains`` is the :class:`~fnebm.losses.PCDState` for pcd and ``None`` otherwise. The sampler
    loop is a scan under compile (``unroll=False``): the gradient is taken by autograd outside,
    and no gradient flows through the chains, so one scan body serves any ``--k``.
    """
    from fnebm import datasets
    from fnebm import losses

    data, sampler, dtype = datasets.get(cfg.dataset), _train_sampler(cfg), DTYPES[cfg.dtype]

    def f(params: dict[str, Tensor], key: Tensor, chains: Any) -> tuple[Tensor, Any]:
        k_data, k_loss = fr.split(key)
        batch = data(k_data, cfg.batch, dtype)
        energy = E.bind(mlp_energy, params)
        if cfg.loss == "pcd":
            loss, aux = losses.persistent_contrastive_divergence(
                energy, batch, k_loss, chains, sampler=sampler, n_steps=cfg.k, reinit_prob=REINIT_PROB,
                noise=_fresh, unroll=False)
            return loss, aux.state
        if cfg.loss == "cd":
            loss, _ = losses.contrastive_divergence(energy, batch, k_loss, sampler=sampler, n_steps=cfg.k,
                                                    init="data", unroll=False)
        elif cfg.loss == "dsm":
            loss, _ = losses.denoising_score_matching(energy, batch, k_loss, sigma=cfg.sigma)
        elif cfg.loss == "ssm":
            loss, _ = losses.sliced_score_matching(energy, batch, k_loss, variance_reduction=True)
        else:
            loss, _ = losses.exact_score_matching(energy, batch, k_loss)
        return loss, chains

    return f


def adam_update(params: dict[str, Tensor], grads: tuple[Tensor, ...], opt: dict[str, Any],
                lr: float) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """One Adam step over the parameter dict (``opt``: ``m``, ``v`` dicts and the count ``t``, a tensor)."""
    b1, b2, eps = ADAM
    t = opt["t"] + 1
    c1, c2 = 1 - b1 ** t, 1 - b2 ** t
    m, v, new = {}, {}, {}
    for (name, p), g in zip(params.items(), grads):
        m[name] = b1 * opt["m"][name] + (1 - b1) * g
        v[name] = b2 * opt["v"][name] + (1 - b2) * g * g
        new[name] = p - lr * (m[name] / c1) / ((v[name] / c2).sqrt() + eps)
    return new, {"m": m, "v": v, "t": t}


_TRAIN_CACHE: dict[tuple, Callable] = {}


def _compiled_loss(cfg: TrainConfig) -> Callable:
    """The loss compiled once per configuration and process (``fullgraph``, default backend)."""
    key = (*cfg.fixed().values(), cfg.device)
    if key not in _TRAIN_CACHE:
        _TRAIN_CACHE[key] = torch.compile(_loss_function(cfg), fullgraph=True)
    return _TRAIN_CACHE[key]


def _initial(cfg: TrainConfig, ckpt: dict[str, Any] | None) -> dict[str, Any]:
    """The training state: from the checkpoint, or fresh from the seed."""
    from fnebm import losses

    if ckpt is not None:
        chains = None if ckpt["chains"] is None else losses.PCDState(**ckpt["chains"])
        return dict(step=int(ckpt["step"]), key=ckpt["key"], params=ckpt["params"], optimizer=ckpt["optimizer"],
                    chains=chains, losses=ckpt["losses"].to(torch.float64).cpu())
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    k_params, k_chains, k_train, _ = fr.split(fr.key(cfg.seed, device=device), 4)
    params = mlp_init(k_params, cfg.hidden, dtype)
    zeros = {name: torch.zeros_like(p) for name, p in params.items()}
    optimizer = {"m": zeros, "v": dict(zeros), "t": torch.zeros((), dtype=dtype, device=device)}
    chains = None
    if cfg.loss == "pcd":
        chains = losses.pcd_init(_fresh(k_chains, (cfg.batch, 2), dtype), buffer_size=cfg.buffer)
    return dict(step=0, key=k_train, params=params, optimizer=optimizer, chains=chains,
                losses=torch.zeros(0, dtype=torch.float64))


def _check_resumed(cfg: TrainConfig, state: dict[str, Any]) -> None:
    """The checkpoint's tensors have the shapes its config says (a hand-edited file fails here, not mid-run)."""
    expected = mlp_init(fr.key(0), cfg.hidden, DTYPES[cfg.dtype])
    params = state["params"]
    ok = isinstance(params, dict) and set(params) == set(expected) and all(
        isinstance(params[n], Tensor) and params[n].shape == p.shape and params[n].dtype == p.dtype
        for n, p in expected.items())
    ok = ok and isinstance(state["key"], Tensor) and state["key"].shape == (2,) and state["step"] >= 0
    opt = state["optimizer"]
    ok = ok and isinstance(opt, dict) and all(
        isinstance(opt.get(s), dict) and set(opt[s]) == set(expected) and
        all(opt[s][n].shape == p.shape for n, p in expected.items()) for s in ("m", "v"))
    chains = state["chains"]
    ok = ok and (chains is None) == (cfg.loss != "pcd")
    ok = ok and (chains is None or (chains.positions.shape == (cfg.batch, 2) and
                                    chains.buffer.shape == (cfg.buffer, 2)))
    if not ok:
        raise UsageError(f"--resume {cfg.resume}: damaged checkpoint (its tensors do not match its config)")


def _train_loop(cfg: TrainConfig, state: dict[str, Any]) -> tuple[dict[str, Any], float | None, float]:
    """``cfg.steps`` training steps from ``state``; returns ``(state, compile_s, train_s)``."""
    device = torch.device(cfg.device)
    loss_fn = _compiled_loss(cfg) if cfg.compile else _loss_function(cfg)
    params, opt, chains = state["params"], state["optimizer"], state["chains"]
    start, base_key = state["step"], state["key"]
    history = torch.empty(cfg.steps, dtype=torch.float64, device=device)
    bar = None
    if cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, unit="step", desc="training", file=sys.stderr)
    every = max(1, cfg.steps // 100)
    compile_s = None
    t0 = time.perf_counter()
    for i in range(cfg.steps):
        leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
        loss, chains = loss_fn(leaves, fr.fold_in(base_key, start + i), chains)
        grads = torch.autograd.grad(loss, tuple(leaves.values()))
        with torch.no_grad():
            params, opt = adam_update({n: p.detach() for n, p in leaves.items()}, grads, opt, cfg.lr)
        history[i] = loss.detach()
        if i == 0 and cfg.compile:  # the first call compiles: timed on its own
            _sync(device)
            compile_s = time.perf_counter() - t0
            t0 = time.perf_counter()
        if bar is not None and ((i + 1) % every == 0 or i + 1 == cfg.steps):
            bar.set_postfix(loss=f"{float(history[max(0, i + 1 - every):i + 1].mean()):.4g}", refresh=False)
            bar.update((i + 1) - bar.n)
    _sync(device)
    train_s = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    losses = torch.cat([state["losses"], history.cpu()])
    new = dict(step=start + cfg.steps, key=base_key, params={n: p.detach() for n, p in params.items()},
               optimizer=opt, chains=chains, losses=losses)
    return new, compile_s, train_s


# ------------------------------------------------------------------------- evaluation


def model_samples(cfg: TrainConfig, params: dict[str, Tensor], key: Tensor, n: int = SAMPLE_CHAINS) -> Tensor:
    """``n`` chains from ``N(0, INIT_SCALE² I)`` run ``cfg.sample_steps`` steps of the sampler on the model: ``(n, 2)``."""
    from fnebm.chain.loop import run

    alg = _train_sampler(cfg)(E.bind(mlp_energy, params))
    k_start, k_run = fr.split(key)
    state = torch.func.vmap(alg.init)(_fresh(k_start, (n, 2), DTYPES[cfg.dtype]))
    with torch.no_grad():
        final, _, _ = run(alg.step, state, fr.split(k_run, n), cfg.sample_steps, collect=lambda s: ())
    return final.position.detach()


def _box(data: Tensor) -> tuple[Tensor, Tensor]:
    lo, hi = data.min(0).values, data.max(0).values
    pad = 0.05 * (hi - lo) + 0.25
    return lo - pad, hi + pad


def _grid(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Cell centres of the GRID x GRID grid over ``[lo, hi]``: ``(xs, ys, points (GRID², 2))``, row y, column x."""
    xs = lo[0] + (torch.arange(GRID, dtype=torch.float64) + 0.5) * (hi[0] - lo[0]) / GRID
    ys = lo[1] + (torch.arange(GRID, dtype=torch.float64) + 0.5) * (hi[1] - lo[1]) / GRID
    gy, gx = torch.meshgrid(ys, xs, indexing="ij")
    return xs, ys, torch.stack([gx.reshape(-1), gy.reshape(-1)], -1)


def _kde(points: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """The density of ``points`` on the grid, as cell probabilities ``(GRID, GRID)`` summing to 1:
    a 2-D histogram smoothed by a Gaussian of KDE_CELLS cells (zero-padded: mass near the border leaks)."""
    cell = (points - lo) / (hi - lo) * GRID
    idx = cell.floor().long()
    inside = ((idx >= 0) & (idx < GRID)).all(1)
    idx = idx[inside]
    hist = torch.zeros(GRID * GRID, dtype=torch.float64)
    hist.index_add_(0, idx[:, 1] * GRID + idx[:, 0], torch.ones(idx.shape[0], dtype=torch.float64))
    radius = int(math.ceil(4 * KDE_CELLS))
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float64)
    w = torch.exp(-0.5 * (offsets / KDE_CELLS) ** 2)
    w = w / w.sum()
    img = hist.reshape(1, 1, GRID, GRID)
    img = torch.nn.functional.conv2d(img, w.reshape(1, 1, 1, -1), padding=(0, radius))
    img = torch.nn.functional.conv2d(img, w.reshape(1, 1, -1, 1), padding=(radius, 0))
    img = img.reshape(GRID, GRID).clamp_min(0)
    return img / img.sum()


def _kl(p: Tensor, log_q: Tensor) -> float:
    """``KL(p || q) = Σ p (log p - log q)`` over the cells where ``p > 0`` (nats)."""
    mask = p > 0
    return float((p[mask] * (p[mask].log() - log_q[mask])).sum())


def mmd2(x: Tensor, y: Tensor, scales: tuple[float, ...] = (0.1, 0.3, 1.0)) -> float:
    """Unbiased squared MMD between samples ``x`` and ``y`` with a sum of Gaussian kernels of the given widths."""
    x, y = x.double(), y.double()

    def k(a: Tensor, b: Tensor) -> Tensor:
        d2 = torch.cdist(a, b).square()
        return sum(torch.exp(-0.5 * d2 / s**2) for s in scales)

    n, m = x.shape[0], y.shape[0]
    kxx, kyy = k(x, x), k(y, y)
    sxx = (kxx.sum() - kxx.diagonal().sum()) / (n * (n - 1))
    syy = (kyy.sum() - kyy.diagonal().sum()) / (m * (m - 1))
    return float(sxx + syy - 2 * k(x, y).mean())


def evaluate(cfg: TrainConfig, params: dict[str, Tensor]) -> dict[str, Any]:
    """The quality figures and what the plot draws, all on the CPU in float64.

    ``kl``: KL(data || model) in nats between two densities on a GRID x GRID grid over the data's
    box: the data's, a histogram of EVAL_POINTS points smoothed by a Gaussian of KDE_CELLS cells;
    the model's, exp(-E) at the cell centres normalised over the grid. ``kl_floor``: the same KL
    between the estimates from two independent data sets of EVAL_POINTS points (what a perfect
    model would score, up to the smoothing). ``mmd2``: unbiased squared MMD between the model
    samples and as many data points (Gaussian kernels of width 0.1, 0.3 and 1).
    """
    from fnebm import datasets

    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    k_eval = fr.split(fr.key(cfg.seed, device=device), 4)[3]
    k_data, k_floor, k_samples = fr.split(k_eval, 3)
    data_fn = datasets.get(cfg.dataset)
    data = data_fn(k_data, EVAL_POINTS, torch.float64).cpu()
    other = data_fn(k_floor, EVAL_POINTS, torch.float64).cpu()
    lo, hi = _box(data)
    xs, ys, points = _grid(lo, hi)
    with torch.no_grad():
        energy = torch.vmap(E.bind(mlp_energy, params))(points.to(device=device, dtype=dtype))
    energy = energy.detach().to("cpu", torch.float64).reshape(GRID, GRID)
    finite = torch.isfinite(energy)
    log_q = torch.where(finite, -energy, torch.full_like(energy, -math.inf))
    log_q = log_q - torch.logsumexp(log_q.reshape(-1), 0)
    p = _kde(data, lo, hi)
    samples = model_samples(cfg, params, k_samples)
    samples_cpu = samples.to("cpu", torch.float64)
    ok = torch.isfinite(samples_cpu).all(1)
    return dict(
        kl=_kl(p, log_q), kl_floor=_kl(p, _kde(other, lo, hi).clamp_min(1e-300).log()),
        mmd2=mmd2(samples_cpu[ok], data[: SAMPLE_CHAINS]) if bool(ok.sum() >= 2) else None,
        nonfinite_samples=int((~ok).sum()),
        data=data, samples=samples_cpu, xs=xs, ys=ys, log_density=log_q, lo=lo, hi=hi,
    )


def plot_training(f: BinaryIO, cfg: TrainConfig, ev: dict[str, Any], summary: dict[str, Any]) -> None:
    """Three panels into ``f`` (PNG): the data, the learned density ``exp(-E)`` on the grid, model samples."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    extent = (float(ev["lo"][0]), float(ev["hi"][0]), float(ev["lo"][1]), float(ev["hi"][1]))
    fig.suptitle(f"fnebm train: {cfg.dataset}, {cfg.loss} ({cfg.sampler}), {summary['step']} steps, "
                 f"KL(data || model) {summary['kl']:.3f} nats")
    n = SAMPLE_CHAINS
    data = ev["data"][:n].numpy()
    axes[0].scatter(data[:, 0], data[:, 1], s=3, c="#3b75af", alpha=0.5, linewidths=0)
    axes[0].set_title(f"data ({n} points)")
    density = ev["log_density"].exp().numpy()
    axes[1].imshow(density, origin="lower", extent=extent, cmap="viridis", aspect="auto")
    axes[1].set_title("learned density exp(-E), normalised on the grid")
    s = ev["samples"]
    s = s[torch.isfinite(s).all(1)].numpy()
    axes[2].scatter(s[:, 0], s[:, 1], s=3, c="#ff5a36", alpha=0.5, linewidths=0)
    axes[2].set_title(f"model samples ({cfg.sampler}, {cfg.sample_steps} steps from noise)")
    for ax in axes:
        ax.set(xlim=extent[:2], ylim=extent[2:], xlabel="x0", ylabel="x1")
        ax.set_aspect("equal", adjustable="box")
    fig.savefig(f, format="png", dpi=100)


def format_train_summary(s: dict[str, Any]) -> list[str]:
    c = s["config"]
    if c["loss"] in ("pcd", "cd"):
        sampler = f"{c['sampler']} step {c['step_size']:g}" + (
            f", noise {c['noise_scale']:g}" if c["sampler"] == "langevin" else "")
        chains = (f"{c['batch']} persistent chains" + (f", buffer {c['buffer']}" if c["buffer"] else "")
                  if c["loss"] == "pcd" else "chains from the data")
        loss = f"{c['loss']}: k={c['k']} steps of {sampler}; {chains}"
    elif c["loss"] == "dsm":
        loss = f"dsm: sigma {c['sigma']:g}"
    else:
        loss = {"ssm": "ssm: one Rademacher projection, variance-reduced", "sm": "sm: exact (Hyvarinen)"}[c["loss"]]
    h = c["hidden"]
    rows = [
        ("dataset", f"{c['dataset']}, {c['dtype']} on {s['device']}"),
        ("model", f"MLP 2-{h}-{h}-1 (SiLU) + {TETHER:g}|x|^2/2, {s['n_params']} parameters"),
        ("loss", loss),
        ("steps", f"{s['start']} -> {s['step']} (batch {c['batch']}, Adam lr {c['lr']:g}, seed {c['seed']})"),
        ("final loss", f"{s['final_loss']:.4g} (mean over the last {s['final_window']} steps)"),
        ("compile", "skipped (--no-compile)" if s["compile_s"] is None else f"{s['compile_s']:.2f} s"),
        ("training", f"{s['train_s']:.2f} s ({1000 * s['step_ms']:.1f} ms/step)"),
        ("KL", f"{s['kl']:.4f} nats: KL(data || model) on a {GRID}x{GRID} grid "
               f"(floor {s['kl_floor']:.4f}: two data sets of {EVAL_POINTS})"),
        ("MMD^2", "n/a" if s["mmd2"] is None else
         f"{s['mmd2']:.2e}: model samples ({c['sampler']}, {s['sample_steps']} steps from noise) vs data"),
        ("evaluation", f"{s['eval_s']:.2f} s"),
    ]
    lines = [f"{k:<12} {v}" for k, v in rows]
    if s["nonfinite_samples"]:
        lines.append(f"{'note':<12} {s['nonfinite_samples']} model samples diverged (left out of MMD and plot)")
    return lines


def _train(args: argparse.Namespace) -> int:
    cfg, ckpt = _train_config(args)
    state = _initial(cfg, ckpt)
    if ckpt is not None:
        _check_resumed(cfg, state)
    start = state["step"]
    state, compile_s, train_s = _train_loop(cfg, state)
    t0 = time.perf_counter()
    ev = evaluate(cfg, state["params"])
    eval_s = time.perf_counter() - t0
    history = state["losses"]
    window = max(1, min(len(history), cfg.steps // 10))
    timed = cfg.steps - (1 if compile_s is not None else 0)
    summary: dict[str, Any] = dict(
        config=cfg.fixed(), device=cfg.device, start=start, step=state["step"],
        n_params=sum(p.numel() for p in state["params"].values()),
        final_loss=float(history[-window:].mean()), final_window=window,
        compile_s=compile_s, train_s=train_s, step_ms=train_s / timed if timed else math.nan,
        kl=ev["kl"], kl_floor=ev["kl_floor"], mmd2=ev["mmd2"], nonfinite_samples=ev["nonfinite_samples"],
        sample_steps=cfg.sample_steps, eval_s=eval_s,
    )
    print("\n".join(format_train_summary(summary)), flush=True)

    files = []
    if cfg.out is not None:
        chains = state["chains"]
        record = {
            "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "config": cfg.fixed(),
            "step": state["step"], "key": state["key"].cpu(),
            "params": {n: p.cpu() for n, p in state["params"].items()},
            "optimizer": {"m": {n: t.cpu() for n, t in state["optimizer"]["m"].items()},
                          "v": {n: t.cpu() for n, t in state["optimizer"]["v"].items()},
                          "t": state["optimizer"]["t"].cpu()},
            "chains": None if chains is None else {k: v.cpu() for k, v in chains._asdict().items()},
            "losses": state["losses"], "summary": summary,
        }
        files.append((cfg.out, lambda f: torch.save(record, f)))
    if cfg.plot is not None:
        files.append((cfg.plot, lambda f: plot_training(f, cfg, ev, summary)))
    try:
        write_atomic(files)
    except OSError as e:
        raise RunError(f"cannot write {e.filename or 'output'}: {e.strerror or e}") from None
    if cfg.out is not None:
        print(f"{'saved':<12} {args.out}")
    if cfg.plot is not None:
        print(f"{'plot':<12} {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the ``fnebm`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        if args.command == "train":
            return _train(args)
        return _sample(args)  # `demo` is `sample` with the preset's defaults
    except UsageError as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError as e:
        print(f"{PROG}: error: out of memory ({_one_line(e)[:200]}); try fewer --chains or --steps", file=sys.stderr)
        return 1
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
