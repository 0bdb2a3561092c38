"""Neural energies: a module as a pure ``energy_fn(params, x)``, ``bind`` to fix ``params``, and
energies written for a whole batch (``batched``).

An energy that can also evaluate a whole batch in one call says so: ``energy.batched`` is
``True`` and ``energy.batch(xs)`` maps ``(n, *event) -> (n,)``. :func:`from_module`'s
``energy_fn`` has that form (a module takes batches already), and :func:`batched` gives it to a
function written for batches. :func:`fnebm.value_and_grad` with chain axes then computes the
energies and gradients of all chains by one forward and one backward pass, instead of ``vmap``
over one-sample calls; the one-sample form ``E(x)`` stays what it was. Each of these forms
derives its one-sample call from its batch call (a batch of one), and checks once, on the
first batch it evaluates eagerly, that a sample's energy does not depend on the other samples
of the batch (:func:`check_batched`).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fnebm import _checks
from fnebm.energies.base import ParameterFree, _check_dim_arg, _check_dtype

__all__ = ["from_module", "ModuleEnergy", "BoundEnergy", "bind", "BatchedEnergy", "batched", "batch_form",
           "check_batched"]


# ------------------------------------------------------------------------ the batch form


def batch_form(energy: Any) -> Callable[[Tensor], Tensor] | None:
    """``energy.batch`` (``(n, *event) -> (n,)``) when the energy declares one (``energy.batched``), else ``None``.

    The declaration is the energy's ``batched`` field or property (``True``), never a guess
    from its type or its name; fnebm's own energies that have it are :func:`from_module`'s
    (bound with :func:`bind`) and :func:`batched` ones.
    """
    if getattr(energy, "batched", False) is True:
        return energy.batch
    return None


def _rtol(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 2e-2)


def plain_batch(energy: Any, batch: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``batch`` (``energy``'s batch form), or a faster equal form for a caller that only takes the
    gradient w.r.t. the samples and detaches the values (:func:`fnebm.value_and_grad`'s eager path):
    a bound module energy calls its module directly while the parameters are the module's own."""
    if isinstance(energy, BoundEnergy) and isinstance(energy.energy_fn, ModuleEnergy):
        return functools.partial(energy.energy_fn._plain_batch, energy.params)
    return batch


def check_batched(energy: Any, xs: Tensor, rows: int = 3) -> None:
    """Raise ``ValueError`` unless ``energy.batch(xs)`` agrees with the one-sample form on ``xs``.

    Compares the first ``rows`` energies of ``energy.batch(xs)`` with ``energy(xs[i])``, to the
    rounding that batching a matrix product may change (relative ``1e-4`` in float32, ``1e-9``
    in float64). A module whose output for one sample depends on the others (batch
    normalisation in training mode, a softmax across the batch) fails it.
    """
    batch = batch_form(energy)
    if batch is None:
        raise TypeError(f"energy declares no batch form (energy.batched is not True): {type(energy).__name__}")
    if not isinstance(xs, Tensor) or xs.ndim < 1:
        raise ValueError("xs must be a tensor of samples (n, *event)")
    with torch.no_grad():
        together = batch(xs[:rows])
        alone = torch.stack([energy(xs[i]) for i in range(min(rows, xs.shape[0]))])
    _agree(together, alone, "energy.batch(xs) and energy(xs[i])")


def _agree(together: Tensor, alone: Tensor, what: str) -> None:
    tol = _rtol(together.dtype)
    scale = max(1.0, float(alone.abs().max())) if alone.numel() else 1.0
    if together.shape != alone.shape or not bool(((together - alone).abs() <= tol * scale).all()):
        diff = float((together - alone).abs().max()) if together.shape == alone.shape else float("nan")
        raise ValueError(
            f"{what} disagree (largest difference {diff:.3g}, allowed {tol * scale:.3g}): a sample's energy "
            "depends on the other samples of its batch (batch normalisation in training mode? call "
            "module.eval()), so the batch form cannot stand for the one-sample energy; evaluate samples one "
            "at a time instead (from_module(module, batched=False), or a one-sample function without batched)"
        )


def _batch_out(out: Any, n: int, who: str) -> Tensor:
    if not isinstance(out, Tensor) or tuple(out.shape) not in ((n,), (n, 1)):  # shapes are static: no sync
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"{who} must return one energy per sample, shape (B,) or (B, 1); got {got} for B={n}")
    return out.reshape(n)


