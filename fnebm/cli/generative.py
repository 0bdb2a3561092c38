"""``fnebm train --objective flow|eqm``: a velocity field (flow matching) or an equilibrium field (EqM).

The same run as the energy losses (:mod:`fnebm.cli.train`: one key, Adam, the learning-rate
decay, checkpoints and ``--resume``), with another model and another evaluation:

- the model is an MLP ``(x, t) -> v`` with inputs ``3`` (flow matching: the time is an input)
  or ``x -> f`` with inputs ``2`` (EqM: time-invariant), two SiLU hidden layers of ``--hidden``
  units and 2 outputs: ``w0 (din, h), b0, w1 (h, h), b1, w2 (h, 2), b2``;
- the loss is :func:`fnebm.losses.flow_matching` (linear path, independent pairs, ``t ~ U[0, 1]``)
  or :func:`fnebm.losses.equilibrium_matching` (EqM's defaults: truncated decay ``a = 0.8``,
  ``lambda = 4``), the field evaluating the whole batch in one call (``bind_field(...,
  batched=True)``);
- the model samples: flow matching integrates ``dx/dt = v(x, t)`` from ``N(0, I)`` at ``t = 0``
  to ``t = 1`` by ``--sample-steps`` Euler steps (:func:`fnebm.samplers.flow_sample`, a fixed grid of
  :data:`fnebm.integrators.ode.euler`); EqM descends its field from ``N(0, I)`` by
  ``--sample-steps`` steps of :func:`fnebm.eqm` (step ``--step-size``, Nesterov momentum
  ``EQM_MOMENTUM``). Neither model has a density on a grid: no KL, the MMD² to the data only;
- the plot: the data, the learned field (arrows of ``v(x, 0.5)``, or of ``-f(x)``, the
  direction EqM's sampler moves), and the model samples.
"""

from __future__ import annotations

import functools
import math
from typing import Any, BinaryIO, Callable

import torch
from torch import Tensor

from fnebm import random as fr

GENERATIVE = ("flow", "eqm")
EQM_MOMENTUM = 0.35
FIELD_GRID = 25  # arrows per side of the field's picture


def field_init(key: Tensor, hidden: int, dtype: torch.dtype, loss: str) -> dict[str, Tensor]:
    """``nn.Linear``'s default initialisation, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, drawn from ``key``."""
    din = 3 if loss == "flow" else 2
    shapes = {"w0": ((din, hidden), din), "b0": ((hidden,), din), "w1": ((hidden, hidden), hidden),
              "b1": ((hidden,), hidden), "w2": ((hidden, 2), hidden), "b2": ((2,), hidden)}
    keys = fr.split(key, len(shapes))
    return {name: (2 * fr.uniform(keys[i], shape, dtype) - 1) / math.sqrt(fan_in)
            for i, (name, (shape, fan_in)) in enumerate(shapes.items())}


