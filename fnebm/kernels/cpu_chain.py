"""Whole chains of unadjusted Langevin or MALA on the CPU, in C: the CPU counterpart of the Triton kernel.

For an analytic energy — :class:`~fnebm.energies.DoubleWell`, :class:`~fnebm.energies.Harmonic`,
:class:`~fnebm.energies.Rastrigin`, a :class:`~fnebm.energies.Gaussian` (diagonal or full) — the C kernel
(``_cpu_chain.c`` beside this file) runs every step of a block of 16 chains with their
positions and gradients in vector registers: the step's key ``fold_in(keys[c], t)``, the noise
``normal(key, (d,))`` of the :mod:`fnebm.random` stream (Philox4x32-10 and Box–Muller, as
:mod:`fnebm.kernels.langevin_chain` draws it), the energy and gradient in closed form, the
divergence check (MALA: the split key, the accept/reject uniform and the proposal densities),
and the kept draws written straight into the trace. OpenMP spreads the blocks over
``torch.get_num_threads()`` threads.

It computes what :func:`~fnebm.kernels.langevin_chain.langevin_chain_torch` and
:func:`~fnebm.kernels.langevin_chain.mala_chain_torch` (the twins) define, to float tolerance:
the Philox words are bit-identical, while ``log``, ``exp``, ``sin`` and ``cos`` are
Cephes' single-precision polynomials (about 1 ulp) where the twin uses ATen's or Sleef's, so
the normals differ in the last bits and a chain's positions drift apart by rounding over many
steps, as the compiled and eager paths do.

**Built on first use** with the system C compiler (``$CC``, else ``cc``; about 1.5 s on two cores) for this
machine's CPU (``-march=native``), into ``$FNEBM_CACHE_DIR`` or ``~/.cache/fnebm`` under a name
that hashes the source, the flags, the compiler and the CPU; later processes load it from
there. Where no compiler works, :func:`available` says why and ``sample_chain`` runs the
compiled runner as before. Called through ``ctypes``, which releases the GIL.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import Tensor

from fnebm.energies.analytic import DoubleWell, Gaussian, Harmonic, Rastrigin

__all__ = ["available", "built", "build_seconds", "covers", "langevin_chain", "mala_chain", "run_into", "FLAGS"]

_SOURCE = Path(__file__).with_name("_cpu_chain.c")
# -O2: as fast as -O3 here (the loops that matter are `omp simd`, vectorised either way; W1 27.6 vs
# 28.2 ms, W3 38.4 vs 39.5 ms) and half the build (1.4 s against 3.0 s on 2 cores).
# -mprefer-vector-width=512 (x86 only): GCC's tuning for AVX-512 CPUs picks 256-bit vectors unless
# told; the kernel's blocks are 16 float32 chains, one 512-bit register (ignored where there is none).
FLAGS = ("-O2", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC") + (
    ("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ())
# The energy families, as the C kernel's `family` (fnebm.kernels.langevin_chain's numbering).
_FAMILIES = {DoubleWell: 0, Harmonic: 1, Gaussian: 2, Rastrigin: 3}
_GAUSSIAN_FULL = 4  # a Gaussian with a full Cholesky factor (the C kernel's own number)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None  # why the library is unavailable, once a build failed
_build_s = 0.0  # seconds this process spent compiling the library (0 when it was found on disk)


class _Args(ctypes.Structure):
    _fields_ = (
        [(n, ctypes.c_int64) for n in ("n_chains", "d", "key_stride_c", "key_stride_w", "start", "h_stride",
                                       "s_stride")]
        + [(n, ctypes.c_void_p) for n in ("x_in", "e_in", "g_in", "h_ptr", "s_ptr", "scalars", "vectors", "keys")]
        + [(n, ctypes.c_int64) for n in ("n_total", "first", "thin", "n_keep", "j0")]
        + [(n, ctypes.c_void_p) for n in ("x_out", "e_out", "g_out", "trace", "div", "rate", "acc", "e_trace")]
    )


def _compiler() -> list[str] | None:
    """The compiler command, as ``$CC`` gives it (``"ccache gcc"`` and ``"gcc -m64"`` included), or ``None``."""
    words = shlex.split(os.environ.get("CC") or "cc")
    found = shutil.which(words[0]) if words else None
    return [found, *words[1:]] if found else None


def _cpu_id() -> str:
    # -march=native code runs only on a CPU with the same instruction sets: the cache name says which
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dirs() -> list[Path]:
    """Where the library may be built: ``$FNEBM_CACHE_DIR`` if set; else ``~/.cache/fnebm`` (or
    ``$XDG_CACHE_HOME/fnebm``), then a folder of this user's own under the temporary directory."""
    root = os.environ.get("FNEBM_CACHE_DIR")
    if root:
        return [Path(root)]
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fnebm"
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return [home, Path(tempfile.gettempdir()) / f"fnebm-{uid}"]


