"""Exponential moving average of parameters, as one pure update."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fnebm import _checks

__all__ = ["ema_update"]


def ema_update(ema_params: Any, params: Any, decay: float | Tensor) -> Any:
    """``decay * ema + (1 - decay) * params``, leaf by leaf: a new pytree, the inputs untouched.

    ema_params, params: pytrees of the same structure (dicts of tensors, energies, fields);
    decay: a number or a tensor of one value (shape ``()`` or ``(1,)``) in ``[0, 1]``; a tensor's new
    value recompiles nothing (under ``torch.compile`` give ``(1,)``: Dynamo reads a 0-dim CPU input
    as a Python number and restarts its analysis once).
    No gradient flows into the average (``params`` is detached). Start with
    ``ema = torch.utils._pytree.tree_map(torch.clone, params)``.
    """
    ema_leaves, spec = pytree.tree_flatten(ema_params)
    leaves, spec2 = pytree.tree_flatten(params)
    if spec != spec2:
        raise ValueError("ema_params and params must be pytrees of the same structure")
    for e, p in zip(ema_leaves, leaves):
        if isinstance(e, Tensor) != isinstance(p, Tensor) or (isinstance(e, Tensor) and e.shape != p.shape):
            raise ValueError("ema_params and params must hold tensors of the same shapes, leaf by leaf")
    if isinstance(decay, Tensor):
        if decay.numel() != 1 or decay.ndim > 1 or not decay.is_floating_point():
            raise ValueError(f"decay must be a floating tensor of one value, shape () or (1,), got shape "
                             f"{tuple(decay.shape)}, {decay.dtype}")
        if _checks.is_concrete(decay) and not bool((decay >= 0) & (decay <= 1)):
            raise ValueError("decay must be in [0, 1]")
    else:
        d = _checks.check_real("decay", decay)
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {d}")
        decay = d

    def one(e: Any, p: Any) -> Any:
        if not isinstance(e, Tensor) or not e.is_floating_point():
            return p
        w = (1 - decay).to(e.dtype) if isinstance(decay, Tensor) else 1.0 - decay
        return torch.lerp(e.detach(), p.detach(), w)

    return pytree.tree_unflatten([one(e, p) for e, p in zip(ema_leaves, leaves)], spec)
