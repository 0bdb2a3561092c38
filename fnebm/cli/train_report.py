"""``fnebm train``'s report: the quality figures (grid KL, MMD), the plot and the printed summary."""

from __future__ import annotations

import math
from typing import Any, BinaryIO

import torch
from torch import Tensor

from fnebm import energies as E
from fnebm import random as fr
from fnebm.cli._common import _box, format_rows, mmd2  # noqa: F401 (mmd2: also read from here)
from fnebm.cli.presets import DTYPES
from fnebm.cli.train_model import mlp_energy, model_samples
from fnebm.cli.train_options import EVAL_POINTS, GRID, KDE_CELLS, LR_FLOOR, SAMPLE_CHAINS, TETHER, TrainConfig


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


def evaluate(cfg: TrainConfig, params: dict[str, Tensor]) -> dict[str, Any] | None:
    """The quality figures and what the plot draws, all on the CPU in float64.

    ``kl``: KL(data || model) in nats between two densities on a GRID x GRID grid over the data's
    box: the data's, a histogram of EVAL_POINTS points smoothed by a Gaussian of KDE_CELLS cells;
    the model's, exp(-E) at the cell centres normalised over the grid. ``kl_floor``: the same KL
    between the estimates from two independent data sets of EVAL_POINTS points (what a perfect
    model would score, up to the smoothing). ``mmd2``: unbiased squared MMD between the model
    samples and as many data points (Gaussian kernels of width 0.1, 0.3 and 1).

    Under torchrun every rank runs its block of the model samples' chains; rank 0 gets the figures,
    the other ranks ``None``.
    """
    from fnebm import datasets

    if cfg.loss in ("flow", "eqm"):
        from fnebm.cli import generative

        return generative.evaluate(cfg, params)
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    k_eval = fr.split(fr.key(cfg.seed, device=device), 4)[3]
    k_data, k_floor, k_samples = fr.split(k_eval, 3)
    samples = model_samples(cfg, params, k_samples)  # a collective under torchrun
    if cfg.rank != 0:
        return None
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

    if cfg.loss in ("flow", "eqm"):
        from fnebm.cli import generative

        return generative.plot(f, cfg, ev, summary)
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
        chains = (f"{c['batch']} persistent chains, restarts {c['reinit']:g}"
                  + (f", buffer {c['buffer']}" if c["buffer"] else "") if c["loss"] == "pcd" else "chains from the data")
        loss = f"{c['loss']}: k={c['k']} steps of {sampler}; {chains}"
    elif c["loss"] == "dsm":
        loss = f"dsm: sigma {c['sigma']:g}"
    elif c["loss"] in ("flow", "eqm"):
        from fnebm.cli import generative

        model, loss = generative.describe(c, c["hidden"])
    else:
        loss = {"ssm": "ssm: one Rademacher projection, variance-reduced", "sm": "sm: exact (Hyvarinen)"}[c["loss"]]
    h = c["hidden"]
    rows = [
        ("dataset", f"{c['dataset']}, {c['dtype']} on {s['device']}"),
        ("model", (model if c["loss"] in ("flow", "eqm") else f"MLP 2-{h}-{h}-1 (SiLU) + {TETHER:g}|x|^2/2")
                  + f", {s['n_params']} parameters"),
        ("loss", loss),
        ("steps", f"{s['start']} -> {s['step']} (batch {c['batch']}, Adam lr {c['lr']:g}"
                  + (f" -> {LR_FLOOR * c['lr']:g} linearly by step {c['lr_decay']}" if c["lr_decay"] else "")
                  + f", seed {c['seed']})"),
        ("final loss", f"{s['final_loss']:.4g} (mean over the last {s['final_window']} steps)"),
        ("compile", (("skipped (per-example layout: eager unless --compile)" if c.get("layout") == "per-example"
                      else "skipped (--no-compile)") if s["compile_s"] is None else f"{s['compile_s']:.2f} s")),
        ("training", f"{s['train_s']:.2f} s ({1000 * s['step_ms']:.1f} ms/step)"),
        ("KL", "n/a: a field has no density on the grid" if s["kl"] is None else
         f"{s['kl']:.4f} nats: KL(data || model) on a {GRID}x{GRID} grid "
         f"(floor {s['kl_floor']:.4f}: two data sets of {EVAL_POINTS})"),
        ("MMD^2", "n/a" if s["mmd2"] is None else
         f"{s['mmd2']:.2e}: model samples ("
         + ({"flow": "Euler", "eqm": "eqm"}.get(c["loss"], c["sampler"]))
         + f", {s['sample_steps']} steps from noise) vs data"),
        ("evaluation", f"{s['eval_s']:.2f} s"),
    ]
    if s.get("processes"):
        p = s["processes"]
        rows.insert(3, ("processes", f"{p['world_size']} ({p['backend']}): {' + '.join(map(str, p['examples']))} "
                                     "examples (and chains) of each step; gradients averaged across them"))
    if c.get("layout", "batch") != "batch":
        rows.insert(3, ("layout", "per-example: a key and a chain per example (fnebm.distributed), the same run "
                                  "on any number of processes"))
    lines = format_rows(rows)
    if s["nonfinite_samples"]:
        lines.append(f"{'note':<12} {s['nonfinite_samples']} model samples diverged (left out of MMD and plot)")
    return lines
