"""Keys as tensors: counter-based Philox4x32-10 in pure integer tensor ops.

A key is an ``int64`` tensor of shape ``(..., 2)`` holding two 32-bit words
``(k0, k1)``, each in ``[0, 2**32)``. Nothing here touches the global RNG: the same key
gives the same numbers eager or compiled, on one chain or vmapped over many, on any
device. Leading dimensions of a key are batch dimensions and work elementwise, so
``normal(keys, shape)`` for ``keys: (n, 2)`` equals ``vmap(lambda k: normal(k, shape))(keys)``.

The stream is Triton's ``tl.randint4x`` / ``tl.randn4x`` (Philox4x32-10 as in Random123),
so a Triton kernel reproduces :func:`normal` and :func:`uniform` for the same key:

* **seed**: ``seed = k0 | (k1 << 32)`` as a 64-bit integer (:func:`triton_seed` gives it as a
  signed ``int64``), so Triton's Philox key words are ``(seed_lo, seed_hi) = (k0, k1)``.
* **offset and lane**: a draw of ``n`` numbers uses ``m = ceil(n / 4)`` Philox blocks with
  counters ``(b_lo, b_hi, 0, 0)`` for ``b in range(m)`` — Triton's ``randint4x(seed, b)``.
  Element ``i`` of the flattened output is lane ``i // m`` of block ``i % m`` (a planar
  layout: a kernel that computes block ``b`` writes lanes to ``b, b + m, b + 2m, b + 3m``).
* **uniform**: ``tl.uint_to_uniform_float``: the word is read as an ``int32`` ``x``, then
  ``x < 0 -> -x - 1`` and ``u = x * 4.6566127342e-10`` in float32 (31 random bits, ``u`` in
  ``[0, 1)``). float64 outputs use the same bits scaled by ``2**-31`` in float64.
* **normal**: ``tl.pair_uniform_to_normal`` (Box–Muller) on lanes (0, 1) and (2, 3):
  ``u1 = max(u1, 1e-7)``, ``r = sqrt(-2 log u1)``, ``th = 2 pi u2``; lanes get
  ``(r cos th, r sin th)``. The floor on ``u1`` truncates the tails at about 5.7 sigma
  (probability 1.3e-8).

Derived keys never collide with draws: :func:`split` and :func:`fold_in` use counters whose
third word is a non-zero tag, while draws always have it zero.

The 32x32 -> 64-bit products Philox needs are computed exactly in ``int64`` (no signed
overflow), so the stream is bit-identical on every backend.

Eager calls on CPU tensors run in compiled C where this machine can build it (once, cached):
the same Philox words, so keys and uniform draws are bit for bit those of the traced path, and
normal draws agree with it up to float rounding (log, sin and cos are computed by different
code: a few ulp, measured in docs/random.md). Compiled code and ``torch.func`` transforms on the
CPU call the same C through ``torch.ops.fnebm.*`` (:mod:`fnebm._random_ops`), so they equal the
eager CPU draws bit for bit; other devices run the torch operations above.
"""

from __future__ import annotations

import ctypes
import contextlib
import math
import operator
import sys
from collections.abc import Sequence

import torch

from fnebm import _checks, _one_thread

__all__ = [
    "key",
    "split",
    "fold_in",
    "bits",
    "uniform",
    "normal",
    "bernoulli",
    "philox4x32",
    "triton_seed",
    "check_key",
]

_M32 = 0xFFFFFFFF
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
assert _ROUND_A >= 2**31 and _ROUND_B >= 2**31  # _mulhilo relies on it
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_ROUNDS = 10
# Third counter word of derived keys; draws use 0 there, so the domains are disjoint.
_SPLIT_TAG = 0x73706C74  # "splt"
_FOLD_TAG = 0x666F6C64  # "fold"
_UNIFORM_SCALE = 4.6566127342e-10  # Triton's: largest with (2**31 - 1) * scale < 1 in float32
_NORMAL_FLOOR = 1.0e-7


