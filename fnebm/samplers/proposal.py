"""Metropolis–Hastings accept/reject, written once for every adjusted sampler (MALA, HMC, ...).

Accept/reject is arithmetic (``torch.where``), never a Python branch, so a step traces into
one graph. A proposal whose log acceptance ratio is not finite (a non-finite energy or
gradient on the way) is rejected and reported as divergent: the chain never turns into NaN.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fnebm import random as fr

__all__ = ["Decision", "metropolis_hastings", "select"]


class Decision(NamedTuple):
    """``is_accepted``, ``acceptance_rate = min(1, alpha)`` (0 when divergent), ``is_divergent``; each ``chains``."""

    is_accepted: Tensor
    acceptance_rate: Tensor
    is_divergent: Tensor


def metropolis_hastings(key: Tensor, log_alpha: Tensor, finite: Tensor) -> Decision:
    """Accept with probability ``min(1, exp(log_alpha))`` unless ``finite`` is False.

    key: ``(*chains, 2)``; log_alpha, finite: ``chains``. One uniform per chain from ``key``.
    """
    log_alpha = torch.where(finite & log_alpha.isfinite(), log_alpha, torch.full_like(log_alpha, -math.inf))
    u = fr.uniform(key, (), log_alpha.dtype)
    accepted = torch.log(u) < log_alpha
    return Decision(accepted, torch.exp(torch.clamp_max(log_alpha, 0.0)), ~(finite & log_alpha.isfinite()))


def select(mask: Tensor, new: Any, old: Any) -> Any:
    """Per chain, ``new`` where ``mask`` else ``old``: pytrees of ``(*chains, ...)`` tensors, ``mask: chains``."""

    def pick(a: Tensor, b: Tensor) -> Tensor:
        return torch.where(mask.reshape(mask.shape + (1,) * (a.ndim - mask.ndim)), a, b)

    return pytree.tree_map(pick, new, old)
