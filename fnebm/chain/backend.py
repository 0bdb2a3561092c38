"""Which engine runs a :func:`fnebm.sample_chain` call: a hand-written Triton kernel (CUDA), a
hand-written C kernel (CPU), the compiled runner, or eager code
(``backend="auto" | "triton" | "c" | "compiled" | "eager"``).

A kernel serves a run only when it computes exactly what the run asks for:

* the step is ``fnebm.langevin(energy, step_size, noise_scale).step`` or
  ``fnebm.mala(energy, step_size).step`` (a ``functools.partial`` of the sampler's kernel;
  anything wrapping one is opaque and runs as before);
* the energy is one :mod:`fnebm.kernels.langevin_chain` computes in closed form (double well,
  harmonic, diagonal Gaussian, Rastrigin: exact types, parameters on the chains' device);
* the state is that sampler's state, float32, one event axis of at most ``MAX_DIM`` elements;
  the step size and noise scale are 0-dim or per chain;
* ``collect`` is the default (the position), and no gradient is taken through the chain;
* the chains are on a CUDA device and triton is installed.

The C kernel (:mod:`fnebm.kernels.cpu_chain`) serves the same runs on a CPU, for Langevin and
MALA on a double well, harmonic, Rastrigin or Gaussian energy (diagonal or full), once the system C
compiler has built it (once per machine, cached on disk; build times in docs/performance.md).

``"auto"`` takes the Triton kernel on a CUDA device and the C kernel on the CPU when all of that
holds — on the CPU only when ``compile`` is not ``False``, which asks for the eager steps — and
otherwise runs the compiled or eager path (``sample_chain``'s ``compile`` decides); it decides
without importing triton. ``"triton"`` and ``"c"`` take their kernel or raise ``ValueError``
saying which condition failed. ``"compiled"`` and ``"eager"`` never take it and mean ``compile=True`` and
``compile=False``. The kernel draws from the same keys as the samplers (``fold_in(keys[c], t)``,
MALA's split), so every backend gives the same chain to float tolerance.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fnebm.chain.loop import needs_grad, position, position_and_energy
from fnebm.chain.schedule import kept_in
# fnebm.samplers exports the constructors langevin and mala, which hide these modules' names
_langevin = importlib.import_module("fnebm.samplers.langevin")
_mala = importlib.import_module("fnebm.samplers.mala")

__all__ = ["BACKENDS", "UNAVAILABLE", "check_backend", "compile_setting", "kernel_runner", "unavailable_kernel",
           "why_not"]

BACKENDS = ("auto", "triton", "c", "compiled", "eager")

# Private switch for tests: let backend="triton" run the kernel on CPU tensors when Triton runs
# under its interpreter (TRITON_INTERPRET=1). "auto" never does.
_INTERPRETER_ON_CPU = os.environ.get("FNEBM_TRITON_ON_CPU") == "1"


def check_backend(backend: Any) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")
    return backend


def compile_setting(backend: str, compile: Any) -> Any:
    """``sample_chain``'s ``compile`` under ``backend``: ``"eager"`` is ``False``, ``"compiled"``
    ``True``; ``"auto"``, ``"triton"`` and ``"c"`` leave it (it decides when no kernel runs)."""
    backend = check_backend(backend)
    return {"eager": False, "compiled": True}.get(backend, compile)


def _chain_module():
    # fnebm.kernels exports the function langevin_chain, which hides the module's name
    return importlib.import_module("fnebm.kernels.langevin_chain")


def _sampler(step: Any) -> tuple[str, Any, Tensor, Tensor] | None:
    """``(kind, energy, step_size, noise_scale)`` when ``step`` is fnebm's Langevin or MALA step."""
    if not isinstance(step, functools.partial) or step.args:
        return None
    kw = step.keywords
    if step.func is _langevin._kernel and set(kw) == {"energy_fn", "step_size", "noise_scale"}:
        return "langevin", kw["energy_fn"], kw["step_size"], kw["noise_scale"]
    if step.func is _mala._kernel and set(kw) == {"energy_fn", "step_size"}:
        return "mala", kw["energy_fn"], kw["step_size"], None
    return None


