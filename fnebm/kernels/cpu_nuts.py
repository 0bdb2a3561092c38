"""One NUTS transition of every chain on the CPU, in C: each chain builds its own tree.

For the energies of the families :mod:`fnebm.kernels.families` lists for ``"c_nuts"``, the C
kernel (``_cpu_nuts.c`` beside this file) runs the transition of :func:`fnebm.nuts` for one chain after another on
``torch.get_num_threads()`` OpenMP threads: the momentum draw, every integrator step of the
doubling trajectory with the energy and gradient in closed form, progressive and biased
multinomial sampling, the generalised U-turn checks through popcount-indexed checkpoints (with
Stan's extra checks), the divergence check, and the transition's info. Its twin is the torch
kernel of :mod:`fnebm.samplers.nuts`, a flat loop that advances every chain in lockstep and
masks the finished ones (it waits for the longest tree); this kernel computes the same
transition from the same keys (the momentum ``normal(split(key)[0], (d,))``, and
``uniform(fold_in(split(key)[1], i), 3)`` at the chain's ``i``-th integrator step) in float32.
The Philox words are bit-identical; ``log``, ``sin`` and ``cos`` of the momentum draw are
Cephes' polynomials, and dot products sum in another order, so the two agree to float
tolerance, and a tree decision that sits within rounding of its threshold can go either way.

:func:`fnebm.nuts` takes this kernel by itself (``backend="auto"``) where it applies; this
module is the launcher (:func:`nuts_step`, the op ``torch.ops.fnebm.cpu_nuts``) and the test
of what it covers (:func:`why_not`). The library builds on first use with the system C
compiler (once per machine, cached on disk; :mod:`fnebm.kernels._cbuild`; build times in docs/performance.md).
"""

from __future__ import annotations

import ctypes
import math
import threading
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fnebm.kernels import _assume_constant_result, cpu_chain, cpu_trips, families
from fnebm.kernels._cbuild import library

__all__ = ["available", "built", "build_seconds", "why_not", "nuts_step", "nuts_transitions", "nuts_warmup",
           "Warmup", "MAX_COEFFICIENTS"]

MAX_COEFFICIENTS = 15  # the C kernel's MAX_COEF: integrators of up to 7 gradient evaluations per step


class _Args(ctypes.Structure):
    _fields_ = (
        [(n, ctypes.c_int64) for n in ("n_chains", "d", "depth", "n_coef", "extra_checks", "key_stride_c",
                                       "key_stride_w", "h_stride", "m_stride", "dense")]
        + [(n, ctypes.c_void_p) for n in ("x_in", "e_in", "g_in", "h_ptr", "imm", "mfac", "scalars", "vectors",
                                          "keys", "coef")]
        + [("threshold", ctypes.c_double)]
        + [(n, ctypes.c_void_p) for n in ("x_out", "e_out", "g_out", "accept", "energy_error", "divergent",
                                          "turning", "tree_depth", "n_steps")]
    )


class _AdaptArgs(ctypes.Structure):
    _fields_ = (
        [("n_da", ctypes.c_int64), ("n_w", ctypes.c_int64), ("slow", ctypes.c_void_p), ("end", ctypes.c_void_p)]
        + [(n, ctypes.c_double) for n in ("target", "t0", "gamma", "kappa")]
        + [(n, ctypes.c_void_p) for n in ("da", "h", "w_mean", "w_m2", "w_count", "imm", "hist_da", "hist_h",
                                          "hist_mean", "hist_m2", "hist_count", "hist_imm", "at")]
    )


def _setup(lib: ctypes.CDLL) -> None:
    lib.fnebm_nuts_step.argtypes = [ctypes.POINTER(_Args), ctypes.c_int, ctypes.c_int]
    lib.fnebm_nuts_step.restype = ctypes.c_int
    lib.fnebm_nuts_begin.argtypes = [ctypes.POINTER(_Args), ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.POINTER(ctypes.c_int64)]
    lib.fnebm_nuts_begin.restype = ctypes.c_void_p
    lib.fnebm_nuts_resume.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.fnebm_nuts_resume.restype = ctypes.c_int64
    lib.fnebm_nuts_end.argtypes = [ctypes.c_void_p]
    lib.fnebm_nuts_end.restype = None
    lib.fnebm_nuts_adapt_begin.argtypes = [ctypes.POINTER(_Args), ctypes.POINTER(_AdaptArgs), ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)]
    lib.fnebm_nuts_adapt_begin.restype = ctypes.c_void_p
    lib.fnebm_nuts_adapt_resume.argtypes = lib.fnebm_nuts_resume.argtypes
    lib.fnebm_nuts_adapt_resume.restype = ctypes.c_int64
    lib.fnebm_nuts_adapt_next.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.fnebm_nuts_adapt_next.restype = ctypes.c_int64
    lib.fnebm_nuts_done.argtypes = [ctypes.c_void_p]
    lib.fnebm_nuts_done.restype = ctypes.c_int64


