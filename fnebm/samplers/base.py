"""The sampler interface, explicit batching, and what every sampler's ``init`` and kernel share.

A sampler lives in three layers (BlackJAX's shape):

* ``init(position, energy_fn) -> state`` for **one** chain (map it over chains with
  ``torch.func.vmap``);
* ``build_kernel() -> kernel``, a pure ``kernel(state, key, energy_fn, *tunables) -> (state, info)``;
* the constructor, e.g. ``mala(energy_fn, step_size) -> SamplingAlgorithm(init, step)``, which
  only closes over its arguments: ``step`` is a :class:`Step`, the kernel with its energy and
  tunables bound and named, so code that dispatches on a step (``fnebm.kernels.dispatch``) reads
  fields (``step.sampler``, ``step.energy_fn``, ``step.tunables``) instead of taking it apart.

**Batching is explicit.** Every fnebm kernel takes a state whose fields lead with the chain
axes and keys ``(*chains, 2)``; the number of chain axes is ``key.ndim - 1`` (0 for one chain).
A step written for one chain is batched by saying so: :func:`vmap_chains`.

**Tunables are data.** Step sizes and noise scales are tensors (a number becomes a 0-dim
float64 tensor): 0-dim, or one value per chain aligned with the leading chain axes. The kernel
casts them to the state's dtype and device, so one compiled graph serves every value.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import _checks, _one_thread
from fnebm import random as fr
from fnebm.energies.neural import batch_form
from fnebm.gradients import value_and_grad

__all__ = [
    "SamplingAlgorithm",
    "Step",
    "vmap_chains",
    "over_batch",
    "event_sum",
    "event_all",
    "all_finite",
    "chain_axes",
    "per_chain",
    "check_energy",
    "check_position",
    "energy_and_grad",
    "init_position_state",
    "caches_energy_of",
    "state_caches_energy",
]


class SamplingAlgorithm(NamedTuple):
    """``init(position) -> state`` (one chain) and ``step(state, keys) -> (state, info)`` (any chain axes)."""

    init: Callable[[Tensor], Any]
    step: Callable[[Any, Tensor], tuple[Any, Any]]


class Step(functools.partial):
    """A sampler's batched step, ``step(state, keys) -> (state, info)``, with its parts named.

    A :class:`functools.partial` of the sampler's kernel (so ``torch.compile``, ``vmap`` and the
    compiled runner's cache treat it exactly as they treat a partial: the tensors it holds are
    graph inputs, its Python constants are specialised on) that also says what it is:

    * ``sampler``: the algorithm's name (``"langevin"``, ``"mala"``, ``"hmc"``, ``"nuts"``, ...);
    * ``state_type`` / ``info_type``: the ``NamedTuple`` types of its state and info;
    * ``caches_energy``: its state's ``energy`` field is ``energy_fn(position)``, as ``init`` computed it;
    * ``energy_fn``: the energy it targets; ``tunables``: its tensor tunables by name (step size,
      noise scale, mass matrix); ``options``: its other, static arguments (integrator, backend);
    * ``replace(**changes)``: the same step with some arguments changed.

    Make one with :meth:`of` (inside a ``torch.compile`` region it gives a plain partial: there a
    step is only called). A step wrapped in anything else (``vmap_chains``, a user's own
    partial or lambda) is opaque: dispatch then falls back to the torch path and says so.
    """

    __slots__ = ()  # the partial's own __dict__ holds sampler, state_type, info_type, tunable names

    @classmethod
    def of(cls, sampler: str, kernel: Callable, *args: Any, state_type: type, info_type: type,
           tunables: tuple[str, ...], caches_energy: bool = False, host_scalars: bool = False,
           **keywords: Any) -> "Step":
        """``kernel(state, key, *args, **keywords)`` as the step of ``sampler``; ``tunables`` names
        the keywords that are tensor tunables (the rest, other than ``energy_fn``, are options).
        ``caches_energy``: the state's ``energy`` field is exactly ``energy_fn(position)`` as
        ``init`` computed it (the CD loss then reuses it as the positives' energies).
        ``host_scalars``: the kernel takes its tunables through ``per_chain(..., host_scalar=True)``
        (a 0-dim CPU tunable is used as a host scalar beside device tensors, and must stay one: the
        arithmetic differs in the last bit once it is a device tensor)."""
        if torch.compiler.is_compiling():
            # built inside a user's compiled function (Dynamo constructs partials, not subclasses):
            # there the step is only called, never dispatched on
            return functools.partial(kernel, *args, **keywords)
        step = cls(kernel, *args, **keywords)
        step.__dict__.update(sampler=sampler, state_type=state_type, info_type=info_type,
                             tunable_names=tuple(tunables), caches_energy=bool(caches_energy),
                             host_scalars=bool(host_scalars))
        return step

    @property
    def caches_energy(self) -> bool:
        return self.__dict__.get("caches_energy", False)

    @property
    def host_scalars(self) -> bool:
        return self.__dict__.get("host_scalars", False)

    @property
    def energy_fn(self) -> Any:
        return self.keywords.get("energy_fn")

    @property
    def tunables(self) -> dict[str, Any]:
        return {k: self.keywords[k] for k in self.__dict__.get("tunable_names", ()) if k in self.keywords}

    @property
    def options(self) -> dict[str, Any]:
        skip = {"energy_fn", *self.__dict__.get("tunable_names", ())}
        return {k: v for k, v in self.keywords.items() if k not in skip}

    def replace(self, **changes: Any) -> "Step":
        """This step with the keyword arguments in ``changes`` replaced (its fields kept)."""
        unknown = set(changes) - set(self.keywords)
        if unknown:
            raise TypeError(f"{self.__dict__.get('sampler', 'this')} step has no argument(s) {sorted(unknown)}; "
                            f"it has {sorted(self.keywords)}")
        step = type(self)(self.func, *self.args, **{**self.keywords, **changes})
        step.__dict__.update(self.__dict__)
        return step

    def __repr__(self) -> str:
        sampler = self.__dict__.get("sampler", "?")
        parts = [f"energy_fn={self.energy_fn!r}"] + [f"{k}={_short(v)}" for k, v in self.tunables.items()]
        parts += [f"{k}={_short(v)}" for k, v in self.options.items()]
        return f"Step[{sampler}]({', '.join(parts)})"


def _short(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"tensor{tuple(value.shape)}" if value.ndim else f"tensor({value.item():g})"
    return repr(value)


def step_fields(step: Any) -> Step | None:
    """``step`` when it is a sampler's :class:`Step` that says what it is, else ``None`` (opaque)."""
    return step if isinstance(step, Step) and "sampler" in step.__dict__ else None


_CACHED_STATE = "fnebm_caches_energy_state"


def caches_energy_of(state_type: type) -> Callable[[Callable], Callable]:
    """Decorator for the function a sampler gives :meth:`Step.of` (its kernel, or the wrapper
    around it): states of ``state_type`` that its ``init`` makes hold ``energy = energy_fn(position)``.

    What ``Step.of(caches_energy=True)`` says, kept on the function itself, so that it can be
    read inside a ``torch.compile`` region too, where ``Step.of`` gives a plain partial
    (:func:`state_caches_energy`). Dynamo reads a function's attributes as constants.
    """

    def mark(fn: Callable) -> Callable:
        setattr(fn, _CACHED_STATE, state_type)
        return fn

    return mark


def state_caches_energy(step: Any, state: Any) -> bool:
    """Whether ``state`` (from the sampler's ``init``) holds ``energy = energy_fn(position)``: the
    :class:`Step` says so (``caches_energy``), or, inside a compiled region, where the step is a
    plain partial, the function it wraps does (:func:`caches_energy_of`). Any other step: ``False``."""
    fields = step_fields(step)
    if fields is not None:
        return fields.caches_energy and isinstance(state, fields.state_type)
    if torch.compiler.is_compiling() and isinstance(step, functools.partial):
        state_type = getattr(step.func, _CACHED_STATE, None)
        return state_type is not None and isinstance(state, state_type)
    return False


class KernelCache:
    """``build(*config)`` built once per configuration (an integrator's coefficients, a
    threshold: hashable constants): the runner cache keys compiled graphs by the kernel's code
    and closure constants, so equal configurations share one kernel object and one graph.

    Not ``functools.cache``: a constructor called inside a user's ``torch.compile`` region
    (``window_adaptation`` builds its sampler there) is traced by Dynamo, which warns on every
    ``lru_cache`` wrapper it meets and traces through it anyway. Under Dynamo the kernel is
    built afresh, as it was then: a lookup would make the graph guard on the dict, and the
    first call, which fills it, would compile twice.
    """

    def __init__(self, build: Callable[..., Callable]):
        self.build = build
        self.kernels: dict[tuple, Callable] = {}

    def __call__(self, *config: Any) -> Callable:
        if torch.compiler.is_compiling():
            return self.build(*config)
        kernel = self.kernels.get(config)
        if kernel is None:
            kernel = self.kernels[config] = self.build(*config)
        return kernel


def over_batch(fn: Callable, n_batch: int) -> Callable:
    """``fn`` of one sample mapped over ``n_batch`` leading axes (nested ``vmap``)."""
    for _ in range(n_batch):
        fn = torch.func.vmap(fn)
    return fn


def _vmapped_step(step: Callable, state: Any, key: Tensor) -> tuple[Any, Any]:
    _checks.check_key(key)
    return over_batch(step, key.ndim - 1)(state, key)


def vmap_chains(step: Callable[[Any, Tensor], tuple[Any, Any]]) -> Callable[[Any, Tensor], tuple[Any, Any]]:
    """A one-chain ``step(state, key: (2,))`` as a batched step taking keys ``(*chains, 2)``.

    The result maps ``step`` over ``key.ndim - 1`` leading axes of the state and the keys with
    ``torch.func.vmap``, which is what :func:`fnebm.sample_chain` and :func:`fnebm.chain.run`
    expect of a step. fnebm's own steps are batched already and need no wrapper.
    """
    _checks.check_callable("step", step, "step(state, key) -> (state, info)")
    return functools.partial(_vmapped_step, step)


def event_sum(x: Tensor, n_batch: int) -> Tensor:
    """Sum over every axis after the first ``n_batch``: ``(*batch, *event) -> batch``."""
    return x.reshape(x.shape[:n_batch] + (-1,)).sum(-1)


def event_all(x: Tensor, n_batch: int) -> Tensor:
    """``all`` over every axis after the first ``n_batch``: ``(*batch, *event) -> batch``."""
    return x.reshape(x.shape[:n_batch] + (-1,)).all(-1)


def all_finite(scalar: Tensor, *events: Tensor, n_batch: int) -> Tensor:
    """Per chain, whether ``scalar: batch`` and every entry of each ``events`` tensor
    ``(*batch, *event)`` (all of one event shape) are finite: ``batch`` bools.

    Compiled, it is ``max |.| < inf`` (``maximum`` and ``amax`` propagate NaN, and NaN compares
    False), not an ``all`` of ``isfinite`` masks: the same answer, but float reductions
    compile to plain vector code, where Inductor's CPU code for bool-mask reductions converts
    masks lane by lane (a 10,000 x 10 Langevin step: about 50 us of 580; docs/performance.md).
    Eagerly on the CPU, NumPy's ``isfinite`` and ``all`` on the same memory: one vectorised pass
    a tensor on the calling thread, where torch's ``isfinite`` runs four operations and a bool
    reduction, each a parallel region that waits for a sleeping thread on a busy machine
    (128 x 784 gradient and proposal: 0.04 ms against 0.45-0.8 ms). Elsewhere eagerly, it is
    ``sum(x - x) == 0``: ``x - x`` is 0 where ``x`` is finite and NaN where it is not
    (``inf - inf``), so the sum is exactly 0 or NaN (it cannot overflow). The same answer everywhere.
    """
    if not torch.compiler.is_compiling():
        ok = _all_finite_numpy(scalar, events, n_batch)
        if ok is not None:
            return ok
        s = scalar.detach()  # no autograd graph for a check (a gradient through a chain)
        s = s - s
        if events and math.prod(events[0].shape[n_batch:]) > 0:
            for t in events:
                t = t.detach()
                s = s + (t - t).reshape(t.shape[:n_batch] + (-1,)).sum(-1)
        return s == 0
    m = scalar.abs()
    if events and math.prod(events[0].shape[n_batch:]) > 0:
        big = events[0].abs()
        for t in events[1:]:
            big = torch.maximum(big, t.abs())
        m = torch.maximum(m, big.reshape(big.shape[:n_batch] + (-1,)).amax(-1))
    return m < math.inf


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)
_FLAT_CHECKS = {torch.float32: "fnebm_all_finite_f32", torch.float64: "fnebm_all_finite_f64"}


