"""Whole chains of unadjusted Langevin or MALA on the CPU, in C: the CPU counterpart of the Triton kernel.

For an analytic energy of a family :mod:`fnebm.kernels.families` lists for ``"c_chain"``, the C kernel
(``_cpu_chain.c`` beside this file) runs every step of a block of 16 chains with their
positions and gradients in vector registers: the step's key ``fold_in(keys[c], t)``, the noise
``normal(key, (d,))`` of the :mod:`fnebm.random` stream (Philox4x32-10 and Box–Muller, as
:mod:`fnebm.kernels.langevin_chain` draws it), the energy and gradient in closed form, the
divergence check (MALA: the split key, the accept/reject uniform and the proposal densities),
and the kept draws written straight into the trace. OpenMP spreads the blocks over
``torch.get_num_threads()`` threads.

It computes what ``fnebm.langevin(energy, h, s).step`` and ``fnebm.mala(energy, h).step`` do
from the same keys (tests/test_cpu_chain.py runs both), to float tolerance: the Philox words
are bit-identical, while ``log``, ``exp``, ``sin`` and ``cos`` are Cephes' single-precision
polynomials (about 1 ulp) where the samplers use ATen's or Sleef's, so the normals differ in the
last bits and a chain's positions drift apart by rounding over many steps, as the compiled and
eager paths do.

**Built on first use** with the system C compiler (``$CC``, else ``cc``; build times in docs/performance.md) for this
machine's CPU (``-march=native``), into ``$FNEBM_CACHE_DIR`` or ``~/.cache/fnebm`` under a name
that hashes the sources, the flags, the compiler and the CPU (:mod:`fnebm.kernels._cbuild`); later processes load it from
there. Where no compiler works, :func:`available` says why and ``sample_chain`` runs the
compiled runner as before. Called through ``ctypes``, which releases the GIL.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from fnebm.kernels import families
from fnebm.kernels._cbuild import FLAGS, library

__all__ = ["available", "built", "build_seconds", "covers", "langevin_chain", "mala_chain", "run_into", "FLAGS"]



class _Args(ctypes.Structure):
    _fields_ = (
        [(n, ctypes.c_int64) for n in ("n_chains", "d", "key_stride_c", "key_stride_w", "start", "h_stride",
                                       "s_stride")]
        + [(n, ctypes.c_void_p) for n in ("x_in", "e_in", "g_in", "h_ptr", "s_ptr", "scalars", "vectors", "keys")]
        + [(n, ctypes.c_int64) for n in ("n_total", "first", "thin", "n_keep", "j0")]
        + [(n, ctypes.c_void_p) for n in ("x_out", "e_out", "g_out", "trace", "div", "rate", "acc", "e_trace")]
    )


def _setup(lib: ctypes.CDLL) -> None:
    for fn in (lib.fnebm_langevin_chain, lib.fnebm_mala_chain):
        fn.argtypes = [ctypes.POINTER(_Args), ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int


# Langevin and MALA are the one source compiled twice (-DFNEBM_MALA=0/1), in parallel
LIBRARY = library("cpu_chain", _setup)


def built() -> bool:
    """Whether the kernel is ready without compiling: loaded, failed for good, or found on disk.
    ``False`` means that the first run it serves compiles it first (seconds): the command line
    says so before that wait."""
    return LIBRARY.built()


def build_seconds() -> float:
    """Seconds this process spent compiling the kernel (0.0 when it was loaded from disk or not used)."""
    return LIBRARY.build_s


def _load() -> ctypes.CDLL | None:
    return LIBRARY.load()


def available() -> str | None:
    """``None`` when the C kernel is built (or builds now) and loads, else why not (one phrase)."""
    return LIBRARY.available()


def covers(energy_fn) -> str | None:
    """``None`` if the C kernel computes ``energy_fn`` in closed form (a family of
    :mod:`fnebm.kernels.families` for ``"c_chain"``), else why not (one phrase)."""
    return families.covers(energy_fn, families.C_CHAIN)


def _params(energy_fn, d: int) -> tuple[int, Tensor, Tensor]:
    """``(family id, scalars, vectors)`` as the C kernels read them (float32, contiguous)."""
    family, scalars, vectors = families.pack(energy_fn, d)
    return family, scalars.to(torch.float32).contiguous(), vectors.to(torch.float32).contiguous()


def run_into(energy_fn, position: Tensor, energy: Tensor, grad: Tensor, keys: Tensor, start: Tensor | int,
             step_size: Tensor, noise_scale: Tensor, outputs: tuple[Tensor, ...], *, mala: bool, n_total: int,
             first: int, thin: int, n_keep: int, j0: int,
             energy_trace: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``n_total`` Langevin (or MALA) steps of every chain from stream index ``start``, writing
    the kept draws into ``outputs = (trace (draws, *chains, d), *info (draws, *chains))`` (the
    info: Langevin's is_divergent; MALA's acceptance rate, is_accepted, is_divergent).

    As :func:`fnebm.kernels.langevin_chain.run_into`: step ``s`` is kept as draw
    ``j0 + (s - first) // thin`` when ``s >= first``, ``(s - first) % thin == 0`` and fewer than
    ``n_keep`` were kept before. float32 CPU tensors; ``step_size`` and ``noise_scale`` 0-dim or one
    per chain (contiguous; MALA ignores the noise scale); ``outputs`` contiguous. ``energy_trace``
    (``(draws, *chains)``, contiguous), when given, gets the energy at each kept step too. The caller has checked the arguments
    (:func:`covers`, dtype, shapes). Returns the final ``(position, energy, grad)``.
    """
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the C kernel is unavailable: {LIBRARY.why}")
    d = position.shape[-1]
    n = keys.numel() // 2
    if keys.dtype != torch.int64 or keys.device.type != "cpu":
        raise TypeError(f"keys must be an int64 CPU tensor for the C kernel, got {keys.dtype} on {keys.device}")
    if tuple(keys.shape[:-1]) != tuple(position.shape[:-1]) or keys.shape[-1:] != (2,):
        raise ValueError(f"keys must be (*chains, 2) for a position (*chains, d), got {tuple(keys.shape)} and "
                         f"{tuple(position.shape)}")
    for name, t in (("position", position), ("energy", energy), ("grad", grad), ("step_size", step_size),
                    ("noise_scale", noise_scale), *((f"outputs[{i}]", o) for i, o in enumerate(outputs[:1]))):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise TypeError(f"{name} must be a float32 CPU tensor for the C kernel, got {t.dtype} on {t.device}")
    for name, t in (("step_size", step_size), ("noise_scale", noise_scale)):
        if t.numel() not in (1, n):  # one value, or one per chain in the chains' order
            raise ValueError(f"{name} must hold 1 or {n} values (one per chain), got shape {tuple(t.shape)}")
    draws = outputs[0].shape[0] if outputs[0].ndim else 0
    want = [(tuple(position.shape), torch.float32)] + [(tuple(keys.shape[:-1]), dt) for dt in
                                                        ((torch.float32, torch.bool, torch.bool) if mala else (torch.bool,))]
    if energy_trace is not None:
        want.append((tuple(keys.shape[:-1]), torch.float32))
    given = list(outputs) + ([] if energy_trace is None else [energy_trace])
    if len(given) != len(want) or any(not t.is_contiguous() or tuple(t.shape[1:]) != shape or t.dtype != dt
                                      or t.shape[0] != draws or t.device.type != "cpu"
                                      for t, (shape, dt) in zip(given, want)):
        raise ValueError(f"outputs must be contiguous CPU tensors (draws, ...) of the shapes and dtypes {want}")
    if min(n_total, thin) < 1 or min(first, n_keep, j0) < 0 or j0 + n_keep > draws:
        raise ValueError(f"bad schedule: n_total={n_total}, first={first}, thin={thin}, n_keep={n_keep}, j0={j0} "
                         f"for {draws} draws")
    energy_fn.check_dim(d)  # ValueError: its parameters would be read at the wrong size
    family, scalars, vectors = _params(energy_fn, d)
    return _launch(lib, family, scalars, vectors, position, energy, grad, keys, int(start), step_size, noise_scale,
                   outputs, mala, n_total, first, thin, n_keep, j0, energy_trace)


