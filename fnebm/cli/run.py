"""``fnebm sample``'s run: the sampler built from the presets, the window adaptation, the burn-in
ramp and the sampling calls, their timings, and under torchrun the gather of every rank's chains."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import fnebm
from fnebm import distributed as fdist
from fnebm import random as fr
from fnebm.cli import plan as dispatch
from fnebm.cli._common import UsageError, _sync, record_compile_time
from fnebm.cli.options import Config
from fnebm.cli.plotting import _PlottingImport
from fnebm.cli.presets import DTYPES, ENERGIES, SAMPLERS, _algorithm, _build, _collect, _extra
from fnebm.cli.report import _Calls, _graph_name, _kernel_build_notice, _warmup_notice
from fnebm.cli.stats import _summary


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


def _kernel_build_s() -> float:
    """Seconds this process spent compiling the C kernels (0.0 if it never loaded them)."""
    return sum(module.build_seconds() for module in (sys.modules.get("fnebm.kernels.cpu_chain"),
                                                     sys.modules.get("fnebm.kernels.cpu_nuts"))
               if module is not None)


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
                                         **_extra(cfg.sampler, cfg.dim, cfg.compile is True, cfg.backend))
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
                                             compile=cfg.compile, backend=dispatch.backend(cfg),
                                             progress=False, on_plan=calls.on_plan, on_chunk=calls.on_chunk)
            key = None
        chain, (positions, energies), info = fnebm.sample_chain(
            alg.step, chain, key, cfg.steps, burn_in=rest, thin=cfg.thin, collect=_collect,
            chunk_size=_chunk_size(rest + cfg.steps), compile=cfg.compile, backend=dispatch.backend(cfg),
            progress=False, on_plan=plotting.after(calls.on_plan), on_chunk=calls.on_chunk,
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
        kernel = dispatch.profiled_instead(compiled, why)
        if kernel is not None:  # the run took a hand-written kernel: say what was timed
            summary["profile"] = (f"(this run used {kernel}; the profile times the same steps in the "
                                  "compiled runner, whose parts can be timed apart)\n" + summary["profile"])
    return summary, positions, energies, target



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