# built with -ffp-contract=off (fnebm._cbuild.LIBRARIES says why)
LIBRARY = library("cpu_nuts", _setup)


_prefetched = False


def prefetch() -> None:
    """Starts building this kernel's library on a thread, once per process, when it is not on disk yet
    (a first NUTS run on this machine, or after an update): the compiler runs while the run's other
    first work does (the keys' and draws' own C library, a build of its own, 0.45 s here), instead
    of after it (0.63 s here). :meth:`CLibrary.load` waits for a build under way. Called by
    :func:`fnebm.samplers.nuts.init` on CPU float32 positions, where the kernel applies unless the
    run asks for the torch backend or a gradient through the chain."""
    global _prefetched
    if _prefetched or torch.compiler.is_compiling():
        return
    _prefetched = True
    if not LIBRARY.built():
        threading.Thread(target=LIBRARY.load, name="fnebm-build-nuts", daemon=True).start()


@_assume_constant_result  # traced code asks too: it builds and loads then, once, outside the graph
def available() -> str | None:
    """``None`` when the C kernel is built (or builds now) and loads, else why not (one phrase)."""
    return LIBRARY.available()


def built() -> bool:
    """Whether the kernel is ready without compiling (loaded, failed for good, or found on disk)."""
    return LIBRARY.built()


def build_seconds() -> float:
    """Seconds this process spent compiling the kernel (0.0 when it was loaded from disk or not used)."""
    return LIBRARY.build_s


def _wrapped(t: Tensor) -> bool:
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def why_not(energy_fn: Any, position: Tensor, energy: Tensor, grad: Tensor, key: Tensor, step_size: Tensor,
            inverse_mass_matrix: Tensor, dense: bool, coefficients: Sequence[float], *,
            evaluated: bool = False) -> str | None:
    """``None`` when the C kernel runs this transition (metadata only), else the first reason it cannot.

    ``position: (*chains, d)``; ``key: (*chains, 2)``; ``step_size``: 0-dim or broadcasting against
    the chains; ``inverse_mass_matrix``: ``(d,)`` / ``(*chains, d)``, or dense ``(d, d)`` /
    ``(*chains, d, d)``. ``evaluated``: the caller can evaluate any energy between the kernel's
    steps (:func:`nuts_step`'s ``evaluate``), so an energy outside the families is covered too,
    eagerly (not while ``torch.compile`` traces: the kernel then returns to Python for every
    evaluation).
    """
    closed = families.covers(energy_fn, families.C_NUTS)
    if closed is not None:
        if not evaluated:
            return closed
        if torch.compiler.is_compiling():
            return (f"{closed}, and torch.compile is tracing the step (the kernel evaluates any other energy "
                    "from Python between its steps, eagerly)")
    held = [position, energy, grad, key, step_size, inverse_mass_matrix,
            *(t for t in pytree.tree_leaves(energy_fn) if isinstance(t, Tensor))]
    # eager under a torch.func transform: the torch kernel (the op has a vmap rule, for compiled
    # code, where Dynamo traces vmap and this test cannot run; a gradient is refused below)
    if not torch.compiler.is_compiling() and any(_wrapped(t) for t in held):
        return "the step runs inside a torch.func transform (vmap, grad): the kernel reads plain tensors"
    if torch.is_grad_enabled() and any(t.requires_grad for t in held):
        return "a gradient flows through the transition (the kernel has no backward)"
    if any(t.device.type != "cpu" for t in held):
        return "the tensors are not all on the CPU (the C kernel runs on the CPU)"
    if any(t.dtype != torch.float32 for t in held[:3] + held[6:]):
        return "the position, its energy and gradient and the energy's parameters are not all float32 (the kernel's precision)"
    if not (step_size.is_floating_point() and inverse_mass_matrix.is_floating_point()):
        return "the step size and inverse mass matrix are not floating tensors"
    chains = tuple(key.shape[:-1])
    if key.dtype != torch.int64 or key.shape[-1:] != (2,):
        return f"the key is {key.dtype} of shape {tuple(key.shape)}, not int64 (*chains, 2)"
    if position.ndim != len(chains) + 1 or tuple(position.shape[:-1]) != chains:
        return f"the position {tuple(position.shape)} is not (*chains, d) for keys {tuple(key.shape)}"
    if tuple(energy.shape) != chains or tuple(grad.shape) != tuple(position.shape):
        return (f"the state's energy {tuple(energy.shape)} and grad {tuple(grad.shape)} are not (*chains,) and "
                f"(*chains, d) for the position {tuple(position.shape)}")
    d = position.shape[-1]
    try:
        if closed is None:
            energy_fn.check_dim(d)
    except ValueError as exc:
        return f"the energy does not take the position's {d} elements per chain ({exc})"
    if step_size.ndim and (step_size.ndim > len(chains)
                           or any(a not in (b, 1) for a, b in zip(step_size.shape, chains))):
        return f"the step size of shape {tuple(step_size.shape)} is neither 0-dim nor per chain {chains}"
    if len(coefficients) > MAX_COEFFICIENTS:
        return f"the integrator has {len(coefficients)} coefficients, more than the kernel's {MAX_COEFFICIENTS}"
    return available()