def _all_finite_numpy(scalar: Tensor, events: tuple[Tensor, ...], n_batch: int) -> Tensor | None:
    """:func:`all_finite` by NumPy for eager plain CPU tensors (``None`` where it does not apply, or where
    something intercepts torch's operations: ``make_fx`` would keep the answer as a constant)."""
    if _one_thread._intercepted():
        return None
    for t in (scalar, *events):
        if (type(t) is not Tensor or t.device.type != "cpu" or t.dtype not in _NUMPY_DTYPES
                or torch._C._functorch.is_functorch_wrapped_tensor(t)):
            return None
    lib = fr._c_library() if fr._C_EAGER else None
    # only where the scalar has the batch's shape (one of fewer axes broadcasts against the rows' answer)
    if (lib is not None and _one_thread._C and scalar.ndim == n_batch
            and all(t.dtype in _FLAT_CHECKS and t.is_contiguous() and t.shape[:n_batch] == scalar.shape
                    for t in (scalar, *events))):
        # every value finite (every step but a divergent one): one flat C pass a tensor, no row looked at
        # (10,000 chains of a 2-D position: the rows' checks took about 0.1 ms a step)
        if all(getattr(lib, _FLAT_CHECKS[t.dtype])(t.numel(), t.data_ptr()) for t in (scalar, *events)):
            return torch.ones(scalar.shape, dtype=torch.bool)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - torch without NumPy
        return None
    try:
        ok = np.array(np.isfinite(scalar.detach().numpy()), dtype=np.bool_, order="C")  # fresh, C-ordered
        if events and math.prod(events[0].shape[n_batch:]) > 0:
            # fnebm's C rows at any size (not only from torch's grain size up, as for the updates, which torch
            # runs on one thread below it): NumPy's isfinite-and-all over short rows took 250-370 us a tensor for
            # 10,000 chains of a 2-D position, the C pass about 35 (bench/finite_check.py)
            for t in events:
                a = t.detach().numpy()
                # in C, into ok itself (one pass, no mask array) where ok has the batch shape; else NumPy
                if ok.shape != tuple(t.shape[:n_batch]) or not _one_thread.rows_finite(lib, ok, a):
                    ok = ok & np.isfinite(a.reshape(tuple(t.shape[:n_batch]) + (-1,))).all(-1)
                    ok = ok if ok.flags.c_contiguous else ok.copy(order="C")
    except RuntimeError:  # a tensor NumPy cannot view (a lazy negation, say)
        return None
    return torch.from_numpy(np.asarray(ok, dtype=np.bool_))


