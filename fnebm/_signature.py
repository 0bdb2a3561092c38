"""A description of a callable that stays the same from one process to the next, for the compile
records of :mod:`fnebm._inductor`: what ``compile_energy="auto"`` knows of a graph this machine
compiled before (then it is in Inductor's on-disk cache, and compiling it again costs a fraction
of a first compile).

:func:`signature` describes a function by its code (bytecode, constants, names, nested code), the
values it closes over and the globals it names, a ``functools.partial`` by its function and
arguments, a module by its class, its ``repr`` (the layers and their sizes), its mode and its
tensors' shapes, and a tensor by its shape, dtype, device and whether it requires a gradient —
never by its values, which a compiled graph takes as inputs. Other objects count by their type and
their attributes, a few levels deep. Two callables with one description trace to the same graph in
almost every case; where they do not, only the estimate of a compile's cost is off (the compile
itself is guarded by Dynamo as always). ``None`` where the description would not be stable (an
object whose ``repr`` holds its address, a description that grows past a limit).

Lowest layer: imports torch.
"""

from __future__ import annotations

import functools
import hashlib
import re
import types
from typing import Any

import torch

__all__ = ["signature"]

_DEPTH = 6  # levels of nested values described
_LIMIT = 20_000  # items in a description, beyond which there is none
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")  # a default repr's object address: differs every process


class _Unstable(Exception):
    """The object cannot be described the same way in another process."""


def signature(*objs: Any) -> str | None:
    """A hex digest describing ``objs`` (see the module docstring), or ``None``."""
    out: list[str] = []
    try:
        for obj in objs:
            _describe(obj, out, 0, set())
    except (_Unstable, RecursionError):
        return None
    except Exception:  # noqa: BLE001 - an object whose attributes raise: no description
        return None
    return hashlib.sha256("\x1f".join(out).encode()).hexdigest()[:32]


def _add(out: list[str], item: str) -> None:
    if len(out) >= _LIMIT:
        raise _Unstable
    out.append(item)


def _describe(obj: Any, out: list[str], depth: int, seen: set[int]) -> None:
    if depth > _DEPTH:
        _add(out, f"deep:{_type(obj)}")
        return
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        _add(out, f"{type(obj).__name__}:{obj!r}")
        return
    if isinstance(obj, (torch.dtype, torch.device, torch.Size)):
        _add(out, f"{type(obj).__name__}:{obj}")
        return
    if isinstance(obj, torch.Tensor):
        _add(out, f"T:{tuple(obj.shape)}:{obj.dtype}:{obj.device.type}:{obj.requires_grad}:{type(obj).__name__}")
        return
    if id(obj) in seen:  # a cycle, or a value met twice: described once
        _add(out, f"again:{_type(obj)}")
        return
    seen.add(id(obj))
    d = depth + 1
    if isinstance(obj, (tuple, list)):
        _add(out, f"{type(obj).__name__}[{len(obj)}")
        for item in obj:
            _describe(item, out, d, seen)
        _add(out, "]")
    elif isinstance(obj, dict):
        _add(out, f"dict[{len(obj)}")
        for k, v in obj.items():
            _describe(k, out, d, seen)
            _describe(v, out, d, seen)
        _add(out, "]")
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
        _add(out, f"module:{_type(obj)}:{obj.training}:{_stable_repr(obj)}")
        for name, t in list(obj.named_parameters()) + list(obj.named_buffers()):
            _add(out, name)
            _describe(t, out, d, seen)
    elif isinstance(obj, (types.BuiltinFunctionType, types.ModuleType, type)) or callable(getattr(obj, "overloadpacket", None)):
        _add(out, f"named:{_type(obj)}:{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', ''))}")
    else:
        _add(out, f"obj:{_type(obj)}")
        fields = getattr(obj, "__dict__", None)
        if fields is None and hasattr(type(obj), "__slots__"):
            fields = {s: getattr(obj, s) for s in type(obj).__slots__ if hasattr(obj, s)}
        if isinstance(obj, tuple):  # a NamedTuple's fields (a tuple subclass)
            fields = dict(enumerate(obj))
        if fields is not None:
            _describe(dict(fields), out, d, seen)
        elif not callable(obj):
            _add(out, _stable_repr(obj))


def _type(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _stable_repr(obj: Any) -> str:
    text = repr(obj)
    if _ADDRESS.search(text):
        raise _Unstable
    return text


def _code(code: types.CodeType, out: list[str], depth: int, seen: set[int]) -> None:
    _add(out, f"code:{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}:{code.co_argcount}")
    _add(out, code.co_code.hex())
    _add(out, ",".join(code.co_names))
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
    # the globals the code names (a module-level data tensor, a helper function), not the builtins
    names = set(fn.__code__.co_names)
    for code in fn.__code__.co_consts:
        if isinstance(code, types.CodeType):
            names.update(code.co_names)
    for name in sorted(names):
        if name in fn.__globals__:
            _add(out, f"global:{name}")
            _describe(fn.__globals__[name], out, depth, seen)
