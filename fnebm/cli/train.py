"""``fnebm train``: an MLP energy fitted to a 2-D toy data set, checkpointed, plotted and measured."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any, BinaryIO, NamedTuple

import torch
from torch import Tensor

import fnebm
from fnebm import distributed as fdist
from fnebm import energies as E
from fnebm import random as fr
from fnebm.cli._common import (Launch, UsageError, _destination, _device, _sync, agree, launched, run_launched,
                               write_outputs)
from fnebm.cli.presets import DTYPES


# ------------------------------------------------------------------------------ train
#
# `fnebm train`: an MLP energy fitted to a 2-D toy data set. Everything random comes from one
# key: k_params, k_chains, k_train, k_eval = split(key(seed), 4); training step t uses
# fold_in(k_train, t). The checkpoint holds the parameters, Adam's moments and count, the
# persistent chains, the key and the step, so a resumed run continues the same stream.
#
# Two key layouts. "batch" (one process): the step's loss takes one key for the whole batch, and pcd's
# chains share one replay buffer. "per-example" (fnebm.distributed's; the default under torchrun): the
# loss key is split over the examples, and each example is a batch of one with its own key and its own
# persistent chain and replay ring, so the run is the same on any number of processes.

TRAIN_LOSSES = ("pcd", "cd", "dsm", "ssm", "sm", "flow", "eqm")  # flow, eqm: fnebm.cli.generative
TRAIN_SAMPLERS = ("langevin", "mala")
LAYOUTS = ("batch", "per-example")
CHECKPOINT_FORMAT = "fnebm-train"
PER_EXAMPLE_VERSION = 3  # a per-example checkpoint: version 2's keys, "layout", one chain (and ring) per example
CHECKPOINT_VERSION = 2  # 2: config["lr_decay"], config["reinit"]; version 1 (constant lr, restarts 0.05) reads as such
V1_CONFIG = {"lr_decay": 0, "reinit": 0.05}  # what a version 1 checkpoint trained with
# the training options a checkpoint fixes (a resumed run takes them from it), and their defaults. Tuned on
# eight_gaussians (docs/cli.md): at a constant lr the modes' weights drift with the gradient noise, and a
# linear decay settles them; the chains' restarts from noise are what carve the modes out of a ring.
TRAIN_DEFAULTS: dict[str, Any] = dict(
    dataset="eight_gaussians", loss="pcd", sampler="langevin", batch=1024, lr=2e-3, lr_decay=2000, k=10,
    step_size=0.01, noise_scale=1.0, sigma=0.1, buffer=0, reinit=0.2, hidden=128, seed=0, dtype="float32",
)
TETHER = 0.01         # E(x) = MLP(x) + TETHER |x|^2 / 2: exp(-E) stays normalisable whatever the MLP does
INIT_SCALE = 2.0      # fresh chains (PCD restarts, model samples) start from N(0, INIT_SCALE^2 I)
LR_FLOOR = 0.05       # with --lr-decay N: the lr falls linearly to LR_FLOOR * lr at step N and stays there
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
    lr_decay: int
    k: int
    step_size: float
    noise_scale: float
    sigma: float
    buffer: int
    reinit: float
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
    layout: str = "batch"  # fixed by a checkpoint too (its version says which), kept apart from TRAIN_DEFAULTS
    world_size: int = 1    # processes (torchrun), each holding a block of every step's examples
    rank: int = 0

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
                        f"ssm (sliced score matching), sm (exact score matching), flow (flow matching: a "
                        f"velocity field), eqm (equilibrium matching: a time-invariant field) (default: {d['loss']})")
    p.add_argument("--objective", dest="loss", default=None, metavar="NAME",
                   help="the same as --loss: flow, eqm, pcd, cd, dsm, ssm or sm")
    p.add_argument("--sampler", default=None, metavar="NAME",
                   help=f"langevin or mala: the negatives of cd/pcd and the model samples (default: {d['sampler']})")
    p.add_argument("--steps", type=int, default=2000, metavar="N",
                   help="training steps to run now (after --resume: more steps) (default: 2000)")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help=f"data points per step, and persistent chains for pcd (default: {d['batch']})")
    p.add_argument("--lr", type=float, default=None, metavar="LR",
                   help=f"Adam's learning rate at step 0 (default: {d['lr']:g})")
    p.add_argument("--lr-decay", type=int, default=None, metavar="N",
                   help=f"the learning rate falls linearly to {LR_FLOOR:g} x --lr at step N and stays there; "
                        f"0 for a constant rate (default: {d['lr_decay']})")
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
    p.add_argument("--reinit", type=float, default=None, metavar="P",
                   help=f"pcd: probability that a chain restarts from noise at each step (default: {d['reinit']:g})")
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
    how = p.add_mutually_exclusive_group()
    how.add_argument("--compile", dest="compile", action="store_const", const=True, default=None,
                     help="compile the loss with torch.compile (the default with --layout batch)")
    how.add_argument("--no-compile", dest="compile", action="store_const", const=False,
                     help="run the training step eagerly, without torch.compile (faster for short runs; the "
                          "default with --layout per-example, whose compile unrolls the --k sampler steps)")
    p.add_argument("--layout", default=None, metavar="NAME",
                   help="the key layout: batch (one key for the batch's loss, one shared replay buffer; one "
                        "process only) or per-example (a key, a chain and a replay ring per example: the same "
                        "run on any number of processes) (default: batch; per-example under torchrun)")


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
    if ckpt.get("version") not in (1, CHECKPOINT_VERSION, PER_EXAMPLE_VERSION):
        raise UsageError(f"--resume {path}: checkpoint version {ckpt.get('version')!r}, this fnebm reads "
                         f"1 to {PER_EXAMPLE_VERSION}")
    if ckpt["version"] < PER_EXAMPLE_VERSION:
        ckpt["layout"] = "batch"
    elif ckpt.get("layout") != "per-example":
        raise UsageError(f"--resume {path}: damaged checkpoint (version {PER_EXAMPLE_VERSION} without its layout)")
    if ckpt["version"] == 1 and isinstance(ckpt.get("config"), dict):
        for name, value in V1_CONFIG.items():  # continue a version 1 run the way it was trained
            ckpt["config"].setdefault(name, value)
    needed = ("config", "step", "key", "params", "optimizer", "chains", "losses")
    missing = [k for k in needed if k not in ckpt]
    config = ckpt.get("config")
    if missing or not isinstance(config, dict) or set(config) != set(TRAIN_DEFAULTS):
        raise UsageError(f"--resume {path}: damaged checkpoint (missing {', '.join(missing) or 'config entries'})")
    return ckpt


def _train_config(args: argparse.Namespace,
                  where: Launch | None = None) -> tuple[TrainConfig, dict[str, Any] | None]:
    """The checked options, and the checkpoint to resume; ``where``: this rank under torchrun."""
    from fnebm import datasets

    device = _device(args.device) if where is None else where.device
    world, rank = (1, 0) if where is None else (where.world_size, where.rank)
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
    if opts["lr_decay"] < 0:
        raise UsageError(f"--lr-decay must be >= 0 (0: a constant learning rate), got {opts['lr_decay']}")
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
    if not (math.isfinite(opts["reinit"]) and 0 <= opts["reinit"] <= 1):
        raise UsageError(f"--reinit must be a probability in [0, 1], got {opts['reinit']}")
    if args.reinit is not None and opts["loss"] != "pcd":
        raise UsageError(f"--reinit is persistent CD's restart probability: use it with --loss pcd, not {opts['loss']}")
    if args.buffer is not None and opts["buffer"] and opts["loss"] != "pcd":
        raise UsageError(f"--buffer is persistent CD's replay buffer: use it with --loss pcd, not {opts['loss']}")
    try:
        fr.key(opts["seed"])
    except (TypeError, ValueError) as e:
        raise UsageError(f"--seed: {e}") from None
    layout = _layout(args, ckpt, world, launched() or world > 1)
    if layout == "per-example" and opts["loss"] in ("flow", "eqm"):
        raise UsageError(f"--loss {opts['loss']} trains in one process with --layout batch")
    if layout == "per-example" and opts["buffer"] % opts["batch"]:
        raise UsageError(f"--buffer {opts['buffer']} with --layout per-example must be a multiple of --batch "
                         f"{opts['batch']}: each example's chain keeps --buffer / --batch replay entries")
    if opts["batch"] < world:
        raise UsageError(f"--batch {opts['batch']} must be at least the number of processes ({world}): every "
                         "rank holds a block of each step's examples")
    # only rank 0 writes files: only its paths are checked
    out = None if args.out is None or rank != 0 else _destination("--out", args.out)
    plot = None if args.plot is None or rank != 0 else _destination("--plot", args.plot)
    if out is not None and out == plot:
        raise UsageError(f"--out and --plot name the same file {args.out}")
    opts = {k: (float(v) if isinstance(TRAIN_DEFAULTS[k], float) else v) for k, v in opts.items()}
    cfg = TrainConfig(**opts, steps=args.steps, sample_steps=args.sample_steps, device=str(device), out=out,
                      plot=plot, resume=args.resume,
                      progress=not args.no_progress and sys.stderr.isatty() and rank == 0,
                      compile=(layout == "batch") if args.compile is None else args.compile, layout=layout,
                      world_size=world, rank=rank)
    return cfg, ckpt


def _layout(args: argparse.Namespace, ckpt: dict[str, Any] | None, world: int, under_torchrun: bool) -> str:
    """The key layout: ``--layout``, else the checkpoint's, else per-example under torchrun, batch otherwise."""
    given = args.layout
    if given is not None and given not in LAYOUTS:
        raise UsageError(f"unknown layout {given!r} (choose from {', '.join(LAYOUTS)})")
    if ckpt is not None:
        if given is not None and given != ckpt["layout"]:
            raise UsageError(f"--resume {args.resume}: --layout {given} differs from the checkpoint's "
                             f"{ckpt['layout']} (leave it out to keep the checkpoint's)")
        layout = ckpt["layout"]
    else:
        layout = given or ("per-example" if under_torchrun else "batch")
    if layout == "batch" and world > 1:
        what = (f"--resume {args.resume} was trained with --layout batch" if given is None else "--layout batch")
        raise UsageError(f"{what}, which runs in one process (one key for the whole batch): under torchrun "
                         "use --layout per-example")
    return layout


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


