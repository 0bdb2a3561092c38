"""Argument checks, in one module and one style: every public boundary of fnebm uses these.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong
value or shape) with a message that names the argument and says what was expected.

Metadata checks (type, dtype, shape, device) are free under ``torch.compile`` and run
everywhere. Value checks (finite, positive, in range) need the tensor's numbers, which is a
host sync on an accelerator and impossible while tracing; they run only where the value is
*concrete* — eager code on a plain tensor (:func:`is_concrete`). Inside a user's compiled
function or under ``torch.func`` transforms they are skipped, and the docs say so.

This is the bottom layer: it imports only ``torch``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import operator
import threading
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

__all__ = [
    "is_concrete",
    "check_callable",
    "check_signature",
    "check_int",
    "check_real",
    "check_shape",
    "check_float_dtype",
    "check_key",
    "check_key_values",
    "tunable",
    "check_tunable_shape",
]

_M32 = 0xFFFFFFFF

_blocks = threading.local()  # .memo: the innermost eager block's answers (see eager_block)


@contextlib.contextmanager
def eager_block() -> Iterator[None]:
    """A stretch of eager steps that runs no user code between two steps (``sample_chain``'s eager
    engine holds one around a chunk's loop, a warm-up's iterations included): checks that depend
    only on an energy and the tensors it holds (:func:`block_memo`) are answered once in it instead
    of at every step, and state kept for the block (a pinned compiled evaluation) is dropped at its
    end (:func:`at_block_exit`). Nested blocks keep their own answers; other threads see none."""
    outer = getattr(_blocks, "memo", None)
    _blocks.memo = memo = {}
    try:
        yield
    finally:
        _blocks.memo = outer
        for fn in memo.get(_AT_EXIT, ()):
            fn()


_AT_EXIT = object()  # the key of a block's exit callbacks in its memo


def at_block_exit(fn: Callable[[], None]) -> bool:
    """Call ``fn()`` when the innermost :func:`eager_block` ends; ``False`` (and nothing registered)
    outside one, or while compiling, where the caller cleans up at once."""
    memo = getattr(_blocks, "memo", None)
    if memo is None or torch.compiler.is_compiling():
        return False
    memo.setdefault(_AT_EXIT, []).append(fn)
    return True


def block_memo(tag: Any, obj: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``, remembered for ``obj`` (by identity, the object kept alive beside the answer) in
    the innermost :func:`eager_block`; outside one, or while compiling, computed every time."""
    memo = getattr(_blocks, "memo", None)
    if memo is None or torch.compiler.is_compiling():
        return compute()
    found = memo.get((tag, id(obj)))
    if found is not None and found[0] is obj:
        return found[1]
    value = compute()
    memo[(tag, id(obj))] = (obj, value)
    return value


