"""``fnebm sample`` and ``fnebm demo``: the options, their checks (:class:`Config`) and the memory a
run needs, refused before anything is allocated."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import NamedTuple

import torch

from fnebm import distributed as fdist
from fnebm import random as fr
from fnebm.cli._common import Launch, UsageError, _destination, _device, available_memory, format_bytes
from fnebm.cli.presets import (ADAPTIVE, DEFAULT_ENERGY, DEMO, DEMO_PLOT, DTYPES, ENERGIES, SAMPLERS,
                               default_step_size, default_steps)


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
        p.add_argument("--energy", default=DEFAULT_ENERGY, metavar="NAME",
                       help=f"one of {', '.join(ENERGIES)} (default: {DEFAULT_ENERGY})")
        p.add_argument("--dim", type=int, default=2, metavar="D", help="dimension of x (default: 2)")
        p.add_argument("--sampler", default="mala", metavar="NAME",
                       help=f"one of {', '.join(SAMPLERS)} (default: mala)")
        p.add_argument("--adapt", type=int, default=None, metavar="N",
                       help="hmc/nuts: warm-up steps of window adaptation (step size and diagonal mass "
                            "matrix) before burn-in and sampling (default: steps // 2; 0: none)")
        p.add_argument("--chains", type=int, default=1024, metavar="N", help="chains run in parallel (default: 1024)")
        p.add_argument("--steps", type=int, default=None, metavar="N",
                       help="steps after burn-in (default: the energy's, about 200 autocorrelation times; "
                            "see docs/cli.md)")
        p.add_argument("--burn-in", type=int, default=None, metavar="N",
                       help="steps run first and not kept (default: steps // 4; 0 after --adapt)")
        p.add_argument("--thin", type=int, default=None, metavar="N",
                       help="keep every N-th step (default: steps // 1000, at least 1)")
        p.add_argument("--step-size", type=float, default=None, metavar="H",
                       help="sampler step size (default: the energy's for the sampler and dim, see docs/cli.md)")
        p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the key (default: 0)")
        p.add_argument("--dtype", default="float32", metavar="NAME", help="float32 or float64 (default: float32)")
        p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG plot of the draws")
    p.add_argument("--out", default=None, metavar="PATH", help="torch.save the draws, summary and arguments")
    p.add_argument("--device", default=None, metavar="NAME",
                   help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown on a terminal)")
    how = p.add_mutually_exclusive_group()
    # dispatch: --compile's help names the families the whole-chain kernels cover (printed by --help)
    how.add_argument("--compile", dest="compile", action="store_const", const=True, default="auto",
                     help="always compile the steps with torch.compile (default: a hand-written whole-chain "
                          "kernel where one covers the run, e.g. Langevin or MALA on double_well, harmonic, rastrigin or "
                          "gaussian on the CPU; otherwise compile only when running the steps eagerly "
                          "would take longer than a compile)")
    how.add_argument("--no-compile", dest="compile", action="store_const", const=False,
                     help="never compile: run the steps eagerly (same draws up to float rounding)")
    p.add_argument("--backend", default="auto", choices=("auto", "c", "triton", "torch"),
                   help="which engine runs the chains, as sample_chain's backend (default auto: a hand-written "
                        "kernel where one covers the run, else the sampler's own steps; c or triton insist on "
                        "that kernel; torch never uses one). --compile and --no-compile choose compiled or "
                        "eager steps for torch; --compile makes auto mean torch")
    p.add_argument("--profile", action="store_true",
                   help="after the run, time the sampler on these shapes: compile, first result, warm step "
                        "and its split into gradient, random draws, update and trace write "
                        "(fnebm.profile_sampling; costs about 7 more runs, and a compile unless --no-compile)")



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
    compile: bool | str
    profile: bool = False
    backend: str = "auto"  # sample_chain's backend word (--backend)
    world_size: int = 1  # processes (torchrun): each runs its block of the chains, fnebm.distributed's layout
    rank: int = 0



def _local_chains(cfg: Config) -> int:
    """The chains this rank runs (all of them in one process)."""
    return cfg.chains if cfg.world_size == 1 else fdist.chain_counts(cfg.chains, cfg.world_size)[cfg.rank]


def _config(args: argparse.Namespace, where: Launch | None = None) -> Config:
    """The checked arguments; ``where``: this rank under torchrun (default: one process)."""
    if args.energy not in ENERGIES:
        raise UsageError(f"unknown energy {args.energy!r} (choose from {', '.join(ENERGIES)})")
    if args.sampler not in SAMPLERS:
        raise UsageError(f"unknown sampler {args.sampler!r} (choose from {', '.join(SAMPLERS)})")
    if args.dtype not in DTYPES:
        raise UsageError(f"unknown dtype {args.dtype!r} (choose from {', '.join(DTYPES)})")
    for flag, value in (("--dim", args.dim), ("--chains", args.chains), ("--steps", args.steps),
                        ("--thin", args.thin)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    steps = default_steps(args.energy, args.dim, args.sampler) if args.steps is None else args.steps
    thin = max(1, steps // 1000) if args.thin is None else args.thin
    adaptive = args.sampler in ADAPTIVE
    if args.adapt is not None and args.adapt < 0:
        raise UsageError(f"--adapt must be >= 0, got {args.adapt}")
    if args.adapt and not adaptive:
        raise UsageError(f"--adapt tunes a mass matrix: use it with --sampler {' or '.join(ADAPTIVE)}, "
                         f"not {args.sampler}")
    adapt = (steps // 2 if adaptive else 0) if args.adapt is None else args.adapt
    burn_in = (0 if adapt else steps // 4) if args.burn_in is None else args.burn_in
    if burn_in < 0:
        raise UsageError(f"--burn-in must be >= 0, got {burn_in}")
    if thin > steps:
        raise UsageError(f"--thin must be <= --steps to keep any draw, got --thin {thin} --steps {steps}")
    world, rank = (1, 0) if where is None else (where.world_size, where.rank)
    if args.chains < world:
        raise UsageError(f"--chains {args.chains} must be at least the number of processes ({world}): every rank "
                         "runs a block of the chains")
    if args.profile and world > 1:
        raise UsageError("--profile times one process: run it without torchrun")
    if args.step_size is not None:
        step_size = args.step_size
    elif adapt:  # the adaptation's starting point: the rule of thumb d^(-1/4)
        step_size = args.dim ** -0.25
    else:
        step_size = default_step_size(args.energy, args.sampler, args.dim)
    if not (math.isfinite(step_size) and step_size > 0):
        raise UsageError(f"--step-size must be a finite number > 0, got {step_size}")
    try:
        fr.key(args.seed)
    except (TypeError, ValueError) as e:
        raise UsageError(f"--seed: {e}") from None
    device = _device(args.device) if where is None else where.device
    # only rank 0 writes files (the draws gathered from every rank): only its paths are checked
    out = None if args.out is None or rank != 0 else _destination("--out", args.out)
    plot = None if args.plot is None or rank != 0 else _destination("--plot", args.plot)
    if out is not None and out == plot:
        raise UsageError(f"--out and --plot name the same file {args.out}")
    cfg = Config(
        energy=args.energy, sampler=args.sampler, dim=args.dim, chains=args.chains, steps=steps,
        adapt=adapt, burn_in=burn_in, thin=thin, step_size=float(step_size), seed=args.seed, dtype=args.dtype,
        device=str(device), out=out, plot=plot,
        progress=not args.no_progress and sys.stderr.isatty() and rank == 0, compile=args.compile,
        profile=args.profile, world_size=world, rank=rank, backend=args.backend,
    )
    _check_memory(cfg)
    return cfg


def memory_estimate(cfg: Config) -> tuple[int, int, str]:
    """``(bytes on the run's device, bytes on the host besides, what dominates)``: a rough upper
    estimate of what the run holds at its peak: the trace (positions, energies and the sampler's
    info per kept draw), the chunk being copied into it, the chains' state and one step's
    temporaries, the energy's parameters, and the diagnostics' float64 copy of the trace with
    their sorting working set."""
    item = DTYPES[cfg.dtype].itemsize
    n_kept = cfg.steps // cfg.thin
    chains = _local_chains(cfg)  # under torchrun: this rank's (see _check_memory for the rest)
    draws = n_kept * chains
    info = {"langevin": 1, "mala": item + 2, "hmc": 40, "nuts": 56}[cfg.sampler]
    trace = draws * ((cfg.dim + 1) * item + info)
    chunk = trace // 10  # a compiled chunk's output (1/20 of the run) before it is copied
    state = chains * (24 * cfg.dim * item + 128)  # position, gradient, proposal, noise, keys, ...
    spec = ENERGIES[cfg.energy]
    params = spec.param_bytes(cfg.dim) if spec.param_bytes is not None else 0
    diag = draws * cfg.dim * 8 + 8 * draws * 8  # float64 trace; sort values, order, ranks of one coordinate
    device_bytes = trace + chunk + state + params + diag
    host = 0
    if cfg.device != "cpu" and (cfg.out is not None or cfg.plot is not None):
        host = draws * (cfg.dim + 1) * item  # the trace copied to the host to save or plot it
    what = (f"the trace alone is {chains} chains x {n_kept} draws x {cfg.dim + 1} values x {item} bytes"
            f" = {format_bytes(draws * (cfg.dim + 1) * item)}")
    return device_bytes, host, what


def _check_memory(cfg: Config) -> None:
    """Refuse, before anything is allocated, a run that cannot fit."""
    need, host, what = memory_estimate(cfg)
    device = torch.device(cfg.device)
    if cfg.world_size > 1:
        if device.type == "cpu":  # the ranks on this machine share its memory
            need *= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if cfg.out is not None or cfg.plot is not None:  # rank 0 gathers every rank's trace to write it
            host += cfg.steps // cfg.thin * cfg.chains * (cfg.dim + 1) * DTYPES[cfg.dtype].itemsize
            what += "; rank 0 gathers every rank's trace to write it"
    places = [(device, need + (host if device.type == "cpu" else 0))]
    if device.type != "cpu" and host:
        places.append((torch.device("cpu"), host))
    for where, n in places:
        free = available_memory(where)
        if free is not None and n > free:
            raise UsageError(
                f"this run needs about {format_bytes(n)} of memory on {where} ({what}) but {format_bytes(free)} "
                "is available: use fewer --chains or --steps, or a larger --thin")