def _init_params(cfg: TrainConfig, key: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
    """The model's first parameters: the energy MLP, or (flow, eqm) the field MLP."""
    if cfg.loss in ("flow", "eqm"):
        from fnebm.cli import generative

        return generative.field_init(key, cfg.hidden, dtype, cfg.loss)
    return mlp_init(key, cfg.hidden, dtype)


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
    if cfg.layout == "per-example":
        return _per_example_loss(cfg)
    if cfg.loss in ("flow", "eqm"):
        from fnebm.cli import generative

        return generative.loss_function(cfg)

    def f(params: dict[str, Tensor], key: Tensor, chains: Any) -> tuple[Tensor, Any]:
        k_data, k_loss = fr.split(key)
        batch = data(k_data, cfg.batch, dtype)
        energy = E.bind(mlp_energy, params)
        if cfg.loss == "pcd":
            loss, aux = losses.persistent_contrastive_divergence(
                energy, batch, k_loss, chains, sampler=sampler, n_steps=cfg.k, reinit_prob=cfg.reinit,
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


def _per_example_loss(cfg: TrainConfig) -> Callable[..., tuple[Tensor, Any]]:
    """:func:`_loss_function` in the per-example layout: ``f(params, key, chains) -> (loss, chains)``
    on this rank's examples ``chain_slice(batch)`` of the step's batch, example ``i`` taking the key
    ``split(k_loss, batch)[i]`` and (pcd) its own chain; the loss is the mean over this rank's examples.

    The batch and ``k_loss`` come from ``key`` as in the batch layout (the same data). The sampler
    loop keeps the losses' ``unroll=None``: unrolled inside ``torch.compile`` (a scan cannot run
    under ``vmap`` there), a loop eagerly.
    """
    import functools

    from fnebm import datasets
    from fnebm import losses

    data, sampler, dtype = datasets.get(cfg.dataset), _train_sampler(cfg), DTYPES[cfg.dtype]
    n = cfg.batch
    mine = fdist.chain_slice(n, rank_=cfg.rank, world_size_=cfg.world_size)  # a constant: nothing asks the group
    if cfg.loss == "pcd":
        one = functools.partial(losses.persistent_contrastive_divergence, sampler=sampler, n_steps=cfg.k,
                                reinit_prob=cfg.reinit, noise=_fresh)
    elif cfg.loss == "cd":
        one = functools.partial(losses.contrastive_divergence, sampler=sampler, n_steps=cfg.k, init="data")
    elif cfg.loss == "dsm":
        one = functools.partial(losses.denoising_score_matching, sigma=cfg.sigma)
    elif cfg.loss == "ssm":
        one = functools.partial(losses.sliced_score_matching, variance_reduction=True)
    else:
        one = losses.exact_score_matching
    loss = fdist.per_example(one)

    def f(params: dict[str, Tensor], key: Tensor, chains: Any) -> tuple[Tensor, Any]:
        k_data, k_loss = fr.split(key)
        batch = data(k_data, n, dtype)[mine]
        keys = fr.split(k_loss, n)[mine]
        energy = E.bind(mlp_energy, params)
        if cfg.loss == "pcd":
            value, aux = loss(energy, batch, keys, chains)
            return value, aux.state
        value, _ = loss(energy, batch, keys)
        return value, chains

    return f


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Adam's rate at training step ``step`` (counted over the whole run, across resumes): ``lr`` falling
    linearly to ``LR_FLOOR * lr`` at step ``lr_decay`` and constant after it; ``lr`` throughout if ``lr_decay`` is 0."""
    if cfg.lr_decay == 0:
        return cfg.lr
    return cfg.lr * max(LR_FLOOR, 1.0 - (1.0 - LR_FLOOR) * step / cfg.lr_decay)


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
    key = (*cfg.fixed().values(), cfg.device, cfg.layout, cfg.world_size, cfg.rank)
    if key not in _TRAIN_CACHE:
        _TRAIN_CACHE[key] = torch.compile(_loss_function(cfg), fullgraph=True)
    return _TRAIN_CACHE[key]


def _initial(cfg: TrainConfig, ckpt: dict[str, Any] | None) -> dict[str, Any]:
    """The training state: from the checkpoint, or fresh from the seed."""
    from fnebm import losses

    if ckpt is not None:  # the chains of every example (per-example: this rank takes its block in _train_loop)
        chains = None if ckpt["chains"] is None else losses.PCDState(**ckpt["chains"])
        return dict(step=int(ckpt["step"]), key=ckpt["key"], params=ckpt["params"], optimizer=ckpt["optimizer"],
                    chains=chains, losses=ckpt["losses"].to(torch.float64).cpu())
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    k_params, k_chains, k_train, _ = fr.split(fr.key(cfg.seed, device=device), 4)
    params = _init_params(cfg, k_params, dtype)
    zeros = {name: torch.zeros_like(p) for name, p in params.items()}
    optimizer = {"m": zeros, "v": dict(zeros), "t": torch.zeros((), dtype=dtype, device=device)}
    chains = None
    if cfg.loss == "pcd" and cfg.layout == "per-example":  # a chain and a ring of buffer / batch entries each
        chains = fdist.per_example_pcd_init(_fresh(k_chains, (cfg.batch, 2), dtype), cfg.buffer // cfg.batch)
    elif cfg.loss == "pcd":
        chains = losses.pcd_init(_fresh(k_chains, (cfg.batch, 2), dtype), buffer_size=cfg.buffer)
    return dict(step=0, key=k_train, params=params, optimizer=optimizer, chains=chains,
                losses=torch.zeros(0, dtype=torch.float64))


def _check_resumed(cfg: TrainConfig, state: dict[str, Any]) -> None:
    """The checkpoint's tensors have the shapes its config says (a hand-edited file fails here, not mid-run)."""
    expected = _init_params(cfg, fr.key(0), DTYPES[cfg.dtype])
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
    if cfg.layout == "per-example":
        n = cfg.batch
        ok = ok and (chains is None or (chains.positions.shape == (n, 1, 2) and
                                        chains.buffer.shape == (n, cfg.buffer // n, 2) and
                                        chains.count.shape == (n,) and chains.pointer.shape == (n,)))
    else:
        ok = ok and (chains is None or (chains.positions.shape == (cfg.batch, 2) and
                                        chains.buffer.shape == (cfg.buffer, 2)))
    if not ok:
        raise UsageError(f"--resume {cfg.resume}: damaged checkpoint (its tensors do not match its config)")


def _train_loop(cfg: TrainConfig, state: dict[str, Any]) -> tuple[dict[str, Any], float | None, float]:
    """``cfg.steps`` training steps from ``state``; returns ``(state, compile_s, train_s)``.

    Per-example under torchrun: this rank trains on its block of every step's examples and their
    chains, and the gradients (and the loss) are averaged over the ranks, weighted by their number of
    examples; the returned chains are every rank's (gathered).
    """
    device = torch.device(cfg.device)
    loss_fn = _compiled_loss(cfg) if cfg.compile else _loss_function(cfg)
    params, opt, chains = state["params"], state["optimizer"], state["chains"]
    sharded = cfg.world_size > 1
    n_local = fdist.chain_counts(cfg.batch, cfg.world_size)[cfg.rank]
    if sharded and chains is not None:
        chains = fdist.shard(chains)
    if chains is not None:  # vmap's per_example_pcd_init leaves a stride-0 count: a compiled step would recompile
        chains = type(chains)(*(x.contiguous() for x in chains))
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
        if sharded:  # the global batch's gradient, and its loss: one all-reduce
            grads, loss = fdist.all_reduce_mean((grads, loss.detach()), weight=n_local)
        with torch.no_grad():
            params, opt = adam_update({n: p.detach() for n, p in leaves.items()}, grads, opt,
                                      learning_rate(cfg, start + i))
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
    if sharded and chains is not None:
        chains = _gather_examples(chains, cfg.batch)
    losses = torch.cat([state["losses"], history.cpu()])
    new = dict(step=start + cfg.steps, key=base_key, params={n: p.detach() for n, p in params.items()},
               optimizer=opt, chains=chains, losses=losses)
    return new, compile_s, train_s


def _gather_examples(chains: Any, n: int) -> Any:
    """Every rank's rows of per-example chains (a ``PCDState``), in global order, on every rank.

    ``fnebm.distributed.gather_chains`` leaf by leaf, except a leaf with no elements (the rings of
    ``--buffer 0``), which is made here: gloo aborts the process on an all-gather of empty tensors."""
    return type(chains)(*(x.new_empty((n, *x.shape[1:])) if x.numel() == 0 else fdist.gather_chains(x, dim=0)
                          for x in chains))


# ------------------------------------------------------------------------- evaluation


def model_samples(cfg: TrainConfig, params: dict[str, Tensor], key: Tensor, n: int = SAMPLE_CHAINS) -> Tensor:
    """``n`` chains from ``N(0, INIT_SCALE² I)`` run ``cfg.sample_steps`` steps of the sampler on the model: ``(n, 2)``.

    Under torchrun each rank runs its block of the chains (fnebm.distributed's layout: the same chains as
    one process) and every rank gets all of them; every rank must call it."""
    from fnebm.chain.loop import run

    alg = _train_sampler(cfg)(E.bind(mlp_energy, params))
    k_start, k_run = fr.split(key)
    mine = fdist.chain_slice(n)
    state = torch.func.vmap(alg.init)(_fresh(k_start, (n, 2), DTYPES[cfg.dtype])[mine])
    with torch.no_grad():
        final, _, _ = run(alg.step, state, fr.split(k_run, n)[mine], cfg.sample_steps, collect=lambda s: ())
    return fdist.gather_chains(final.position.detach(), dim=0)


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
    lines = [f"{k:<12} {v}" for k, v in rows]
    if s["nonfinite_samples"]:
        lines.append(f"{'note':<12} {s['nonfinite_samples']} model samples diverged (left out of MMD and plot)")
    return lines


def _train(args: argparse.Namespace) -> int:
    return run_launched(args.device, lambda where: _train_on(args, where))


def _train_on(args: argparse.Namespace, where: Launch) -> int:
    def checked() -> tuple[TrainConfig, dict[str, Any] | None, dict[str, Any]]:
        cfg, ckpt = _train_config(args, where)
        state = _initial(cfg, ckpt)
        if ckpt is not None:
            _check_resumed(cfg, state)
        return cfg, ckpt, state

    cfg, ckpt, state = agree(where, checked)  # every rank reads --resume (a file every rank sees)
    start = state["step"]
    state, compile_s, train_s = _train_loop(cfg, state)
    t0 = time.perf_counter()
    ev = evaluate(cfg, state["params"])
    eval_s = time.perf_counter() - t0
    if cfg.rank != 0:  # rank 0 prints and writes for every rank
        return 0
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
    if cfg.layout != "batch":
        summary["config"]["layout"] = cfg.layout
    if cfg.world_size > 1:
        summary["processes"] = dict(world_size=cfg.world_size, backend=where.backend,
                                    examples=fdist.chain_counts(cfg.batch, cfg.world_size))
    print("\n".join(format_train_summary(summary)), flush=True)

    files = []
    if cfg.out is not None:
        chains = state["chains"]
        record = {
            "format": CHECKPOINT_FORMAT, "config": cfg.fixed(),
            **({"version": CHECKPOINT_VERSION} if cfg.layout == "batch" else
               {"version": PER_EXAMPLE_VERSION, "layout": cfg.layout}),
            "step": state["step"], "key": state["key"].cpu(),
            "params": {n: p.cpu() for n, p in state["params"].items()},
            "optimizer": {"m": {n: t.cpu() for n, t in state["optimizer"]["m"].items()},
                          "v": {n: t.cpu() for n, t in state["optimizer"]["v"].items()},
                          "t": state["optimizer"]["t"].cpu()},
            "chains": None if chains is None else {k: v.cpu() for k, v in chains._asdict().items()},
            "losses": state["losses"], "summary": summary,
        }
        files.append(("saved", args.out, cfg.out, lambda f: torch.save(record, f)))
    if cfg.plot is not None:
        files.append(("plot", args.plot, cfg.plot, lambda f: plot_training(f, cfg, ev, summary)))
    write_outputs(files)
    return 0

