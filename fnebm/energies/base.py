"""The energy protocol, the shared argument checks, pytree registration and ``from_logdensity``.

An energy is a pure function ``E(x) -> ()`` of one sample ``x: (dim,)``. Energies are
pytrees whose leaves are their tensor parameters, so ``torch.func.vmap`` / ``grad`` map and
differentiate over them, and ``torch.compile`` sees parameters as graph inputs: a new value
of the same shape reuses the compiled graph.

Constructors are the boundary. Metadata checks (types, dtypes, shapes) run everywhere;
value checks (finite, positive, symmetric, positive definite) read numbers, so they run
only where the values are concrete (:func:`fnebm._checks.is_concrete`: eager code on plain
tensors) and are skipped under ``torch.compile`` and ``torch.func`` transforms, where a
constructor traces without a graph break or host sync.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fnebm import _checks

__all__ = ["Energy", "LogDensityEnergy", "from_logdensity", "static_field"]


# ------------------------------------------------------------------------------ pytrees


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is not a parameter: kept in the pytree's context, not a leaf.

    For the non-tensor fields of an :class:`Energy` subclass (functions, ints, strings):
    ``n_terms: int = static_field(default=3)``. Every other field is a child of the pytree.
    A static value is compared with ``==`` when tree structures are compared, so it must
    not be a tensor.
    """
    metadata = {**kwargs.pop("metadata", {}), "static": True}
    return dataclasses.field(metadata=metadata, **kwargs)


def _split_fields(obj: Any) -> tuple[list[str], list[str]]:
    """Init fields of a dataclass instance: ``(children, static)`` names, in declaration order."""
    children, static = [], []
    for f in dataclasses.fields(obj):
        if f.init:
            (static if f.metadata.get("static", False) else children).append(f.name)
    return children, static


def _flatten(obj: Any) -> tuple[list[Any], Any]:
    children, static = _split_fields(obj)
    context = (tuple(children), tuple((n, getattr(obj, n)) for n in static))
    return [getattr(obj, n) for n in children], context


def _flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
    leaves, context = _flatten(obj)
    return [(pytree.GetAttrKey(n), v) for n, v in zip(context[0], leaves)], context


def _unflatten(cls: type, values: Any, context: Any) -> Any:
    # No checks here: unflatten rebuilds from anything torch.func or tree_map hands back
    # (wrapped tensors, gradients, None), so it must not validate.
    names, static = context
    return cls(**dict(zip(names, values)), **dict(static))


def register_dataclass_pytree(cls: type) -> type:
    """Register a dataclass with ``torch.utils._pytree``: fields are children, static fields context.

    Fields are read when an instance is flattened, not here, so this may run before the
    ``@dataclass`` decorator has processed ``cls`` (it does, from ``Energy.__init_subclass__``).
    Unflattening calls ``cls(**fields)``.
    """
    pytree.register_pytree_node(
        cls,
        _flatten,
        functools.partial(_unflatten, cls),
        flatten_with_keys_fn=_flatten_with_keys,
    )
    return cls


# ----------------------------------------------------------------------------- checks


def _check_dim_arg(d: Any) -> None:
    _checks.check_int("dim", d, minimum=1)


def _check_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    return dtype


def _resolve(dtype: Any, device: Any, *args: Any) -> tuple[torch.dtype, torch.device | None]:
    """dtype/device given, else those of the tensor arguments, else torch's defaults.

    With no device and no tensor argument the device is ``None`` (torch's default device
    when a tensor is made): ``torch.get_default_device()`` does not trace under Dynamo.
    """
    dtype = _check_dtype(dtype)
    tensors = [a for a in args if isinstance(a, Tensor)]
    if dtype is None:
        floats = [t.dtype for t in tensors if t.dtype.is_floating_point]
        dtype = floats[0] if floats else torch.get_default_dtype()
        for d in floats[1:]:
            dtype = torch.promote_types(dtype, d)
    if device is None:
        return dtype, (tensors[0].device if tensors else None)
    return dtype, torch.device(device)