def chain_axes(energy: Tensor, key: Tensor) -> tuple[int, ...]:
    """The chain shape ``key.shape[:-1]``; ``energy`` (one per chain) must have it. Metadata only."""
    _checks.check_key(key)
    batch = tuple(key.shape[:-1])
    if tuple(energy.shape) != batch:
        raise ValueError(
            f"key has chain shape {batch} but the state's energy has shape {tuple(energy.shape)}: "
            "pass one key per chain, with the chain axes leading both (keys (*chains, 2))"
        )
    return batch


def per_chain(name: str, value: Tensor, batch: tuple[int, ...], like: Tensor, host_scalar: bool = False) -> Tensor:
    """A tunable reshaped to broadcast against ``like: (*batch, ...)``, in ``like``'s dtype and device.

    ``host_scalar``: for a kernel that uses the tunable only in elementwise arithmetic with device
    tensors (Langevin, MALA), a 0-dim CPU tensor stays a 0-dim CPU tensor eagerly (``like``'s dtype):
    torch's operators take it beside device tensors as a scalar, where a copy to the device would
    wait for the device at every step (a pageable host-to-device copy; two a Langevin step)."""
    _checks.check_tunable_shape(name, value, batch)
    if (host_scalar and value.ndim == 0 and value.device.type == "cpu" and like.device.type != "cpu"
            and _checks.is_concrete(value)):
        return value.to(dtype=like.dtype)
    value = value.to(dtype=like.dtype, device=like.device)
    return value.reshape(tuple(value.shape) + (1,) * (like.ndim - value.ndim))


