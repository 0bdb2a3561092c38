"""What the simulation-free losses share: velocity fields as pytrees, training-time samplers.

A **field** is a callable of one sample, ``field(x, t) -> v`` (``x: event``, ``t: ()``, ``v:
event``) or, time-invariant, ``field(x) -> v``, and a pytree whose tensor leaves are its
parameters — the same contract as an fnebm energy, so ``torch.func.grad(loss)(field, ...)``
returns gradients shaped like the field and one compiled loss serves every parameter value.
:func:`bind_field` makes one from a pure ``field_fn(params, x, *args)``.

A **time sampler** is ``time(key, n, dtype) -> t: (n,)``, built by :func:`uniform_time` or
:func:`logit_normal_time` (or any function of that signature).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fnebm import _checks
from fnebm import random as fr

__all__ = ["BoundField", "bind_field", "uniform_time", "logit_normal_time", "mean_flat"]


@dataclass(frozen=True, eq=False)
class BoundField:
    """``field_fn`` with ``params`` fixed: ``f(x, *args) = field_fn(params, x, *args)``.

    For one sample, or, with ``batched=True``, for a whole batch in one call (``x: (n, *event)``,
    ``t: (n,)``): the losses then call it once instead of mapping it with ``vmap``, which lets a
    network use its fused batch kernels (``addmm``). A pytree: its leaves are those of
    ``params``; ``field_fn`` and ``batched`` are the context.
    """

    field_fn: Callable[..., Tensor]
    params: Any
    batched: bool = False

    def __call__(self, x: Tensor, *args: Tensor) -> Tensor:
        return self.field_fn(self.params, x, *args)


pytree.register_pytree_node(
    BoundField,
    lambda f: ([f.params], (f.field_fn, f.batched)),
    lambda children, context: BoundField(context[0], children[0], context[1]),
    flatten_with_keys_fn=lambda f: ([(pytree.GetAttrKey("params"), f.params)], (f.field_fn, f.batched)),
)


def bind_field(field_fn: Callable[..., Tensor], params: Any, *, batched: bool = False) -> BoundField:
    """Fix ``params`` of ``field_fn(params, x, t)`` (or ``field_fn(params, x)``): a field for the losses.

    ``batched=True``: ``field_fn`` takes a whole batch, ``x: (n, *event)``, ``t: (n,)``, and returns
    ``(n, *event)``, and must treat the samples independently (as ``vmap`` would).
    """
    _checks.check_callable("field_fn", field_fn, "(params, x, t) -> v for one sample")
    if not isinstance(batched, bool):
        raise TypeError(f"batched must be a bool, got {type(batched).__name__}")
    return BoundField(field_fn, params, batched)


def mean_flat(x: Tensor) -> Tensor:
    """``(n, *event) -> (n,)``: the mean over every axis but the first (TorchEBM's ``mean_flat``)."""
    return x.reshape(x.shape[0], -1).mean(1)


def _call(f: Callable, *args: Tensor) -> Tensor:
    return f(*args)


def _is_batched(f: Any) -> bool:
    while isinstance(f, functools.partial):
        f = f.args[0] if f.func is _autocast_call else f.func
    return isinstance(f, BoundField) and f.batched


def batched(f: Callable) -> Callable:
    """``f`` of one sample mapped over the leading axis of every argument (``vmap`` of a partial:
    see :func:`fnebm.losses._common.batched`); ``f`` itself for a ``bind_field(..., batched=True)``."""
    if _is_batched(f):
        return f
    return torch.func.vmap(functools.partial(_call, f))


def _autocast_call(model: Callable, dtype: torch.dtype, x: Tensor, *args: Tensor) -> Tensor:
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        out = model(x, *args)
    return out.to(x.dtype)


def with_autocast(model: Callable, dtype: torch.dtype | None) -> Callable:
    """``model`` (a field or an energy, any arguments) whose forward runs under ``torch.autocast(dtype)``,
    returning ``x``'s dtype; ``model`` itself if ``dtype`` is None."""
    return model if dtype is None else functools.partial(_autocast_call, model, dtype)


def _uniform(lo: float, hi: float, key: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    return lo + (hi - lo) * fr.uniform(key, (n,), dtype)


def uniform_time(eps: float = 0.0) -> Callable[[Tensor, int, torch.dtype], Tensor]:
    """``t ~ U[eps, 1 - eps]`` (TorchEBM's ``t_sampler="uniform"`` with ``train_eps=eps``)."""
    eps = _checks.check_real("eps", eps)
    if not 0.0 <= eps < 0.5:
        raise ValueError(f"eps must be in [0, 0.5), got {eps}")
    return functools.partial(_uniform, eps, 1.0 - eps)


def _logit_normal(mean: float, std: float, lo: float, hi: float, key: Tensor, n: int,
                  dtype: torch.dtype) -> Tensor:
    return torch.sigmoid(mean + std * fr.normal(key, (n,), dtype)).clamp(lo, hi)


def logit_normal_time(mean: float = 0.0, std: float = 1.0, eps: float = 0.0) -> Callable[[Tensor, int, torch.dtype], Tensor]:
    """``logit(t) ~ N(mean, std^2)``, clamped to ``[max(1e-4, eps), 1 - eps]``.

    TorchEBM's ``t_sampler="lognormal"`` (EDM's skew, ``t = 1 / (1 + exp(p_mean + p_std z))``)
    is this with ``mean = -p_mean``, ``std = p_std``: its defaults ``p_mean = -1.2``,
    ``p_std = 1.2`` are ``logit_normal_time(1.2, 1.2)``.
    """
    mean, std, eps = (_checks.check_real(n, v) for n, v in (("mean", mean), ("std", std), ("eps", eps)))
    if not std > 0:
        raise ValueError(f"std must be > 0, got {std}")
    if not 0.0 <= eps < 0.5:
        raise ValueError(f"eps must be in [0, 0.5), got {eps}")
    return functools.partial(_logit_normal, mean, std, max(1e-4, eps), 1.0 - eps)


def check_field(name: str, model: Any) -> None:
    _checks.check_callable(name, model, "x, t -> v for one sample (losses.bind_field(field_fn, params))")


def check_time(time: Any) -> Callable:
    if time is None:
        return uniform_time()
    _checks.check_callable("time", time, "(key, n, dtype) -> t: (n,) (losses.uniform_time(), logit_normal_time())")
    return time


def check_coupling(coupling: Any) -> Callable | None:
    if coupling is None:
        return None
    _checks.check_callable("coupling", coupling, "(x0, x1, key) -> (x0, x1') (e.g. fnebm.couplings.exact_ot)")
    return coupling


def check_interpolant(interpolant: Any):
    from fnebm import interpolants

    if interpolant is None:
        return interpolants.linear()
    if not isinstance(interpolant, interpolants.Interpolant):
        raise TypeError(f"interpolant must be an fnebm.interpolants.Interpolant (e.g. interpolants.linear()), "
                        f"got {type(interpolant).__name__}")
    return interpolant


def check_source(x0: Any, batch: Tensor) -> Tensor:
    if not isinstance(x0, Tensor):
        raise TypeError(f"x0 must be a tensor like the batch {tuple(batch.shape)}, got {type(x0).__name__}")
    if x0.shape != batch.shape or x0.dtype != batch.dtype or x0.device != batch.device:
        raise ValueError(f"x0 must have the batch's shape, dtype and device {tuple(batch.shape)}, {batch.dtype}, "
                         f"{batch.device}; got {tuple(x0.shape)}, {x0.dtype}, {x0.device}")
    return x0


def pairs(batch: Tensor, key: Tensor, x0: Tensor | None, coupling: Callable | None,
          time: Callable) -> tuple[Tensor, Tensor, Tensor]:
    """``(x0, x1, t)``: noise (or the given source), the data coupled to it, training times.

    ``key`` is split as ``k_noise, k_couple, k_time = split(key, 3)``.
    """
    k_noise, k_couple, k_time = fr.split(key, 3)
    if x0 is None:
        x0 = fr.normal(k_noise, tuple(batch.shape), batch.dtype)
    x1 = batch
    if coupling is not None:
        x0, x1 = coupling(x0, x1, k_couple)
    t = time(k_time, batch.shape[0], batch.dtype)
    return x0, x1, t
