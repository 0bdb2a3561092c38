"""``fnebm sample`` and ``fnebm demo``: options, checks, the run, its summary and its plot."""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any, BinaryIO, NamedTuple

import torch
from torch import Tensor

import fnebm
from fnebm import diagnostics
from fnebm import random as fr
from fnebm.cli._common import RunError, UsageError, _destination, _device, _float_or_none, _fmt, _sync, write_atomic
from fnebm.cli.presets import (ADAPTIVE, DEMO, DEMO_PLOT, DTYPES, ENERGIES, SAMPLERS, _build, _collect,
                               _extra)


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

