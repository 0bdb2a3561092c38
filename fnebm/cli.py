"""The ``fnebm`` command: ``fnebm sample`` runs a sampler on a named energy, ``fnebm demo`` a preset.

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

__all__ = ["main", "ENERGIES", "SAMPLERS", "DEMO", "demo_command"]

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
    sub = parser.add_subparsers(dest="command", metavar="{sample,demo}", required=True, parser_class=_Parser)
    sample = sub.add_parser("sample", help="run a sampler on a named energy", allow_abbrev=False,
                            description="Run a sampler on a named energy and summarise the draws.")
    _add_run_options(sample, demo=False)
    demo = sub.add_parser("demo", help="MALA on a 2-D Gaussian mixture, with a plot", allow_abbrev=False,
                          description=f"The first thing to run. Equivalent to: {demo_command()}")
    _add_run_options(demo, demo=True)
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


def main(argv: list[str] | None = None) -> int:
    """Run the ``fnebm`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
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
