"""Pure energy functions ``E(x) -> scalar`` for one sample ``x: (dim,)``.

Chains come from ``torch.func.vmap``; gradients from ``torch.func.grad`` or, for the
analytic families, the closed-form ``grad`` method. Every ``__call__`` and ``grad`` is
free of host syncs and data-dependent Python branches, so it traces under
``torch.compile(fullgraph=True)``. Constructors validate once (they may sync with the
host: they are a boundary); calls carry no checks.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

__all__ = [
    "Energy",
    "Gaussian",
    "DoubleWell",
    "Rosenbrock",
    "Harmonic",
    "Rastrigin",
    "Ackley",
    "GaussianMixture",
    "BoundEnergy",
    "gaussian",
    "double_well",
    "rosenbrock",
    "harmonic",
    "rastrigin",
    "ackley",
    "gaussian_mixture",
    "from_module",
    "bind",
]

_LOG_2PI = math.log(2 * math.pi)


def _check_dim_arg(d: Any) -> None:
    if isinstance(d, bool) or not isinstance(d, numbers.Integral):
        raise TypeError(f"dim must be an int, got {type(d).__name__}")
    if d < 1:
        raise ValueError(f"dim must be >= 1, got {d}")


# ---------------------------------------------------------------------------- protocol


# eq=False: field-wise == on tensors is ambiguous; identity equality/hash is what
# dict keys, caches and torch.compile guards need.
@dataclass(frozen=True, eq=False)
class Energy:
    """Base of the analytic families: a frozen dataclass of tensor parameters.

    ``e(x)``: ``x: (dim,)`` -> 0-dim energy. ``e.grad(x)``: closed-form ``dE/dx``, ``(dim,)``.
    Batch with ``torch.func.vmap(e)``: ``(n, dim) -> (n,)``.
    """

    name: ClassVar[str] = "energy"
    min_dim: ClassVar[int] = 1

    def __call__(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def grad(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _tensors(self) -> list[Tensor]:
        return [v for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name), Tensor)]

    @property
    def dtype(self) -> torch.dtype:
        return self._tensors()[0].dtype

    @property
    def device(self) -> torch.device:
        return self._tensors()[0].device

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Energy:
        """A copy with every tensor parameter on ``device`` / in ``dtype`` (``None`` keeps it)."""
        dtype = _check_dtype(dtype)
        return dataclasses.replace(
            self,
            **{
                f.name: v.to(device=device, dtype=dtype)
                for f in dataclasses.fields(self)
                if isinstance(v := getattr(self, f.name), Tensor)
            },
        )

    @property
    def dim(self) -> int | None:
        """The one dimension this energy takes, or ``None`` if it takes any (>= ``min_dim``)."""
        return None

    def check_dim(self, d: int) -> None:
        """Raise ``ValueError`` unless a sample of shape ``(d,)`` is valid input."""
        _check_dim_arg(d)
        if self.dim is not None and d != self.dim:
            raise ValueError(f"{self.name} takes dim == {self.dim}, got dim={d}")
        if d < self.min_dim:
            raise ValueError(f"{self.name} takes dim >= {self.min_dim}, got dim={d}")


# ----------------------------------------------------------------------------- families


@dataclass(frozen=True, eq=False)
class Gaussian(Energy):
    """``E(x) = 0.5 (x - mean)^T P (x - mean)`` (unnormalised).

    ``mean: (d,)``; ``precision``: ``(d, d)`` full or ``(d,)`` diagonal;
    ``precision_tril``: lower Cholesky factor ``L`` of ``P = L L^T`` (``(d,)`` sqrt of the
    diagonal when diagonal), so the energy is ``0.5 |L^T (x - mean)|^2``, never negative.
    """

    mean: Tensor
    precision: Tensor
    precision_tril: Tensor = field(repr=False)
    name: ClassVar[str] = "gaussian"

    @property
    def is_diagonal(self) -> bool:
        return self.precision.ndim == 1

    @property
    def dim(self) -> int:
        return self.mean.shape[0]

    def __call__(self, x: Tensor) -> Tensor:
        delta = x - self.mean
        # shape-static branch: traced once, no graph break
        y = delta * self.precision_tril if self.is_diagonal else delta @ self.precision_tril
        return 0.5 * (y * y).sum(-1)

    def grad(self, x: Tensor) -> Tensor:
        delta = x - self.mean
        return delta * self.precision if self.is_diagonal else delta @ self.precision


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


@dataclass(frozen=True, eq=False)
class Harmonic(Energy):
    """``E(x) = 0.5 k |x|^2``."""

    k: Tensor
    name: ClassVar[str] = "harmonic"

    def __call__(self, x: Tensor) -> Tensor:
        return 0.5 * self.k * (x * x).sum(-1)

    def grad(self, x: Tensor) -> Tensor:
        return self.k * x


@dataclass(frozen=True, eq=False)
class Rastrigin(Energy):
    """``E(x) = a n + sum_i (x_i^2 - a cos(2 pi x_i))``."""

    a: Tensor
    name: ClassVar[str] = "rastrigin"

    def __call__(self, x: Tensor) -> Tensor:
        return self.a * x.shape[-1] + (x * x - self.a * torch.cos(2 * math.pi * x)).sum(-1)

    def grad(self, x: Tensor) -> Tensor:
        return 2 * x + 2 * math.pi * self.a * torch.sin(2 * math.pi * x)


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


@dataclass(frozen=True, eq=False)
class GaussianMixture(Energy):
    """``E(x) = -log sum_k w_k N(x; means_k, diag(scales_k^2))``, normalised.

    ``means, scales: (K, d)``; ``weights: (K,)`` summing to 1; ``log_coef: (K,)`` is
    ``log w_k - sum_j log scales_kj - d/2 log(2 pi)``, precomputed.
    """

    means: Tensor
    scales: Tensor
    weights: Tensor
    log_coef: Tensor = field(repr=False)
    name: ClassVar[str] = "gaussian_mixture"

    @property
    def dim(self) -> int:
        return self.means.shape[-1]

    def _z_logp(self, x: Tensor) -> tuple[Tensor, Tensor]:
        z = (x[..., None, :] - self.means) / self.scales  # (K, d)
        return z, self.log_coef - 0.5 * (z * z).sum(-1)  # (K,)

    def __call__(self, x: Tensor) -> Tensor:
        return -torch.logsumexp(self._z_logp(x)[1], -1)

    def grad(self, x: Tensor) -> Tensor:
        z, logp = self._z_logp(x)
        resp = torch.softmax(logp, -1)  # responsibilities p(k | x)
        return (resp[..., None] * z / self.scales).sum(-2)


# --------------------------------------------------------------------------- validation


def _check_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    return dtype


def _resolve(dtype: Any, device: Any, *args: Any) -> tuple[torch.dtype, torch.device]:
    """dtype/device given, else those of the tensor arguments, else torch's defaults."""
    dtype = _check_dtype(dtype)
    tensors = [a for a in args if isinstance(a, Tensor)]
    if dtype is None:
        floats = [t.dtype for t in tensors if t.dtype.is_floating_point]
        dtype = floats[0] if floats else torch.get_default_dtype()
        for d in floats[1:]:
            dtype = torch.promote_types(dtype, d)
    if device is None:
        device = tensors[0].device if tensors else torch.get_default_device()
    return dtype, torch.device(device)