def _cpu_module():
    return importlib.import_module("fnebm.kernels.cpu_chain")


def _sampler_and_state(step: Any, chain: Any) -> str | tuple[str, Any, Any, Any]:
    """``(kind, energy, step_size, noise_scale)`` when ``step`` is fnebm's Langevin or MALA step on
    its own state (what both kernels run), else the reason it is not."""
    found = _sampler(step)
    if found is None:
        return ("step is not fnebm.langevin(...).step or fnebm.mala(...).step (the kernels run those two "
                "samplers on the state they step)")
    kind = found[0]
    state_type = _langevin.LangevinState if kind == "langevin" else _mala.MALAState
    if type(chain.state) is not state_type:
        return f"the state is a {type(chain.state).__name__}, not the {state_type.__name__} that {kind} steps"
    return found


def why_not_c(step: Any, chain: Any, collect: Callable) -> str | None:
    """``None`` when the C kernel can run this chain (a ``ChainState``), else the first reason it cannot."""
    found = _sampler_and_state(step, chain)
    if isinstance(found, str):
        return found
    _, energy, step_size, noise_scale = found
    state = chain.state
    if collect is not position and collect is not position_and_energy:
        return ("collect is neither the default (the position) nor fnebm.chain.position_and_energy: the kernel "
                "writes those only")
    x = state.position
    if x.device.type != "cpu":
        return f"the chains are on {x.device.type}, not the CPU (the C kernel runs on the CPU)"
    cc = _cpu_module()
    return _covered(cc, step, chain, energy, step_size, noise_scale, max_dim=None) or cc.available()


def _covered(module: Any, step: Any, chain: Any, energy: Any, step_size: Any, noise_scale: Any,
             max_dim: int | None) -> str | None:
    """What both kernels check once the chains' device fits: the energy (``module.covers``), the
    dtypes, shapes and tunables (:func:`_common`), and no gradient through the chain."""
    state = chain.state
    reason = module.covers(energy) or _common(state.position, energy, state, chain, step_size, noise_scale,
                                              max_dim=max_dim)
    if reason is not None:
        return reason
    if needs_grad(step, state):
        return "a gradient is taken through the chain (the kernels have no backward)"
    return None


def _common(x: Tensor, energy: Any, state: Any, chain: Any, step_size: Any, noise_scale: Any,
            max_dim: int | None) -> str | None:
    """The checks both kernels make on dtypes, devices, shapes and tunables."""
    device = x.device
    held = [x, state.energy, state.grad, chain.keys, chain.steps_taken, *(
        t for t in (step_size, noise_scale, *pytree.tree_leaves(energy)) if isinstance(t, Tensor))]
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in held if isinstance(t, Tensor)):
        return "the run is inside a torch.func transform (vmap, grad): the kernels read plain tensors"
    if x.dtype != torch.float32:
        return f"the position is {x.dtype}; the kernels cover float32 (the stream's normals are float32)"
    if energy.dtype != x.dtype or energy.device != device:
        return (f"the energy's parameters are {energy.dtype} on {energy.device}, not the position's {x.dtype} "
                f"on {device}")
    chains = tuple(chain.keys.shape[:-1])
    if x.ndim != len(chains) + 1:
        return f"the position {tuple(x.shape)} is not (*chains, d) for chains {chains}: the kernels take one event axis"
    d = x.shape[-1]
    try:  # an energy for another dimension: the kernels would read its parameters at the wrong size
        energy.check_dim(d)
    except ValueError as exc:
        return f"the energy does not take the position's {d} elements per chain ({exc})"
    if max_dim is not None and d > max_dim:
        return f"the position has {d} elements per chain, more than the kernels' MAX_DIM={max_dim}"
    if any(t.device != device or t.dtype != x.dtype for t in (state.energy, state.grad)):
        return "the state's energy and grad are not on the position's device and dtype"
    for name, t in (("step_size", step_size), ("noise_scale", noise_scale)):
        if t is None:
            continue
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
            return f"{name} is not a floating tensor"
        if t.ndim and (t.device != device or t.ndim > len(chains)
                       or any(a not in (b, 1) for a, b in zip(t.shape, chains))):
            return f"{name} of shape {tuple(t.shape)} on {t.device} is neither 0-dim nor per chain {chains} on {device}"
    return None


