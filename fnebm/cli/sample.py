"""``fnebm sample`` and ``fnebm demo``: options, checks, the run, its summary and its plot."""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from statistics import NormalDist
from typing import Any, BinaryIO, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

import fnebm
from fnebm import diagnostics
from fnebm import distributed as fdist
from fnebm import random as fr
from fnebm.chain.sample import UNAVAILABLE
from fnebm.cli._common import (Launch, UsageError, _destination, _device, _float_or_none, _fmt, _sync, agree,
                               available_memory, compile_cache_dir, compile_times, format_bytes,
                               record_compile_time, run_launched, write_outputs)
from fnebm.cli.presets import (ADAPTIVE, DEFAULT_ENERGY, DEMO, DEMO_PLOT, DTYPES, ENERGIES, SAMPLERS, Truth, _algorithm,
                               _build, _collect, _extra, default_step_size, default_steps, truth_of)

# A chain is a runaway when a kept draw lies this many interquartile ranges (of all draws,
# per coordinate) from the median, or is not finite: 50 IQRs is 67 standard deviations of a
# Gaussian, which no chain of a sampler that works reaches.
RUNAWAY_IQRS = 50.0
# A chain that did not move over this many kept draws or more is frozen.
FROZEN_MIN_DRAWS = 10
# R-hat above this: the chains disagree (Vehtari et al. 2021).
RHAT_OK = 1.01
# The mixing verdict needs this many chains: with fewer, separate modes and slow chains look alike.
MIXING_MIN_CHAINS = 16


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
    how.add_argument("--compile", dest="compile", action="store_const", const=True, default="auto",
                     help="always compile the steps with torch.compile (default: a hand-written whole-chain "
                          "kernel where one covers the run, e.g. Langevin or MALA on double_well, harmonic, rastrigin or "
                          "gaussian on the CPU; otherwise compile only when running the steps eagerly "
                          "would take longer than a compile)")
    how.add_argument("--no-compile", dest="compile", action="store_const", const=False,
                     help="never compile: run the steps eagerly (same draws up to float rounding)")
    p.add_argument("--profile", action="store_true",
                   help="after the run, time the sampler on these shapes: compile, first result, warm step "
                        "and its split into gradient, random draws, update and trace write "
                        "(fnebm.profile_sampling; costs about 7 more runs, and a compile unless --no-compile)")



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
    compile: bool | str
    profile: bool = False
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
        profile=args.profile, world_size=world, rank=rank,
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



# ---------------------------------------------------------------------------- running


