"""The sampler interface and the checks every constructor shares.

A sampler is two pure functions (BlackJAX's ``SamplingAlgorithm``):
``state = init(position)`` and ``state, info = step(state, key)``, for one chain.
Batch over chains with ``torch.func.vmap`` or hand a batched state to ``fnebm.sample_chain``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

__all__ = ["SamplingAlgorithm", "check_step_size", "check_energy", "check_position"]


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