def _usable(folder: Path) -> bool:
    """Creates ``folder`` if needed; whether this user may build there and load from it: a folder
    others can write to could hold a planted library (Inductor checks its cache the same way)."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = folder.stat()
    except OSError:
        return False
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return False
    return True


def _name(cc: list[str]) -> str:
    """The library's file name: a hash of the source, the flags, the compiler, the CPU and torch."""
    source = _SOURCE.read_bytes()
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"the C compiler {cc} does not run: {exc}") from None
    digest = hashlib.sha256(b"\0".join([source, " ".join(cc[1:] + list(FLAGS)).encode(), version.encode(),
                                        _cpu_id().encode(), torch.__version__.encode()])).hexdigest()[:20]
    return f"cpu_chain-{digest}.so"


def _cached(name: str) -> Path | None:
    for folder in _cache_dirs():
        if (folder / name).exists() and _usable(folder):
            return folder / name
    return None


def built() -> bool:
    """Whether the kernel is ready without compiling: loaded, failed for good, or found on disk.
    ``False`` means that the first run it serves compiles it first (about 1.5 s): the command line
    says so before that wait."""
    if _lib is not None or _why is not None:
        return True
    cc = _compiler()
    if cc is None:
        return True  # nothing will be compiled
    try:
        return _cached(_name(cc)) is not None
    except RuntimeError:
        return True


def build_seconds() -> float:
    """Seconds this process spent compiling the kernel (0.0 when it was loaded from disk or not used)."""
    return _build_s


def _build(cc: list[str]) -> Path:
    """The shared library, compiled now unless a matching one is cached; raises ``RuntimeError``."""
    name = _name(cc)
    found = _cached(name)
    if found is not None:
        return found
    folders = _cache_dirs()
    usable = [f for f in folders if _usable(f)]
    if not usable:
        raise RuntimeError(f"cannot write the build cache ({', '.join(map(str, folders))}: missing, not writable, or "
                           "writable by others); set FNEBM_CACHE_DIR to a folder of your own")
    target = usable[0] / name
    global _build_s
    t0 = time.perf_counter()
    with _build_lock(target):  # one process builds; the others wait, then load its library
        if not target.exists():
            _compile(cc, target)
    _build_s += time.perf_counter() - t0
    return target