def _chunk_size(total: int) -> int:
    # about 20 chunks: a progress bar moves, and a compile shows as the first chunk's extra time.
    # No chunk is one step long: a length-1 scan is specialised by the compiler and would
    # compile a second graph in the middle of the run.
    size = min(total, max(2, -(-total // 20)))
    while size < total and total % size == 1:
        size += 1
    return size


def _ramp(burn_in: int, adapted: bool, energy: str | None = None) -> list[tuple[float, int]]:
    """The burn-in's first steps at smaller step sizes: ``[(fraction of the step size, steps)]``.

    A chain drawn far out in a light tail (a double well's quartic walls, Rosenbrock's ridge) sees
    a gradient so steep that a full step overshoots: an unadjusted chain runs away, an adjusted
    one rejects every proposal and freezes. Steps of 1/64, 1/16 and 1/4 the size (``burn_in // 8``
    each, at most 64) bring such chains in; the rest of the burn-in runs at the full step. Only for energies
    marked ``ramp`` (``None``: any), not after ``--adapt`` (its warm-up starts small itself), nor
    for a burn-in under 16 steps.
    """
    if adapted or burn_in < 16 or (energy is not None and not ENERGIES[energy].ramp):
        return []
    n = min(burn_in // 8, 64)  # tens of steps bring a chain in from the walls
    return [(1 / 64, n), (1 / 16, n), (1 / 4, n)]


def _tty() -> bool:
    return sys.stderr.isatty() and fdist.rank() == 0  # under torchrun, rank 0 speaks for every rank


def _graph_name(cfg: Config) -> str:
    return (f"{cfg.sampler} {cfg.energy} dim={cfg.dim} chains={_local_chains(cfg)} {cfg.dtype} "
            f"{torch.device(cfg.device).type}")


def compile_notice(cfg: Config, warmup: bool = False) -> str:
    """The line shown before a compile: what, about how long on this machine, and that it is cached.
    ``warmup``: the window adaptation's graph (all chains, on every rank), not the sampler's."""
    chains = (f"{cfg.chains} chains" if warmup or cfg.world_size == 1
              else f"{_local_chains(cfg)} chains on rank {cfg.rank} of {cfg.world_size}")
    what = (f"compiling {'the window adaptation of ' if warmup else ''}{cfg.sampler} on {cfg.energy} "
            f"(dim {cfg.dim}, {chains}, {cfg.dtype}, {torch.device(cfg.device).type}) with torch.compile")
    times = compile_times()
    kind = torch.device(cfg.device).type
    mine = None if warmup else times.get(_graph_name(cfg))  # warm-up compiles are not timed apart
    others = sorted(v["first"] for k, v in times.items() if k.endswith(f" {kind}"))
    where = compile_cache_dir() or "Inductor's cache directory"
    if mine is not None:
        return (f"{what}: about {mine['last']:.0f} s (it took {mine['last']:.0f} s here last time; "
                f"the code is served from the on-disk cache in {where})")
    if others:
        typical = others[len(others) // 2]  # the median first compile measured here
        return (f"{what}: about {typical:.0f} s the first time on this machine (the median of {len(others)} first "
                f"compiles measured here); then cached on disk in {where}, so a later run compiles faster")
    guess = "30-45 s on a 2-core CPU, less on more cores" if kind == "cpu" else "tens of seconds"
    return (f"{what}: the first time typically {guess}; then cached on disk in {where}, "
            "so a later run compiles faster")


class _Calls:
    """What the ``sample_chain`` calls of one run report: their plans and their chunks' seconds.
    It prints the compile notice before a compile and drives the progress bar, which starts once
    the compile is done."""

    def __init__(self, cfg: Config, total: int):
        self.cfg, self.total = cfg, total
        self.plans: list[Any] = []
        self.chunks: list[tuple[int, int, float]] = []  # (call, steps, seconds)
        self.planned_at: list[float] = []  # when each call had planned (a compile's imports come next)
        self.first_done: dict[int, float] = {}  # when each call's first chunk ended
        self.done = 0
        self.bar = None
        self.announced = False
        self._seen = 0

    def on_plan(self, plan: Any) -> None:
        if getattr(plan, "revised", False) and self.plans:  # the same call: its compile failed, it runs eagerly
            self.plans[-1] = plan
            self._start_bar()
            return
        self.plans.append(plan)
        self.planned_at.append(time.perf_counter())
        self._seen = 0
        if plan.compiles and not self.announced:
            self.announced = True
            if self.bar is not None:  # the burn-in ramp ran eagerly: the bar starts again after the compile
                self.bar.leave = False
                self.bar.close()
                self.bar = None
            if _tty():
                self._say(f"fnebm: {compile_notice(self.cfg)}")
        elif not plan.compiles:
            self._start_bar()

    def on_chunk(self, done: int, total: int, seconds: float) -> None:
        steps, self._seen = done - self._seen, done
        self.chunks.append((len(self.plans) - 1, steps, seconds))
        self.first_done.setdefault(len(self.plans) - 1, time.perf_counter())
        self._start_bar()
        self.done += steps
        if self.bar is not None:
            self.bar.update(steps)

    def _start_bar(self) -> None:
        if self.bar is None and self.cfg.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=self.done, unit="step", desc="sampling", file=sys.stderr)

    def _say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _compiles(self) -> tuple[dict[int, tuple[int, float]], float]:
        """Each compiling call's first chunk ``{call: (steps, seconds)}``, and the seconds per step
        of the other compiled chunks."""
        compiling = {i for i, p in enumerate(self.plans) if p is not None and p.compiles}
        firsts, steps, seconds = {}, 0, 0.0
        for call, n, s in self.chunks:
            if call in compiling and call not in firsts:
                firsts[call] = (n, s)
            elif self.plans[call] is not None and self.plans[call].compiled:
                steps, seconds = steps + n, seconds + s
        return firsts, seconds / steps if steps else 0.0

    def compile_s(self) -> float | None:
        """Seconds the compiles took: from a compiling call's plan to the end of its first chunk
        (the compiler's imports, tracing, code generation and that chunk), less what the chunk's
        steps cost at the rate of the other compiled chunks (``None`` when nothing was compiled)."""
        firsts, rate = self._compiles()
        if not firsts:
            return None
        return sum(max(0.0, self.first_done[c] - self.planned_at[c] - n * rate) for c, (n, _) in firsts.items())

    def stepping_s(self) -> float:
        """Seconds the steps took: the synchronised chunk times, less the compiling in them."""
        firsts, rate = self._compiles()
        compiling = sum(max(0.0, s - n * rate) for n, s in firsts.values())
        return max(0.0, sum(s for _, _, s in self.chunks) - compiling)

    def path(self, main: int) -> tuple[bool | None, str]:
        """``(compiled, why)`` for the main call, and a word on the burn-in ramp's calls if they differ."""
        if main >= len(self.plans) or self.plans[main] is None:
            return None, "a hand-written kernel (no plan reported)"
        plan = self.plans[main]
        if getattr(plan, "kernel", False):  # e.g. "backend='auto': the whole-chain C kernel (CPU)"
            return None, plan.reason.split(": ", 1)[-1] + ", nothing compiled"
        if getattr(plan, "fallback", None):
            return False, f"the compile failed ({plan.fallback}), so the steps ran eagerly"
        if self.cfg.compile is True:
            why = "--compile"
        elif self.cfg.compile is False:
            why = "--no-compile"
        elif any(p is not None and p.compiles for p in self.plans[:main]):
            why = "auto: compiled during the burn-in ramp"
        elif plan.reason.startswith("compiled earlier"):
            why = plan.reason
        else:
            why = "auto: " + plan.reason.removeprefix("eager: ").removeprefix("compiled: ")
        ramp = [p for p in self.plans[:main] if p is not None and p.compiled != plan.compiled]
        if ramp:
            why += f"; {sum(p.steps for p in ramp)} burn-in steps ran {'compiled' if ramp[0].compiled else 'eagerly'}"
        # a C kernel that covers the run but did not build or load: say why, whatever the branch above
        notes = [n for n in plan.reason.split("; ") if UNAVAILABLE in n and n not in why]
        return plan.compiled, "; ".join([why, *notes])


def _kernel_build_notice(cfg: Config, target: Any) -> None:
    """On a terminal, one line before the C kernel is compiled for this run (its first use on this
    machine), as before a torch.compile."""
    if not _tty() or cfg.compile is True or cfg.sampler not in ("langevin", "mala", "nuts") or cfg.rank != 0:
        return
    if cfg.compile is False and cfg.sampler != "nuts":  # --no-compile: Langevin and MALA run their eager steps
        return
    if torch.device(cfg.device).type != "cpu" or cfg.dtype != "float32":
        return
    from fnebm.kernels import cpu_chain, cpu_nuts

    if cpu_chain.covers(target) is not None:
        return
    if cfg.sampler == "nuts" and not cpu_nuts.built():
        print("fnebm: building the NUTS C kernel with the system C compiler: a few seconds, once on this machine "
              "(cached on disk)", file=sys.stderr, flush=True)
    elif cfg.sampler != "nuts" and not cpu_chain.built():
        print("fnebm: building the whole-chain C kernel with the system C compiler: a few seconds, once on this "
              "machine (cached on disk)", file=sys.stderr, flush=True)


def _kernel_build_s() -> float:
    """Seconds this process spent compiling the C kernels (0.0 if it never loaded them)."""
    return sum(module.build_seconds() for module in (sys.modules.get("fnebm.kernels.cpu_chain"),
                                                     sys.modules.get("fnebm.kernels.cpu_nuts"))
               if module is not None)


def _setup_words(s: dict[str, Any]) -> str:
    built = s.get("kernel_build_s")
    if built:
        return (f" (+{s['setup_s']:.2f} s setting up, {built:.2f} s of it building the C kernel: once on this "
                "machine, cached on disk)")
    return f" (+{s['setup_s']:.2f} s setting up: checks, the first eager step, tracing)"


def _backend(cfg: Config) -> str:
    """``sample_chain``'s backend: ``--compile`` asks for torch.compile, so it never takes a
    hand-written kernel; otherwise one runs where it covers the run (docs/kernels.md)."""
    return "compiled" if cfg.compile is True else "auto"


def _warmup_notice(cfg: Config) -> Any:
    """``on_plan`` of the warm-up: the compile notice before its graph compiles, as for sampling."""
    def on_plan(plan: Any) -> None:
        if plan.compiles and _tty():
            print(f"fnebm: {compile_notice(cfg, warmup=True)}", file=sys.stderr, flush=True)
    return on_plan


def _slowest(*seconds: float | None) -> list[float | None]:
    """Each of ``seconds`` as its largest value over the ranks (``None`` stays ``None``)."""
    values = torch.tensor([-1.0 if s is None else s for s in seconds], dtype=torch.float64,
                          device=_group_device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [None if s is None else float(v) for s, v in zip(seconds, values.tolist())]


def _group_device() -> torch.device:
    """Where the process group's collectives take their tensors: the rank's GPU under NCCL."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _run(cfg: Config) -> tuple[dict[str, Any], Tensor, Tensor, Any]:
    """Sample; returns ``(summary, positions: (draws, chains, dim), energies: (draws, chains), energy)``.
    Under torchrun ``positions`` and ``energies`` hold this rank's chains; the summary is of all of them."""
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    try:
        target, alg = _build(cfg.energy, cfg.sampler, cfg.step_size, cfg.dim, dtype, cfg.device,
                              compiled=cfg.compile is True)
    except (ValueError, TypeError) as e:  # the library's own checks of what we built
        raise UsageError(e) from None
    init_key, run_key = fr.split(fr.key(cfg.seed, device=device))
    x0 = fr.normal(init_key, (cfg.chains, cfg.dim), dtype)
    sharded = cfg.world_size > 1  # under torchrun: this rank's block of the chains (fnebm.distributed)
    # the warm-up pools every chain, so it starts from all of them (on every rank alike)
    state = torch.func.vmap(alg.init)(fdist.shard(x0) if sharded and not cfg.adapt else x0)

    adapted, adapt_s = None, None
    _kernel_build_notice(cfg, target)  # NUTS's C kernel builds at the warm-up's first step
    if cfg.adapt:
        built_at_adapt = _kernel_build_s()
        adapt_key, run_key = fr.split(run_key)
        t0 = time.perf_counter()
        warmup = fnebm.window_adaptation(SAMPLERS[cfg.sampler], target, cfg.adapt,
                                         initial_step_size=cfg.step_size,
                                         **_extra(cfg.sampler, cfg.dim, cfg.compile is True))
        state, parameters, _ = warmup.run(state, adapt_key, compile=cfg.compile, progress=cfg.progress,
                                          on_plan=_warmup_notice(cfg))
        if sharded:
            state = fdist.shard(state)
        _sync(device)
        adapt_s = time.perf_counter() - t0
        alg = _algorithm(target, cfg.sampler, cfg.step_size, cfg.dim, parameters)
        imm = parameters["inverse_mass_matrix"]
        imm = getattr(imm, "inverse_mass_matrix", imm)
        adapted = dict(step_size=float(parameters["step_size"]),
                       inverse_mass_matrix_range=(float(imm.min()), float(imm.max())),
                       kernel_build_s=(_kernel_build_s() - built_at_adapt) or None)

    ramp = _ramp(cfg.burn_in, bool(cfg.adapt), cfg.energy)
    rest = cfg.burn_in - sum(n for _, n in ramp)
    calls = _Calls(cfg, cfg.burn_in + cfg.steps)
    plotting = _PlottingImport(cfg)
    chain, key = state, fdist.local_keys(run_key, cfg.chains) if sharded else run_key
    built_before = _kernel_build_s()
    t0 = time.perf_counter()
    try:
        for fraction, n in ramp:  # each is one short call: the graph is shared (parameters are data)
            step = _algorithm(target, cfg.sampler, cfg.step_size * fraction, cfg.dim,
                              compiled=cfg.compile is True).step
            chain, _, _ = fnebm.sample_chain(step, chain, key, n, collect=_collect, chunk_size=n,
                                             compile=cfg.compile, backend=_backend(cfg), progress=False,
                                             on_plan=calls.on_plan, on_chunk=calls.on_chunk)
            key = None
        chain, (positions, energies), info = fnebm.sample_chain(
            alg.step, chain, key, cfg.steps, burn_in=rest, thin=cfg.thin, collect=_collect,
            chunk_size=_chunk_size(rest + cfg.steps), compile=cfg.compile, backend=_backend(cfg), progress=False,
            on_plan=plotting.after(calls.on_plan), on_chunk=calls.on_chunk,
        )
        _sync(device)
    finally:
        calls.close()
    wall = time.perf_counter() - t0
    plotting.start()  # if it has not started: the summary's diagnostics come next
    compile_s = calls.compile_s()
    if compile_s is not None and cfg.rank == 0:
        record_compile_time(_graph_name(cfg), compile_s)
    compiled, why = calls.path(len(ramp))
    sampling_s = calls.stepping_s()
    if sharded:  # the run took as long as its slowest rank
        compile_s, sampling_s, wall, adapt_s = _slowest(compile_s, sampling_s, wall, adapt_s)
    summary = _summary(cfg, target, positions, energies, info, compile_s, sampling_s)
    summary.update(kernel_build_s=(_kernel_build_s() - built_before) or None)
    summary.update(adapt=cfg.adapt, adapt_s=adapt_s, adapted=adapted, compiled=compiled, path=why,
                   ramp=[[f, n] for f, n in ramp], setup_s=max(0.0, wall - sampling_s - (compile_s or 0.0)))
    if sharded:
        summary["processes"] = dict(world_size=cfg.world_size, backend=dist.get_backend(),
                                    chain_counts=fdist.chain_counts(cfg.chains, cfg.world_size))
    if cfg.profile:  # the sampled algorithm from the same start (after adaptation), measured apart
        profile = fnebm.profile_sampling(alg, state, run_key, cfg.steps, burn_in=cfg.burn_in, thin=cfg.thin,
                                         collect=_collect, compile=cfg.compile is not False)
        summary["profile"] = str(profile)
        if compiled is None and "kernel" in why:  # the run took a hand-written kernel: say what was timed
            summary["profile"] = (f"(this run used {why.split(',')[0]}; the profile times the same steps in the "
                                  "compiled runner, whose parts can be timed apart)\n" + summary["profile"])
    return summary, positions, energies, target



# ---------------------------------------------------------------------------- analysis


def _robust_centre(positions: Tensor, chains: int | None = None) -> tuple[Tensor, Tensor]:
    """Per-coordinate median and interquartile range (float64) of up to ~1M finite draws.

    Under torchrun ``positions`` is this rank's chains of ``chains`` in all: every rank takes the
    same stride through its draws and the subsamples are gathered (with a stride of 1, below ~1M
    draws in all, the very draws one process takes)."""
    flat = positions.reshape(-1, positions.shape[-1])
    rows = max(1, min(2**20, 2**24 // max(1, flat.shape[1])))
    if fdist.is_distributed():
        total = positions.shape[0] * (positions.shape[1] if chains is None else chains)
        sample = fdist.gather_chains(flat[:: max(1, -(-total // rows))].double(), dim=0)
    else:
        sample = flat[:: max(1, -(-flat.shape[0] // rows))].double()
    sample = sample[torch.isfinite(sample).all(-1)]
    if sample.shape[0] == 0:
        zero = torch.zeros(flat.shape[1], dtype=torch.float64, device=flat.device)
        return zero, zero + 1
    q = torch.quantile(sample, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64, device=flat.device), dim=0)
    iqr = q[2] - q[0]
    return q[1], torch.where(iqr > 0, iqr, 1e-12 * (1 + q[1].abs()))


def flag_chains(positions: Tensor, *, chains: int | None = None) -> dict[str, Tensor]:
    """Chains that ran away or froze, as boolean masks over chains (CPU).

    runaway: a kept draw is not finite, or lies more than ``RUNAWAY_IQRS`` interquartile ranges
    (of all draws, per coordinate) from the median; frozen: not a runaway, and every kept draw
    equals the first (needs ``FROZEN_MIN_DRAWS`` kept draws); max_abs: each chain's largest |x|.
    Under torchrun ``positions`` is this rank's block of ``chains`` chains, and the masks cover
    all of them (gathered, in global chain order).
    """
    n, local, _ = positions.shape
    centre, iqr = _robust_centre(positions, chains)
    far = torch.zeros(local, dtype=torch.float64, device=positions.device)
    moved = torch.zeros(local, dtype=torch.bool, device=positions.device)
    max_abs = torch.zeros(local, dtype=torch.float64, device=positions.device)
    first = positions[0]
    for block in positions.split(max(1, 2**22 // max(1, positions[0].numel()))):  # bounded temporaries
        b = block.double()
        dev = ((b - centre) / iqr).abs().nan_to_num(nan=math.inf)
        far = torch.maximum(far, dev.amax(dim=(0, 2)))
        max_abs = torch.maximum(max_abs, b.abs().nan_to_num(nan=math.inf).amax(dim=(0, 2)))
        moved |= (block != first).any(-1).any(0)
    runaway = far > RUNAWAY_IQRS
    frozen = ~moved & ~runaway if n >= FROZEN_MIN_DRAWS else torch.zeros_like(moved)
    stuck = ~moved & runaway
    if fdist.is_distributed():  # every rank's chains, in global order
        both = fdist.gather_chains(torch.stack([runaway.double(), frozen.double(), stuck.double(), max_abs], -1), dim=0)
        runaway, frozen, stuck, max_abs = both[:, 0] > 0, both[:, 1] > 0, both[:, 2] > 0, both[:, 3]
    return dict(runaway=runaway.cpu(), frozen=frozen.cpu(), stuck=stuck.cpu(), max_abs=max_abs.cpu())


def mixing(positions: Tensor, rhat: Tensor, keep: Tensor | None = None) -> dict[str, Any]:
    """Why R-hat is high: ``separate modes`` or ``too short`` (or ``few chains``).

    On the coordinate with the largest R-hat: when the chains sit in separate modes (little spread
    within a chain, much between, means in clusters), the chains' means, sorted, leave a gap: an
    interval more than 4 typical within-chain standard deviations wide that holds at most 1% of
    them (a few chains may cross between modes), with at least 5% of the chains on each side. A
    run that is merely too short spreads the means out without such a gap.
    """
    d = int(torch.nan_to_num(rhat.double(), nan=-1.0).argmax())
    x = positions[..., d].double()
    if keep is not None:  # a mask over all chains; under torchrun, positions hold this rank's block
        keep = keep.to(x.device)
        x = x[:, fdist.shard(keep) if fdist.is_distributed() else keep]
    if x.shape[1] == 0:  # every chain flagged (or none on this rank): no spread to measure
        means = sds = x.new_zeros(0)
    else:
        means, sds = x.mean(0), x.std(0)
    if fdist.is_distributed():  # the per-chain figures of every rank's chains
        means, sds = fdist.gather_chains(torch.stack([means, sds], -1), dim=0).unbind(-1)
    chains = means.shape[0]
    if chains < MIXING_MIN_CHAINS:
        return dict(verdict="few chains", coordinate=d, gap=None)
    within = float(sds.median())
    m = means.sort().values
    k = max(2, math.ceil(0.05 * chains))  # chains on each side
    w = max(1, round(0.01 * chains))  # the gap may hold w - 1 chains
    lo = torch.arange(k - 1, chains - k - w + 1, device=m.device)
    gap = float((m[lo + w] - m[lo]).max()) / within if within > 0 else math.inf
    return dict(verdict="separate modes" if gap > 4 else "too short", coordinate=d, gap=gap)


def _pooled_mean(x: Tensor) -> Tensor:
    """The mean over draws and chains ``(draws, chains, ...) -> (...)``; under torchrun, over every
    rank's chains (the ranks hold the same number of draws)."""
    if not fdist.is_distributed():
        return x.mean((0, 1))
    return fdist.all_reduce_mean(x.mean((0, 1)), weight=x.shape[1])


def truth_check(truth: Truth, positions: Tensor) -> dict[str, Any]:
    """Estimates ± MCSE of what ``truth`` knows: the mean of each coordinate (up to 10), the
    variance of each and the covariance of neighbours, and a mixture's weights (the mean of the
    component probabilities ``assign(x)``, whose expectation is exactly the weights). ``z`` is
    (estimate - truth) / MCSE; the run agrees when every ``|z|`` stays under the level an exact
    sampler exceeds 1% of the time (Bonferroni over the estimates). Under torchrun, of every
    rank's chains (fnebm.distributed's diagnostics)."""
    x = positions[..., :10].double()
    d = x.shape[-1]
    rows = []
    mean = _pooled_mean(x)
    mcse = fdist.mcse_mean(x, layout="draws_chains")
    for i in range(d):
        rows.append((f"mean x{i}", float(mean[i]), float(mcse[i]), float(truth.mean[i])))
    pairs = [(i, i) for i in range(d)] + [(i, i + 1) for i in range(d - 1)]
    i_idx = torch.tensor([p[0] for p in pairs], device=x.device)
    j_idx = torch.tensor([p[1] for p in pairs], device=x.device)
    prod = (x[..., i_idx] - mean[i_idx]) * (x[..., j_idx] - mean[j_idx])
    est, err = _pooled_mean(prod), fdist.mcse_mean(prod, layout="draws_chains")
    del prod
    for n, (i, j) in enumerate(pairs):
        rows.append((f"var x{i}" if i == j else f"cov x{i},x{j}", float(est[n]), float(err[n]),
                     float(truth.cov[i, j])))
    if truth.weights is not None and truth.assign is not None:
        r = truth.assign(positions.to("cpu"))
        if fdist.is_distributed():
            r = r.to(positions.device)  # where the group's collectives take it
        w, werr = _pooled_mean(r), fdist.mcse_mean(r, layout="draws_chains")
        for k in range(r.shape[-1]):
            centre = ", ".join(f"{v:g}" for v in truth.centres[k, :2].tolist())
            rows.append((f"weight {k}", float(w[k]), float(werr[k]), float(truth.weights[k]), f"mode at ({centre}, ...)"
                         if truth.centres.shape[1] > 2 else f"mode at ({centre})"))
    out = []
    for row in rows:
        name, e, s, t = row[:4]
        z = (e - t) / s if s > 0 and math.isfinite(s) else (0.0 if e == t else math.inf)
        out.append(dict(name=name, estimate=e, mcse=s, truth=t, z=z, where=row[4] if len(row) > 4 else None))
    crit = NormalDist().inv_cdf(1 - 0.005 / len(out))
    worst = max(out, key=lambda r: abs(r["z"]) if math.isfinite(r["z"]) else math.inf)
    return dict(about=truth.about, rows=out, z_max=abs(worst["z"]), worst=worst["name"], z_crit=crit,
                agrees=all(math.isfinite(r["z"]) and abs(r["z"]) <= crit for r in out))


def _rhat_of(positions: Tensor, keep: Tensor) -> Tensor:
    """R-hat of the chains ``keep`` (a mask over all chains) marks. Under torchrun, across the ranks;
    a rank left without a chain sends its peers the kept chains instead (a rare case: it takes
    the ranks' flagged chains to empty a whole block)."""
    if not fdist.is_distributed():
        return diagnostics.rhat(positions[:, keep], layout="draws_chains")
    w = fdist.world_size()
    kept = [int(keep[fdist.chain_slice(keep.shape[0], rank_=r, world_size_=w)].sum()) for r in range(w)]
    mine = positions[:, fdist.shard(keep)]
    if min(kept) >= 1:
        return fdist.rhat(mine, layout="draws_chains")
    return diagnostics.rhat(fdist.gather_chains(mine, dim=1), layout="draws_chains")


def _summary(cfg: Config, target: Any, positions: Tensor, energies: Tensor, info: Any, compile_s: float | None,
             sampling_s: float) -> dict:
    """Plain Python numbers (``None`` where not computed). Under torchrun ``positions``, ``energies``
    and ``info`` are this rank's chains and the summary is of all of them, the same on every rank:
    every figure is a collective of :mod:`fnebm.distributed` (no rank holds the whole trace)."""
    acc = fdist.acceptance_summary(info, layout="draws_chains")
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
        ess_bulk_min=None, ess_bulk_median=None, ess_per_s=None, rhat_max=None, rhat_max_unflagged=None,
        compile_s=compile_s, sampling_s=sampling_s, mixing=None, truth=None,
    )
    flags = flag_chains(positions, chains=cfg.chains)
    for name in ("runaway", "frozen"):
        idx = flags[name].nonzero().flatten()
        out[f"n_{name}"] = int(idx.numel())
        out[f"{name}_chains"] = idx[:100].tolist()
    out["n_runaway_stuck"] = int(flags["stuck"].sum())
    bad = flags["runaway"] | flags["frozen"]
    out["runaway_max_abs"] = float(flags["max_abs"][flags["runaway"]].max()) if out["n_runaway"] else None
    if positions.shape[0] >= 4:  # the diagnostics need 4 draws
        ess = fdist.ess_bulk(positions, layout="draws_chains").double().cpu()
        out["ess_bulk_min"] = float(ess.min())
        out["ess_bulk_median"] = float(ess.quantile(0.5))
        out["ess_per_s"] = out["ess_bulk_min"] / sampling_s if sampling_s > 0 else math.inf
        rhat = fdist.rhat(positions, layout="draws_chains")
        out["rhat_max"] = float(rhat.max())
        keep = ~bad
        if bad.any() and int(keep.sum()) >= 2:
            out["rhat_max_unflagged"] = float(_rhat_of(positions, keep.to(positions.device)).max())
        if out["rhat_max"] > RHAT_OK and cfg.chains >= 2:
            verdict = mixing(positions, rhat, keep if bad.any() else None)
            tau = positions.shape[0] * cfg.chains / out["ess_bulk_min"] * cfg.thin
            verdict["steps_needed"] = int(float(f"{max(200 * tau, 2 * cfg.steps):.2g}"))
            out["mixing"] = verdict
        truth = truth_of(cfg.energy, target, cfg.dim)
        if truth is not None:
            out["truth"] = truth_check(truth, positions)
    return out



# ---------------------------------------------------------------------------- summary


def _chain_list(idx: list[int], n: int) -> str:
    shown = ", ".join(str(i) for i in idx[:5])
    return f"{shown}, ..." if n > 5 else shown


def format_summary(s: dict[str, Any]) -> list[str]:
    """The summary as aligned lines."""
    if s["acceptance"] is not None:
        acceptance = f"{s['acceptance']:.3f} (mean {s['sampler'].upper()} acceptance statistic)"
    else:
        acceptance = f"{1 - s['divergent_fraction']:.3f} (unadjusted: 1 - divergent fraction)"
    smaller = f"try a smaller --step-size (e.g. {s['step_size'] / 4:.3g})"
    if s.get("compiled") is None and s["compile_s"] is None:
        path = s.get("path") or "eager"
    else:
        path = f"{'compiled' if s.get('compiled') else 'eager'} ({s.get('path')})"
    rows = [
        ("sampler", f"{s['sampler']}, step size {s['step_size']:g}" + (" (before adaptation)" if s.get("adapted") else "")),
        ("energy", f"{s['energy']}, dim {s['dim']}, {s['dtype']} on {s['device']}"),
        ("run", f"{s['chains']} chains x {s['steps']} steps (burn-in {s['burn_in']}, thin {s['thin']})"
                f" -> {s['draws']} draws"),
        *([("processes", f"{s['processes']['world_size']} ({s['processes']['backend']}): "
                         f"{' + '.join(map(str, s['processes']['chain_counts']))} chains; the diagnostics "
                         "are computed across them")] if s.get("processes") else []),
        *([("adaptation", f"{s['adapt']} warm-up steps: step size {s['adapted']['step_size']:.3g}, diagonal "
                          f"inverse mass matrix in [{s['adapted']['inverse_mass_matrix_range'][0]:.3g}, "
                          f"{s['adapted']['inverse_mass_matrix_range'][1]:.3g}] ({s['adapt_s']:.2f} s"
                          + (f", {s['adapted']['kernel_build_s']:.2f} s of it building the C kernel: once on this "
                             "machine" if s['adapted'].get('kernel_build_s') else "") + ")")]
          if s.get("adapted") else []),
        ("acceptance", acceptance),
        *([("trajectory", f"mean tree depth {s['mean_tree_depth']:.2f}, mean {s['mean_integration_steps']:.1f} "
                          "leapfrog steps per draw")] if s.get("mean_tree_depth") is not None else
          [("trajectory", f"{s['mean_integration_steps']:.0f} leapfrog steps per draw")]
          if s.get("mean_integration_steps") is not None else []),
        ("divergences", f"{s['n_divergent']} ({100 * s['divergent_fraction']:.2f}% of kept steps)"),
    ]
    if s.get("n_runaway"):
        stuck = f", {s['n_runaway_stuck']} of them stuck there" if s.get("n_runaway_stuck") else ""
        rows.append(("runaway", f"{s['n_runaway']} of {s['chains']} chains (chain {_chain_list(s['runaway_chains'], s['n_runaway'])}) "
                                f"left the bulk: |x| up to {s['runaway_max_abs']:.3g}{stuck}; {smaller}"))
    if s.get("n_frozen"):
        rows.append(("frozen", f"{s['n_frozen']} of {s['chains']} chains (chain {_chain_list(s['frozen_chains'], s['n_frozen'])}) "
                               f"did not move over the {s['draws']} kept draws (every proposal rejected); {smaller}"))
    rhat = _fmt(s["rhat_max"], ".4f") + (" (needs >= 2 chains)" if s["chains"] == 1 else "")
    if s.get("rhat_max_unflagged") is not None:
        rhat += f" ({s['rhat_max_unflagged']:.4f} without the runaway and frozen chains)"
    rows += [
        ("ESS bulk", "n/a (needs >= 4 kept draws)" if s["ess_bulk_min"] is None
         else f"min {s['ess_bulk_min']:.0f}, median {s['ess_bulk_median']:.0f} (over dims)"),
        ("ESS/s", _fmt(s["ess_per_s"], ".1f") + ("" if s["ess_per_s"] is None else " (min bulk ESS per sampling s)")),
        ("R-hat max", rhat),
        ("path", path),
        ("compile", "none" if s["compile_s"] is None else f"{s['compile_s']:.2f} s (torch.compile; cached on disk "
                                                          "for the next run)"),
        ("sampling", f"{s['sampling_s']:.2f} s" + (_setup_words(s) if s.get("setup_s") else "")),
    ]
    lines = [f"{k:<12} {v}" for k, v in rows]
    truth = s.get("truth")
    if truth is not None:
        lines.append(f"{'truth':<12} {truth['about']}: estimate ± MCSE from the kept draws")
        shown = truth["rows"]
        if len(shown) > 7:  # the largest deviations
            shown = sorted(shown, key=lambda r: -abs(r["z"]) if math.isfinite(r["z"]) else -math.inf)[:5]
        for r in shown:
            where = f"  {r['where']}" if r.get("where") else ""
            lines.append(f"  {r['name']:<10} {r['estimate']:+.4f} ± {r['mcse']:.4f}   truth {r['truth']:+.4f}"
                         f"   z {r['z']:+.2f}{where}")
        if len(shown) < len(truth["rows"]):
            lines.append(f"  ({len(shown)} of {len(truth['rows'])} estimates shown: the largest |z|)")
        level = f"an exact sampler exceeds {truth['z_crit']:.2f} 1% of the time"
        if s["rhat_max"] is not None and s["rhat_max"] > RHAT_OK:
            lines.append(f"{'check':<12} no verdict: R-hat > {RHAT_OK}, and an MCSE assumes chains that have "
                         f"converged (largest |z| {truth['z_max']:.3g})")
        elif truth["agrees"]:
            lines.append(f"{'check':<12} agrees with the truth: largest |z| {truth['z_max']:.2f} of "
                         f"{len(truth['rows'])} estimates ({level})")
        else:
            why = []
            if s["sampler"] == "langevin":
                why.append("unadjusted Langevin is biased by O(step size): use --sampler mala or a smaller --step-size")
            if s["rhat_max"] is not None and s["rhat_max"] > RHAT_OK:
                why.append("the chains have not converged (see the note)")
            if s.get("n_runaway") or s.get("n_frozen"):
                why.append("some chains ran away or froze")
            lines.append(f"{'check':<12} DISAGREES with the truth: |z| {truth['z_max']:.3g} for {truth['worst']} "
                         f"({level})" + (f"; {'; '.join(why)}" if why else ""))
    note = _note(s)
    if note:
        lines.append(f"{'note':<12} {note}")
    return lines


def _note(s: dict[str, Any]) -> str | None:
    if s["rhat_max"] is None or not s["rhat_max"] > RHAT_OK:
        return None
    m = s.get("mixing") or {}
    spec = ENERGIES.get(s["energy"])
    head = f"R-hat {s['rhat_max']:.3g} > {RHAT_OK}: the chains disagree."
    if m.get("verdict") == "separate modes":
        known = f" ({s['energy']} is multimodal, see docs/cli.md)" if spec is not None and spec.multimodal else ""
        return (f"{head} They sit in separate modes{known}: the chain means of x{m['coordinate']} fall into "
                f"groups {m['gap']:.0f} within-chain standard deviations apart, and no chain crosses between "
                "them. More steps will not fix this soon: the pooled draws weigh each mode by how many chains "
                "started near it, not by its mass.")
    known = f" {s['energy']}: {spec.mixing} (docs/cli.md)." if spec is not None and spec.mixing else ""
    if m.get("verdict") == "too short":
        return (f"{head} No separate modes show (the chain means of x{m['coordinate']} spread without a gap): "
                f"the run is too short. Try --steps {m['steps_needed']} (about 200 autocorrelation times, "
                "from the bulk ESS)." + known)
    return (f"{head} Too short, or chains in separate modes: with fewer than {MIXING_MIN_CHAINS} chains the "
            "two cannot be told apart." + known)



# --------------------------------------------------------------------------------- plot


def plot(f: BinaryIO, target: Any, positions: Tensor, energies: Tensor, summary: dict[str, Any]) -> None:
    """A PNG into ``f``: for dim 2, energy contours with final draws over them (and the truth
    where it is known); otherwise histograms of the first (up to 4) marginals. Then a few chains'
    traces of the coordinate with the largest R-hat, and the energy trace (median and 10-90%
    band over chains). Limits come from quantiles of the draws, so a few runaway chains do not
    squash the picture."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg, without touching pyplot's backend
    from matplotlib.figure import Figure

    n_draws, chains, dim = positions.shape
    steps = summary["burn_in"] + summary["thin"] * np.arange(1, n_draws + 1)
    flagged = set(summary.get("runaway_chains") or []) | set(summary.get("frozen_chains") or [])
    good = [c for c in range(chains) if c not in flagged]
    truth = truth_of(summary["energy"], target, dim) if summary["energy"] in ENERGIES else None
    # a subsample of draws (at most ~200k points) for quantiles and histograms
    sub = positions[:: max(1, n_draws * chains // 200_000)].detach().to("cpu", torch.float64)
    sub_good = sub[:, good] if good else sub
    flat = sub_good.reshape(-1, dim)
    flat = flat[torch.isfinite(flat).all(-1)]

    def limits(values: Tensor) -> tuple[float, float]:
        if values.numel() == 0:
            return -1.0, 1.0
        lo, hi = (float(v) for v in torch.quantile(values, torch.tensor([0.005, 0.995], dtype=torch.float64)))
        pad = 0.15 * (hi - lo) + 0.25
        return lo - pad, hi + pad

    n_left = 1 if dim == 2 else min(dim, 4)
    # fixed margins: the constrained layout engine took a third of the plot's time (0.18 of 0.55 s)
    fig = Figure(figsize=(5.6 + 4.4 * 2 if dim == 2 else 3.4 * n_left + 8.8, 4.6))
    fig.subplots_adjust(left=0.06 if dim == 2 else 0.05, right=0.985, bottom=0.12, top=0.85, wspace=0.32)
    FigureCanvasAgg(fig)
    ratios = ([1.3] if dim == 2 else [1] * n_left) + [1.1, 1.1]
    axes = fig.subplots(1, n_left + 2, width_ratios=ratios)
    r = summary.get("rhat_max")
    fig.suptitle(
        f"{summary['energy']} (dim {dim}), {summary['sampler']} step {summary['step_size']:g}: "
        f"{chains} chains, {summary['steps']} steps (burn-in {summary['burn_in']})"
        + (f", R-hat {r:.3f}" if r is not None else "")
    )

    if dim == 2:
        ax = axes[0]
        final = positions[-1].detach().to("cpu", torch.float64)
        final = final[good[:2000]] if good else final[:2000]  # chains are exchangeable: a fair subsample
        (x0, x1), (y0, y1) = limits(flat[:, 0]), limits(flat[:, 1])
        xs = torch.linspace(x0, x1, 200, dtype=torch.float64)
        ys = torch.linspace(y0, y1, 200, dtype=torch.float64)
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
        if truth is not None:
            _truth_overlay(ax, truth, flat, summary)
        ax.set(xlabel="x0", ylabel="x1", title="energy contours and final draws",
               xlim=(x0, x1), ylim=(y0, y1))
        ax.legend(loc="upper right", fontsize="small", markerscale=3)
    else:
        for i in range(n_left):
            ax = axes[i]
            lo, hi = limits(flat[:, i])
            ax.hist(flat[:, i].numpy(), bins=60, range=(lo, hi), density=True, color="#3b75af", label="draws")
            if truth is not None:
                grid = np.linspace(lo, hi, 300)
                ax.plot(grid, _truth_marginal(truth, i, grid), color="k", lw=1.2, ls="--", label="truth")
                ax.legend(fontsize="small")
            ax.set(xlabel=f"x{i}", ylabel="density" if i == 0 else None, title=f"marginal of x{i}", xlim=(lo, hi))

    # a few chains' traces of the coordinate with the largest R-hat, flagged chains in red
    ax = axes[-2]
    mix = summary.get("mixing") or {}
    d = mix.get("coordinate", 0) if mix else 0
    picks = good[:3] + sorted(flagged)[:2]
    lo, hi = limits(flat[:, d])
    stride = max(1, n_draws // 2000)
    for c in picks:
        y = positions[::stride, c, d].detach().to("cpu", torch.float64).numpy()
        bad = c in flagged
        ax.plot(steps[::stride], np.clip(y, lo, hi), lw=0.8 if not bad else 1.4,
                color="#d62728" if bad else None, alpha=0.9,
                label=(f"chain {c} ({'ran away' if c in (summary.get('runaway_chains') or []) else 'frozen'}, clipped)"
                       if bad else None))
    ax.set(xlabel="step", ylabel=f"x{d}", ylim=(lo, hi), title=f"x{d} of {len(picks)} chains")
    if flagged:
        ax.legend(fontsize="small", loc="upper right")
    ax.grid(alpha=0.3)

    ax = axes[-1]
    en = energies[:: stride].detach().to("cpu", torch.float64)
    en = en[:, good] if good else en
    en = torch.where(torch.isfinite(en), en, torch.nan)
    q = torch.nanquantile(en, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64), dim=1).numpy()
    ax.fill_between(steps[::stride], q[0], q[2], color="#3b75af", alpha=0.25, lw=0, label="10-90% of chains")
    ax.plot(steps[::stride], q[1], color="#3b75af", lw=1.2, label="median")
    left_out = f" ({len(flagged)} flagged chains out)" if flagged and good else " over chains"
    ax.set(xlabel="step", ylabel="energy E(x)", title=f"energy{left_out}")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.savefig(f, format="png", dpi=110)


def _ellipse(mean: Tensor, cov: Tensor, radius: float):
    t = torch.linspace(0, 2 * math.pi, 200, dtype=torch.float64)
    vals, vecs = torch.linalg.eigh(cov)
    circle = torch.stack([t.cos(), t.sin()], -1) * vals.clamp_min(0).sqrt() * radius
    pts = mean + circle @ vecs.T
    return pts[:, 0].numpy(), pts[:, 1].numpy()


def _truth_overlay(ax: Any, truth: Truth, flat: Tensor, summary: dict[str, Any]) -> None:
    """Dim 2: the truth's 1- and 2-sigma ellipses against the draws', or a mixture's modes and weights."""
    if truth.weights is not None:
        est = {r["name"]: r["estimate"] for r in (summary.get("truth") or {}).get("rows", [])}
        for k, (c, w) in enumerate(zip(truth.centres.tolist(), truth.weights.tolist())):
            ax.plot(c[0], c[1], marker="x", color="white", ms=9, mew=2, label="true modes" if k == 0 else None)
            got = est.get(f"weight {k}")
            ax.annotate(f"w={w:.2f}" + (f"\nest {got:.2f}" if got is not None else ""), (c[0], c[1]),
                        xytext=(6, 6), textcoords="offset points", color="white", fontsize="small")
        return
    mean = flat.mean(0)
    cov = torch.cov(flat.T)
    for radius in (1.0, 2.0):
        ax.plot(*_ellipse(mean, cov, radius), color="#ffd166", lw=2.4,
                label="estimate (1, 2 sd)" if radius == 1 else None)
        ax.plot(*_ellipse(truth.mean[:2], truth.cov[:2, :2], radius), color="black", lw=1.3, ls="--",
                label="truth (1, 2 sd)" if radius == 1 else None)


def _truth_marginal(truth: Truth, i: int, grid: Any) -> Any:
    import numpy as np

    if truth.weights is not None:  # a mixture of Gaussians: its marginal is a mixture too
        dens = np.zeros_like(grid)
        spread = _component_sd(truth, i)
        for c, w in zip(truth.centres[:, i].tolist(), truth.weights.tolist()):
            dens += w * np.exp(-0.5 * ((grid - c) / spread) ** 2) / (spread * math.sqrt(2 * math.pi))
        return dens
    sd = math.sqrt(float(truth.cov[i, i]))
    return np.exp(-0.5 * ((grid - float(truth.mean[i])) / sd) ** 2) / (sd * math.sqrt(2 * math.pi))


def _component_sd(truth: Truth, i: int) -> float:
    # the within-component variance: total variance less the spread of the component means
    w, c = truth.weights, truth.centres[:, i]
    between = float((w * c * c).sum() - (w * c).sum() ** 2)
    return math.sqrt(max(float(truth.cov[i, i]) - between, 1e-12))


# ------------------------------------------------------------------------------ main


def _gather_on_rank0(t: Tensor, chains: int) -> Tensor | None:
    """Every rank's chains of a trace ``t: (draws, local_chains, ...)`` side by side, on rank 0's
    host ``(draws, chains, ...)`` (``None`` on the other ranks). A block of draws at a time, so a
    GPU holds one block of every rank's chains, not the whole trace."""
    counts = fdist.chain_counts(chains)
    rank, device = fdist.rank(), _group_device()
    top = max(counts)
    per_draw = max(1, top * math.prod(t.shape[2:]) * t.element_size())
    rows = max(1, (64 << 20) // per_draw)  # about 64 MiB a block
    out = []
    for block in t.split(rows):
        block = block.to(device)
        if block.shape[1] < top:  # dist.gather wants equal shapes: pad, then trim
            block = torch.cat([block, block.new_zeros((block.shape[0], top - block.shape[1], *block.shape[2:]))], 1)
        block = block.contiguous()
        parts = [torch.empty_like(block) for _ in counts] if rank == 0 else None
        dist.gather(block, parts, dst=0)
        if rank == 0:
            out.append(torch.cat([p[:, :n] for p, n in zip(parts, counts)], 1).cpu())
    return torch.cat(out) if rank == 0 else None


def _sample(args: argparse.Namespace) -> int:
    return run_launched(args.device, lambda where: _sample_on(args, where))


def _import_plotting() -> None:
    import matplotlib.figure  # noqa: F401
    from matplotlib.backends import backend_agg  # noqa: F401


class _PlottingImport:
    """Imports matplotlib (0.6 s on a 2-core AMD EPYC) on a thread while the run does other work,
    where a plot is asked for (rank 0); ``plot`` then finds it imported, or waits on Python's
    import lock.

    When: once the last ``sample_chain`` call has planned, if its chains run compiled (or in a
    Triton kernel: either leaves the GIL free); otherwise once the sampling is done, beside the
    summary's diagnostics (torch ops, which release the GIL). Never before the last plan:
    ``compile="auto"`` times eager steps to decide, and beside the importing thread a step of
    the demo looked 56-86 ms instead of 3.5 ms, so the demo compiled for 37 s instead of sampling
    eagerly for 2 s. Nor beside eager steps: they hold the GIL, and the demo's 2.06 s of eager
    sampling took 2.89 s with the import beside it. Nor with ``--profile``, which times steps after
    the summary.
    """

    def __init__(self, cfg: Config):
        self.wanted = cfg.plot is not None and cfg.rank == 0 and not cfg.profile
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.wanted and self.thread is None:
            self.thread = threading.Thread(target=_import_plotting, name="fnebm-import-matplotlib", daemon=True)
            self.thread.start()

    def after(self, on_plan: Callable[[Any], None]) -> Callable[[Any], None]:
        """``on_plan`` of the last call: it starts the import if that call's chains leave the GIL free."""

        def plan_then_import(plan: Any) -> None:
            on_plan(plan)
            if plan.compiled or getattr(plan, "kernel", False):
                self.start()

        return plan_then_import


def _sample_on(args: argparse.Namespace, where: Launch) -> int:
    cfg = agree(where, lambda: _config(args, where))
    summary, positions, energies, target = _run(cfg)
    if cfg.rank == 0:  # rank 0 prints (and writes) for every rank
        print("\n".join(format_summary(summary)), flush=True)
        if "profile" in summary:
            print(summary["profile"], flush=True)
    if cfg.world_size > 1 and (args.out is not None or args.plot is not None):  # every rank takes part
        positions, energies = _gather_on_rank0(positions, cfg.chains), _gather_on_rank0(energies, cfg.chains)
    if cfg.rank != 0:
        return 0

    files = []
    if cfg.out is not None:
        record = {
            "trace": positions.detach().cpu(),
            "energy": energies.detach().cpu(),
            "summary": summary,
            "args": {k: v for k, v in cfg._asdict().items()
                     if k not in ("out", "plot", "progress", "world_size", "rank")},
        }
        files.append(("saved", args.out, cfg.out, lambda f: torch.save(record, f)))
    if cfg.plot is not None:
        files.append(("plot", args.plot, cfg.plot, lambda f: plot(f, target, positions, energies, summary)))
    write_outputs(files)
    return 0