def check_energy(energy_fn: Any) -> None:
    _checks.check_callable("energy_fn", energy_fn, "x -> E(x) (one sample in, a 0-dim energy out)")


def check_position(position: Any, energy_fn: Any) -> None:
    """``position`` is one chain's floating tensor, matching the energy's dtype, device and dimension.

    Reads metadata only (free under ``torch.compile`` and ``vmap``), except the finiteness
    check, which runs where the position is concrete (eager, unmapped).
    """
    if not isinstance(position, Tensor):
        raise TypeError(f"position must be a torch.Tensor, got {type(position).__name__}")
    if not position.is_floating_point():
        raise TypeError(f"position must be a floating tensor, got dtype {position.dtype}")
    dtype, device = getattr(energy_fn, "dtype", None), getattr(energy_fn, "device", None)
    if isinstance(dtype, torch.dtype) and position.dtype != dtype:
        raise TypeError(
            f"position has dtype {position.dtype} but the energy's parameters are {dtype}; "
            f"convert one of them (e.g. energy.to(dtype={position.dtype}))"
        )
    if isinstance(device, torch.device) and position.device.type != device.type:
        raise ValueError(
            f"position is on {position.device} but the energy's parameters are on {device}; "
            f"move one of them (e.g. energy.to(device='{position.device}'))"
        )
    check_dim = getattr(energy_fn, "check_dim", None)
    if callable(check_dim):  # fnebm's energies take one vector (dim,)
        if position.ndim != 1:
            raise ValueError(
                f"init takes one chain's position of shape (dim,), got shape {tuple(position.shape)}; "
                "for many chains map it: torch.func.vmap(alg.init)(positions)"
            )
        try:
            check_dim(position.shape[0])
        except ValueError as e:
            raise ValueError(f"position of shape {tuple(position.shape)} does not fit the energy: {e}") from None
    if _checks.is_concrete(position) and not bool(torch.isfinite(position).all()):
        raise ValueError("position must be finite (no NaN or inf): a chain started there never moves")


