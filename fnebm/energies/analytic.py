"""The analytic families, each class beside its constructor.

Classes hold parameters as tensors and do no checks (they are rebuilt by pytree
unflattening under ``torch.func``); constructors are the checked boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from fnebm import _checks
from fnebm.energies.base import Energy, _cholesky, _positive, _resolve, _scalar, _tensor

__all__ = [
    "Gaussian",
    "gaussian",
    "DoubleWell",
    "double_well",
    "Rosenbrock",
    "rosenbrock",
    "Harmonic",
    "harmonic",
    "Rastrigin",
    "rastrigin",
    "Ackley",
    "ackley",
]


# ------------------------------------------------------------------------------ Gaussian


_UNSET: Any = object()


@dataclass(frozen=True, eq=False, init=False)
class Gaussian(Energy):
    """``E(x) = 0.5 (x - mean)^T P (x - mean)`` (unnormalised), with ``P = L L^T``.

    ``mean: (d,)``; ``precision_tril``: the lower Cholesky factor ``L`` of the precision ``P``,
    ``(d, d)``, or ``(d,)`` (the square roots of a diagonal ``P``). ``L`` is the only
    parameter besides the mean: ``precision`` is derived from it when read, so training ``L``
    moves the energy, ``grad`` and ``precision`` together. The energy is
    ``0.5 |L^T (x - mean)|^2``, never negative.

    ``Gaussian(mean, precision_tril)``; the older ``Gaussian(mean, precision, precision_tril)``
    is still accepted, and its ``precision`` (``L L^T`` by definition) is dropped.
    """

    mean: Tensor
    precision_tril: Tensor
    name: ClassVar[str] = "gaussian"

    def __init__(self, mean: Tensor, *args: Tensor, precision_tril: Tensor = _UNSET) -> None:
        # no value checks (unflattening calls this with whatever torch.func hands back); the
        # arity is the signature's, as for any function
        if precision_tril is _UNSET and len(args) in (1, 2):
            precision_tril = args[-1]
        elif args or precision_tril is _UNSET:
            raise TypeError("Gaussian takes (mean, precision_tril) (or the older (mean, precision, "
                            f"precision_tril)), got {1 + len(args)} positional argument(s)"
                            + ("" if precision_tril is _UNSET else " and precision_tril="))
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "precision_tril", precision_tril)

    @property
    def is_diagonal(self) -> bool:
        return self.precision_tril.ndim == 1

    @property
    def dim(self) -> int:
        return self.mean.shape[0]

    @property
    def precision(self) -> Tensor:
        """``P = L L^T``: ``(d, d)``, or ``(d,)`` when diagonal. Computed on each read (a matmul for a full ``L``)."""
        tril = self.precision_tril
        return tril * tril if self.is_diagonal else tril @ tril.mT

    def __call__(self, x: Tensor) -> Tensor:
        delta = x - self.mean
        # shape-static branch: traced once, no graph break
        y = delta * self.precision_tril if self.is_diagonal else delta @ self.precision_tril
        return 0.5 * (y * y).sum(-1)

    def grad(self, x: Tensor) -> Tensor:
        # P (x - mean) = L (L^T (x - mean)): two matvecs with L, no d x d product formed
        delta = x - self.mean
        tril = self.precision_tril
        # (delta @ L) @ L^T written with transpose(): the .mT property of a parameter inside a
        # compiled scan is lifted as a second input aliasing the first, which scan refuses
        return delta * (tril * tril) if self.is_diagonal else (delta @ tril) @ tril.transpose(-2, -1)


def gaussian(mean: Any, cov: Any = None, precision: Any = None, *, dtype=None, device=None) -> Gaussian:
    """Gaussian energy ``0.5 (x - mean)^T P (x - mean)``.

    mean: ``(d,)``. Give at most one of ``cov`` or ``precision`` (``P``), each ``(d, d)``
    symmetric positive definite or ``(d,)`` positive diagonal; neither means identity.
    Values (finite, positive, symmetric, positive definite) are checked where concrete.
    """
    if cov is not None and precision is not None:
        raise ValueError("give at most one of cov and precision, not both")
    dtype, device = _resolve(dtype, device, mean, cov, precision)
    mean = _tensor("mean", mean, (1,), dtype, device)
    d = mean.shape[0]
    if d == 0:
        raise ValueError("mean must have at least one element, got shape (0,)")
    if cov is None and precision is None:
        return Gaussian(mean, torch.ones(d, dtype=dtype, device=device))
    arg_name, m = ("cov", cov) if cov is not None else ("precision", precision)
    m = _tensor(arg_name, m, (1, 2), dtype, device)
    want = (d,) if m.ndim == 1 else (d, d)
    if tuple(m.shape) != want:
        raise ValueError(f"{arg_name} must have shape {want} to match mean of shape ({d},), got {tuple(m.shape)}")
    if m.ndim == 1:
        prec = 1 / _positive(arg_name, m) if cov is not None else _positive(arg_name, m)
        return Gaussian(mean, prec.sqrt())
    tril = _cholesky(arg_name, m)
    if cov is None:
        return Gaussian(mean, tril)
    prec = torch.cholesky_inverse(tril)
    prec = 0.5 * (prec + prec.mT)
    prec_tril, info = torch.linalg.cholesky_ex(prec)
    if _checks.is_concrete(info) and bool(info != 0):
        raise ValueError("cov is too ill-conditioned to invert in this dtype")
    return Gaussian(mean, prec_tril)


# ---------------------------------------------------------------------------- DoubleWell


@dataclass(frozen=True, eq=False)
class DoubleWell(Energy):
    """``E(x) = h * sum_i (x_i^2 - b^2)^2``; wells at ``x_i = +-b`` (TorchEBM's DoubleWellModel)."""

    barrier_height: Tensor
    b: Tensor
    name: ClassVar[str] = "double_well"

    def __call__(self, x: Tensor) -> Tensor:
        return self.barrier_height * ((x * x - self.b**2) ** 2).sum(-1)

    def grad(self, x: Tensor) -> Tensor:
        return 4 * self.barrier_height * x * (x * x - self.b**2)


def double_well(barrier_height: Any = 2.0, b: Any = 1.0, *, dtype=None, device=None) -> DoubleWell:
    """Double well ``h * sum_i (x_i^2 - b^2)^2``: ``barrier_height > 0``, ``b`` finite."""
    dtype, device = _resolve(dtype, device, barrier_height, b)
    return DoubleWell(
        _scalar("barrier_height", barrier_height, dtype, device, positive=True),
        _scalar("b", b, dtype, device),
    )


# ---------------------------------------------------------------------------- Rosenbrock


@dataclass(frozen=True, eq=False)
class Rosenbrock(Energy):
    """``E(x) = sum_{i<n} b (x_{i+1} - x_i^2)^2 + (a - x_i)^2``; dim >= 2."""

    a: Tensor
    b: Tensor
    name: ClassVar[str] = "rosenbrock"
    min_dim: ClassVar[int] = 2

    def __call__(self, x: Tensor) -> Tensor:
        head, tail = x[..., :-1], x[..., 1:]
        return (self.b * (tail - head * head) ** 2 + (self.a - head) ** 2).sum(-1)

    def grad(self, x: Tensor) -> Tensor:
        head, tail = x[..., :-1], x[..., 1:]
        r = tail - head * head
        # x_i appears as the head of term i and as the tail of term i-1
        as_head = -4 * self.b * head * r - 2 * (self.a - head)
        as_tail = 2 * self.b * r
        return nn.functional.pad(as_head, (0, 1)) + nn.functional.pad(as_tail, (1, 0))


def rosenbrock(a: Any = 1.0, b: Any = 100.0, *, dtype=None, device=None) -> Rosenbrock:
    """Rosenbrock ``sum_{i<n} b (x_{i+1} - x_i^2)^2 + (a - x_i)^2``: ``a`` finite, ``b > 0``; dim >= 2."""
    dtype, device = _resolve(dtype, device, a, b)
    return Rosenbrock(_scalar("a", a, dtype, device), _scalar("b", b, dtype, device, positive=True))


# ------------------------------------------------------------------------------ Harmonic


@dataclass(frozen=True, eq=False)
class Harmonic(Energy):
    """``E(x) = 0.5 k |x|^2``."""

    k: Tensor
    name: ClassVar[str] = "harmonic"

    def __call__(self, x: Tensor) -> Tensor:
        return 0.5 * self.k * (x * x).sum(-1)

    def grad(self, x: Tensor) -> Tensor:
        return self.k * x


def harmonic(k: Any = 1.0, *, dtype=None, device=None) -> Harmonic:
    """Harmonic ``0.5 k |x|^2``: ``k > 0``."""
    dtype, device = _resolve(dtype, device, k)
    return Harmonic(_scalar("k", k, dtype, device, positive=True))


# ----------------------------------------------------------------------------- Rastrigin


@dataclass(frozen=True, eq=False)
class Rastrigin(Energy):
    """``E(x) = a n + sum_i (x_i^2 - a cos(2 pi x_i))``."""

    a: Tensor
    name: ClassVar[str] = "rastrigin"

    def __call__(self, x: Tensor) -> Tensor:
        return self.a * x.shape[-1] + (x * x - self.a * torch.cos(2 * math.pi * x)).sum(-1)

    def grad(self, x: Tensor) -> Tensor:
        return 2 * x + 2 * math.pi * self.a * torch.sin(2 * math.pi * x)


def rastrigin(a: Any = 10.0, *, dtype=None, device=None) -> Rastrigin:
    """Rastrigin ``a n + sum_i (x_i^2 - a cos(2 pi x_i))``: ``a >= 0``."""
    dtype, device = _resolve(dtype, device, a)
    return Rastrigin(_scalar("a", a, dtype, device, nonnegative=True))


# -------------------------------------------------------------------------------- Ackley


def _safe_rms(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(sqrt(mean(x^2)), mean(x^2) > 0)`` with a zero (not NaN) gradient at ``x = 0``."""
    ms = (x * x).mean(-1)
    pos = ms > 0
    # double where: the untaken sqrt branch never sees 0, so its backward is never inf * 0
    return torch.where(pos, torch.sqrt(torch.where(pos, ms, 1.0)), 0.0), pos


@dataclass(frozen=True, eq=False)
class Ackley(Energy):
    """``E(x) = -a exp(-b sqrt(mean(x^2))) - exp(mean(cos(c x))) + a + e`` (TorchEBM's AckleyModel).

    Finite everywhere, with gradient 0 at ``x = 0`` (the cone's tip), from ``grad`` and autograd.
    """

    a: Tensor
    b: Tensor
    c: Tensor
    name: ClassVar[str] = "ackley"

    def __call__(self, x: Tensor) -> Tensor:
        rms, _ = _safe_rms(x)
        return (
            -self.a * torch.exp(-self.b * rms)
            - torch.exp(torch.cos(self.c * x).mean(-1))
            + self.a
            + math.e
        )

    def grad(self, x: Tensor) -> Tensor:
        n = x.shape[-1]
        rms, pos = _safe_rms(x)
        # d rms / dx = x / (n rms); taken as 0 at the tip
        safe_rms = torch.where(pos, rms, 1.0)
        radial = torch.where(pos, self.a * self.b * torch.exp(-self.b * rms) / (n * safe_rms), 0.0)
        wave = torch.exp(torch.cos(self.c * x).mean(-1)) * self.c / n
        return radial[..., None] * x + wave[..., None] * torch.sin(self.c * x)


def ackley(a: Any = 20.0, b: Any = 0.2, c: Any = 2 * math.pi, *, dtype=None, device=None) -> Ackley:
    """Ackley ``-a exp(-b rms(x)) - exp(mean(cos(c x))) + a + e``: ``a >= 0``, ``b > 0``, ``c`` finite."""
    dtype, device = _resolve(dtype, device, a, b, c)
    return Ackley(
        _scalar("a", a, dtype, device, nonnegative=True),
        _scalar("b", b, dtype, device, positive=True),
        _scalar("c", c, dtype, device),
    )
