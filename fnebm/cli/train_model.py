"""``fnebm train``'s model and what trains it: the MLP energy, its initialisation, the training
sampler, the loss of a step (batch or per-example layout), and chains run from the model."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import fnebm
from fnebm import distributed as fdist
from fnebm import energies as E
from fnebm import random as fr
from fnebm.cli.presets import DTYPES
from fnebm.cli.train_options import INIT_SCALE, SAMPLE_CHAINS, TETHER, TrainConfig


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
