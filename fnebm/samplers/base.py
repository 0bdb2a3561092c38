"""The sampler interface and the checks every constructor shares.

A sampler is two pure functions (BlackJAX's ``SamplingAlgorithm``):
``state = init(position)`` and ``state, info = step(state, key)``, for one chain.
Batch over chains with ``torch.func.vmap`` or hand a batched state to ``fnebm.sample_chain``.

fnebm's own steps also take a batch of keys directly: with ``keys: (*batch, 2)`` and a state
whose fields lead with ``batch``, ``step(state, keys)`` equals ``vmap(step)(state, keys)``
(the energy is still evaluated per sample under ``vmap``). Such a step is marked with
:func:`batch_native`; ``sample_chain`` then calls it directly, which lets the random draws of
all chains be computed with the chain axis innermost (vectorised) instead of under ``vmap``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import random as fr

__all__ = [
    "SamplingAlgorithm",
    "check_step_size",
    "check_energy",
    "check_position",
    "batch_native",
    "is_batch_native",
    "over_batch",
    "event_sum",
    "event_all",
    "where_batch",
    "check_batch",
]


class SamplingAlgorithm(NamedTuple):
    """``init(position) -> state`` and ``step(state, key) -> (state, info)``, both pure."""

    init: Callable[[Tensor], Any]
    step: Callable[[Any, Tensor], tuple[Any, Any]]


def check_step_size(value: Any, name: str = "step_size", *, allow_zero: bool = False) -> float:
    """A positive (or, with ``allow_zero``, non-negative) finite number, as a Python float.

    Constructors call this once, at the boundary; a 0-dim tensor is read with one host sync.
    """
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a number or a one-element real tensor, got shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    ok = value >= 0 if allow_zero else value > 0
    if not math.isfinite(value) or not ok:
        expected = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value


def check_energy(energy_fn: Any) -> None:
    if not callable(energy_fn):
        raise TypeError(f"energy_fn must be callable x -> E(x), got {type(energy_fn).__name__}")


def check_position(position: Any, energy_fn: Any) -> None:
    """``position`` is a floating tensor on the energy's device and in its dtype (when it has them).

    Runs in ``init``; it reads metadata only, so it is free under ``torch.compile``.
    """
    if not isinstance(position, Tensor):
        raise TypeError(f"position must be a torch.Tensor, got {type(position).__name__}")
    if not position.is_floating_point():
        raise TypeError(f"position must be a floating tensor, got dtype {position.dtype}")
    dtype, device = getattr(energy_fn, "dtype", None), getattr(energy_fn, "device", None)
    if isinstance(dtype, torch.dtype) and position.dtype != dtype:
        raise TypeError(
            f"position has dtype {position.dtype} but the energy's parameters are {dtype}; "
            f"convert one of them (e.g. energy.to(dtype={position.dtype}))"
        )
    if isinstance(device, torch.device) and position.device.type != device.type:
        raise ValueError(
            f"position is on {position.device} but the energy's parameters are on {device}; "
            f"move one of them (e.g. energy.to(device='{position.device}'))"
        )


_BATCH_NATIVE = "__fnebm_batch_native__"


def batch_native(step: Callable) -> Callable:
    """Mark ``step`` as taking leading batch axes itself (see the module docstring)."""
    setattr(step, _BATCH_NATIVE, True)
    return step


def is_batch_native(step: Any) -> bool:
    return bool(getattr(step, _BATCH_NATIVE, False))


def over_batch(fn: Callable, n_batch: int) -> Callable:
    """``fn`` of one sample mapped over ``n_batch`` leading axes (nested ``vmap``)."""
    for _ in range(n_batch):
        fn = torch.func.vmap(fn)
    return fn


def event_sum(x: Tensor, n_batch: int) -> Tensor:
    """Sum over every axis after the first ``n_batch``: ``(*batch, *event) -> batch``."""
    return x.reshape(x.shape[:n_batch] + (-1,)).sum(-1)


def event_all(x: Tensor, n_batch: int) -> Tensor:
    """``all`` over every axis after the first ``n_batch``: ``(*batch, *event) -> batch``."""
    return x.reshape(x.shape[:n_batch] + (-1,)).all(-1)


def where_batch(mask: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``torch.where`` with a ``batch``-shaped mask picking whole ``(*batch, *event)`` samples."""
    return torch.where(mask.reshape(mask.shape + (1,) * (a.ndim - mask.ndim)), a, b)


def check_batch(state: Any, key: Tensor) -> int:
    """The number of batch axes, ``key.ndim - 1``; the state's energy must have that shape.

    Reads metadata only, so it costs nothing under ``torch.compile``.
    """
    fr.check_key(key)
    batch = key.shape[:-1]
    if state.energy.shape != batch:
        raise ValueError(
            f"key has batch shape {tuple(batch)} but state.energy has shape {tuple(state.energy.shape)}: "
            "pass one key per chain, with the chain axes leading both"
        )
    return len(batch)