def _launch(lib, family, scalars, vectors, position, energy, grad, keys, start: int, step_size, noise_scale, outputs,
            mala, n_total, first, thin, n_keep, j0, energy_trace):
    d = position.shape[-1]
    n = keys.numel() // 2
    x = position.reshape(n, d).contiguous()
    g = grad.reshape(n, d).contiguous()
    e = energy.reshape(n).contiguous()
    k = keys.reshape(n, 2)
    h = step_size.reshape(-1).contiguous()
    s = noise_scale.reshape(-1).contiguous()
    x_out, g_out, e_out = torch.empty_like(x), torch.empty_like(g), torch.empty_like(e)
    scalars, vectors = scalars.to(torch.float32).contiguous(), vectors.to(torch.float32).contiguous()
    trace = outputs[0]
    if mala:
        rate, acc, div = outputs[1], outputs[2].view(torch.int8), outputs[3].view(torch.int8)
        s = torch.ones((), dtype=torch.float32)
    else:
        div = outputs[1].view(torch.int8)
        rate, acc = trace, div  # not written: MALA is off
    args = _Args(n, d, k.stride(0), k.stride(1), start, 1 if h.numel() > 1 else 0, 1 if s.numel() > 1 else 0,
                 x.data_ptr(), e.data_ptr(), g.data_ptr(), h.data_ptr(), s.data_ptr(), scalars.data_ptr(),
                 vectors.data_ptr(), k.data_ptr(), n_total, first, thin, n_keep, j0,
                 x_out.data_ptr(), e_out.data_ptr(), g_out.data_ptr(), trace.data_ptr(), div.data_ptr(),
                 rate.data_ptr(), acc.data_ptr(), None if energy_trace is None else energy_trace.data_ptr())
    entry = lib.fnebm_mala_chain if mala else lib.fnebm_langevin_chain
    if n and entry(ctypes.byref(args), family, torch.get_num_threads()) != 0:
        raise MemoryError("the C kernel could not allocate its scratch")
    shape = tuple(position.shape)
    return x_out.reshape(shape), e_out.reshape(energy.shape), g_out.reshape(shape)