def check_key(key: torch.Tensor, name: str = "key") -> None:
    """Raise ``TypeError``/``ValueError`` unless ``key`` is an int64 tensor of shape ``(..., 2)``
    whose words lie in ``[0, 2**32)``.

    The dtype and shape are metadata, checked everywhere (free under ``torch.compile``). The
    word range needs the values: it is checked for keys on the CPU in eager code, where it
    costs no device sync, and skipped under ``torch.compile``, ``torch.func`` transforms and
    for keys on an accelerator (``fnebm.sample_chain`` checks its key once, on any device).
    """
    _checks.check_key(key, name)
    if key.device.type == "cpu":
        _checks.check_key_values(key, name)


def key(seed: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Make a key from an integer seed: ``(2,)`` int64 tensor ``(seed & 0xFFFFFFFF, seed >> 32)``.

    ``seed`` is any integer in ``[-2**63, 2**64)``; negative seeds are read as two's complement.
    """
    if isinstance(seed, bool):
        raise TypeError("seed must be an integer, got bool")
    try:
        seed = operator.index(seed)  # also numpy integers and 0-dim integer tensors
    except TypeError:
        raise TypeError(f"seed must be an integer, got {type(seed).__name__}") from None
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must be in [-2**63, 2**64), got {seed}")
    seed &= 2**64 - 1
    return torch.tensor([seed & _M32, seed >> 32], dtype=torch.int64, device=device)


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Exact 32x32 -> 64-bit product in int64 with no overflow: for m >= 2**31,
    # a * m = a * 2**32 + p with p = a * (m - 2**32), |p| < 2**62. The low word is p's (two's
    # complement) low 32 bits; the high word is floor(p / 2**32) + a (an arithmetic shift).
    p = a * (m - 2**32)
    return (p >> 32) + a, p & _M32


# Eager CPU calls run Philox in NumPy's uint64, which multiplies 32-bit words exactly and costs
# about 1 us an operation where a small torch operation costs 5-10 us: the same bits (tested
# against the torch path), 2-10x faster for a sampler's per-step keys and draws (where the C
# library below cannot be built). Compiled code and vmap/grad on the CPU take the operators of
# fnebm._random_ops; other devices take the torch path, which is what the compiler sees there.
_NUMPY_EAGER = True


# CPU draws in compiled code and under vmap go to torch.ops.fnebm.* (fnebm._random_ops): the eager
# C draws as one opaque call each, where Inductor would otherwise generate and compile Philox's
# ~150 integer operations for every graph that draws (most of a neural Langevin step's compile).
# The same bits as the eager CPU draws. Other devices (Inductor fuses Philox into Triton there) and
# the torch path forced by tests (_NUMPY_EAGER = False) trace the torch operations.
_OPS = True


def _op_eligible(key: torch.Tensor) -> bool:
    """Whether this draw of a CPU key runs compiled or under a ``torch.func`` transform (the operators)."""
    if not (_OPS and _NUMPY_EAGER) or key.device.type != "cpu":
        return False
    return torch.compiler.is_compiling() or _in_transform() or torch._C._functorch.is_functorch_wrapped_tensor(key)


def _in_transform() -> bool:
    # inside torch.func.grad/vmap/jvp even a captured plain tensor's results are functorch
    # tensors (no data pointer): the eager CPU paths must not read them
    return torch._C._functorch.peek_interpreter_stack() is not None


def _numpy_eligible(words: tuple) -> bool:
    if not _NUMPY_EAGER or torch.compiler.is_compiling() or _in_transform():
        return False
    for w in words:
        if type(w) is not torch.Tensor or w.device.type != "cpu" or w.requires_grad:
            return False
        if torch._C._functorch.is_functorch_wrapped_tensor(w):
            return False
    return True


def _philox_numpy(c0, c1, c2, c3, k0, k1, rounds: int):
    import numpy as np

    # The counters are broadcast to the output's shape; the keys keep their own (a batch of keys
    # is often far smaller than the blocks drawn under it), so their schedule costs little.
    k0, k1 = (w.numpy().view(np.uint64) for w in (k0, k1))
    shape = np.broadcast_shapes(*(w.shape for w in (c0, c1, c2, c3)), k0.shape, k1.shape)
    c0, c1, c2, c3 = (np.broadcast_to(w.numpy().view(np.uint64), shape) for w in (c0, c1, c2, c3))
    m32, s32 = np.uint64(_M32), np.uint64(32)
    ra, rb, ka, kb = np.uint64(_ROUND_A), np.uint64(_ROUND_B), np.uint64(_KEY_A), np.uint64(_KEY_B)
    for _ in range(rounds):
        p0, p1 = c0 * ra, c2 * rb  # exact: 32 x 32 bits fit in 64; fresh arrays of the full shape (0-dim: scalars)
        n0 = p1 >> s32
        n0 ^= c1
        n0 ^= k0
        n2 = p0 >> s32
        n2 ^= c3
        n2 ^= k1
        p1 &= m32
        p0 &= m32
        c0, c1, c2, c3 = n0, p1, n2, p0
        k0 = (k0 + ka) & m32
        k1 = (k1 + kb) & m32
    # every word is a fresh array of the broadcast shape (rounds >= 1): wrap it without a copy
    return tuple(torch.from_numpy((np.asarray(w) if rounds else np.array(w)).view(np.int64)) for w in (c0, c1, c2, c3))


# Eager CPU draws (normal, uniform, split, fold_in) run in compiled C when this machine can build it
# (fnebm._random_cpu: Philox, the units, Box–Muller and the layout in one pass; built once per
# machine, cached, loaded on the first eager draw): the same Philox words, so uniform draws and keys
# are the NumPy path's bits and normal draws differ from the torch path's by float rounding only
# (log, sin and cos are Cephes' float32 polynomials there, as in the C chain and NUTS kernels, whose
# noise they then equal bit for bit; the largest difference measured is in docs/performance.md).
# For 128 chains x 784 values about 15x faster than the NumPy path. Without a compiler, the NumPy path.
_C_EAGER = True
_c_lib = None  # None: not loaded yet; False: not available in this process


def _c_library():
    global _c_lib
    if _c_lib is None:
        lib = None
        try:  # a private module beside this one (it builds with fnebm._cbuild, which imports only torch)
            from fnebm import _random_cpu

            lib = _random_cpu.load()
        except Exception:  # pragma: no cover - the draws never fail over their fast path
            lib = None
        _c_lib = lib if lib is not None else False
    return _c_lib or None


def _c_helpers(x: torch.Tensor):
    """The C library for the eager samplers' elementwise helpers (:mod:`fnebm._one_thread`) on ``x``: an
    eager CPU tensor of at least ``_one_thread.C_MIN`` values outside any transform; else ``None``."""
    if (type(x) is not torch.Tensor or x.device.type != "cpu" or x.numel() < _one_thread.C_MIN or not _C_EAGER
            or _one_thread._intercepted()):
        return None
    return _c_library()


def _c_eligible(tensors: tuple):
    """The C library when these (CPU, plain, eager) tensors may take it, else ``None``."""
    if not _C_EAGER or not _numpy_eligible(tensors):
        return None
    return _c_library()


def _broadcast_shapes(*shapes) -> tuple[int, ...]:
    # torch.broadcast_shapes imports torch.fx's symbolic shapes and sympy on its first call (0.4 s
    # in a fresh process, measured in the first call of sample_chain): plain tuples need none of it
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for s in shapes:
        for i, d in enumerate(s, ndim - len(s)):
            if d != 1:
                if out[i] not in (1, d):
                    raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
                out[i] = d
    return tuple(out)


def _key_words(key: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    # (the words as (n_keys, 2), address of k0 of key 0, address of its k1, stride between keys in
    # elements): no copy for contiguous or word-major keys (reshape copies only what it cannot view;
    # the caller holds the tensor while C reads it)
    kw = key.reshape(-1, 2)
    return kw, kw.data_ptr(), kw.data_ptr() + 8 * kw.stride(1), kw.stride(0)


def _draw_c(lib, name: str, key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``uniform``/``normal`` (by ``name``) of ``key`` in C: float64 in float64, every other dtype in float32
    and then converted, as the torch path computes them. The caller checked the key's dtype and shape;
    the C code checks its words' range (a pass over the keys instead of five torch operations)."""
    f64 = dtype == torch.float64
    batch = tuple(key.shape[:-1])
    out = torch.empty(batch + shape, dtype=torch.float64 if f64 else torch.float32)
    if out.numel():
        kw, k0, k1, ks = _key_words(key)
        if getattr(lib, f"fnebm_{name}_{'f64' if f64 else 'f32'}")(
                math.prod(batch), k0, k1, ks, math.prod(shape), out.data_ptr(), torch.get_num_threads()):
            check_key(key)  # a word outside [0, 2**32): raises
    return out if out.dtype == dtype else out.to(dtype)


# Eager calls on a CUDA device run Philox as one Triton kernel: the torch path is about 150
# small kernels, each a launch of 5-10 us of host time (1.5-4 ms for the keys of a sample_chain
# call, which on a GPU took longer than the whole-chain kernel itself). Same bits (tested
# against the torch path under TRITON_INTERPRET=1). Compiled code and vmap/grad take the torch
# path, which Inductor fuses; so do inputs broadcast over more than _TRITON_MAX_NDIM axes.
_TRITON_EAGER_DEVICES = ("cuda",)
_TRITON_MAX_NDIM = 4
_philox_kernel = None


def _triton_eligible(words: tuple) -> bool:
    if torch.compiler.is_compiling() or _in_transform():
        return False
    for w in words:
        if type(w) is not torch.Tensor or w.device.type not in _TRITON_EAGER_DEVICES or w.requires_grad:
            return False
        if torch._C._functorch.is_functorch_wrapped_tensor(w):
            return False
    return _triton_kernel() is not None


def _triton_kernel():
    global _philox_kernel
    if _philox_kernel is None:
        try:  # a private module beside this one: the kernel needs triton, this module does not
            from fnebm._philox_triton import philox_kernel
        except ImportError:  # pragma: no cover - CUDA builds of torch bring triton
            philox_kernel = False
        _philox_kernel = philox_kernel
    return _philox_kernel or None


def _philox_triton(c0, c1, c2, c3, k0, k1, rounds: int):
    words = (c0, c1, c2, c3, k0, k1)
    shape = _broadcast_shapes(*(w.shape for w in words))
    if len(shape) > _TRITON_MAX_NDIM or rounds < 1:
        return None
    full = (1,) * (_TRITON_MAX_NDIM - len(shape)) + tuple(shape)
    outs = tuple(torch.empty(shape, dtype=torch.int64, device=c0.device) for _ in range(4))
    n = math.prod(shape)
    if n == 0:
        return outs
    # broadcast views (strides 0 on broadcast axes), no copies
    views = [(w if w.dtype == torch.int64 else w.to(torch.int64)).expand(shape).reshape(full) for w in words]
    strides = [st for v in views for st in v.stride()]
    block = 512
    with _on(c0.device):
        _philox_kernel[(-(-n // block),)](*views, *outs, n, full[1], full[2], full[3], *strides, ROUNDS=rounds,
                                          BLOCK=block)
    return outs


def _on(device: torch.device):
    # Triton launches on the current CUDA device: the tensors' own, where another is current
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# Eager normal and uniform draws on a CUDA device are one Triton launch each (Philox, the units,
# Box–Muller in libdevice's log/cos/sin, the layout): on an H100 the block kernel plus the torch
# operations that converted its words took 1.0-1.3 ms of launches per draw (bench/gpu_rng_probe.py).
# The Philox words are the torch path's (tested under TRITON_INTERPRET=1); _TRITON_DRAWS = False
# keeps the block kernel and the torch conversion.
_TRITON_DRAWS = True
_draw_kernel = None


def _triton_draw(key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, normal: bool):
    """``normal``/``uniform`` of ``key`` as one Triton launch, or ``None`` where it does not apply."""
    global _draw_kernel
    if not _TRITON_DRAWS or not _triton_eligible((key,)):
        return None
    if _draw_kernel is None:
        try:
            from fnebm._philox_triton import draw_kernel
        except ImportError:  # pragma: no cover - an older triton without libdevice
            draw_kernel = False
        _draw_kernel = draw_kernel
    if _draw_kernel is False:
        return None
    check_key(key)
    f64 = dtype == torch.float64
    batch = tuple(key.shape[:-1])
    out = torch.empty(batch + shape, dtype=torch.float64 if f64 else torch.float32, device=key.device)
    n, n_keys = math.prod(shape), math.prod(batch)
    if out.numel():
        kw = key.reshape(-1, 2)
        m = -(-n // 4)
        block = 256
        with _on(key.device):
            _draw_kernel[(-(-(n_keys * m) // block),)](kw, kw.stride(0), kw.stride(1), out, n_keys, n, m,
                                                       NORMAL=normal, F64=f64, BLOCK=block)
    return out if out.dtype == dtype else out.to(dtype)


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = _ROUNDS):
    """Philox4x32 (Random123) on int64 tensors holding 32-bit words; broadcasts its inputs.

    Returns the four output words. With ``rounds=10`` this is ``philox4x32_10`` and Triton's
    ``tl.philox(seed, c0, c1, c2, c3)`` with ``seed = k0 | k1 << 32``.
    """
    if _numpy_eligible((c0, c1, c2, c3, k0, k1)):
        return _philox_numpy(c0, c1, c2, c3, k0, k1, rounds)
    if _triton_eligible((c0, c1, c2, c3, k0, k1)):
        out = _philox_triton(c0, c1, c2, c3, k0, k1, rounds)
        if out is not None:
            return out
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, _ROUND_A)
        hi1, lo1 = _mulhilo(c2, _ROUND_B)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _KEY_A) & _M32
        k1 = (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def _blocks(key: torch.Tensor, n_blocks: int, c2: int = 0) -> tuple[torch.Tensor, ...]:
    """Philox blocks ``b = 0 .. n_blocks-1`` under ``key``: four ``(n_blocks, *batch)`` word tensors.

    The block index leads and the key's batch axes trail, so a batch of keys (many chains,
    each drawing a few numbers) is computed with the chains as the innermost, contiguous,
    vectorised axis; the other order makes the compiler vectorise over a handful of blocks.
    """
    check_key(key)
    batch = key.shape[:-1]
    b = torch.arange(n_blocks, dtype=torch.int64, device=key.device).reshape((n_blocks,) + (1,) * len(batch))
    k0, k1 = key[..., 0].unsqueeze(0), key[..., 1].unsqueeze(0)
    zero = torch.zeros_like(b)
    c2 = zero if c2 == 0 else zero + c2
    return philox4x32(b & _M32, b >> 32, c2, zero, k0, k1)


def _batch_last_to_first(x: torch.Tensor, n_batch: int) -> torch.Tensor:
    # (*event, *batch) -> (*batch, *event)
    n_event = x.ndim - n_batch
    return torch.movedim(x, tuple(range(n_event, x.ndim)), tuple(range(n_batch)))


def _planar(lanes: Sequence[torch.Tensor], key: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    # Element i is lane i // m of block i % m (see the module docstring): stacking the four
    # (m, *batch) lanes gives (4 m, *batch) whose row i is element i.
    n, batch = math.prod(shape), key.shape[:-1]
    out = torch.cat(tuple(lanes), dim=0)[:n]
    return _batch_last_to_first(out.reshape(shape + batch), len(batch))


def _as_shape(shape) -> tuple[int, ...]:
    return _checks.check_shape("shape", shape)


def _check_float(dtype: torch.dtype) -> None:
    _checks.check_float_dtype("dtype", dtype)


def _lanes_used(shape: tuple[int, ...], n_blocks: int) -> int:
    # element i is lane i // n_blocks: lanes past the last element are never read (a draw of
    # one number per chain uses one word of its block; the others need not be converted)
    return -(-math.prod(shape) // n_blocks) if n_blocks else 1


def bits(key: torch.Tensor, shape: int | Sequence[int] = ()) -> torch.Tensor:
    """Random 32-bit words, as int64 in ``[0, 2**32)``: ``(*key.shape[:-1], *shape)``."""
    shape = _as_shape(shape)
    n_blocks = -(-math.prod(shape) // 4)
    return _planar(_blocks(key, n_blocks), key, shape)


def _to_unit(word: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Triton's uint_to_uniform_float: the word as int32, negative x -> -x - 1, times 2**-31.
    x = torch.where(word >= 2**31, (2**32 - 1) - word, word)
    if dtype == torch.float64:
        return x.to(torch.float64) * 2.0**-31
    return (x.to(torch.float32) * _UNIFORM_SCALE).to(dtype)


def _units_numpy(words: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """:func:`_to_unit` of ``words`` (int64 tensors from :func:`_philox_numpy`), stacked: ``(len(words), *shape)``.

    The eager CPU path: one pass in NumPy instead of five torch operations per word. The word
    read as an ``int32`` ``x``, ``x < 0 -> -x - 1`` is ``x ^ (x >> 31)``; the int32 -> float
    conversion and the multiply by a float32 (or float64) constant round as torch's do, so the
    bits are those of :func:`_to_unit` (tested).
    """
    import numpy as np

    x = np.stack([w.numpy() for w in words]).astype(np.uint32).view(np.int32)
    x ^= x >> 31
    if dtype == torch.float64:
        return torch.from_numpy(x.astype(np.float64) * 2.0**-31)
    u = torch.from_numpy(x.astype(np.float32) * np.float32(_UNIFORM_SCALE))
    return u if dtype == torch.float32 else u.to(dtype)


def _planar_stacked(lanes: torch.Tensor, key: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    # _planar of lanes stacked as (n_lanes, m, *batch): their rows in order are elements 0, 1, ...
    n, batch = math.prod(shape), key.shape[:-1]
    # (lanes, m) flattened; not reshape(-1, *batch), which fails for an empty batch of keys
    out = lanes.flatten(0, lanes.ndim - len(batch) - 1)[:n]
    return _batch_last_to_first(out.reshape(shape + batch), len(batch))


def uniform(
    key: torch.Tensor,
    shape: int | Sequence[int] = (),
    dtype: torch.dtype = torch.float32,
    minval: float | torch.Tensor = 0.0,
    maxval: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Uniform draws on ``[minval, maxval)``: ``(*key.shape[:-1], *shape)`` of ``dtype``."""
    _check_float(dtype)
    shape = _as_shape(shape)
    _checks.check_key(key)
    lib = _c_eligible((key,))
    if lib is not None:  # the words' range: in C
        u = _draw_c(lib, "uniform", key, shape, dtype)
    elif _op_eligible(key):
        u = torch.ops.fnebm.uniform(key, list(shape), dtype)
    else:
        u = _triton_draw(key, shape, dtype, normal=False)
    if u is not None:
        if isinstance(minval, (int, float)) and isinstance(maxval, (int, float)) and (minval, maxval) == (0.0, 1.0):
            return u
        return minval + (maxval - minval) * u
    n_blocks = -(-math.prod(shape) // 4)
    words = _blocks(key, n_blocks)[: _lanes_used(shape, n_blocks)]
    if _numpy_eligible(words):
        u = _planar_stacked(_units_numpy(words, dtype), key, shape)
    else:
        u = _planar([_to_unit(w, dtype) for w in words], key, shape)
    if isinstance(minval, (int, float)) and isinstance(maxval, (int, float)) and (minval, maxval) == (0.0, 1.0):
        return u
    return minval + (maxval - minval) * u


def normal(key: torch.Tensor, shape: int | Sequence[int] = (), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal draws: ``(*key.shape[:-1], *shape)`` of ``dtype`` (Box–Muller, as Triton)."""
    _check_float(dtype)
    shape = _as_shape(shape)
    _checks.check_key(key)
    lib = _c_eligible((key,))
    if lib is not None:  # the words' range: in C
        return _draw_c(lib, "normal", key, shape, dtype)
    if _op_eligible(key):
        return torch.ops.fnebm.normal(key, list(shape), dtype)
    z = _triton_draw(key, shape, dtype, normal=True)
    if z is not None:
        return z
    n_blocks = -(-math.prod(shape) // 4)
    # Box–Muller in at least float32, as Triton computes it.
    work = torch.float64 if dtype == torch.float64 else torch.float32
    words = _blocks(key, n_blocks)
    used = _lanes_used(shape, n_blocks)
    if _numpy_eligible(words):
        # Eagerly on the CPU: both Box–Muller pairs in one set of torch operations (the same
        # elementwise operations on the same values as below, so the same bits: tested), on
        # units converted in NumPy. For 128 chains x 784 values: about 3x faster.
        pairs = -(-used // 2)
        u = _units_numpy([words[i] for i in range(0, 2 * pairs, 2)] + [words[i] for i in range(1, 2 * pairs, 2)], work)
        # in place on u (a fresh tensor): the same operations, fewer temporaries
        r = u[:pairs].clamp_min_(_NORMAL_FLOOR).log_().mul_(-2.0).sqrt_()
        th = u[pairs:].mul_(2 * math.pi)
        c = torch.cos(th).mul_(r)
        lanes = torch.stack((c, th.sin_().mul_(r)), dim=1)  # lanes 0, 1, 2, 3 in order
        return _planar_stacked(lanes, key, shape).to(dtype)
    lanes = []
    for i in range(0, used, 2):  # Box–Muller pairs (lanes 0, 1) and (2, 3), as far as they are used
        a, b = _to_unit(words[i], work), _to_unit(words[i + 1], work)
        r = torch.sqrt(-2.0 * torch.log(torch.clamp_min(a, _NORMAL_FLOOR)))
        th = (2 * math.pi) * b
        lanes += [r * torch.cos(th), r * torch.sin(th)]
    return _planar(lanes[:used], key, shape).to(dtype)


def bernoulli(key: torch.Tensor, p: float | torch.Tensor = 0.5, shape: int | Sequence[int] | None = None) -> torch.Tensor:
    """Boolean draws, True with probability ``p``; ``shape`` defaults to ``p``'s shape."""
    p = torch.as_tensor(p, device=key.device)
    if not p.dtype.is_floating_point:
        p = p.to(torch.float32)
    shape = tuple(p.shape) if shape is None else _as_shape(shape)
    return uniform(key, shape, dtype=p.dtype) < p


def split(key: torch.Tensor, num: int = 2) -> torch.Tensor:
    """``num`` new independent keys: ``(*key.shape[:-1], num, 2)``.

    For a single key ``k1, k2 = split(key)`` unpacks; for a batch of keys the new axis comes
    after the batch axes, so the result equals ``vmap(split)(keys)``.
    """
    # a SymInt (a traced chain count under dynamic shapes) is fine too
    if not isinstance(num, torch.SymInt):
        num = _checks.check_int("num", num, 1)
        _checks.check_key(key)
        lib = _c_eligible((key,))
        if lib is not None:  # the words' range: in C
            return _split_c(lib, key, num)
        if _op_eligible(key):
            return torch.ops.fnebm.split(key, num)
    # One block gives two keys: key i is words (2(i % 2), 2(i % 2) + 1) of block i // 2.
    w0, w1, w2, w3 = _blocks(key, -(-num // 2), c2=_SPLIT_TAG)  # (blocks, *batch)
    # (2, num, *batch) in memory, (*batch, num, 2) to the caller: one word of one key index
    # is contiguous across the batch, so kernels that use key i of every chain load vectors.
    # words[0] holds the first words (w0, w2 of each block in turn), words[1] the second ones;
    # one stack, so compiled code writes the Philox words in place rather than copying them.
    words = torch.stack((w0, w2, w1, w3), dim=0).unflatten(0, (2, 2)).transpose(1, 2).flatten(1, 2)[:, :num]
    n_batch = key.ndim - 1
    return words.permute(*range(2, 2 + n_batch), 1, 0)


def fold_in(key: torch.Tensor, data: int | torch.Tensor) -> torch.Tensor:
    """A new key from ``key`` and an integer ``data`` (e.g. a step index): shape of the broadcast.

    ``data`` is an int or an integer tensor (read as 64-bit); it broadcasts against the key's
    batch dimensions. Distinct data give independent keys.
    """
    _checks.check_key(key)  # the words' range below (in C on the eager CPU path)
    if isinstance(data, torch.Tensor):
        if data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
            raise TypeError(f"data must be an integer or integer tensor, got dtype {data.dtype}")
        data = data.to(device=key.device, dtype=torch.int64)
    else:
        data = _checks.check_int("data", data)
        if not -(2**63) <= data < 2**63:
            raise ValueError(f"data must fit in int64, got {data}")
    lib = _c_eligible((key, data) if isinstance(data, torch.Tensor) else (key,))
    if lib is not None:
        return _fold_in_c(lib, key, data)
    if not isinstance(data, torch.Tensor):
        data = torch.tensor(data, dtype=torch.int64, device=key.device)
    if _op_eligible(key):
        return torch.ops.fnebm.fold_in(key, data)
    check_key(key)
    d_lo = data & _M32
    d_hi = (data >> 32) & _M32
    zero = torch.zeros_like(d_lo)
    k0, k1 = key[..., 0], key[..., 1]
    w0, w1, _, _ = philox4x32(d_lo, d_hi, zero + _FOLD_TAG, zero, k0, k1)
    return _word_major(w0, w1)


def _split_c(lib, key: torch.Tensor, num: int) -> torch.Tensor:
    """:func:`split` of an int64 CPU key in C (the eager path and ``torch.ops.fnebm.split``)."""
    batch = tuple(key.shape[:-1])
    out = torch.empty((2, num) + batch, dtype=torch.int64)  # stored as the torch path stores it
    if out.numel():
        kw, k0, k1, ks = _key_words(key)
        if lib.fnebm_split(math.prod(batch), k0, k1, ks, num, out.data_ptr(), torch.get_num_threads()):
            check_key(key)  # raises
    return out.permute(*range(2, 2 + len(batch)), 1, 0)


def _fold_in_c(lib, key: torch.Tensor, data: int | torch.Tensor) -> torch.Tensor:
    """:func:`fold_in` of an int64 CPU key and int64 data (a tensor, or an int read in place) in C
    (the eager path and ``torch.ops.fnebm.fold_in``)."""
    batch = tuple(key.shape[:-1])
    if not isinstance(data, torch.Tensor):  # an int (a step index): read in place, no tensor made for it
        shape, d = batch, ctypes.c_int64(data)
        d_ptr, d_stride = ctypes.addressof(d), 0
    elif data.ndim == 0:  # a step index as a tensor (compiled code's): read in place too
        shape, d_ptr, d_stride = batch, data.data_ptr(), 0
    else:
        shape = batch if tuple(data.shape) == batch else _broadcast_shapes(batch, tuple(data.shape))
        d = data.expand(shape).reshape(-1)
        d_ptr, d_stride = d.data_ptr(), d.stride(0)
    out = torch.empty((2,) + shape, dtype=torch.int64)  # word-major, as _word_major stores it
    n = out.numel() // 2
    if n:
        if key.ndim == 2 and batch == shape:  # a chain's keys (n, 2): their words in place
            k0 = key.data_ptr()
            k1, ks = k0 + 8 * key.stride(1), key.stride(0)
        else:
            kw, k0, k1, ks = _key_words(key if batch == shape else key.expand(shape + (2,)))
        if lib.fnebm_fold_in(n, k0, k1, ks, d_ptr, d_stride, out.data_ptr(), torch.get_num_threads()):
            check_key(key)  # raises
    return out.movedim(0, -1)


def _word_major(w0: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    # Shape (..., 2), stored word by word: each word is contiguous across a batch of keys,
    # so kernels that read one word of many keys load them as vectors.
    return torch.stack((w0, w1), dim=0).movedim(0, -1)


def triton_seed(key: torch.Tensor) -> torch.Tensor:
    """The 64-bit Philox seed ``k0 | k1 << 32`` as a signed int64 tensor ``(*key.shape[:-1],)``.

    Pass it to a Triton kernel; ``tl.randint4x(seed, b)`` then gives this key's block ``b``.
    """
    check_key(key)
    k0, k1 = key[..., 0], key[..., 1]
    hi = torch.where(k1 >= 2**31, k1 - 2**32, k1)
    return hi * 2**32 + k0


# torch.ops.fnebm.* (fnebm._random_ops): registered on import; their implementations call this module's C path
from fnebm import _random_ops  # noqa: E402

_random_ops.bind(sys.modules[__name__])