class _CheckedOnce:
    """Runs :func:`_agree` on the first eager batch of two or more samples a form evaluates."""

    def _check_once(self, one: Callable[[Tensor], Tensor], xs: Tensor, out: Tensor) -> None:
        # is_concrete first: under torch.compile it is a constant False, so no guard on the flag
        if _checks.is_concrete(xs) and xs.ndim >= 1 and xs.shape[0] >= 2 and not self._checked:
            with torch.no_grad():
                k = min(3, xs.shape[0])
                _agree(out[:k].detach(), torch.cat([one(xs[i : i + 1]) for i in range(k)]),
                       f"{self.who}'s energies of a batch and of its samples one at a time")
            object.__setattr__(self, "_checked", True)


# ------------------------------------------------------------------------------- modules


# modules whose batch form passed the check, with their submodules' training flags then
_MODULES_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True, eq=False)
class ModuleEnergy(_CheckedOnce):
    """:func:`from_module`'s ``energy_fn``: ``energy_fn(params, x)`` of one sample ``x: event`` -> 0-dim,
    and ``energy_fn.batch(params, xs)`` of a batch ``(n, *event) -> (n,)`` in one module call.

    ``batched``: whether :func:`bind` gives its energies the batch form (``from_module(batched=)``).
    """

    module: nn.Module
    batched: bool = True
    who = "the module"

    def __post_init__(self):
        object.__setattr__(self, "_checked", False)
        object.__setattr__(self, "_slots", None)

    def __call__(self, params: dict[str, Tensor], x: Tensor) -> Tensor:
        out = torch.func.functional_call(self.module, params, (x[None],))
        if out.numel() != 1:  # shapes are static: no sync, no graph break
            raise ValueError(
                f"module must return one energy per sample, shape (B,) or (B, 1); got {tuple(out.shape)} for B=1"
            )
        return out.reshape(())

    def batch(self, params: dict[str, Tensor], xs: Tensor) -> Tensor:
        out = _batch_out(torch.func.functional_call(self.module, params, (xs,)), xs.shape[0], "module")
        self._check_once(lambda x1: torch.func.functional_call(self.module, params, (x1,)).reshape(1), xs, out)
        return out

    def _plain_batch(self, params: dict[str, Tensor], xs: Tensor) -> Tensor:
        """:meth:`batch` for :func:`fnebm.value_and_grad`'s eager path, which differentiates w.r.t. ``xs``
        only and detaches the value: while ``params`` are the module's own tensors (from_module's, as
        the module still holds them) the module is called as it is — the same operations on the same
        values, without functional_call's swap of every parameter in and out (0.1-0.2 ms a call, a few
        percent of a 784-D MLP step). Its output may carry a graph through the module's parameters
        (when they require grad), which that caller never uses."""
        if not self._holds(params, xs):
            return self.batch(params, xs)
        out = _batch_out(self.module(xs), xs.shape[0], "module")
        self._check_once(lambda x1: torch.func.functional_call(self.module, params, (x1,)).reshape(1), xs, out)
        return out

    def _check_once(self, one: Callable[[Tensor], Tensor], xs: Tensor, out: Tensor) -> None:
        # from_module is called anew in every iteration of a training loop: a module checked before in
        # the same train/eval modes is not checked again (three one-sample passes a call)
        # is_concrete first: under torch.compile it is a constant False, so no guard on the flag
        if not _checks.is_concrete(xs) or xs.ndim < 1 or xs.shape[0] < 2 or self._checked:
            return
        modes = tuple(m.training for m in self.module.modules())
        if _MODULES_CHECKED.get(self.module) == modes:
            object.__setattr__(self, "_checked", True)
            return
        super()._check_once(one, xs, out)
        if self._checked:
            _MODULES_CHECKED[self.module] = modes

    def _holds(self, params: Any, xs: Tensor) -> bool:
        """Whether ``functional_call(module, params, (xs,))`` is ``module(xs)``: eager plain tensors that
        autograd does not track, and each of ``params`` is the tensor the module holds at its name
        (the same memory, shape, strides and dtype; the module's structure unchanged since the first
        call). Then the two compute the same operations on the same values."""
        if type(params) is not dict or not _checks.is_concrete(xs):
            return False
        # once per eager block of steps (sample_chain's eager engine): no user code rebinds a module's
        # tensors between two of its steps
        return _checks.block_memo(("holds", id(self)), params, lambda: self._holds_now(params))

    def _holds_now(self, params: dict) -> bool:
        slots = self._slots
        if slots is None:
            slots = _slots(self.module)
            object.__setattr__(self, "_slots", slots)
        for name, v in params.items():
            where = slots.get(name)
            if where is None or type(v) is not Tensor or v.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(v):
                return False
            owner, attr, path = where
            for parent, key, child in path:
                if parent._modules.get(key) is not child:  # a submodule replaced: look again next call
                    object.__setattr__(self, "_slots", None)
                    return False
            held = owner._parameters.get(attr) if attr in owner._parameters else owner._buffers.get(attr)
            if held is None:
                return False
            if held is not v and (v.data_ptr() != held.data_ptr() or v.shape != held.shape or v.stride() != held.stride()
                                  or v.dtype != held.dtype or v.device != held.device):
                return False
        return True