def _tensor(name: str, value: Any, ndims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``value`` as a finite tensor of one of ``ndims`` dimensions, or TypeError/ValueError naming it."""
    want = " or ".join(f"{n}-D" for n in ndims)
    bad = TypeError(f"{name} must be a real number or a {want} real tensor, got {type(value).__name__}")
    if value is None or isinstance(value, (bool, str, bytes)):
        raise bad
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise bad from None
    if t.dtype == torch.bool or t.is_complex():
        raise bad
    if t.ndim not in ndims:
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    t = t.to(dtype=dtype, device=device)
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    return t


def _scalar(name: str, value: Any, dtype: torch.dtype, device: torch.device, positive: bool = False,
            nonnegative: bool = False) -> Tensor:
    t = _tensor(name, value, (0,), dtype, device)
    if positive and not t > 0:
        raise ValueError(f"{name} must be a finite number > 0, got {t.item()}")
    if nonnegative and not t >= 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {t.item()}")
    return t


def _positive(name: str, t: Tensor) -> Tensor:
    if not (t > 0).all():
        raise ValueError(f"{name} must be > 0 everywhere")
    return t


def _cholesky(name: str, m: Tensor) -> Tensor:
    """Lower Cholesky factor of a symmetric positive-definite ``m: (d, d)``."""
    scale = m.abs().max()
    if not torch.allclose(m, m.mT, rtol=1e-5, atol=1e-6 * float(scale)):
        raise ValueError(f"{name} must be symmetric")
    tril, info = torch.linalg.cholesky_ex(m)
    if info != 0:
        raise ValueError(f"{name} must be positive definite")
    return tril


# --------------------------------------------------------------------------- constructors


def gaussian(mean: Any, cov: Any = None, precision: Any = None, *, dtype=None, device=None) -> Gaussian:
    """Gaussian energy ``0.5 (x - mean)^T P (x - mean)``.

    mean: ``(d,)``. Give at most one of ``cov`` or ``precision`` (``P``), each ``(d, d)``
    symmetric positive definite or ``(d,)`` positive diagonal; neither means identity.
    """
    if cov is not None and precision is not None:
        raise ValueError("give at most one of cov and precision, not both")
    dtype, device = _resolve(dtype, device, mean, cov, precision)
    mean = _tensor("mean", mean, (1,), dtype, device)
    d = mean.shape[0]
    if d == 0:
        raise ValueError("mean must have at least one element, got shape (0,)")
    if cov is None and precision is None:
        prec = torch.ones(d, dtype=dtype, device=device)
        return Gaussian(mean, prec, prec)
    arg_name, m = ("cov", cov) if cov is not None else ("precision", precision)
    m = _tensor(arg_name, m, (1, 2), dtype, device)
    want = (d,) if m.ndim == 1 else (d, d)
    if tuple(m.shape) != want:
        raise ValueError(f"{arg_name} must have shape {want} to match mean of shape ({d},), got {tuple(m.shape)}")
    if m.ndim == 1:
        prec = 1 / _positive(arg_name, m) if cov is not None else _positive(arg_name, m)
        return Gaussian(mean, prec, prec.sqrt())
    tril = _cholesky(arg_name, m)
    if cov is None:
        return Gaussian(mean, 0.5 * (m + m.mT), tril)
    prec = torch.cholesky_inverse(tril)
    prec = 0.5 * (prec + prec.mT)
    prec_tril, info = torch.linalg.cholesky_ex(prec)
    if info != 0:
        raise ValueError("cov is too ill-conditioned to invert in this dtype")
    return Gaussian(mean, prec, prec_tril)


def double_well(barrier_height: Any = 2.0, b: Any = 1.0, *, dtype=None, device=None) -> DoubleWell:
    """Double well ``h * sum_i (x_i^2 - b^2)^2``: ``barrier_height > 0``, ``b`` finite."""
    dtype, device = _resolve(dtype, device, barrier_height, b)
    return DoubleWell(
        _scalar("barrier_height", barrier_height, dtype, device, positive=True),
        _scalar("b", b, dtype, device),
    )


def rosenbrock(a: Any = 1.0, b: Any = 100.0, *, dtype=None, device=None) -> Rosenbrock:
    """Rosenbrock ``sum_{i<n} b (x_{i+1} - x_i^2)^2 + (a - x_i)^2``: ``a`` finite, ``b > 0``; dim >= 2."""
    dtype, device = _resolve(dtype, device, a, b)
    return Rosenbrock(_scalar("a", a, dtype, device), _scalar("b", b, dtype, device, positive=True))


def harmonic(k: Any = 1.0, *, dtype=None, device=None) -> Harmonic:
    """Harmonic ``0.5 k |x|^2``: ``k > 0``."""
    dtype, device = _resolve(dtype, device, k)
    return Harmonic(_scalar("k", k, dtype, device, positive=True))


def rastrigin(a: Any = 10.0, *, dtype=None, device=None) -> Rastrigin:
    """Rastrigin ``a n + sum_i (x_i^2 - a cos(2 pi x_i))``: ``a >= 0``."""
    dtype, device = _resolve(dtype, device, a)
    return Rastrigin(_scalar("a", a, dtype, device, nonnegative=True))


def ackley(a: Any = 20.0, b: Any = 0.2, c: Any = 2 * math.pi, *, dtype=None, device=None) -> Ackley:
    """Ackley ``-a exp(-b rms(x)) - exp(mean(cos(c x))) + a + e``: ``a >= 0``, ``b > 0``, ``c`` finite."""
    dtype, device = _resolve(dtype, device, a, b, c)
    return Ackley(
        _scalar("a", a, dtype, device, nonnegative=True),
        _scalar("b", b, dtype, device, positive=True),
        _scalar("c", c, dtype, device),
    )


def gaussian_mixture(means: Any, scales: Any, weights: Any = None, *, dtype=None, device=None) -> GaussianMixture:
    """Mixture of diagonal Gaussians, ``E = -log p(x)`` with normalising constants.

    means: ``(K, d)``; scales: ``(K,)`` isotropic or ``(K, d)`` diagonal standard
    deviations, > 0; weights: ``(K,)`` > 0, normalised here (``None``: uniform).
    """
    dtype, device = _resolve(dtype, device, means, scales, weights)
    means = _tensor("means", means, (2,), dtype, device)
    k, d = means.shape
    if k == 0 or d == 0:
        raise ValueError(f"means must have shape (K, d) with K, d >= 1, got {tuple(means.shape)}")
    scales = _positive("scales", _tensor("scales", scales, (1, 2), dtype, device))
    if tuple(scales.shape) not in ((k,), (k, d)):
        raise ValueError(f"scales must have shape ({k},) or ({k}, {d}) to match means, got {tuple(scales.shape)}")
    scales = (scales[:, None] if scales.ndim == 1 else scales).expand(k, d).contiguous()
    if weights is None:
        weights = torch.full((k,), 1 / k, dtype=dtype, device=device)
    else:
        weights = _positive("weights", _tensor("weights", weights, (1,), dtype, device))
        if weights.shape[0] != k:
            raise ValueError(f"weights must have shape ({k},) to match means, got {tuple(weights.shape)}")
        weights = weights / weights.sum()
    log_coef = weights.log() - scales.log().sum(-1) - 0.5 * d * _LOG_2PI
    return GaussianMixture(means, scales, weights, log_coef)


# ------------------------------------------------------------------------ neural energies


def from_module(module: nn.Module) -> tuple[Callable[[dict[str, Tensor], Tensor], Tensor], dict[str, Tensor]]:
    """A batch-style module as a pure ``energy_fn(params, x)`` and its ``params``.

    ``module`` maps ``(B, *event) -> (B,)`` or ``(B, 1)``; ``energy_fn(params, x)`` takes one
    sample ``x: event`` and returns a 0-dim energy. ``params`` holds the module's parameters
    and buffers, detached, so ``torch.func.grad(energy_fn)(params, x)`` differentiates them.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    params = {k: v.detach() for k, v in (*module.named_parameters(), *module.named_buffers())}

    def energy_fn(params: dict[str, Tensor], x: Tensor) -> Tensor:
        out = torch.func.functional_call(module, params, (x[None],))
        if out.numel() != 1:  # shapes are static: no sync, no graph break
            raise ValueError(
                f"module must return one energy per sample, shape (B,) or (B, 1); got {tuple(out.shape)} for B=1"
            )
        return out.reshape(())

    return energy_fn, params


@dataclass(frozen=True, eq=False)
class BoundEnergy:
    """``energy_fn`` with ``params`` fixed: ``e(x) = energy_fn(params, x)``, ``x: (dim,)`` -> 0-dim.

    ``dtype``/``device`` are those of the first floating tensor in ``params`` (``None`` if none).
    """

    energy_fn: Callable[[Any, Tensor], Tensor]
    params: Any

    def __call__(self, x: Tensor) -> Tensor:
        return self.energy_fn(self.params, x)

    def _first_float(self) -> Tensor | None:
        return next(
            (t for t in pytree.tree_leaves(self.params) if isinstance(t, Tensor) and t.is_floating_point()), None
        )

    @property
    def dtype(self) -> torch.dtype | None:
        t = self._first_float()
        return None if t is None else t.dtype

    @property
    def device(self) -> torch.device | None:
        t = self._first_float()
        return None if t is None else t.device

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> BoundEnergy:
        """A copy with floating tensors in ``params`` on ``device`` / in ``dtype``."""
        dtype = _check_dtype(dtype)

        def convert(v: Any) -> Any:
            if isinstance(v, Tensor):
                return v.to(device=device, dtype=dtype if v.is_floating_point() else None)
            return v

        return BoundEnergy(self.energy_fn, pytree.tree_map(convert, self.params))

    @property
    def dim(self) -> None:
        return None

    def check_dim(self, d: int) -> None:
        _check_dim_arg(d)


def bind(energy_fn: Callable[[Any, Tensor], Tensor], params: Any) -> BoundEnergy:
    """Fix ``params`` of ``energy_fn(params, x)``, giving a one-argument energy ``x -> E``."""
    if not callable(energy_fn):
        raise TypeError(f"energy_fn must be callable, got {type(energy_fn).__name__}")
    return BoundEnergy(energy_fn, params)
