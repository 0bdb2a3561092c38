"""Couplings: how a minibatch of noise ``x0`` is paired with a minibatch of data ``x1``.

A coupling is a pure function ``coupling(x0, x1, key) -> (x0, x1')``: the noise stays in its
order and the data is re-indexed, ``x1' = x1[idx]`` (TorchEBM's convention), so a loss that
takes ``coupling=`` treats every coupling alike. ``key`` is one key ``(2,)``; a deterministic
coupling accepts and ignores it.

* :func:`independent` — the pairs as given, or the data shuffled by ``key``;
* :func:`exact_ot` — minibatch optimal transport, exact: the permutation minimising
  ``sum_i |x0_i - x1_idx(i)|^2`` (the Hungarian method, shortest augmenting paths, on the host
  in float64: one device-to-host copy of the ``n x n`` cost; for batches up to a few hundred);
* :func:`sinkhorn_ot` — entropic OT for large batches, pure torch on any device and
  traceable by ``torch.compile``: log-domain Sinkhorn iterations, then each noise point takes a
  data point drawn from its row of the plan (``mode="sample"``, keyed) or the row's argmax
  (``mode="argmax"``). Neither is a permutation: a data point may be taken twice.

The cost is the squared Euclidean distance on flattened samples divided by its maximum over
the batch (TorchEBM's), so Sinkhorn's ``epsilon`` is relative to the batch's largest cost.
:func:`assignment` and :func:`sinkhorn` are the solvers on a cost matrix.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import random as fr

__all__ = ["independent", "exact_ot", "sinkhorn_ot", "assignment", "sinkhorn", "squared_cost"]


def _check_pair(x0: Any, x1: Any) -> None:
    for name, x in (("x0", x0), ("x1", x1)):
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor (n, *event), got {type(x).__name__}")
        if x.ndim < 1 or x.shape[0] == 0:
            raise ValueError(f"{name} must have shape (n, *event) with n >= 1, got {tuple(x.shape)}")
    if x0.shape != x1.shape:
        raise ValueError(f"x0 and x1 must have the same shape (n, *event), got {tuple(x0.shape)} and {tuple(x1.shape)}")
    if x0.dtype != x1.dtype or x0.device != x1.device:
        raise TypeError(f"x0 and x1 must share dtype and device, got ({x0.dtype}, {x0.device}) and "
                        f"({x1.dtype}, {x1.device})")


def _check_optional_key(key: Any) -> None:
    if key is not None:
        fr.check_key(key)
        if key.shape != (2,):
            raise ValueError(f"key must be one key of shape (2,), got shape {tuple(key.shape)}")


def squared_cost(x0: Tensor, x1: Tensor) -> Tensor:
    """``C[i, j] = |x0_i - x1_j|^2 / max_ij |x0_i - x1_j|^2`` on flattened samples: ``(n, n)``."""
    n = x0.shape[0]
    a, b = x0.reshape(n, -1), x1.reshape(n, -1)
    # |a|^2 + |b|^2 - 2 a.b: one matmul (cdist's path for large n), clamped at 0 against rounding
    cost = ((a * a).sum(1, keepdim=True) + (b * b).sum(1)[None, :] - 2.0 * (a @ b.T)).clamp_min(0.0)
    return cost / cost.max().clamp_min(1e-12)


# --------------------------------------------------------------------------- independent


def independent(x0: Tensor, x1: Tensor, key: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The pairs as given (``key=None``), or ``x1`` in a random order drawn from ``key``."""
    _check_pair(x0, x1)
    _check_optional_key(key)
    if key is None:
        return x0, x1
    perm = torch.argsort(fr.uniform(key, (x1.shape[0],), torch.float32).to(x1.device))
    return x0, x1[perm]


# ------------------------------------------------------------------------------- exact


def _hungarian(cost: Any) -> Any:
    """Row -> column of the minimum-cost perfect matching of a square float64 numpy matrix.

    Shortest augmenting paths with potentials (Kuhn-Munkres as in Jonker & Volgenant): one row
    added per outer pass, each inner pass a vector operation over the columns; O(n^3) in all.
    """
    import numpy as np

    n = cost.shape[0]
    u = np.zeros(n + 1)
    v = np.zeros(n + 1)
    p = np.zeros(n + 1, dtype=np.int64)     # p[j]: the row matched to column j (1-based; 0: none)
    way = np.zeros(n + 1, dtype=np.int64)
    for i in range(1, n + 1):
        p[0] = i
        j0 = 0
        minv = np.full(n + 1, np.inf)
        used = np.zeros(n + 1, dtype=bool)
        while True:
            used[j0] = True
            i0 = p[j0]
            cur = cost[i0 - 1] - u[i0] - v[1:]
            free = ~used[1:]
            better = free & (cur < minv[1:])
            minv[1:][better] = cur[better]
            way[1:][better] = j0
            masked = np.where(free, minv[1:], np.inf)
            j1 = int(np.argmin(masked)) + 1
            delta = masked[j1 - 1]
            u[p[used]] += delta
            v[used] -= delta
            minv[~used] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
    rows = np.empty(n, dtype=np.int64)
    rows[p[1:] - 1] = np.arange(n)
    return rows