def why_not(step: Any, chain: Any, collect: Callable) -> str | None:
    """``None`` when the Triton kernel can run this chain (a ``ChainState``), else the first reason it cannot."""
    found = _sampler_and_state(step, chain)
    if isinstance(found, str):
        return found
    _, energy, step_size, noise_scale = found
    state = chain.state
    if collect is not position:
        return "collect is not the default (the position): the kernels write positions only"
    x = state.position
    device = x.device
    if device.type != "cuda":
        allowed = device.type == "cpu" and _INTERPRETER_ON_CPU and os.environ.get("TRITON_INTERPRET") == "1"
        if not allowed:
            return f"the chains are on {device.type}, not a CUDA device (the Triton kernels run on NVIDIA GPUs)"
    try:
        lc = _chain_module()
    except ImportError:  # pragma: no cover - triton is a dependency of torch's CUDA builds
        return "triton is not installed"
    if not lc.HAS_TRITON:  # pragma: no cover
        return "triton is not installed"
    return _covered(lc, step, chain, energy, step_size, noise_scale, max_dim=lc.MAX_DIM)


UNAVAILABLE = "covers this run but could not be used"  # in the note of unavailable_kernel


def unavailable_kernel(step: Any, chain: Any, collect: Callable, backend: str, compile: Any) -> str | None:
    """A note for ``on_plan`` when a C kernel covers this CPU run under ``backend="auto"`` but its
    library did not build or load (no compiler, a failed build, a damaged cache that could not be
    rebuilt): ``"the C kernel covers this run but could not be used (why)"``; else ``None``.

    The whole-chain kernel (Langevin, MALA; not under ``compile=False``) and the NUTS kernel,
    which a ``fnebm.nuts(...).step`` takes by itself, are checked. It asks the library only where
    everything else fits, after :func:`kernel_runner` has (no second build is tried)."""
    if backend != "auto" or chain.keys.device.type != "cpu":
        return None
    nuts = importlib.import_module("fnebm.samplers.nuts")
    if (isinstance(step, functools.partial) and step.func is nuts._step and step.keywords.get("backend") == "auto"
            and type(chain.state) is nuts.NUTSState):
        x = chain.state.position
        energy = step.keywords.get("energy_fn")
        if _cpu_module().covers(energy) is not None or x.dtype != torch.float32 or energy.dtype != x.dtype:
            return None
        why = importlib.import_module("fnebm.kernels.cpu_nuts").available()
        return None if why is None else f"the NUTS C kernel {UNAVAILABLE} ({why}); the torch kernel ran"
    if compile is False:
        return None
    found = _sampler_and_state(step, chain)
    if isinstance(found, str) or (collect is not position and collect is not position_and_energy):
        return None
    _, energy, step_size, noise_scale = found
    cc = _cpu_module()
    if _covered(cc, step, chain, energy, step_size, noise_scale, max_dim=None) is not None:
        return None
    why = cc.available()
    return None if why is None else f"the C kernel {UNAVAILABLE} ({why})"