def _strided(t: Tensor, chains: tuple[int, ...], event: tuple[int, ...]) -> tuple[Tensor, int]:
    """A shared ``event`` tensor (stride 0 between chains) or a per-chain one, flat and contiguous."""
    if tuple(t.shape) == event:
        return t.contiguous(), 0
    return t.reshape((-1,) + event).contiguous(), int(torch.Size(event).numel())


@torch.library.custom_op("fnebm::cpu_nuts", mutates_args=())
def _nuts_op(x: Tensor, energy: Tensor, grad: Tensor, keys: Tensor, step_size: Tensor, imm: Tensor, mfac: Tensor,
             scalars: Tensor, vectors: Tensor, coefficients: Tensor, family: int, dense: bool, depth: int,
             threshold: float, extra_checks: bool) -> list[Tensor]:
    lib = LIBRARY.load()
    if lib is None:
        raise RuntimeError(f"the C NUTS kernel is unavailable: {LIBRARY.why}")
    chains, d = tuple(x.shape[:-1]), x.shape[-1]
    n = x.numel() // d if d else 0
    event = (d, d) if dense else (d,)
    # the op is public: what the C code indexes is checked here (nuts_step passes these layouts)
    if (tuple(energy.shape) != chains or grad.shape != x.shape or tuple(keys.shape) != chains + (2,)
            or keys.dtype != torch.int64 or any(t.dtype != torch.float32 for t in (x, energy, grad, scalars, vectors))
            or step_size.numel() not in (1, n) or imm.shape != mfac.shape
            or tuple(imm.shape) not in (event, chains + event) or not 1 <= coefficients.numel() <= MAX_COEFFICIENTS
            or depth < 1):
        raise ValueError("fnebm::cpu_nuts: inconsistent arguments (float32 x (*chains, d), energy (*chains), grad "
                         "like x, int64 keys (*chains, 2), step_size of 1 or n values, imm and mfac alike, "
                         f"{event} or per chain, 1-{MAX_COEFFICIENTS} coefficients, depth >= 1)")
    xs = x.reshape(n, d).contiguous()
    gs = grad.reshape(n, d).contiguous()
    es = energy.reshape(n).contiguous()
    ks = keys.reshape(n, 2)
    h = step_size.reshape(-1).to(torch.float32).contiguous()
    m, m_stride = _strided(imm.to(torch.float32), chains, event)
    f, _ = _strided(mfac.to(torch.float32), chains, event)
    coef = coefficients.to(torch.float64).contiguous()
    scalars, vectors = scalars.contiguous(), vectors.contiguous()
    x_out, g_out, e_out = torch.empty_like(xs), torch.empty_like(gs), torch.empty_like(es)
    accept, error = torch.empty_like(es), torch.empty_like(es)
    divergent, turning = torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=torch.bool)
    tree_depth, steps = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    args = _Args(n, d, depth, coef.numel(), int(extra_checks), ks.stride(0), ks.stride(1),
                 1 if h.numel() > 1 else 0, m_stride, int(dense),
                 xs.data_ptr(), es.data_ptr(), gs.data_ptr(), h.data_ptr(), m.data_ptr(), f.data_ptr(),
                 scalars.data_ptr(), vectors.data_ptr(), ks.data_ptr(), coef.data_ptr(), float(threshold),
                 x_out.data_ptr(), e_out.data_ptr(), g_out.data_ptr(), accept.data_ptr(), error.data_ptr(),
                 divergent.view(torch.int8).data_ptr(), turning.view(torch.int8).data_ptr(), tree_depth.data_ptr(),
                 steps.data_ptr())
    if n and lib.fnebm_nuts_step(ctypes.byref(args), family, torch.get_num_threads()) != 0:
        raise MemoryError("the C NUTS kernel could not allocate its scratch")
    outs = [x_out.reshape(x.shape), e_out.reshape(chains), g_out.reshape(x.shape)]
    return outs + [t.reshape(chains) for t in (accept, divergent, turning, error, tree_depth, steps)]


@_nuts_op.register_fake
def _(x, energy, grad, keys, step_size, imm, mfac, scalars, vectors, coefficients, family, dense, depth, threshold,
      extra_checks):
    chains = tuple(x.shape[:-1])
    outs = [torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(chains),
            torch.empty_like(x, memory_format=torch.contiguous_format)]
    return outs + [x.new_empty(chains), x.new_empty(chains, dtype=torch.bool), x.new_empty(chains, dtype=torch.bool),
                   x.new_empty(chains), x.new_empty(chains, dtype=torch.int64), x.new_empty(chains, dtype=torch.int64)]