def init_position_state(state_type: type, position: Tensor, energy_fn: Callable[[Tensor], Tensor]) -> Any:
    """``state_type(position, E(position), dE/dx)`` for one chain, after the boundary checks:
    the ``init`` of every sampler whose state caches the energy and gradient."""
    check_energy(energy_fn)
    check_position(position, energy_fn)
    return state_type(position, *energy_and_grad(energy_fn, position))


def energy_and_grad(energy_fn: Callable[[Tensor], Tensor], position: Tensor) -> tuple[Tensor, Tensor]:
    """``(E(x), dE/dx)`` at ``init``, with errors that name the energy when it does not take one sample."""
    batched_hint = (
        "an energy takes one sample x and returns a 0-dim energy; a batched energy "
        "E(X: (n, d)) -> (n,) can be wrapped as lambda x: E(x[None])[0]"
    )
    declared = batch_form(energy_fn) is not None
    try:
        # an energy with a batch form checks its output's shape itself (one energy per sample), so the
        # pair is computed at once: no separate forward pass that only looks at the value's shape
        value, grad = value_and_grad(energy_fn)(position) if declared else (energy_fn(position), None)
    except (IndexError, RuntimeError) as e:
        raise ValueError(
            f"energy_fn failed on one sample of shape {tuple(position.shape)} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); {batched_hint}"
        ) from e
    if not isinstance(value, Tensor):
        raise TypeError(
            f"energy_fn must return a 0-dim tensor, got {type(value).__name__}; {batched_hint}"
        )
    if value.ndim != 0:
        raise ValueError(
            f"energy_fn must return a 0-dim energy for one sample, got shape {tuple(value.shape)} "
            f"for a position of shape {tuple(position.shape)}. If the position holds many chains, "
            f"use torch.func.vmap(alg.init)(positions); otherwise {batched_hint}"
        )
    if not value.is_floating_point():
        raise TypeError(f"energy_fn must return a floating tensor, got dtype {value.dtype}")
    return (value, grad) if declared else value_and_grad(energy_fn)(position)