def kernel_runner(step: Any, chain: Any, n_steps: int, *, burn_in: int, thin: int, collect: Callable,
                  backend: str, compile: Any = "auto") -> Callable[..., tuple[Any, Any, Any]] | None:
    """A runner that serves this ``sample_chain`` call with a hand-written kernel, or ``None``.

    ``chain``: the checked :class:`~fnebm.chain.ChainState`. ``None`` for ``"compiled"`` and
    ``"eager"``, and for ``"auto"`` where a kernel does not apply (on the CPU also when
    ``compile`` is ``False``); ``"triton"`` and ``"c"`` where their kernel does not apply raise
    ``ValueError`` with the reason. The runner takes ``out``, ``chunk_size``, ``progress`` and
    ``on_chunk`` as ``sample_chain`` does and returns its ``(chain, trace, info)``; its
    ``engine`` attribute names the kernel (``"triton"`` or ``"c"``).
    """
    backend = check_backend(backend)
    if backend in ("compiled", "eager"):
        return None
    on_cpu = chain.keys.device.type == "cpu"
    if backend == "c" or (backend == "auto" and on_cpu):
        if backend == "auto" and compile is False:
            return None
        reason = why_not_c(step, chain, collect)
        if reason is not None:
            if backend == "c":
                raise ValueError(f'backend="c" cannot run this chain: {reason}. '
                                 'backend="auto" runs it with the compiled runner or eagerly instead, as compile says')
            return None
        run = functools.partial(_run, step, chain, n_steps, burn_in, thin, engine="c", collect=collect)
        run.engine = "c"
        return run
    if backend == "auto" and chain.keys.device.type != "cuda":
        return None  # decided before triton is imported
    reason = why_not(step, chain, collect)
    if reason is not None:
        if backend == "triton":
            raise ValueError(f'backend="triton" cannot run this chain: {reason}. '
                             'backend="auto" runs it with the compiled runner or eagerly instead, as compile says')
        return None
    run = functools.partial(_run, step, chain, n_steps, burn_in, thin, engine="triton")
    run.engine = "triton"
    return run