def _nuts_vmap(info, in_dims, x, energy, grad, keys, step_size, imm, mfac, scalars, vectors, coefficients, family,
               dense, depth, threshold, extra_checks):
    # vmap over chains is more chains: the mapped axis leads the chain axes of every per-chain input
    if any(dim is not None for dim in in_dims[7:10]):
        raise ValueError("the energy's parameters and the integrator cannot vary across a vmap of the C NUTS "
                         'kernel (one energy for all chains); map the torch kernel (backend="torch") instead')
    b = info.batch_size

    def lead(t: Tensor, dim: int | None) -> Tensor:
        return t.movedim(dim, 0) if dim is not None else t.expand((b,) + tuple(t.shape))

    x, energy, grad, keys = (lead(t, dim) for t, dim in zip((x, energy, grad, keys), in_dims[:4]))
    chains = tuple(x.shape[:-1])
    event = (x.shape[-1],) * (2 if dense else 1)

    def per_chain(t: Tensor, dim: int | None, shared: tuple[int, ...]) -> Tensor:
        if dim is None and tuple(t.shape) == shared:
            return t  # shared by every chain, mapped or not
        t = lead(t, dim)
        if tuple(t.shape[1:]) == shared:  # one per mapped index
            t = t.reshape((b,) + (1,) * (len(chains) - 1) + shared)
        return t.expand(chains + shared)

    step_size = per_chain(step_size, in_dims[4], ())
    imm, mfac = per_chain(imm, in_dims[5], event), per_chain(mfac, in_dims[6], event)
    outs = _nuts_op(x, energy, grad, keys, step_size, imm, mfac, scalars, vectors, coefficients, family, dense,
                    depth, threshold, extra_checks)
    return outs, [0] * len(outs)


torch.library.register_vmap("fnebm::cpu_nuts", _nuts_vmap)


def nuts_step(energy_fn: Any, position: Tensor, energy: Tensor, grad: Tensor, key: Tensor, step_size: Tensor,
              inverse_mass_matrix: Tensor, dense: bool, *, max_tree_depth: int, coefficients: Sequence[float],
              divergence_threshold: float, uturn_extra_checks: bool = True,
              evaluate: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None) -> list[Tensor]:
    """One NUTS transition of every chain: ``[position, energy, grad, acceptance_rate, is_divergent,
    is_turning, energy_error, tree_depth, num_integration_steps]`` (the fields of
    :class:`fnebm.samplers.nuts.NUTSState` and ``NUTSInfo``).

    The caller has checked the arguments with :func:`why_not`. ``step_size`` is 0-dim or per chain;
    ``inverse_mass_matrix`` diagonal or (``dense``) dense, shared or per chain. For the families,
    traces under ``torch.compile(fullgraph=True)`` as one node (the momentum's factor is computed in
    torch before it). Any other energy needs ``evaluate``: ``x: (*chains, d) -> (E (*chains,),
    dE/dx (*chains, d))``, called once per integrator evaluation for every chain at once (the
    chains advance in lockstep between calls; a finished chain's row holds its result), eagerly.
    """
    h, imm, mfac, coef = _metric(position, step_size, inverse_mass_matrix, dense, coefficients)
    if families.covers(energy_fn, families.C_NUTS) is not None:
        if evaluate is None:
            raise ValueError("nuts_step: an energy outside the C kernel's families needs `evaluate`")
        return _evaluated(evaluate, position, energy, grad, key, None, h, imm, mfac, coef, bool(dense),
                          int(max_tree_depth), float(divergence_threshold), bool(uturn_extra_checks))
    family, scalars, vectors = cpu_chain._params(energy_fn, position.shape[-1])
    return torch.ops.fnebm.cpu_nuts(position, energy, grad, key, h, imm, mfac, scalars.to(position.dtype),
                                    vectors.to(position.dtype), coef, family, bool(dense), int(max_tree_depth),
                                    float(divergence_threshold), bool(uturn_extra_checks))


def nuts_transitions(evaluate: Callable[[Tensor], tuple[Tensor, Tensor]], position: Tensor, energy: Tensor,
                     grad: Tensor, keys: Tensor, step_size: Tensor, inverse_mass_matrix: Tensor, dense: bool, *,
                     max_tree_depth: int, coefficients: Sequence[float], divergence_threshold: float,
                     uturn_extra_checks: bool = True) -> list[Tensor]:
    """``T`` NUTS transitions of every chain on an energy evaluated by ``evaluate`` (as :func:`nuts_step`'s),
    ``keys: (T, *chains, 2)`` (transition ``t`` takes ``keys[t]``): the nine fields with a leading ``T``.

    Each chain runs its transitions one after another without waiting for the others' trees (a
    chain that finished transition ``t`` starts ``t + 1`` while the others build theirs), so the
    evaluations number the longest chain's total of integrator steps rather than the sum over
    transitions of the longest tree; every transition is the one :func:`nuts_step` takes from
    the same state and key, bit for bit. Eager only (``evaluate`` runs between the kernel's steps).
    """
    h, imm, mfac, coef = _metric(position, step_size, inverse_mass_matrix, dense, coefficients)
    return _evaluated(evaluate, position, energy, grad, keys, keys.shape[0], h, imm, mfac, coef, bool(dense),
                      int(max_tree_depth), float(divergence_threshold), bool(uturn_extra_checks))


