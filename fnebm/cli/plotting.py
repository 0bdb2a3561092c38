"""``fnebm sample``'s plot (:func:`plot`), and matplotlib's import on a thread while the run does
other work (:class:`_PlottingImport`)."""

from __future__ import annotations

import math
import threading
from typing import Any, BinaryIO, Callable

import torch
from torch import Tensor

from fnebm.cli import plan as dispatch
from fnebm.cli.options import Config
from fnebm.cli.presets import ENERGIES, Truth, truth_of


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


def _import_plotting() -> None:
    import matplotlib.figure  # noqa: F401
    from matplotlib.backends import backend_agg  # noqa: F401


class _PlottingImport:
    """Imports matplotlib (most of a second on a 2-core CPU) on a thread while the run does other work,
    where a plot is asked for (rank 0); ``plot`` then finds it imported, or waits on Python's
    import lock.

    When: once the last ``sample_chain`` call has planned, if its chains run compiled (or in a
    Triton kernel: either leaves the GIL free); otherwise once the sampling is done, beside the
    summary's diagnostics (torch ops, which release the GIL). Never before the last plan:
    ``compile="auto"`` times eager steps to decide, and beside the importing thread the demo's
    steps looked more than 15 times slower, so it compiled instead of sampling eagerly. Nor beside
    eager steps: they hold the GIL. Nor with ``--profile``, which times steps after the summary.
    The figures: docs/cli.md, ``fnebm demo``.
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
            if plan.compiled or dispatch.ran_kernel(plan):
                self.start()

        return plan_then_import