def _tensor(name: str, value: Any, ndims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``value`` as a tensor of one of ``ndims`` dimensions, finite where concrete; else TypeError/ValueError."""
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
    if _checks.is_concrete(t) and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    return t


def _scalar(name: str, value: Any, dtype: torch.dtype, device: torch.device, positive: bool = False,
            nonnegative: bool = False) -> Tensor:
    """A 0-dim parameter; ``> 0`` / ``>= 0`` checked where concrete."""
    t = _tensor(name, value, (0,), dtype, device)
    if _checks.is_concrete(t):
        if positive and not bool(t > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {t.item()}")
        if nonnegative and not bool(t >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {t.item()}")
    return t


def _positive(name: str, t: Tensor) -> Tensor:
    """``t > 0`` everywhere, checked where concrete."""
    if _checks.is_concrete(t) and not bool((t > 0).all()):
        raise ValueError(f"{name} must be > 0 everywhere")
    return t


def _cholesky(name: str, m: Tensor) -> Tensor:
    """Lower Cholesky factor of ``m: (d, d)``; symmetric positive definite checked where concrete.

    Unchecked (under compile or a transform), a matrix that is not positive definite gives
    a factor with NaNs, not an error: there is no host sync to raise one.
    """
    tril, info = torch.linalg.cholesky_ex(m)
    if _checks.is_concrete(m):
        scale = float(m.abs().max())
        if not torch.allclose(m, m.mT, rtol=1e-5, atol=1e-6 * scale):
            raise ValueError(f"{name} must be symmetric")
        if bool(info != 0):
            raise ValueError(f"{name} must be positive definite")
    return tril


# ------------------------------------------------------------------------------ protocol


# eq=False: field-wise == on tensors is ambiguous; identity equality/hash is what
# dict keys, caches and torch.compile guards need.
@dataclass(frozen=True, eq=False)
class Energy:
    """Base of the analytic families: a frozen dataclass of tensor parameters, and a pytree.

    ``e(x)``: ``x: (dim,)`` -> 0-dim energy. ``e.grad(x)``: closed-form ``dE/dx``, ``(dim,)``.
    Batch with ``torch.func.vmap(e)``: ``(n, dim) -> (n,)``.

    Every subclass is registered with ``torch.utils._pytree`` when it is defined (in
    ``__init_subclass__``): its dataclass fields are the children (leaves: the tensor
    parameters), fields declared with :func:`static_field` the context. Decorate a
    subclass with ``@dataclass(frozen=True, eq=False)`` and keep its ``__init__`` free of
    checks (unflattening calls it with whatever ``torch.func`` hands back); validate in a
    constructor function instead. ``class MyEnergy(Energy, pytree=False)`` opts out.
    """

    name: ClassVar[str] = "energy"
    min_dim: ClassVar[int] = 1
    # no whole-batch form (see fnebm.energies.batch_form): a closed-form grad serves batches under vmap
    batched: ClassVar[bool] = False

    def __init_subclass__(cls, pytree: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if pytree:
            register_dataclass_pytree(cls)

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
                if f.init and isinstance(v := getattr(self, f.name), Tensor)
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


# ------------------------------------------------------------------------ log-densities


class ParameterFree:
    """What an energy that is a bare function (no tensor leaves) says of itself: ``dtype``, ``device``
    and ``dim`` are unknown (``None``), and ``to`` has nothing to convert (tensors the function closes
    over stay put). Shared by log-density and batched-function energies."""

    @property
    def dtype(self) -> None:
        return None

    @property
    def device(self) -> None:
        return None

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        """``self``: there are no parameters to convert."""
        _check_dtype(dtype)
        return self

    @property
    def dim(self) -> None:
        return None

    def check_dim(self, d: int) -> None:
        _check_dim_arg(d)


@dataclass(frozen=True, eq=False)
class LogDensityEnergy(ParameterFree):
    """``E(x) = -logdensity_fn(x)``: a log-density (BlackJAX's convention) as an energy.

    A pytree with no leaves (``logdensity_fn`` is its context). ``dtype``/``device``/``dim``
    are ``None``: whatever the function closes over is not known here. No closed-form ``grad``.
    """

    logdensity_fn: Callable[[Tensor], Tensor]

    def __call__(self, x: Tensor) -> Tensor:
        return -self.logdensity_fn(x)


pytree.register_pytree_node(
    LogDensityEnergy,
    lambda e: ([], e.logdensity_fn),
    lambda _, fn: LogDensityEnergy(fn),
    flatten_with_keys_fn=lambda e: ([], e.logdensity_fn),
)


def from_logdensity(logdensity_fn: Callable[[Tensor], Tensor]) -> LogDensityEnergy:
    """The energy ``E(x) = -logdensity_fn(x)`` of a log-density ``x: (dim,) -> log p(x)``.

    fnebm samples ``p(x) ∝ exp(-E(x))``; a log-density (BlackJAX, NumPyro, ``log_prob``) is
    ``-E`` up to a constant, so it must be negated: this does it. For a log-density with
    parameters as data, use ``bind(lambda params, x: -logdensity(params, x), params)``.
    """
    _checks.check_callable("logdensity_fn", logdensity_fn, "x -> log p(x)")
    return LogDensityEnergy(logdensity_fn)
