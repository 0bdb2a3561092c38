"""``fnebm train``: an MLP energy fitted to a 2-D toy data set, checkpointed, plotted and measured.

The options are in :mod:`fnebm.cli.train_options`, the model and its loss in
:mod:`fnebm.cli.train_model`, the figures, plot and summary in :mod:`fnebm.cli.train_report`;
here: the optimiser, the training loop and its checks, and the entry point."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fnebm import distributed as fdist
from fnebm import random as fr
from fnebm.cli._common import Launch, UsageError, _sync, agree, run_launched, write_outputs
from fnebm.cli.presets import DTYPES
from fnebm.cli.train_model import _fresh, _init_params, _loss_function
from fnebm.cli.train_options import (ADAM, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, DIVERGENCE_CHECK, LR_FLOOR,
                                     PER_EXAMPLE_VERSION, TrainConfig, _train_config)
from fnebm.cli.train_report import evaluate, format_train_summary, plot_training


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
    bad = _nonfinite(_model_tensors(state))
    if bad:
        raise UsageError(f"--resume {cfg.resume}: the model in this checkpoint is not finite ({'; '.join(bad)}): "
                         "it can be neither trained nor sampled; resume from a checkpoint written before the "
                         "run diverged, or start afresh")


def _model_tensors(state: dict[str, Any]) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` for what a model is made of: the parameters, Adam's moments and the
    persistent chains (and their replay buffer)."""
    named = [(f"params[{n!r}]", p) for n, p in state["params"].items()]
    for s in ("m", "v"):
        named += [(f"optimizer[{s!r}][{n!r}]", t) for n, t in state["optimizer"][s].items()]
    if state["chains"] is not None:
        named += [(f"chains.{f}", state["chains"].positions if f == "positions" else state["chains"].buffer)
                  for f in ("positions", "buffer")]
    return named


def _nonfinite(named: list[tuple[str, Tensor]], limit: int = 3) -> list[str]:
    """``"params['w1']: 3 NaN, 1 inf of 2048 values"`` for each floating tensor holding a NaN or an
    inf (the first ``limit``, then a count of the rest); ``[]`` when every one is finite."""
    found = []
    for name, t in named:
        if isinstance(t, Tensor) and t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            nan = int(t.isnan().sum())
            inf = int((~torch.isfinite(t)).sum()) - nan
            what = " and ".join(f"{k} {w}" for k, w in ((nan, "NaN"), (inf, "inf")) if k)
            found.append(f"{name}: {what} of {t.numel()} values")
    return found[:limit] + ([f"{len(found) - limit} more tensors"] if len(found) > limit else [])


class Diverged(UsageError):
    """Training reached a non-finite loss or model: one line on stderr, exit status 2, nothing written."""


def _check_training(cfg: TrainConfig, history: Tensor, lo: int, hi: int, start: int, params: dict[str, Tensor],
                    opt: dict[str, Any]) -> None:
    """Raise :class:`Diverged` when a loss of steps ``lo:hi`` of this run, the parameters or Adam's
    moments are not finite. Called every few steps (a host sync each time), and after the last."""
    losses = history[lo:hi]
    named = _model_tensors(dict(params=params, optimizer=opt, chains=None))
    # one read: the largest |value| of each tensor is finite exactly when all its values are (NaN propagates)
    peaks = [t.abs().amax().double() for t in (losses, *(t for _, t in named)) if t.numel()]
    if bool(torch.isfinite(torch.stack(peaks)).all()):
        return
    finite = torch.isfinite(losses)
    bad = _nonfinite(named)
    if not bool(finite.all()):
        j = int((~finite).nonzero()[0, 0])
        what = f"the loss is {float(losses[j])} at step {start + lo + j}"
    else:
        what = f"by step {start + hi}"
    if bad:
        what += f"; {'; '.join(bad)}"
    raise Diverged(f"training diverged ({what}); nothing written: try a smaller --lr"
                   + ("" if cfg.loss in ("dsm", "ssm", "sm") else " or --step-size"))


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
    every = max(1, min(cfg.steps // 100, DIVERGENCE_CHECK))
    checked = 0  # steps whose loss (and the model after them) were checked finite
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
        if (i + 1) % every == 0 or i + 1 == cfg.steps:
            try:  # a model that went non-finite is never trained on, evaluated or saved
                _check_training(cfg, history, checked, i + 1, start, params, opt)
            except Diverged:
                if bar is not None:
                    bar.close()
                raise
            checked = i + 1
            if bar is not None:
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
