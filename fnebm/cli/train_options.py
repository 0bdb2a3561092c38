"""``fnebm train``'s options: the constants, :class:`TrainConfig`, the parser, the checks of the
arguments and of a checkpoint to resume from, and the key layout."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, NamedTuple

import torch

from fnebm import random as fr
from fnebm.cli._common import Launch, UsageError, _destination, _device, launched
from fnebm.cli.presets import DTYPES


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
DIVERGENCE_CHECK = 50  # training checks its loss and model for NaN/inf at least this often (steps), and at the end
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