def _buffers(out: Any, kind: str, x: Tensor, chains: tuple[int, ...], n_kept: int,
             with_energy: bool = False) -> tuple[Any, Any, Any]:
    """``(trace, info, copy_to)``: the buffers the kernel writes — the caller's ``out`` when its
    tensors are contiguous, else fresh ones then copied into ``copy_to`` (``out``, or ``None``).
    ``trace`` is ``(positions, energies)`` when ``with_energy``, else the positions."""
    flag = torch.empty((n_kept,) + chains, dtype=torch.bool, device=x.device)
    trace = torch.empty((n_kept,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    if with_energy:
        trace = (trace, torch.empty((n_kept,) + chains, dtype=x.dtype, device=x.device))
    if kind == "mala":
        info = _mala.MALAInfo(torch.empty((n_kept,) + chains, dtype=x.dtype, device=x.device), flag, flag.clone())
    else:
        info = _langevin.LangevinInfo(flag)
    if out is None:
        return trace, info, None
    want = pytree.tree_leaves((trace, info))
    pair = isinstance(out, tuple) and len(out) == 2
    if not pair or pytree.tree_structure(out) != pytree.tree_structure((trace, info)):
        raise ValueError(f"out must be a (trace, info) pair as this run returns: a tensor and a {type(info).__name__}")
    for got, w in zip(pytree.tree_leaves(out), want):
        if not isinstance(got, Tensor) or got.shape != w.shape or got.dtype != w.dtype or got.device != w.device:
            shapes = [(tuple(t.shape), t.dtype) for t in want]
            raise ValueError(f"out's buffers must have the shapes and dtypes {shapes} "
                             f"on {x.device}")
    if all(t.is_contiguous() for t in pytree.tree_leaves(out)):
        return out[0], out[1], None  # the kernel writes the caller's buffers directly
    return trace, info, out


def _run(step, chain, n_steps: int, burn_in: int, thin: int, *, engine: str, collect: Callable = position, out=None,
         chunk_size: int | None = None, progress: bool | None = None,
         on_chunk: Callable | None = None) -> tuple[Any, Any, Any]:
    from fnebm.chain.sample import ChainState  # sample imports this module

    lc = _cpu_module() if engine == "c" else _chain_module()
    kind, energy, step_size, noise_scale = _sampler(step)
    state, keys = chain.state, chain.keys
    x = state.position
    chains = tuple(keys.shape[:-1])
    h = _per_chain(step_size, x, chains)
    s = _per_chain(noise_scale if noise_scale is not None else torch.ones(()), x, chains)
    n_kept = n_steps // thin
    with_energy = collect is position_and_energy
    trace, info, copy_to = _buffers(out, kind, x, chains, n_kept, with_energy)
    outputs = (trace[0] if with_energy else trace, *info)
    more = {"energy_trace": trace[1]} if with_energy else {}
    total = burn_in + n_steps
    show = sys.stderr.isatty() if progress is None else bool(progress)
    if chunk_size is None:
        chunk_size = -(-total // 20) if show else total  # one launch unless a bar shows
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="step", desc=f"sampling ({engine})", file=sys.stderr)
    e, g = state.energy, state.grad
    # The C kernel's launches are also cut by time (_SLICE_S each): Python raises a Ctrl-C's
    # KeyboardInterrupt only once a ctypes call returns, so a launch's length bounds the wait.
    # Any cut gives the same draws (step t's key is fold_in(key, t) wherever a launch starts).
    timed = engine == "c"
    size = min(chunk_size, _first_slice(x, energy)) if timed else max(chunk_size, 2)
    a = 0
    try:
        while a < total:
            b = min(total, a + size)
            if total - b == 1 and not timed:  # as fnebm.chain.schedule.chunks: no lone last step
                b = total
            t0 = time.perf_counter()
            k = kept_in(a, b, burn_in, thin, n_kept)
            first, n_keep, j0 = (k.lo, k.j1 - k.j0, k.j0) if k is not None else (b - a, 0, 0)
            x, e, g = lc.run_into(energy, x, e, g, keys, chain.steps_taken + a, h, s, outputs, mala=kind == "mala",
                                  n_total=b - a, first=first, thin=thin, n_keep=n_keep, j0=j0, **more)
            if timed:
                size = _next_slice(b - a, time.perf_counter() - t0, chunk_size)
            if on_chunk is not None:
                if x.device.type != "cpu":
                    torch.accelerator.synchronize(x.device)
                on_chunk(b, total, time.perf_counter() - t0)
            if bar is not None:
                bar.update(b - a)
            a = b
    finally:
        if bar is not None:
            bar.close()
    if copy_to is not None:  # out= with non-contiguous buffers
        for buf, new in zip(pytree.tree_leaves(copy_to), pytree.tree_leaves((trace, info))):
            buf.copy_(new)
        trace, info = copy_to
    final = type(state)(x, e, g)
    return ChainState(final, keys, chain.steps_taken + total), trace, info


_SLICE_S = 0.25  # the longest a launch of the C kernel should take (then Ctrl-C is seen)
# The first launch's work, before a rate is measured: steps x chains x elements (x d for a full
# Gaussian, d multiply-adds an element). 2**24 is about 50 ms at W1's rate on 2 quiet cores of this
# project's CPU host (29 ms for 10**7), 0.4 s at load average 6 there; W1 and W3 (10,000 chains x
# 10 x 100 steps) stay one launch (two launches cost them 1.10x and 1.16x at that load).
_FIRST_SLICE_WORK = 1 << 24
_GROWTH = 8  # a launch is at most this many times the one before


def _first_slice(x: Tensor, energy: Any = None) -> int:
    """The first launch's steps, before a rate is measured: tens of milliseconds' work."""
    work = x.numel() * (x.shape[-1] if getattr(energy, "is_diagonal", True) is False else 1)
    return max(1, _FIRST_SLICE_WORK // max(1, work))


def _next_slice(steps: int, seconds: float, limit: int) -> int:
    """The next launch's steps: about ``_SLICE_S`` at the rate just measured, at most ``_GROWTH``
    times the last (one fast launch on a noisy machine does not make the next one long) and at
    most ``limit``."""
    fit = int(_SLICE_S * steps / seconds) if seconds > 0 else _GROWTH * steps
    return max(1, min(limit, _GROWTH * steps, fit))


def _per_chain(value: Tensor, x: Tensor, chains: tuple[int, ...]) -> Tensor:
    # the sampler's tunable in the position's dtype and device: 0-dim, or one value per chain
    value = value.to(dtype=x.dtype, device=x.device)
    if value.ndim == 0:
        return value
    return value.reshape(value.shape + (1,) * (len(chains) - value.ndim)).expand(chains).contiguous()