# ------------------------------------------------------------------------------ the ops
# As the Triton kernels, the C kernel is a torch op (``torch.ops.fnebm.cpu_chain``), so a call
# sits inside a torch.compile(fullgraph=True) graph as one opaque node; the fake gives shapes.


@torch.library.custom_op("fnebm::cpu_chain", mutates_args=())
def _chain_op(x: Tensor, energy: Tensor, grad: Tensor, keys: Tensor, start: Tensor, step_size: Tensor,
              noise_scale: Tensor, scalars: Tensor, vectors: Tensor, family: int, mala: bool, n_steps: int,
              burn_in: int, thin: int) -> list[Tensor]:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the C kernel is unavailable: {LIBRARY.why}")
    outputs = _fresh(x, n_steps // thin, mala)
    final = _launch(lib, family, scalars, vectors, x, energy, grad, keys, int(start), step_size.contiguous(),
                    noise_scale.contiguous(), outputs, mala, burn_in + n_steps, burn_in + thin - 1, thin,
                    n_steps // thin, 0, None)
    return [*final, *outputs]


def _fresh(x: Tensor, draws: int, mala: bool) -> tuple[Tensor, ...]:
    chains = (draws,) + tuple(x.shape[:-1])
    trace = torch.empty((draws,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    if mala:
        return (trace, torch.empty(chains, dtype=x.dtype, device=x.device), torch.empty(chains, dtype=torch.bool,
                device=x.device), torch.empty(chains, dtype=torch.bool, device=x.device))
    return trace, torch.empty(chains, dtype=torch.bool, device=x.device)


@_chain_op.register_fake
def _(x, energy, grad, keys, start, step_size, noise_scale, scalars, vectors, family, mala, n_steps, burn_in, thin):
    final = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (x, energy, grad)]
    return [*final, *_fresh(x, n_steps // thin, mala)]


def _run_op(energy_fn, position, energy, grad, keys, start, step_size, noise_scale, n_steps, burn_in, thin, mala):
    # the Triton launchers' checks (the module imports triton where it is installed, so not at import time here)
    from fnebm.kernels.langevin_chain import _check

    reason = covers(energy_fn)
    if reason is not None:
        raise TypeError(f"energy_fn: {reason}")
    if not isinstance(position, Tensor) or position.device.type != "cpu":
        raise TypeError(f"position must be a CPU tensor for the C kernel (the Triton kernels run on CUDA), got "
                        f"{getattr(position, 'device', type(position).__name__)}")
    _, start, h, s = _check(energy_fn, position, energy, grad, keys, start, step_size, noise_scale, n_steps,
                            burn_in, thin, dtypes=(torch.float32,), covers_fn=covers, max_dim=None)
    family, scalars, vectors = _params(energy_fn, position.shape[-1])
    h = h if h.ndim == 0 else h.contiguous()
    s = s if s.ndim == 0 else s.contiguous()
    return torch.ops.fnebm.cpu_chain(position, energy, grad, keys, start, h, s, scalars, vectors, family, mala,
                                     n_steps, burn_in, thin)


def langevin_chain(energy_fn, position: Tensor, energy: Tensor, grad: Tensor, keys: Tensor, start: Tensor | int,
                   step_size: Tensor | float, noise_scale: Tensor | float = 1.0, *, n_steps: int, burn_in: int = 0,
                   thin: int = 1):
    """Unadjusted Langevin, the whole run in one call of the C kernel (the op ``torch.ops.fnebm.cpu_chain``).

    Same arguments, meaning and result (a :class:`~fnebm.kernels.LangevinChain`) as
    :func:`fnebm.kernels.langevin_chain`, for float32 CPU tensors and an energy :func:`covers`
    says the C kernel computes; agrees with ``fnebm.langevin``'s steps to float tolerance.
    Metadata checks only: it traces under ``torch.compile(fullgraph=True)``. Not differentiable.
    """
    from fnebm.kernels.langevin_chain import LangevinChain

    return LangevinChain(*_run_op(energy_fn, position, energy, grad, keys, start, step_size, noise_scale, n_steps,
                                  burn_in, thin, mala=False))


def mala_chain(energy_fn, position: Tensor, energy: Tensor, grad: Tensor, keys: Tensor, start: Tensor | int,
               step_size: Tensor | float, *, n_steps: int, burn_in: int = 0, thin: int = 1):
    """MALA, the whole run in one call of the C kernel; as :func:`fnebm.kernels.mala_chain`
    (a :class:`~fnebm.kernels.MALAChain`), for what :func:`langevin_chain` covers."""
    from fnebm.kernels.langevin_chain import MALAChain

    return MALAChain(*_run_op(energy_fn, position, energy, grad, keys, start, step_size, 1.0, n_steps, burn_in, thin,
                              mala=True))
