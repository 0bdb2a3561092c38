"""Flow matching: regress a time-conditioned velocity field on the interpolant's velocity.

``L = mean_i mean_event |v(x_t, t) - u_t|^2`` with ``x_t = alpha(t) x1 + sigma(t) x0`` and
``u_t = alpha'(t) x1 + sigma'(t) x0`` (:func:`fnebm.interpolants.interpolate`), ``x0 ~ N(0, I)``
(or a given source batch) paired with the data ``x1`` by a coupling (independent by default;
:func:`fnebm.couplings.exact_ot` for OT-CFM), and ``t`` from a time sampler (uniform by
default). TorchEBM's ``FlowMatchingLoss`` with the same interpolant, coupling and time
distribution computes the same quantity (its ``mean_flat``, then the batch mean).

Sample the trained field by integrating ``dx/dt = v(x, t)`` from ``t = 0`` (noise) to 1 (data).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from fnebm.interpolants import Interpolant, interpolate
from fnebm.losses import _common, _generative

__all__ = ["FlowMatchingAux", "flow_matching"]


class FlowMatchingAux(NamedTuple):
    """per_sample: ``(n,)`` each pair's squared error, averaged over the event; t: ``(n,)`` the times (detached)."""

    per_sample: Tensor
    t: Tensor


def flow_matching(
    model: Callable[[Tensor, Tensor], Tensor],
    batch: Tensor,
    key: Tensor,
    *,
    interpolant: Interpolant | None = None,
    coupling: Callable | None = None,
    time: Callable | None = None,
    x0: Tensor | None = None,
    negate: bool = False,
    autocast: torch.dtype | None = None,
) -> tuple[Tensor, FlowMatchingAux]:
    """Conditional flow matching: ``mean_i mean_event |model(x_t_i, t_i) - u_t_i|^2``.

    Args:
        model: the velocity field and the parameters being learned, ``model(x, t) -> v`` for
            one sample (``x, v: event``, ``t: ()``), a pytree whose leaves are its parameters
            (``losses.bind_field(field_fn, params)``). Mapped over the batch with ``vmap``.
        batch: data ``x1: (n, *event)``.
        key: one key ``(2,)``, split as ``k_noise, k_couple, k_time = split(key, 3)``.
        interpolant: the path (default :func:`fnebm.interpolants.linear`: ``u_t = x1 - x0``).
        coupling: ``(x0, x1, key) -> (x0, x1')``; default none (independent pairs). E.g.
            :func:`fnebm.couplings.exact_ot` (host-side, outside ``torch.compile``) or
            ``functools.partial(couplings.sinkhorn_ot, epsilon=0.05)``.
        time: ``(key, n, dtype) -> t``; default :func:`uniform_time` ``U[0, 1]``;
            :func:`logit_normal_time` for SD3's logit-normal.
        x0: the source batch (default: ``N(0, I)`` from ``k_noise``), e.g. another data set.
        negate: regress on ``-u_t`` (TorchEBM's ``negate_velocity=True``: the sign of a
            gradient field, data to noise).
        autocast: run the model's forward under ``torch.autocast(dtype)``.

    Returns:
        ``(loss, FlowMatchingAux)``; the loss is 0-dim in the batch's dtype.
    """
    _generative.check_field("model", model)
    batch = _common.check_batch(batch)
    _common.check_loss_key(key)
    interpolant = _generative.check_interpolant(interpolant)
    coupling = _generative.check_coupling(coupling)
    time = _generative.check_time(time)
    if x0 is not None:
        x0 = _generative.check_source(x0, batch)
    if not isinstance(negate, bool):
        raise TypeError(f"negate must be a bool, got {type(negate).__name__}")
    dtype = _common.check_autocast(autocast)
    x0, x1, t = _generative.pairs(batch, key, x0, coupling, time)
    xt, ut = interpolate(interpolant, x0, x1, t)
    target = -ut if negate else ut
    pred = _generative.batched(_generative.with_autocast(model, dtype))(xt, t)
    per = _generative.mean_flat((pred - target) ** 2)
    return per.mean(), FlowMatchingAux(per.detach(), t.detach())

