"""What every loss shares: the argument checks, batched energies, opt-in autocast, stop-gradient.

An energy here is what :mod:`fnebm.energies` makes: a callable of one sample ``x: event ->
()`` and a pytree whose tensor leaves are its parameters (an analytic family, or a neural
network as ``energies.bind(energy_fn, params)``). The loss's ``params`` argument *is* the
energy, so ``torch.func.grad(loss)(energy, batch, key)`` returns an energy-shaped pytree of
gradients.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fnebm import _checks
from fnebm import random as fr

__all__ = [
    "check_energy",
    "check_batch",
    "check_fits",
    "checked",
    "check_loss_key",
    "check_autocast",
    "with_autocast",
    "batched",
    "stop_gradient",
]


def check_energy(energy: Any) -> None:
    _checks.check_callable(
        "energy", energy, "x -> E(x) for one sample (an fnebm energy, or energies.bind(energy_fn, params))"
    )


def check_batch(batch: Any, name: str = "batch") -> Tensor:
    """A floating tensor ``(n, *event)`` with ``n >= 1``; finite where concrete."""
    if not isinstance(batch, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (n, *event), got {type(batch).__name__}")
    if not batch.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {batch.dtype}")
    if batch.ndim < 1 or batch.shape[0] == 0:
        raise ValueError(f"{name} must have shape (n, *event) with n >= 1, got shape {tuple(batch.shape)}")
    if _checks.is_concrete(batch) and not bool(torch.isfinite(batch).all()):
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    return batch


def check_fits(energy: Any, batch: Tensor) -> None:
    """The batch fits the energy, as a sampler's ``init`` checks a position: the energy's dtype and
    device where it has parameters, and for fnebm's energies (which take one vector ``(dim,)``) the
    batch's shape ``(n, dim)``. Metadata only."""
    try:
        dtype, device = getattr(energy, "dtype", None), getattr(energy, "device", None)
    except Exception:  # an energy whose dtype cannot be told (no tensor parameters) is not checked here
        dtype = device = None
    if isinstance(dtype, torch.dtype) and batch.dtype != dtype:
        raise TypeError(f"batch has dtype {batch.dtype} but the energy's parameters are {dtype}; convert one of "
                        f"them (e.g. energy.to(dtype={batch.dtype}))")
    if isinstance(device, torch.device) and batch.device.type != device.type:
        raise ValueError(f"batch is on {batch.device} but the energy's parameters are on {device}; move one of "
                         f"them (e.g. energy.to(device='{batch.device}'))")
    check_dim = getattr(energy, "check_dim", None)
    if callable(check_dim):
        if batch.ndim != 2:
            raise ValueError(f"batch must have shape (n, dim) for this energy, which takes one vector (dim,) per "
                             f"sample, got shape {tuple(batch.shape)}")
        try:
            check_dim(batch.shape[1])
        except ValueError as e:
            raise ValueError(f"batch of shape {tuple(batch.shape)} does not fit the energy: {e}") from None


_ONE_SAMPLE = ("an energy takes one sample x and returns a 0-dim energy; a batched energy E(X: (n, d)) -> (n,) "
               "can be wrapped as lambda x: E(x[None])[0]")


def _energy_value(value: Any, x: Tensor) -> Tensor:
    # metadata only: under vmap and compile these are the shapes of one sample, known at trace time
    if not isinstance(value, Tensor):
        raise TypeError(f"energy must return a 0-dim tensor, got {type(value).__name__}; {_ONE_SAMPLE}")
    if value.ndim != 0:
        raise ValueError(f"energy must return a 0-dim energy for one sample, got shape {tuple(value.shape)} for a "
                         f"sample of shape {tuple(x.shape)}; {_ONE_SAMPLE}")
    if not value.is_floating_point():
        raise TypeError(f"energy must return a floating tensor, got dtype {value.dtype}")
    return value


def _checked_call(energy: Callable[[Tensor], Tensor], dtype: torch.dtype | None, x: Tensor) -> Tensor:
    if dtype is None:
        return _energy_value(energy(x), x)
    return _energy_value(_autocast_value(energy, dtype, x), x).to(x.dtype)


def checked(energy: Callable[[Tensor], Tensor], dtype: torch.dtype | None = None) -> Callable[[Tensor], Tensor]:
    """``energy`` (forward under ``torch.autocast(dtype)`` when given) whose every call checks that it
    returned one floating 0-dim energy: the loss's own evaluations, so a batched energy or one that
    returns a vector gets a ``ValueError`` naming ``energy``, not a ``torch.func`` error. A
    ``functools.partial``, so the energy's tensors stay visible to :func:`fnebm.chain.run`."""
    return functools.partial(_checked_call, energy, dtype)


def check_loss_key(key: Any) -> None:
    """One key ``(2,)``: a loss draws all its randomness from it."""
    fr.check_key(key)
    if key.shape != (2,):
        raise ValueError(f"key must be one key of shape (2,), got shape {tuple(key.shape)}")


def check_autocast(autocast: Any) -> torch.dtype | None:
    if autocast is None:
        return None
    if not isinstance(autocast, torch.dtype) or not autocast.is_floating_point:
        raise TypeError(f"autocast must be None or a floating torch.dtype (e.g. torch.bfloat16), got {autocast!r}")
    return autocast


def _autocast_value(energy: Callable[[Tensor], Tensor], dtype: torch.dtype, x: Tensor) -> Any:
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        return energy(x)


def _autocast_call(energy: Callable[[Tensor], Tensor], dtype: torch.dtype, x: Tensor) -> Tensor:
    # Only the energy's forward runs under autocast; its value (and so dE/dx, by autograd) comes
    # back in the dtype of x, so the sampler's update and the loss's reductions stay in float32.
    return _autocast_value(energy, dtype, x).to(x.dtype)


def with_autocast(energy: Callable[[Tensor], Tensor], dtype: torch.dtype | None) -> Callable[[Tensor], Tensor]:
    """``energy`` whose forward runs under ``torch.autocast(dtype)``, returning ``x``'s dtype; ``energy`` if ``None``.

    A ``functools.partial``, so the energy's tensors stay visible to :func:`fnebm.chain.run`.
    """
    return energy if dtype is None else functools.partial(_autocast_call, energy, dtype)


def _call(energy: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    return energy(x)


def batched(energy: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``(n, *event) -> (n,)``: the energy mapped over the leading axis.

    ``vmap`` of a ``partial``, not of the energy object itself: under Dynamo, ``vmap`` reads its
    function's name, which for a dataclass energy means ``repr``, which Dynamo cannot trace.
    """
    return torch.func.vmap(functools.partial(_call, energy))


def stop_gradient(tree: Any) -> Any:
    """Every tensor leaf detached: a pytree (an energy) through which no gradient flows,
    under ``torch.autograd`` and ``torch.func.grad`` alike."""
    return pytree.tree_map_only(Tensor, torch.Tensor.detach, tree)


def nonnegative(name: str, value: Any) -> Tensor | float:
    """A number or floating tensor ``>= 0`` (checked where concrete); numbers stay Python floats."""
    if isinstance(value, Tensor):
        return _checks.tunable(name, value, allow_zero=True)
    v = _checks.check_real(name, value)
    if not v >= 0 or v == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {v}")
    return v
