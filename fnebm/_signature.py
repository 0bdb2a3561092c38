"""A description of a callable that stays the same from one process to the next, for the compile
records of :mod:`fnebm._inductor`: what ``compile="auto"`` knows of a graph this machine compiled
before (then it is in Inductor's on-disk cache, and compiling it again costs a fraction of a first
compile).

:func:`signature` describes a function by its code (bytecode, constants, names, nested code), the
values it closes over and the globals it names; a ``functools.partial`` by its function and
arguments; a module by each of its submodules' class, ``forward`` code, mode, plain attributes and
tensors' shapes; a tensor by its shape, strides, dtype, device and whether it requires a gradient
— never by its values, which a compiled graph takes as inputs (Python numbers and strings, which
Dynamo bakes into a graph, enter by value). Other objects count by their type and their
attributes. Where the description would not be stable or cheap (an object it cannot see into, a
string or container past a size limit, text holding an object's address) there is none
(``None``). Two callables with one description trace to the same graph in almost every case;
where they do not (code the description does not reach, such as a function called through a
module object's attribute), only the estimate of a compile's cost is off: Dynamo's guards decide
what runs, as always.

Lowest layer: imports torch.
"""

from __future__ import annotations

import array
import collections
import functools
import hashlib
import re
import types
from typing import Any

import torch

__all__ = ["signature", "stable_text"]

_DEPTH = 12  # objects nested in objects, described this deep (plain values are described at any depth)
_ITEMS = 20_000  # items in a description, beyond which there is none
_TEXT = 4096  # characters of one string, bytes or repr, beyond which there is none
_LIBRARIES = {"fnebm", "torch", "functorch", "numpy"}  # whose functions' globals are not followed
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")  # a default repr's object address: differs every process


class _Unstable(Exception):
    """The object cannot be described cheaply, the same way in another process."""


def signature(*objs: Any) -> str | None:
    """A hex digest describing ``objs`` (see the module docstring), or ``None``."""
    out: list[str] = []
    try:
        seen: set[int] = set()
        for obj in objs:
            _describe(obj, out, 0, seen)
    except (_Unstable, RecursionError):
        return None
    except Exception:  # noqa: BLE001 - an object whose attributes raise: no description
        return None
    return hashlib.sha256("\x1f".join(out).encode()).hexdigest()[:32]


def stable_text(text: str) -> str:
    """``text`` if it could be written the same in another process (no object address, not too
    long), else a text that never matches another process's (so its signature is ``None``)."""
    return text if len(text) <= _TEXT and not _ADDRESS.search(text) else "\0unstable"


def _add(out: list[str], item: str) -> None:
    if len(out) >= _ITEMS or len(item) > _TEXT or item == "\0unstable":
        raise _Unstable
    out.append(item)


def _describe(obj: Any, out: list[str], depth: int, seen: set[int]) -> None:
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        if isinstance(obj, (str, bytes)) and len(obj) > _TEXT:
            raise _Unstable
        _add(out, f"{type(obj).__name__}:{obj!r}")
        return
    if obj is Ellipsis or obj is NotImplemented:
        _add(out, repr(obj))
        return
    if isinstance(obj, slice):
        _add(out, "slice")
        for part in (obj.start, obj.stop, obj.step):
            _describe(part, out, depth, seen)
        return
    if isinstance(obj, (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)):
        _add(out, f"{type(obj).__name__}:{obj}")
        return
    if isinstance(obj, torch.Tensor):
        strides = tuple(obj.stride()) if obj.layout == torch.strided else str(obj.layout)
        _add(out, f"T:{tuple(obj.shape)}:{strides}:{obj.dtype}:{obj.device.type}:{obj.requires_grad}:{type(obj).__name__}")
        return
    if depth > _DEPTH:
        raise _Unstable  # deeper than a description goes: not known to be the same
    if id(obj) in seen:  # a cycle, or a value met twice: described once
        _add(out, f"again:{_type(obj)}")
        return
    seen.add(id(obj))  # only objects that live through the whole description (no temporaries)
    d = depth + 1
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):  # a NamedTuple: its type and its fields
        _add(out, f"namedtuple:{_type(obj)}[{len(obj)}")
        _items(obj, out, d, seen)
    elif isinstance(obj, (tuple, list, collections.deque)):
        _add(out, f"{type(obj).__name__}[{len(obj)}")
        _items(obj, out, d, seen)
    elif isinstance(obj, (set, frozenset)):
        # in an order of their own: a set's iteration order follows string hashing, which differs by process
        parts = []
        for item in obj:
            part: list[str] = []
            _describe(item, part, d, seen)
            parts.append("\x1e".join(part))
        _add(out, f"{type(obj).__name__}[{len(obj)}")
        for part in sorted(parts):
            _add(out, part)
        _add(out, "]")
    elif isinstance(obj, dict):
        _add(out, f"dict[{len(obj)}")
        _pairs(obj.items(), out, d, seen)
    elif isinstance(obj, array.array):
        raise _Unstable  # a data array of Python's: values, possibly many (a numpy array is shape and dtype)
    elif type(obj).__module__ == "numpy" and hasattr(obj, "shape") and hasattr(obj, "dtype"):
        _add(out, f"ndarray:{tuple(obj.shape)}:{obj.dtype}")
    elif isinstance(obj, types.CodeType):
        _code(obj, out, d, seen)
    elif isinstance(obj, types.FunctionType):
        _function(obj, out, d, seen)
    elif isinstance(obj, types.MethodType):
        _add(out, "method")
        _describe(obj.__func__, out, d, seen)
        _describe(obj.__self__, out, d, seen)
    elif isinstance(obj, functools.partial):
        _add(out, "partial")
        for part in (obj.func, obj.args, obj.keywords):
            _describe(part, out, d, seen)
    elif isinstance(obj, torch.nn.Module):
        _module(obj, out, d, seen)
    elif isinstance(obj, types.FunctionType) is False and (
            isinstance(obj, (types.BuiltinFunctionType, types.ModuleType, type))
            or callable(getattr(obj, "overloadpacket", None))):
        name = getattr(obj, "__qualname__", getattr(obj, "__name__", ""))
        _add(out, f"named:{_type(obj)}:{getattr(obj, '__module__', '')}.{name}")
    else:
        _add(out, f"obj:{_type(obj)}")
        fields = getattr(obj, "__dict__", None)
        slots = [s for t in type(obj).__mro__ for s in _slots(t)]
        if fields is None and not any("__slots__" in t.__dict__ for t in type(obj).__mro__[:-1]):
            raise _Unstable  # nothing to see into (a C object): not known to be the same
        _pairs(list((fields or {}).items()) + [(s, getattr(obj, s)) for s in slots if hasattr(obj, s)], out, d, seen)