class Warmup(NamedTuple):
    """What :func:`nuts_warmup` returns, every field with a leading axis of iterations ``T``: the
    transition's ``position``, ``energy``, ``grad``, ``acceptance_rate``, ``is_divergent``
    (``(T, *chains, ...)``), and the adaptation's state after each iteration: ``dual_averaging`` (the
    five fields of :class:`fnebm.adaptation.step_size.DualAveragingState`, each ``(T, *pool)``),
    ``step_size`` (``(T, *pool)``: the one the next iteration takes), ``welford`` (``mean (T, *pool,
    d)``, ``m2 (T, *pool, d[, d])``, ``count (T,)``) and ``inverse_mass_matrix`` (``(T, *pool, d[, d])``)."""

    position: Tensor
    energy: Tensor
    grad: Tensor
    acceptance_rate: Tensor
    is_divergent: Tensor
    dual_averaging: tuple[Tensor, ...]
    step_size: Tensor
    welford: tuple[Tensor, Tensor, Tensor]
    inverse_mass_matrix: Tensor


def nuts_warmup(evaluate: Callable[[Tensor], tuple[Tensor, Tensor]], position: Tensor, energy: Tensor, grad: Tensor,
                keys: Tensor, step_size: Tensor, inverse_mass_matrix: Tensor, dense: bool, *, max_tree_depth: int,
                coefficients: Sequence[float], divergence_threshold: float, dual_averaging: Sequence[Tensor],
                welford: Sequence[Tensor], slow: Tensor, end: Tensor, target: float, t0: float, gamma: float,
                kappa: float, window_end: Callable[[Tensor, Tensor, Tensor, Sequence[Tensor]], tuple],
                uturn_extra_checks: bool = True) -> Warmup:
    """``T`` iterations of window adaptation with NUTS on an energy evaluated by ``evaluate`` (as
    :func:`nuts_transitions`'), ``keys: (T, *chains, 2)``: at iteration ``t`` every chain takes the
    transition :func:`nuts_step` takes with ``keys[t]``, the step size and the metric in force; then
    dual averaging (toward ``target``, with ``t0``, ``gamma``, ``kappa``) and, where ``slow[t]``,
    Welford's update run in C (:mod:`fnebm.adaptation`'s ``update`` functions, in float32 and their
    order of operations; torch's ``sqrt`` and ``exp`` and a mean over many chains can differ in the last bit). Where ``end[t]``,
    ``window_end(mean, m2, count, dual_averaging) -> (inverse_mass_matrix, (mean, m2, count),
    dual_averaging, step_size)`` gives the state after the window in torch (the adaptation's own
    code), and the iterations go on from it.

    ``step_size: pool``, ``inverse_mass_matrix: pool + (d,)`` or ``pool + (d, d)`` (``dense``),
    ``dual_averaging``: five tensors ``pool``, ``welford``: ``(mean pool + (d,), m2, count ())``, with
    ``pool`` either ``()`` (pooled: one step size and metric, statistics over every chain) or the
    chains' shape; all float32 on the CPU. The caller has checked the transition with :func:`why_not`.
    Pooled, a chain's next transition waits for every chain's last (its step size does); the
    iterations run in C but for the evaluations and the windows' ends.
    """
    lib = LIBRARY.load()
    if lib is None:
        raise RuntimeError(f"the C NUTS kernel is unavailable: {LIBRARY.why}")
    chains, d = tuple(position.shape[:-1]), position.shape[-1]
    n, t_n = math.prod(chains), keys.shape[0]
    pool = tuple(step_size.shape)
    n_p = math.prod(pool)
    event = (d, d) if dense else (d,)
    m_el = math.prod(event)
    f32 = dict(dtype=torch.float32)
    # the buffers C reads and writes: the step size and metric in use, dual averaging, Welford
    h = step_size.detach().to(torch.float32).reshape(n_p).clone()
    imm = inverse_mass_matrix.detach().to(torch.float32).reshape(n_p * m_el).clone()
    def factor(metric: Tensor) -> Tensor:  # the momentum's factor of an inverse mass matrix, flat
        return _metric(position, h.reshape(pool), metric.reshape(pool + event), dense, coefficients)[2].reshape(-1)

    mfac = factor(imm).contiguous()
    da = torch.stack([f.detach().to(torch.float32).reshape(n_p) for f in dual_averaging]).contiguous()
    w_mean = welford[0].detach().to(torch.float32).reshape(n_p * d).clone()
    w_m2 = welford[1].detach().to(torch.float32).reshape(n_p * m_el).clone()
    w_count = welford[2].detach().to(torch.float32).reshape(1).clone()
    slow = slow.to(torch.int8).contiguous()
    end = end.to(torch.int8).contiguous()
    hist_da, hist_h = torch.empty(t_n, 5, n_p, **f32), torch.empty(t_n, n_p, **f32)
    hist_mean, hist_m2 = torch.empty(t_n, n_p * d, **f32), torch.empty(t_n, n_p * m_el, **f32)
    hist_count, hist_imm = torch.empty(t_n, **f32), torch.empty(t_n, n_p * m_el, **f32)
    at = torch.zeros(1, dtype=torch.int64)
    ad = _AdaptArgs(n_p, n_p, slow.data_ptr(), end.data_ptr(), float(target), float(t0), float(gamma), float(kappa),
                    da.data_ptr(), h.data_ptr(), w_mean.data_ptr(), w_m2.data_ptr(), w_count.data_ptr(),
                    imm.data_ptr(), hist_da.data_ptr(), hist_h.data_ptr(), hist_mean.data_ptr(), hist_m2.data_ptr(),
                    hist_count.data_ptr(), hist_imm.data_ptr(), at.data_ptr())

    ks = keys.reshape(t_n, n, 2)
    coef = torch.tensor([float(c) for c in coefficients], dtype=torch.float64)
    args, alive, outs = _launch(  # alive: what args points into, held until the loop ends
        position, energy, grad, ks, h, 0 if n_p == 1 else 1, imm, 0 if n_p == 1 else m_el, mfac, coef, dense,
        max_tree_depth, divergence_threshold, uturn_extra_checks)
    if t_n * n:
        pending = torch.empty(n, d, **f32)
        left = ctypes.c_int64(0)
        ctx = lib.fnebm_nuts_adapt_begin(ctypes.byref(args), ctypes.byref(ad), t_n, ks.stride(0), pending.data_ptr(),
                                         ctypes.byref(left))
        if not ctx:
            raise MemoryError("the C NUTS kernel could not allocate its scratch")
        try:
            waiting, trips = left.value, [0]
            while True:
                waiting = _trips(lib.fnebm_nuts_adapt_resume, ctx, waiting, pending, evaluate, chains, n, d, trips,
                                 t_n * n)
                if waiting == 0:
                    break
                # a window ends: the new metric and dual averaging, in torch (the adaptation's own code)
                new_imm, new_w, new_da, new_h = window_end(w_mean.view(pool + (d,)), w_m2.view(pool + event),
                                                           w_count.view(()), tuple(da.unbind(0)))
                new_imm = new_imm.detach().to(torch.float32)
                imm.copy_(new_imm.reshape(-1))
                mfac.copy_(factor(new_imm))
                for buf, value in zip((w_mean, w_m2, w_count), new_w):
                    buf.copy_(value.detach().reshape(-1))
                da.copy_(torch.stack([f.detach().to(torch.float32).reshape(n_p) for f in new_da]))
                h.copy_(new_h.detach().reshape(-1))
                waiting = lib.fnebm_nuts_adapt_next(ctx, pending.data_ptr())
                if waiting == 0:
                    break
        finally:
            lib.fnebm_nuts_end(ctx)
    lead = (t_n,)
    x_out, e_out, g_out, accept, divergent = _shaped(outs, lead + tuple(position.shape), lead + chains)[:5]
    return Warmup(x_out, e_out, g_out, accept, divergent,
                  tuple(hist_da[:, i].reshape(lead + pool) for i in range(5)), hist_h.view(lead + pool),
                  (hist_mean.view(lead + pool + (d,)), hist_m2.view(lead + pool + event), hist_count),
                  hist_imm.view(lead + pool + event))


