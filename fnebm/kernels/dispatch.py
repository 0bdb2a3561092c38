"""Which engine runs a chain: the one table of fast paths and the one check of whether a path applies.

A chain runs on one of these engines:

* ``"torch"`` — the sampler's own step, compiled (the compiled runner) or eager, as
  ``sample_chain``'s ``compile`` says. It runs every step of every sampler.
* ``"triton"`` — a whole chain in one launch on a CUDA device (:mod:`fnebm.kernels.langevin_chain`).
* ``"c"`` — a whole chain in C on the CPU (:mod:`fnebm.kernels.cpu_chain`), or, for NUTS, each
  transition in C (:mod:`fnebm.kernels.cpu_nuts`, a torch op called from inside the step).

:data:`FAST_PATHS` says what each hand-written engine covers: the samplers (by the ``sampler``
field of their :class:`~fnebm.samplers.base.Step`), the device, the dtype, what a whole-chain
kernel writes, and the module that knows the energy families (``covers``) and whether its
library loads (``available``). :func:`why_not` is the one applicability check: it returns the
first reason a path does not apply, or ``None``. :func:`choose` applies the ``backend`` vocabulary
shared by ``sample_chain``, the samplers that have a kernel (``nuts(..., backend=)``),
``window_adaptation`` and the command line:

* ``"auto"`` — the first fast path that applies, else the torch engine; the :class:`Decision`
  lists every path it passed over and why (``on_plan`` carries it: no string to parse);
* ``"triton"`` / ``"c"`` — that engine, or a ``ValueError`` naming the first reason it cannot run;
* ``"torch"`` — never a hand-written kernel.

The energy families the kernels compute in closed form are declared in
:mod:`fnebm.kernels.families` (or each engine's ``covers``), not here. This module imports no
sampler and no chain code (kernels sit below both): it reads the step's fields.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

__all__ = ["BACKENDS", "BackendUnavailable", "UNAVAILABLE", "FAST_PATHS", "FastPath", "Decision", "Skipped", "RunRequest", "check_backend", "why_not",
           "choose", "info_buffers"]

BACKENDS = ("auto", "triton", "c", "torch")
# sample_chain's backend="compiled" / "eager" of earlier releases: the torch engine, compiled or not
_LEGACY = {"compiled": True, "eager": False}

# Private switch for tests: let backend="triton" run the kernel on CPU tensors when Triton runs
# under its interpreter (TRITON_INTERPRET=1). "auto" never does.
_INTERPRETER_ON_CPU = os.environ.get("FNEBM_TRITON_ON_CPU") == "1"


class FastPath(NamedTuple):
    """One hand-written engine and what it covers.

    engine: the ``backend`` value that forces it. scope: ``"chain"`` (whole chains: the run loop
    calls ``module.run_into`` chunk by chunk) or ``"transition"`` (one transition, a torch op the
    sampler's step calls itself). samplers: the ``Step.sampler`` names it runs. device: the
    device type. dtypes: the position dtypes. collects: what a whole-chain kernel writes
    (``"position"``, ``"position_and_energy"``). module: has ``covers(energy) -> reason | None``
    and ``available() -> reason | None``. max_dim: the module attribute bounding the event size,
    if any. info: the dtype kind of each field of the sampler's info a whole-chain kernel writes.
    families: the engine's name in :mod:`fnebm.kernels.families`, when its energies are those: an
    energy outside them is turned down before ``module`` is imported (importing the Triton kernels
    registers torch operators that load ``torch._dynamo``, a second or more, for a run they never take).
    """

    engine: str
    scope: str
    samplers: tuple[str, ...]
    device: str
    dtypes: tuple[torch.dtype, ...]
    collects: tuple[str, ...]
    module: str
    max_dim: str | None = None
    info: dict | None = None
    families: str | None = None


NAMES = {"c": "C", "triton": "Triton", "torch": "torch"}  # an engine's name in a sentence

_CHAIN_INFO = {"langevin": ("bool",), "mala": ("float", "bool", "bool")}

FAST_PATHS: tuple[FastPath, ...] = (
    FastPath("triton", "chain", ("langevin", "mala"), "cuda", (torch.float32,), ("position",),
             "fnebm.kernels.langevin_chain", max_dim="MAX_DIM", info=_CHAIN_INFO, families="triton"),
    FastPath("c", "chain", ("langevin", "mala"), "cpu", (torch.float32,), ("position", "position_and_energy"),
             "fnebm.kernels.cpu_chain", info=_CHAIN_INFO, families="c_chain"),
    FastPath("c", "transition", ("nuts",), "cpu", (torch.float32,), (), "fnebm.kernels.cpu_nuts"),
)


class Skipped(NamedTuple):
    """A fast path ``backend="auto"`` passed over: its ``engine`` and ``scope``, ``reason`` (one
    line), and ``unavailable``: the path covers the run but its library could not be built or
    loaded (no compiler, a damaged cache), which a user may want to fix."""

    engine: str
    scope: str
    reason: str
    unavailable: bool = False
    sampler: str = ""

    def describe(self) -> str:
        """One phrase: ``"the C kernel covers this run but could not be used (why)"`` for an
        unavailable kernel (a transition kernel named with its sampler: ``"the NUTS C kernel ..."``,
        whose own steps then ran), else ``"the C kernel: why not"``."""
        name = f"{self.sampler.upper()} {NAMES[self.engine]}" if self.scope == "transition" else NAMES[self.engine]
        if not self.unavailable:
            return f"the {name} kernel: {self.reason}"
        ran = "; the torch kernel ran" if self.scope == "transition" else ""
        return f"the {name} kernel {UNAVAILABLE} ({self.reason}){ran}"


UNAVAILABLE = "covers this run but could not be used"


class Decision(NamedTuple):
    """The engine that runs a chain: ``engine`` (``"triton"``, ``"c"`` or ``"torch"``), ``path``
    (the :class:`FastPath`, ``None`` for torch), ``compile`` (for torch: ``True``, ``False`` or
    ``"auto"``), ``step`` (the step to run: a NUTS step's own ``backend`` follows the chain's),
    ``skipped``: the fast paths passed over, each with why, and ``transition``: the engine of the
    step's own transition kernel when one runs inside the torch engine's steps (NUTS in C)."""

    engine: str
    path: FastPath | None
    compile: Any
    step: Any
    skipped: tuple[Skipped, ...] = ()
    transition: str | None = None

    @property
    def unavailable(self) -> Skipped | None:
        """A skipped path that covers the run but could not be used, if any."""
        return next((s for s in self.skipped if s.unavailable), None)


class RunRequest(NamedTuple):
    """What a chain asks of an engine (the chain layer fills it in; metadata only).

    step: the step (a sampler ``Step``, or anything: opaque); state: the sampler state (chain
    axes leading); keys ``(*chains, 2)``; steps_taken; collect: ``"position"``,
    ``"position_and_energy"``, or ``None`` for another ``collect``; grad: a gradient is taken
    through the chain."""

    step: Any
    state: Any
    keys: Tensor
    steps_taken: Tensor
    collect: str | None
    grad: bool


class BackendUnavailable(ValueError):
    """A forced ``backend`` (``"c"``, ``"triton"``) cannot run this chain or transition: ``reason``
    is the first reason (one line). ``backend="auto"`` would run the torch engine instead."""

    def __init__(self, backend: str, reason: str, what: str = "this chain",
                 instead: str = "the torch engine instead (compiled or eager, as compile says)"):
        self.backend, self.reason = backend, reason
        super().__init__(f'backend="{backend}" cannot run {what}: {reason}. backend="auto" runs it with {instead}')


def check_backend(backend: Any) -> str:
    if not isinstance(backend, str) or (backend not in BACKENDS and backend not in _LEGACY):
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")
    return backend


def module(path: FastPath) -> Any:
    return importlib.import_module(path.module)


def _fields(step: Any) -> Any:
    """The step's fields when it is a sampler ``Step`` (read by attribute: no sampler import)."""
    d = getattr(step, "__dict__", None)
    return step if isinstance(d, dict) and "sampler" in d and hasattr(step, "keywords") else None


def _wrapped(*ts: Any) -> bool:
    return any(isinstance(t, Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in ts)


def why_not(path: FastPath, req: RunRequest) -> str | None:
    """``None`` when ``path`` can run this chain, else the first reason it cannot (one line).

    The order: the step is a sampler the path runs, on its own state; the device; what is
    collected; the energy (the path's families); dtypes, shapes and tunables; no gradient
    through the chain; and last whether the path's library builds and loads. A transition path
    (NUTS) asks the sampler's own check, ``step.func.kernel_reason(step, state, keys)``, which
    its step also calls before each transition: one check for both.
    """
    step = _fields(req.step)
    names = " or ".join(f"fnebm.{s}(...).step" for s in path.samplers)
    if step is None or step.sampler not in path.samplers:
        what = "an opaque callable" if step is None else f"a {step.sampler} step"
        return f"the step is {what}, not {names} (the {path.engine} kernel runs those)"
    state = req.state
    if type(state) is not step.state_type:
        return f"the state is a {type(state).__name__}, not the {step.state_type.__name__} that {step.sampler} steps"
    x = state.position
    if x.device.type != path.device:
        allowed = (path.engine == "triton" and x.device.type == "cpu" and _INTERPRETER_ON_CPU
                   and os.environ.get("TRITON_INTERPRET") == "1")
        if not allowed:
            where = "a CUDA device" if path.device == "cuda" else "the CPU"
            return f"the chains are on {x.device.type}, not {where} (the {path.engine} kernel runs there)"
    if path.scope == "transition":
        if req.grad:
            return "a gradient is taken through the chain (the kernels have no backward)"
        return step.func.kernel_reason(step, state, req.keys)
    if req.collect not in path.collects:
        kept = " or ".join({"position": "the default (the position)",
                            "position_and_energy": "fnebm.chain.position_and_energy"}[c] for c in path.collects)
        return f"collect is not {kept}: the kernel writes those only"
    if path.families is not None:
        from fnebm.kernels import families  # the energies' table alone: no kernel module imported

        reason = families.covers(step.energy_fn, path.families)
        if reason is not None:
            return reason
    if path.engine == "triton":
        try:
            mod = module(path)
        except ImportError:  # pragma: no cover - triton is a dependency of torch's CUDA builds
            return "triton is not installed"
        if not getattr(mod, "HAS_TRITON", True):  # pragma: no cover
            return "triton is not installed"
    else:
        mod = module(path)
    energy = step.energy_fn
    reason = mod.covers(energy)
    if reason is not None:
        return reason
    tunables = step.tunables
    held = [x, state.energy, state.grad, req.keys, req.steps_taken, *tunables.values(), *pytree.tree_leaves(energy)]
    if _wrapped(*held):
        return "the run is inside a torch.func transform (vmap, grad): the kernels read plain tensors"
    if x.dtype not in path.dtypes:
        return f"the position is {x.dtype}; the kernels cover {', '.join(map(str, path.dtypes))} (the stream's normals)"
    if energy.dtype != x.dtype or energy.device != x.device:
        return (f"the energy's parameters are {energy.dtype} on {energy.device}, not the position's {x.dtype} "
                f"on {x.device}")
    reason = _chain_shapes(path, mod, x, energy, state, tuple(req.keys.shape[:-1]), tunables)
    if reason is not None:
        return reason
    if req.grad:
        return "a gradient is taken through the chain (the kernels have no backward)"
    return mod.available() if hasattr(mod, "available") else None


def _unavailable(path: FastPath, reason: str) -> bool:
    """Whether ``reason`` is the path's library failing to build or load (it covers the run otherwise)."""
    library = getattr(module(path), "LIBRARY", None) if path.engine == "c" else None
    return library is not None and library.why is not None and reason == library.why


def _chain_shapes(path: FastPath, mod: Any, x: Tensor, energy: Any, state: Any, chains: tuple[int, ...],
                  tunables: dict) -> str | None:
    """The whole-chain kernels' checks of shapes and tunables."""
    if x.ndim != len(chains) + 1:
        return f"the position {tuple(x.shape)} is not (*chains, d) for chains {chains}: the kernels take one event axis"
    d = x.shape[-1]
    try:  # an energy for another dimension: the kernels would read its parameters at the wrong size
        energy.check_dim(d)
    except ValueError as exc:
        return f"the energy does not take the position's {d} elements per chain ({exc})"
    max_dim = getattr(mod, path.max_dim) if path.max_dim else None
    if max_dim is not None and d > max_dim:
        return f"the position has {d} elements per chain, more than the kernels' MAX_DIM={max_dim}"
    if any(t.device != x.device or t.dtype != x.dtype for t in (state.energy, state.grad)):
        return "the state's energy and grad are not on the position's device and dtype"
    for name, t in tunables.items():
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
            return f"{name} is not a floating tensor"
        if t.ndim and (t.device != x.device or t.ndim > len(chains)
                       or any(a not in (b, 1) for a, b in zip(t.shape, chains))):
            return f"{name} of shape {tuple(t.shape)} on {t.device} is neither 0-dim nor per chain {chains} on {x.device}"
    return None


def choose(req: RunRequest, backend: str = "auto", compile: Any = "auto") -> Decision:
    """The engine for this chain under ``backend`` (see the module docstring).

    A NUTS-like step whose transition has a kernel of its own (``scope="transition"``) runs on
    the torch engine with its ``backend`` option set from the chain's: ``"torch"`` turns its
    kernel off, ``"c"`` insists on it, ``"auto"`` leaves the step's own choice.
    """
    backend = check_backend(backend)
    if backend in _LEGACY:
        backend, compile = "torch", _LEGACY[backend]
    step, skipped = req.step, []
    fields = _fields(step)
    device = req.keys.device.type
    for path in FAST_PATHS:
        if backend not in ("auto", path.engine):
            continue
        if fields is None or fields.sampler not in path.samplers:
            continue
        if backend == "auto" and path.device != device:
            continue  # another device's engine: not a candidate (and triton is not imported)
        reason = why_not(path, req)
        if reason is None:
            if path.scope == "transition":
                step = _with_backend(step, path.engine)
                traces = getattr(fields.func, "kernel_traces", None)
                if traces is not None and not traces(fields):
                    # a transition that calls back into torch (a user's energy in the C NUTS kernel):
                    # eager steps; compile=True/False says whether its evaluations are compiled
                    if compile is not None and compile != "auto":
                        step = _fields(step).replace(compile_energy=bool(compile))
                    compile = False
                return Decision("torch", None, compile, step, tuple(skipped), path.engine)
            return Decision(path.engine, path, False, step, tuple(skipped))
        unavailable = _unavailable(path, reason)
        if backend == path.engine:
            raise BackendUnavailable(backend, reason)
        skipped.append(Skipped(path.engine, path.scope, reason, bool(unavailable), fields.sampler))
    if backend in ("triton", "c"):  # no path of that engine runs this kind of step
        what = "an opaque callable" if fields is None else f"a {fields.sampler} step"
        names = [f"fnebm.{s}(...).step" for p in FAST_PATHS if p.engine == backend for s in p.samplers]
        raise BackendUnavailable(backend, f"the step is {what}, not {', '.join(names[:-1])} or {names[-1]} "
                                          f"(the {NAMES[backend]} kernels run those)")
    if backend == "torch":
        step = _with_backend(step, "torch")
    return Decision("torch", None, compile, step, tuple(skipped))


def _with_backend(step: Any, backend: str) -> Any:
    """A step whose transition can run a kernel (its ``backend`` option), set to ``backend``."""
    fields = _fields(step)
    if fields is None or "backend" not in fields.keywords or fields.keywords["backend"] == backend:
        return step
    return fields.replace(backend=backend)


def info_buffers(path: FastPath, sampler: str, info_type: type, n_kept: int, chains: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device) -> Any:
    """The info a whole-chain kernel writes, ``info_type`` of ``(n_kept, *chains)`` buffers."""
    kinds = path.info[sampler]
    return info_type(*(torch.empty((n_kept,) + chains, dtype=dtype if k == "float" else torch.bool, device=device)
                       for k in kinds))