def assignment(cost: Tensor) -> Tensor:
    """The exact linear assignment: ``idx: (n,)`` int64 minimising ``sum_i cost[i, idx[i]]``.

    cost: ``(n, n)`` floating. Solved on the host in float64 (one copy of the cost off the
    device, a host sync: not traceable by ``torch.compile``); ``idx`` comes back on the cost's
    device. Exact for any real costs (ties broken by the algorithm's order, deterministically).
    """
    if not isinstance(cost, Tensor) or not cost.is_floating_point():
        raise TypeError(f"cost must be a floating tensor (n, n), got {type(cost).__name__}")
    if cost.ndim != 2 or cost.shape[0] != cost.shape[1] or cost.shape[0] == 0:
        raise ValueError(f"cost must be a square matrix (n, n) with n >= 1, got shape {tuple(cost.shape)}")
    if torch.compiler.is_compiling():
        raise RuntimeError("assignment (exact_ot) runs on the host and cannot be traced by torch.compile: "
                           "couple outside the compiled function (pass x0=...) or use sinkhorn_ot")
    c = cost.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(c).all()):
        raise ValueError("cost must be finite")
    rows = _hungarian(c.numpy())
    return torch.from_numpy(rows).to(cost.device)


def exact_ot(x0: Tensor, x1: Tensor, key: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Exact minibatch OT: ``(x0, x1[idx])`` with ``idx`` the permutation of least total squared distance.

    ``key`` is accepted for the coupling signature and not used. Host-side (see :func:`assignment`):
    for batches up to a few hundred points; use :func:`sinkhorn_ot` beyond, or inside ``torch.compile``.
    """
    _check_pair(x0, x1)
    _check_optional_key(key)
    if x0.shape[0] == 1:
        return x0, x1
    idx = assignment(squared_cost(x0.detach(), x1.detach()))
    return x0, x1[idx]


# ----------------------------------------------------------------------------- Sinkhorn


def sinkhorn(cost: Tensor, epsilon: float | Tensor = 0.05, n_iters: int = 100) -> Tensor:
    """The entropic OT plan's logarithm, ``log P: (n, m)``, uniform marginals ``1/n`` and ``1/m``.

    ``P = exp(-C/eps + f_i + g_j)`` after ``n_iters`` log-domain Sinkhorn iterations (each
    updating ``f`` then ``g``, so the column marginals are exact and the row marginals converge).
    Stable for any ``epsilon > 0``: nothing is exponentiated until the end. ``n_iters`` is a
    Python int (the loop is unrolled under ``torch.compile``).
    """
    n, m = cost.shape
    eps = epsilon.to(cost.dtype) if isinstance(epsilon, Tensor) else epsilon
    k = -cost / eps
    log_mu, log_nu = -math.log(n), -math.log(m)
    f = cost.new_zeros(n)
    g = cost.new_zeros(m)
    for _ in range(n_iters):
        f = log_mu - torch.logsumexp(k + g[None, :], dim=1)
        g = log_nu - torch.logsumexp(k + f[:, None], dim=0)
    return k + f[:, None] + g[None, :]


def sinkhorn_ot(x0: Tensor, x1: Tensor, key: Tensor | None = None, *, epsilon: float | Tensor = 0.05,
                n_iters: int = 100, mode: str = "sample") -> tuple[Tensor, Tensor]:
    """Entropic minibatch OT: ``(x0, x1[idx])``, ``idx_i`` from row ``i`` of the Sinkhorn plan.

    mode ``"sample"``: ``idx_i ~ P[i, :] / sum_j P[i, j]`` by the Gumbel-max trick with noise from
    ``key`` (required); ``"argmax"``: ``idx_i = argmax_j P[i, j]`` (deterministic, ``key`` unused).
    ``epsilon > 0``: the entropic regularisation relative to the batch's largest squared
    distance (small: close to exact OT, slower to converge; TorchEBM's default 0.05);
    ``n_iters >= 1``. Pure torch: runs on the tensors' device and under ``torch.compile``.
    """
    _check_pair(x0, x1)
    _check_optional_key(key)
    n_iters = _checks.check_int("n_iters", n_iters, 1)
    eps = _checks.tunable("epsilon", epsilon) if isinstance(epsilon, Tensor) else _checks.check_real("epsilon", epsilon)
    if not isinstance(eps, Tensor) and not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"epsilon must be a finite number > 0, got {eps}")
    if mode not in ("sample", "argmax"):
        raise ValueError(f"mode must be 'sample' or 'argmax', got {mode!r}")
    if mode == "sample" and key is None:
        raise ValueError("sinkhorn_ot(mode='sample') draws from the plan: pass key=")
    log_plan = sinkhorn(squared_cost(x0.detach(), x1.detach()), eps, n_iters)
    if mode == "argmax":
        idx = log_plan.argmax(1)
    else:
        u = fr.uniform(key, tuple(log_plan.shape), log_plan.dtype).to(log_plan.device)
        gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))
        idx = (log_plan + gumbel).argmax(1)
    return x0, x1[idx]