def _metric(position: Tensor, step_size: Tensor, inverse_mass_matrix: Tensor, dense: bool,
            coefficients: Sequence[float]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(h per chain or 0-dim, imm, the momentum's factor, coefficients)`` as the kernel reads them."""
    chains, d = tuple(position.shape[:-1]), position.shape[-1]
    imm = inverse_mass_matrix.to(position.dtype)
    if dense:  # M^{-1} = L L^T, and p = L^{-T} z has covariance M: the kernel takes L^{-T}
        tril = torch.linalg.cholesky(imm)
        eye = torch.eye(d, dtype=imm.dtype).expand(tril.shape)
        mfac = torch.linalg.solve_triangular(tril.mT, eye, upper=True)
    else:
        mfac = imm.rsqrt()
    h = step_size.to(position.dtype)
    if h.ndim:
        h = h.reshape(tuple(h.shape) + (1,) * (len(chains) - h.ndim)).expand(chains)
    coef = torch.tensor([float(c) for c in coefficients], dtype=torch.float64)
    return h, imm, mfac, coef


def _evaluated(evaluate: Callable[[Tensor], tuple[Tensor, Tensor]], x: Tensor, energy: Tensor, grad: Tensor,
               keys: Tensor, n_trans: int | None, step_size: Tensor, imm: Tensor, mfac: Tensor, coef: Tensor,
               dense: bool, depth: int, threshold: float, extra_checks: bool) -> list[Tensor]:
    """Transitions of every chain with ``evaluate`` between the kernel's steps: one (``n_trans=None``,
    ``keys (*chains, 2)``), or ``n_trans`` (``keys (n_trans, *chains, 2)``, outputs with that leading axis)."""
    lib = LIBRARY.load()
    if lib is None:
        raise RuntimeError(f"the C NUTS kernel is unavailable: {LIBRARY.why}")
    chains, d = tuple(x.shape[:-1]), x.shape[-1]
    n = x.numel() // d if d else 0
    t = 1 if n_trans is None else n_trans
    lead = () if n_trans is None else (n_trans,)
    event = (d, d) if dense else (d,)
    ks = keys.reshape(t, n, 2)
    h = _flat(step_size, (-1,))
    m, m_stride = _strided(imm.detach().to(torch.float32), chains, event)
    f, _ = _strided(mfac.detach().to(torch.float32), chains, event)
    args, alive, outs = _launch(  # alive: what args points into, held until the loop ends
        x, energy, grad, ks, h, 1 if h.numel() > 1 else 0, m, m_stride, f, coef, dense, depth, threshold,
        extra_checks)
    if t * n:
        if torch.autograd.profiler._is_profiler_enabled:  # named in a profile (tests look for it)
            with torch.profiler.record_function("fnebm::cpu_nuts_evaluated"):
                _drive(lib, args, t, ks.stride(0), evaluate, chains, n, d)
        else:
            _drive(lib, args, t, ks.stride(0), evaluate, chains, n, d)
    return _shaped(outs, lead + tuple(x.shape), lead + chains)


def _launch(x: Tensor, energy: Tensor, grad: Tensor, ks: Tensor, h: Tensor, h_stride: int, m: Tensor, m_stride: int,
            f: Tensor, coef: Tensor, dense: bool, depth: int, threshold: float,
            extra_checks: bool) -> tuple[_Args, tuple, list[Tensor]]:
    """The arguments of an evaluated loop (``ks: (T, n, 2)``; ``h``, ``m``, ``f``: contiguous float32, their
    strides between chains given), the tensors they point into (keep them alive until the loop ends),
    and the nine outputs, ``(T * n, ...)`` rows: position, energy, gradient, acceptance, divergent,
    turning, energy error, tree depth, integrator steps."""
    n, d = ks.shape[1], x.shape[-1]
    xs, gs, es = _flat(x, (n, d)), _flat(grad, (n, d)), _flat(energy, (n,))
    # one buffer for the float outputs: position, gradient, energy, acceptance, energy error
    rows = ks.shape[0] * n
    floats = torch.empty(2 * rows * d + 3 * rows, dtype=torch.float32)
    x_out, g_out = floats[:rows * d].view(rows, d), floats[rows * d:2 * rows * d].view(rows, d)
    e_out, accept, error = floats[2 * rows * d:].view(3, rows).unbind(0)
    flags = torch.empty(2, rows, dtype=torch.bool)
    ints = torch.empty(2, rows, dtype=torch.int64)
    args = _Args(n, d, int(depth), coef.numel(), int(extra_checks), ks.stride(1), ks.stride(2), h_stride, m_stride,
                 int(dense), xs.data_ptr(), es.data_ptr(), gs.data_ptr(), h.data_ptr(), m.data_ptr(), f.data_ptr(),
                 0, 0, ks.data_ptr(), coef.data_ptr(), float(threshold),  # no family parameters
                 x_out.data_ptr(), e_out.data_ptr(), g_out.data_ptr(), accept.data_ptr(), error.data_ptr(),
                 flags.data_ptr(), flags.data_ptr() + rows, ints.data_ptr(), ints.data_ptr() + 8 * rows)
    return args, (xs, gs, es, ks, h, m, f, coef), [x_out, e_out, g_out, accept, flags[0], flags[1], error, ints[0],
                                                   ints[1]]


def _shaped(outs: list[Tensor], shape: tuple[int, ...], each: tuple[int, ...]) -> list[Tensor]:
    """:func:`_launch`'s outputs with the positions' ``shape`` and the chains' ``each``."""
    return [o.view(shape if i in (0, 2) else each) for i, o in enumerate(outs)]


def _flat(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``t`` as contiguous float32 of ``shape``, without copying when it already is."""
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    return t.reshape(shape).contiguous()


def _drive(lib: ctypes.CDLL, args: _Args, n_trans: int, key_stride_t: int,
           evaluate: Callable[[Tensor], tuple[Tensor, Tensor]], chains: tuple[int, ...], n: int, d: int) -> None:
    pending = torch.empty(n, d, dtype=torch.float32)
    left = ctypes.c_int64(0)
    ctx = lib.fnebm_nuts_begin(ctypes.byref(args), n_trans, key_stride_t, pending.data_ptr(), ctypes.byref(left))
    if not ctx:
        raise MemoryError("the C NUTS kernel could not allocate its scratch")
    try:
        _trips(lib.fnebm_nuts_resume, ctx, left.value, pending, evaluate, chains, n, d, [0], n_trans * n)
    finally:
        lib.fnebm_nuts_end(ctx)


_HINT_EVERY = 256  # trips between two estimates of the evaluations a loop still needs (Evaluate.expect)
# trips of one run in C++ (cpu_trips) before the loop is back in Python, at most (and at most 50 ms of
# them: cpu_trips.run's max_s), so that Ctrl-C and the estimates above are never far off
_NATIVE_TRIPS = 4096


def _trips(resume: Callable, ctx: int, waiting: int, pending: Tensor,
           evaluate: Callable[[Tensor], tuple[Tensor, Tensor]], chains: tuple[int, ...], n: int, d: int,
           trips: list[int] | None = None, total: int = 0) -> int:
    """Evaluate at the kernel's pending rows and resume it until no chain waits (or ``resume`` returns a
    negative code, returned to the caller). A trip is a few microseconds of C around the evaluation, so its
    Python is kept short: outputs that are already float32, contiguous CPU tensors of the right sizes
    (a compiled evaluation's) go to the kernel as they are, anything else is checked and converted.
    Once the evaluation is a compiled graph with a C++ entry (``evaluate.native``, after a trip in
    Python whose outputs went to the kernel as they were), the trips run in C++ (:mod:`cpu_trips`),
    :data:`_NATIVE_TRIPS` at a time; a failed one is made again here, where its error raises.

    ``trips``: a one-element count of the loop's trips so far (kept across calls of one loop) and
    ``total`` the transitions the loop runs, summed over chains: every :data:`_HINT_EVERY` trips, an
    evaluator with ``expect`` is told the trips still to come at the rate so far, once 2% of the
    transitions are done."""
    at, p_ptr, nd = pending.view(chains + (d,)), pending.data_ptr(), n * d
    f32 = torch.float32
    expect = getattr(evaluate, "expect", None) if trips is not None and total > n else None
    native = getattr(evaluate, "native", None)
    count = 0 if trips is None else trips[0]
    hint = count + _HINT_EVERY - count % _HINT_EVERY
    plain = False  # the last trip's outputs went to the kernel as they were
    while waiting > 0:
        graph = native(at) if native is not None and plain else None
        if graph is not None and cpu_trips.available() is None:
            waiting, made, failed = cpu_trips.run(graph[0], graph[1], resume, ctx, waiting, pending, _NATIVE_TRIPS)
            count += made
            if failed:
                native = None  # the rest of this loop in Python, its next trip first
        else:
            e, g = evaluate(at)
            plain = (type(e) is Tensor and type(g) is Tensor and e.dtype is f32 and g.dtype is f32 and e.is_cpu
                     and g.is_cpu and e.numel() == n and g.numel() == nd and e.is_contiguous() and g.is_contiguous())
            if not plain:
                e, g = _outputs(e, g, at, chains, n, d)
            waiting = resume(ctx, e.data_ptr(), g.data_ptr(), p_ptr)
            count += 1
        if count >= hint:
            hint = count + _HINT_EVERY - count % _HINT_EVERY
            if expect is not None:
                done = LIBRARY.load().fnebm_nuts_done(ctx)
                if done * 50 >= total and done > 0:
                    expect(count * (total - done) / done)
    if trips is not None:
        trips[0] = count
    return waiting


def _outputs(e: Any, g: Any, at: Tensor, chains: tuple[int, ...], n: int, d: int) -> tuple[Tensor, Tensor]:
    """An evaluation's ``(E, grad)`` as contiguous float32 CPU tensors of ``n`` and ``n * d`` values."""
    if not (isinstance(e, Tensor) and isinstance(g, Tensor) and e.numel() == n and g.numel() == n * d):
        raise ValueError(f"the energy's evaluation at positions {tuple(at.shape)} must give energies "
                         f"{chains} and gradients {tuple(at.shape)}, got "
                         f"{tuple(getattr(e, 'shape', ()))} and {tuple(getattr(g, 'shape', ()))}")
    return _flat(e.cpu(), (n,)), _flat(g.cpu(), (n, d))