def mlp_field(params: dict[str, Tensor], x: Tensor, *t: Tensor) -> Tensor:
    """``x: (n, 2)`` (and ``t: (n,)`` for flow matching) ``-> (n, 2)``: the field on a batch."""
    h = torch.cat([x, t[0][:, None]], 1) if t else x
    h = torch.nn.functional.silu(h @ params["w0"] + params["b0"])
    h = torch.nn.functional.silu(h @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def loss_function(cfg: Any) -> Callable[..., tuple[Tensor, Any]]:
    """``f(params, key, chains) -> (loss, chains)``, as :func:`fnebm.cli.train._loss_function`
    (``chains`` is ``None`` and passed through); the batch from ``k_data``, the loss from ``k_loss``."""
    from fnebm import datasets, losses
    from fnebm.cli.presets import DTYPES

    data, dtype = datasets.get(cfg.dataset), DTYPES[cfg.dtype]

    def f(params: dict[str, Tensor], key: Tensor, chains: Any) -> tuple[Tensor, Any]:
        k_data, k_loss = fr.split(key)
        batch = data(k_data, cfg.batch, dtype)
        field = losses.bind_field(mlp_field, params, batched=True)
        if cfg.loss == "flow":
            loss, _ = losses.flow_matching(field, batch, k_loss)
        else:
            loss, _ = losses.equilibrium_matching(field, batch, k_loss)
        return loss, chains

    return f


@torch.no_grad()
def model_samples(cfg: Any, params: dict[str, Tensor], key: Tensor, n: int) -> Tensor:
    """``n`` model samples from ``N(0, I)``: Euler steps of the flow, or EqM's descent."""
    import fnebm
    from fnebm.cli.presets import DTYPES

    x = fr.normal(key, (n, 2), DTYPES[cfg.dtype])
    steps = cfg.sample_steps
    if cfg.loss == "flow":  # the library's flow sampler: a fixed Euler grid of `steps` steps (one scan)
        from fnebm.integrators import ode

        x, _ = fnebm.samplers.flow_sample(functools.partial(mlp_field, params), key, x.shape, method=ode.euler,
                                          steps=steps, x0=x, dtype=x.dtype)
        return x
    alg = fnebm.eqm(_one(params), cfg.step_size, EQM_MOMENTUM)
    state = torch.func.vmap(alg.init)(x)
    keys = fr.split(key, n)
    for _ in range(steps):
        state, _ = alg.step(state, keys)
    return state.position


def _field_one(params: dict[str, Tensor], x: Tensor) -> Tensor:
    return mlp_field(params, x[None])[0]


def _one(params: dict[str, Tensor]) -> Callable[[Tensor], Tensor]:
    return functools.partial(_field_one, params)


def evaluate(cfg: Any, params: dict[str, Tensor]) -> dict[str, Any]:
    """:func:`fnebm.cli.train.evaluate`'s figures for a field: ``mmd2`` (no density: ``kl`` is None)
    and what the plot draws (the field on a FIELD_GRID x FIELD_GRID grid)."""
    from fnebm import datasets
    from fnebm.cli.train_options import EVAL_POINTS, SAMPLE_CHAINS
    from fnebm.cli._common import _box, mmd2

    device = torch.device(cfg.device)
    k_eval = fr.split(fr.key(cfg.seed, device=device), 4)[3]
    k_data, _, k_samples = fr.split(k_eval, 3)
    samples = model_samples(cfg, params, k_samples, SAMPLE_CHAINS).to("cpu", torch.float64)
    data = datasets.get(cfg.dataset)(k_data, EVAL_POINTS, torch.float64).cpu()
    lo, hi = _box(data)
    gx, gy = torch.meshgrid(torch.linspace(float(lo[0]), float(hi[0]), FIELD_GRID, dtype=torch.float64),
                            torch.linspace(float(lo[1]), float(hi[1]), FIELD_GRID, dtype=torch.float64), indexing="xy")
    points = torch.stack([gx.reshape(-1), gy.reshape(-1)], -1)
    p = {k: v.detach().to("cpu", torch.float64) for k, v in params.items()}
    with torch.no_grad():
        if cfg.loss == "flow":
            arrows = mlp_field(p, points, torch.full((points.shape[0],), 0.5, dtype=torch.float64))
        else:
            arrows = -mlp_field(p, points)
    ok = torch.isfinite(samples).all(1)
    return dict(kl=None, kl_floor=None,
                mmd2=mmd2(samples[ok], data[:SAMPLE_CHAINS]) if bool(ok.sum() >= 2) else None,
                nonfinite_samples=int((~ok).sum()), data=data, samples=samples, points=points, arrows=arrows,
                lo=lo, hi=hi)


def plot(f: BinaryIO, cfg: Any, ev: dict[str, Any], summary: dict[str, Any]) -> None:
    """Three panels into ``f`` (PNG): the data, the learned field, the model samples."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from fnebm.cli.train_options import SAMPLE_CHAINS

    fig = Figure(figsize=(15, 5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    extent = (float(ev["lo"][0]), float(ev["hi"][0]), float(ev["lo"][1]), float(ev["hi"][1]))
    mmd = "n/a" if summary["mmd2"] is None else f"{summary['mmd2']:.2e}"
    fig.suptitle(f"fnebm train: {cfg.dataset}, {cfg.loss}, {summary['step']} steps, MMD^2 to the data {mmd}")
    data = ev["data"][:SAMPLE_CHAINS].numpy()
    axes[0].scatter(data[:, 0], data[:, 1], s=3, c="#3b75af", alpha=0.5, linewidths=0)
    axes[0].set_title(f"data ({SAMPLE_CHAINS} points)")
    pts, arr = ev["points"].numpy(), ev["arrows"].numpy()
    speed = (arr ** 2).sum(1) ** 0.5
    axes[1].quiver(pts[:, 0], pts[:, 1], arr[:, 0], arr[:, 1], speed, cmap="viridis")
    axes[1].set_title("learned velocity v(x, t = 0.5)" if cfg.loss == "flow" else
                      "learned field -f(x): where EqM's descent moves")
    s = ev["samples"]
    s = s[torch.isfinite(s).all(1)].numpy()
    axes[2].scatter(s[:, 0], s[:, 1], s=3, c="#ff5a36", alpha=0.5, linewidths=0)
    how = (f"{cfg.sample_steps} Euler steps of the flow" if cfg.loss == "flow" else
           f"{cfg.sample_steps} steps of EqM's descent")
    axes[2].set_title(f"model samples ({how} from N(0, I))")
    for ax in axes:
        ax.set(xlim=extent[:2], ylim=extent[2:], xlabel="x0", ylabel="x1")
        ax.set_aspect("equal", adjustable="box")
    fig.savefig(f, format="png", dpi=100)


def describe(c: dict[str, Any], h: int) -> tuple[str, str]:
    """The summary's ``model`` and ``loss`` rows."""
    if c["loss"] == "flow":
        return (f"MLP 3-{h}-{h}-2 (SiLU): the velocity v(x, t)",
                "flow: flow matching, linear path, independent pairs, t ~ U[0, 1]")
    return (f"MLP 2-{h}-{h}-2 (SiLU): the time-invariant field f(x)",
            "eqm: equilibrium matching, linear path, truncated decay a = 0.8, lambda = 4")