def _slots(t: type) -> tuple:
    s = t.__dict__.get("__slots__", ())
    return (s,) if isinstance(s, str) else tuple(s)


def _items(items: Any, out: list[str], depth: int, seen: set[int]) -> None:
    for item in items:
        _describe(item, out, depth, seen)
    _add(out, "]")


def _pairs(pairs: Any, out: list[str], depth: int, seen: set[int]) -> None:
    for k, v in pairs:
        _describe(k, out, depth, seen)
        _describe(v, out, depth, seen)
    _add(out, "]")


def _type(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _module(module: torch.nn.Module, out: list[str], depth: int, seen: set[int]) -> None:
    """Each submodule: its name, class, ``forward`` code, mode and plain attributes (the hyperparameters
    a ``forward`` reads: a temperature, an activation's name), then every parameter's and buffer's layout."""
    for name, sub in module.named_modules():
        _add(out, f"module:{name}:{_type(sub)}:{sub.training}")
        forward = getattr(type(sub), "forward", None)
        if isinstance(forward, types.FunctionType) and id(forward) not in seen:
            seen.add(id(forward))
            _code(forward.__code__, out, depth, seen)
        plain = [(k, v) for k, v in vars(sub).items() if not k.startswith("_") and k != "training"]
        _pairs(plain, out, depth, seen)
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        _add(out, name)
        _describe(t, out, depth, seen)


def _code(code: types.CodeType, out: list[str], depth: int, seen: set[int]) -> None:
    _add(out, f"code:{getattr(code, 'co_qualname', code.co_name)}:{code.co_argcount}")
    _add(out, hashlib.sha256(code.co_code).hexdigest())
    _add(out, hashlib.sha256(",".join(code.co_names).encode()).hexdigest())
    for const in code.co_consts:
        _describe(const, out, depth, seen)


def _function(fn: types.FunctionType, out: list[str], depth: int, seen: set[int]) -> None:
    _add(out, f"fn:{fn.__module__}")
    _code(fn.__code__, out, depth, seen)
    _describe(fn.__defaults__, out, depth, seen)
    _describe(fn.__kwdefaults__, out, depth, seen)
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            _add(out, "empty")
            continue
        _describe(value, out, depth, seen)
    if (fn.__module__ or "").split(".")[0] in _LIBRARIES:
        return  # a library's own function: its code and closure; what its globals name is the installed library's
    # the globals the code names (a module-level data tensor, a helper function), not the builtins
    names = set(fn.__code__.co_names)
    for code in fn.__code__.co_consts:
        if isinstance(code, types.CodeType):
            names.update(code.co_names)
    for name in sorted(names):
        if name in fn.__globals__:
            _add(out, f"global:{name}")
            _describe(fn.__globals__[name], out, depth, seen)
