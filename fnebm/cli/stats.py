"""``fnebm sample``'s statistics of a run: runaway and frozen chains, why R-hat is high, the check
against a known truth, and the summary (a dict of plain numbers). Under torchrun every figure is a
collective of :mod:`fnebm.distributed`, the same on every rank."""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import torch
from torch import Tensor

from fnebm import diagnostics
from fnebm import distributed as fdist
from fnebm.cli._common import _float_or_none
from fnebm.cli.options import Config
from fnebm.cli.presets import Truth, truth_of

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