def _slots(module: nn.Module) -> dict[str, tuple[nn.Module, str, tuple]]:
    """Each parameter and buffer name -> (its module, its attribute, the path of (parent, key, child)
    from ``module`` down to it), to check cheaply that ``module`` still holds it there."""
    slots = {}
    paths = {"": ()}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for key, child in sub._modules.items():
            if child is not None:
                paths.setdefault(f"{prefix}.{key}" if prefix else key, paths[prefix] + ((sub, key, child),))
        for attr in (*sub._parameters, *sub._buffers):
            slots.setdefault(f"{prefix}.{attr}" if prefix else attr, (sub, attr, paths[prefix]))
    return slots


def from_module(module: nn.Module, batched: bool = True) -> tuple[ModuleEnergy, dict[str, Tensor]]:
    """A batch-style module as a pure ``energy_fn(params, x)`` and its ``params``.

    ``module`` maps ``(B, *event) -> (B,)`` or ``(B, 1)``; ``energy_fn(params, x)`` takes one
    sample ``x: event`` and returns a 0-dim energy. ``params`` holds the module's parameters
    and buffers, detached, so ``torch.func.grad(energy_fn)(params, x)`` differentiates them.

    ``batched=True`` (default): ``energy_fn.batch(params, xs)`` evaluates a whole batch in one
    module call, and ``bind(energy_fn, params)`` declares it, so samplers compute every chain's
    energy and gradient in one forward and one backward pass. The first eager batch checks that
    a sample's energy does not depend on the rest of its batch (it does with batch
    normalisation in training mode: call ``module.eval()``, or pass ``batched=False``).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(batched, bool):
        raise TypeError(f"batched must be True or False, got {type(batched).__name__}")
    params = {k: v.detach() for k, v in (*module.named_parameters(), *module.named_buffers())}
    return ModuleEnergy(module, batched), params


# ------------------------------------------------------------------ functions of batches


@dataclass(frozen=True, eq=False)
class _BatchFn(_CheckedOnce):
    """``fn(params, xs: (n, *event)) -> (n,)`` in both forms: ``(params, x)`` of one sample, and ``batch``."""

    fn: Callable[[Any, Tensor], Tensor]
    batched = True
    who = "the batched function"

    def __post_init__(self):
        object.__setattr__(self, "_checked", False)

    def __call__(self, params: Any, x: Tensor) -> Tensor:
        return _batch_out(self.fn(params, x[None]), 1, "the batched function").reshape(())

    def batch(self, params: Any, xs: Tensor) -> Tensor:
        out = _batch_out(self.fn(params, xs), xs.shape[0], "the batched function")
        self._check_once(lambda x1: _batch_out(self.fn(params, x1), 1, "the batched function"), xs, out)
        return out


# One _BatchFn per function, so batched(fn, params) rebuilt every iteration of a training loop
# is the same pytree context (and the same compiled graph) each time.
_BATCH_FNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True, eq=False)
class BatchedEnergy(_CheckedOnce, ParameterFree):
    """``batched(fn)``: an energy from ``fn(xs: (n, *event)) -> (n,)``; ``e(x) = fn(x[None])[0]``, ``e.batch(xs) = fn(xs)``.

    A pytree with no leaves (``fn`` is its context), as :func:`~fnebm.energies.from_logdensity`'s
    energies: tensors ``fn`` closes over are constants (bind them with ``batched(fn, params)``
    to make them data). ``dtype``/``device``/``dim`` are ``None``.
    """

    fn: Callable[[Tensor], Tensor]
    batched = True
    who = "the batched function"

    def __post_init__(self):
        object.__setattr__(self, "_checked", False)

    def __call__(self, x: Tensor) -> Tensor:
        return _batch_out(self.fn(x[None]), 1, "the batched function").reshape(())

    def batch(self, xs: Tensor) -> Tensor:
        out = _batch_out(self.fn(xs), xs.shape[0], "the batched function")
        self._check_once(lambda x1: _batch_out(self.fn(x1), 1, "the batched function"), xs, out)
        return out



pytree.register_pytree_node(
    BatchedEnergy,
    lambda e: ([], e.fn),
    lambda _, fn: BatchedEnergy(fn),
    flatten_with_keys_fn=lambda e: ([], e.fn),
)

_NO_PARAMS = object()


def batched(fn: Callable, params: Any = _NO_PARAMS) -> BatchedEnergy | BoundEnergy:
    """An energy written for a whole batch: ``fn(xs: (n, *event)) -> (n,)`` (or ``(n, 1)``).

    ``batched(fn)`` is an energy whose one-sample call is ``fn(x[None])`` and whose batch form
    is ``fn`` itself; ``batched(fn, params)`` takes ``fn(params, xs)`` and fixes ``params`` as
    :func:`bind` does (a :class:`BoundEnergy` whose leaves are ``params``). Samplers then
    evaluate all chains in one call of ``fn`` and one backward pass. ``fn`` must treat the
    samples of a batch independently; the first batch evaluated eagerly checks it.
    """
    if params is _NO_PARAMS:
        _checks.check_callable("fn", fn, "xs: (n, *event) -> (n,) energies")
        return BatchedEnergy(fn)
    _checks.check_callable("fn", fn, "(params, xs: (n, *event)) -> (n,) energies")
    form = _BATCH_FNS.get(fn)
    if form is None:
        form = _BATCH_FNS[fn] = _BatchFn(fn)
    return BoundEnergy(form, params)


# ------------------------------------------------------------------------------- binding


@dataclass(frozen=True, eq=False)
class BoundEnergy:
    """``energy_fn`` with ``params`` fixed: ``e(x) = energy_fn(params, x)``, ``x: (dim,)`` -> 0-dim.

    A pytree: its leaves are those of ``params``; ``energy_fn`` is the context.
    ``dtype``/``device`` are those of the first floating tensor in ``params`` (``None`` if none).
    ``batched``: ``energy_fn`` declares a batch form (``energy_fn.batched``, as
    :func:`from_module`'s does); then ``e.batch(xs) = energy_fn.batch(params, xs)``.
    """

    energy_fn: Callable[[Any, Tensor], Tensor]
    params: Any

    def __call__(self, x: Tensor) -> Tensor:
        return self.energy_fn(self.params, x)

    @property
    def batched(self) -> bool:
        return getattr(self.energy_fn, "batched", False) is True

    def batch(self, xs: Tensor) -> Tensor:
        """Energies of a batch ``xs: (n, *event) -> (n,)`` in one call of ``energy_fn.batch``."""
        if not self.batched:
            raise TypeError("this energy's energy_fn declares no batch form; map it: torch.func.vmap(energy)(xs)")
        return self.energy_fn.batch(self.params, xs)

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


pytree.register_pytree_node(
    BoundEnergy,
    lambda e: ([e.params], e.energy_fn),
    lambda children, energy_fn: BoundEnergy(energy_fn, children[0]),
    flatten_with_keys_fn=lambda e: ([(pytree.GetAttrKey("params"), e.params)], e.energy_fn),
)


def bind(energy_fn: Callable[[Any, Tensor], Tensor], params: Any) -> BoundEnergy:
    """Fix ``params`` of ``energy_fn(params, x)``, giving a one-argument energy ``x -> E``.

    An ``energy_fn`` with a batch form (:func:`from_module`'s) gives an energy with one
    (``e.batched``); for a function written for batches, use :func:`batched` ``(fn, params)``.
    """
    _checks.check_callable("energy_fn", energy_fn, "(params, x) -> E")
    return BoundEnergy(energy_fn, params)