def is_concrete(*tensors: Any) -> bool:
    """True when values may be read: eager mode, and no tensor is a functorch/fake wrapper."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if isinstance(t, Tensor):
            if torch._C._functorch.is_functorch_wrapped_tensor(t) or isinstance(
                t, torch._subclasses.fake_tensor.FakeTensor
            ):
                return False
            if t.device.type == "meta":
                return False
    return True


def check_callable(name: str, value: Any, what: str) -> None:
    if not callable(value):
        raise TypeError(f"{name} must be callable {what}, got {type(value).__name__}")


def _plain_signature(sig: inspect.Signature) -> str:
    """``(energy_fn, step_size, *, backend='auto')``: the parameters without annotations."""
    plain = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=plain, return_annotation=sig.empty))


def check_signature(name: str, value: Any, n_positional: int, keywords: Any = (), *, what: str,
                    hint: str = "") -> None:
    """``value`` can be called with ``n_positional`` positional arguments and ``keywords``.

    Read from ``inspect.signature`` (which sees through ``functools.partial``); a callable whose
    signature cannot be read (a builtin) passes, and so does everything under ``torch.compile``,
    where the check has already run eagerly or cannot be traced. ``what``: the calling convention
    expected, e.g. ``"energy -> SamplingAlgorithm"``; ``hint``: appended to the message.
    """
    if torch.compiler.is_compiling():
        return
    try:
        sig = inspect.signature(value)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*([None] * n_positional), **dict.fromkeys(keywords))
    except TypeError as e:
        fn = value
        while hasattr(fn, "func"):  # functools.partial layers: name the function under them
            fn = fn.func
        shown = getattr(fn, "__name__", None) or type(value).__name__
        raise TypeError(f"{name} must be callable as {what}, but {shown}{_plain_signature(sig)} cannot be "
                        f"({e}){'; ' + hint if hint else ''}") from None


def check_int(name: str, value: Any, minimum: int | None = None) -> int:
    """An integer (Python, NumPy or a one-element integer tensor; not bool) ``>= minimum``."""
    if isinstance(value, bool) or (isinstance(value, Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_shape(name: str, shape: Any) -> tuple[int, ...]:
    """An int or a sequence of ints (SymInts allowed under compile), none negative, as a tuple."""
    if isinstance(shape, (int, torch.SymInt)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(s if isinstance(s, torch.SymInt) else check_int(name, s) for s in shape)
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints, got {shape!r}") from None
    if any(isinstance(s, int) and s < 0 for s in dims):
        raise ValueError(f"{name} must have non-negative sizes, got {dims}")
    return dims


def check_float_dtype(name: str, dtype: Any) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating torch.dtype, got {dtype}")


def check_real(name: str, value: Any) -> float:
    """A real Python/NumPy number (not bool), as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def check_key(key: Any, name: str = "key") -> None:
    """``key`` is an int64 tensor of shape ``(..., 2)``. Metadata only: free under compile."""
    if not isinstance(key, Tensor):
        raise TypeError(f"{name} must be a key tensor from fnebm.random.key(seed), got {type(key).__name__}")
    if key.dtype != torch.int64:
        raise TypeError(f"{name} must have dtype torch.int64 (a key from fnebm.random.key), got {key.dtype}")
    if key.ndim == 0 or key.shape[-1] != 2:
        raise ValueError(f"{name} must have shape (..., 2) (two 32-bit words per key), got {tuple(key.shape)}")


def check_key_values(key: Tensor, name: str = "key") -> None:
    """Both words of every key in ``[0, 2**32)``; checked only where the key is concrete."""
    check_key(key, name)
    if key.numel() and is_concrete(key) and not bool(((key >= 0) & (key <= _M32)).all()):
        raise ValueError(
            f"{name} has words outside [0, 2**32): a key is two 32-bit words; make keys with "
            "fnebm.random.key(seed), split and fold_in"
        )


def tunable(name: str, value: Any, *, allow_zero: bool = False) -> Tensor:
    """A sampler parameter (step size, noise scale, ...) as a tensor: the one place it is checked.

    Accepts a Python or NumPy real number (made a 0-dim float64 tensor, rounded to the
    state's dtype when a step uses it) or a real floating tensor: 0-dim, or per chain
    ``(n_chains,)`` / the chain axes ``(*chains)``. Concrete values must be finite and ``> 0``
    (``>= 0`` with ``allow_zero``); under compile or a ``torch.func`` transform the values are
    not read (see the module docstring).
    """
    expected = "a finite number >= 0" if allow_zero else "a finite number > 0"
    if isinstance(value, Tensor):
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name} must be a real number or a floating tensor, got a tensor of dtype {value.dtype}")
        t = value
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number or a floating tensor, got {type(value).__name__}")
    else:
        v = float(value)
        if not math.isfinite(v) or not (v >= 0 if allow_zero else v > 0):
            raise ValueError(f"{name} must be {expected}, got {v}")
        return torch.tensor(v, dtype=torch.float64)
    if is_concrete(t) and t.numel():
        ok = torch.isfinite(t) & (t >= 0 if allow_zero else t > 0)
        if not bool(ok.all()):
            bad = t[~ok].flatten()[0].item()
            where = "" if t.ndim == 0 else " everywhere"
            raise ValueError(f"{name} must be {expected}{where}, got {bad}")
    return t


def check_tunable_shape(name: str, t: Tensor, batch: tuple[int, ...]) -> None:
    """A tunable is 0-dim or matches the leading chain axes of the state (metadata only).

    ``t.shape`` must be a prefix of ``batch`` (sizes equal, or 1): with chains ``(16, 1024)``,
    a step size of shape ``(16,)`` gives each row of 1,024 chains its own value.
    """
    if t.ndim > len(batch) or any(a != b and a != 1 for a, b in zip(t.shape, batch)):
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, which does not match the chain axes {tuple(batch)}: "
            "give one value (0-dim) or one per chain, aligned with the leading chain axes"
        )