@contextlib.contextmanager
def _build_lock(target: Path):
    try:
        import fcntl
    except ImportError:  # not POSIX: builds may overlap, each ending in an atomic rename
        yield
        return
    with open(target.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(cc: list[str], target: Path) -> None:
    # compile beside the target and rename: another process never loads a half-written library.
    # Langevin and MALA are two objects compiled at once: on two cores 1.5 s in all, against 2.6 s for
    # the two compiles one after the other.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        objects = [os.path.join(work, f"chain{mala}.o") for mala in (0, 1)]
        jobs = [subprocess.Popen([*cc, *FLAGS, f"-DFNEBM_MALA={mala}", "-c", str(_SOURCE), "-o", obj],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for mala, obj in zip((0, 1), objects)]
        errors = [job.communicate(timeout=300)[1] for job in jobs]
        for job, err in zip(jobs, errors):
            if job.returncode != 0:
                first = (err.strip().splitlines() or ["no message"])[0]
                raise RuntimeError(f"{' '.join(cc)} failed to build the C kernel: {first}")
        tmp = os.path.join(work, "cpu_chain.so")
        done = subprocess.run([*cc, "-shared", "-fopenmp", *objects, "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            raise RuntimeError(f"{' '.join(cc)} failed to link the C kernel: {first}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)


def _load() -> ctypes.CDLL | None:
    global _lib, _why
    with _lock:
        if _lib is not None or _why is not None:
            return _lib
        cc = _compiler()
        if cc is None:
            _why = f"no C compiler found (set CC; tried {os.environ.get('CC') or 'cc'})"
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc)))
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            _why = str(exc)
            return None
        for fn in (lib.fnebm_langevin_chain, lib.fnebm_mala_chain):
            fn.argtypes = [ctypes.POINTER(_Args), ctypes.c_int, ctypes.c_int]
            fn.restype = ctypes.c_int
        _lib = lib
        return lib


def available() -> str | None:
    """``None`` when the C kernel is built (or builds now) and loads, else why not (one phrase)."""
    _load()
    return _why


def covers(energy_fn) -> str | None:
    """``None`` if the C kernel computes ``energy_fn`` in closed form, else why not (one phrase)."""
    family = _FAMILIES.get(type(energy_fn))
    if family is None:
        return (f"the energy {type(energy_fn).__name__} is not one the C kernel computes in closed form "
                "(DoubleWell, Harmonic, Gaussian, Rastrigin)")
    return None


def _params(energy_fn, d: int) -> tuple[int, Tensor, Tensor]:
    family = _FAMILIES[type(energy_fn)]
    if family == 2 and not energy_fn.is_diagonal:  # mean, then L row-major
        vectors = torch.cat([energy_fn.mean.reshape(d), energy_fn.precision_tril.reshape(d * d)])
        return _GAUSSIAN_FULL, torch.zeros(2, dtype=torch.float32), vectors.to(torch.float32).contiguous()
    if family == 2:
        vectors = torch.stack([energy_fn.mean, energy_fn.precision, energy_fn.precision_tril]).reshape(3, d)
        return family, torch.zeros(2, dtype=torch.float32), vectors.to(torch.float32).contiguous()
    if family == 0:
        p = torch.stack([energy_fn.barrier_height, energy_fn.b])
    else:
        p = energy_fn.k if family == 1 else energy_fn.a
        p = torch.stack([p, p])
    p = p.to(torch.float32).contiguous()
    return family, p, p


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
        raise RuntimeError(f"the C kernel is unavailable: {_why}")
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
        raise RuntimeError(f"the C kernel is unavailable: {_why}")
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
    # the twins' checks (the module imports triton where it is installed, so not at import time here)
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
    :func:`~fnebm.kernels.langevin_chain_torch`, for float32 CPU tensors and an energy :func:`covers`
    says the C kernel computes; agrees with the twin to float tolerance. Metadata checks only: it
    traces under ``torch.compile(fullgraph=True)``. Not differentiable.
    """
    from fnebm.kernels.langevin_chain import LangevinChain

    return LangevinChain(*_run_op(energy_fn, position, energy, grad, keys, start, step_size, noise_scale, n_steps,
                                  burn_in, thin, mala=False))


def mala_chain(energy_fn, position: Tensor, energy: Tensor, grad: Tensor, keys: Tensor, start: Tensor | int,
               step_size: Tensor | float, *, n_steps: int, burn_in: int = 0, thin: int = 1):
    """MALA, the whole run in one call of the C kernel; as :func:`~fnebm.kernels.mala_chain_torch`
    (a :class:`~fnebm.kernels.MALAChain`), for what :func:`langevin_chain` covers."""
    from fnebm.kernels.langevin_chain import MALAChain

    return MALAChain(*_run_op(energy_fn, position, energy, grad, keys, start, step_size, 1.0, n_steps, burn_in, thin,
                              mala=True))
