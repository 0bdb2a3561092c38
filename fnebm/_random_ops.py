"""fnebm.random's CPU draws as torch operators (``torch.ops.fnebm.*``), for compiled code and ``vmap``.

Philox written in torch operations is about 150 integer operations a block. Inductor compiles
that into C++ for every graph that draws: on the 784-D MLP's Langevin step (one ``fold_in`` and
one ``normal``) the draws were most of the code Inductor generated, and most of the compile
(bench/compile_time.py; docs/performance.md). On the CPU the eager draws already run in compiled C
(:mod:`fnebm._random_cpu`). These operators hand that C to the compiler as one opaque call each:
the compiled graph calls it as it calls a matmul, and the draws are the eager CPU draws bit for
bit (uniform draws and keys are the torch path's bits everywhere; normal draws are the C
library's, a few ulp from the torch path's, see :mod:`fnebm.random`).

Each operator has a fake (meta) implementation that gives the output's shape and strides as the
eager code lays them out, and a ``vmap`` rule (a vmapped key is a batch of keys: the same call on
the batch, with the batch axis first), so ``vmap`` of a step compiles to one call per draw.
Keys carry no gradient; the operators have none.

The operators are registered when :mod:`fnebm.random` is imported (about a millisecond); the C
library is built or loaded at the first call that runs (where it cannot be built, the NumPy path
gives the same words).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LIBRARY"]

# torch.library.Library rather than torch.library.custom_op: a call costs about 5 us against 13 us
# (custom_op's Python wrapper), and a compiled Langevin step makes two of them
# Registered once per process: a second import of this module (fnebm reloaded, %autoreload) finds
# the operators defined and only binds (the first registration's implementations keep working).
_DEFINED = hasattr(torch.ops.fnebm, "fold_in")
LIBRARY = torch.library.Library("fnebm", "FRAGMENT")
if not _DEFINED:
    LIBRARY.define("normal(Tensor key, SymInt[] shape, ScalarType dtype) -> Tensor")
    LIBRARY.define("uniform(Tensor key, SymInt[] shape, ScalarType dtype) -> Tensor")
    LIBRARY.define("split(Tensor key, SymInt num) -> Tensor")
    LIBRARY.define("fold_in(Tensor key, Tensor data) -> Tensor")


_random = None  # fnebm.random, given by bind() when it is imported (this module never imports it)


def bind(module) -> None:
    """Called by :mod:`fnebm.random` once it is defined: the implementations call its C path."""
    global _random
    _random = module


def _like(layout: Tensor, value: Tensor) -> Tensor:
    # the fallback paths lay their results out otherwise (the NumPy path's planar views): the layout
    # the shape functions promised the compiler, which reads outputs by those strides
    return layout.copy_(value)


def _batch_first(x: Tensor, bdim: int | None, size: int) -> Tensor:
    return x.movedim(bdim, 0) if bdim is not None else x.unsqueeze(0).expand((size,) + tuple(x.shape))


# ----------------------------------------------------------------------------- the CPU implementations
# The eager functions' C paths without their checks (the compiled caller checked the shapes when it
# traced; the C code checks the words' range and a bad word raises), or the eager functions themselves
# where the C library is unavailable (the NumPy path: the same words).


def _int64(name: str, t: Tensor) -> None:
    # the C code reads 8-byte words: the operators are callable by name, so they check what the
    # public functions convert
    if t.dtype != torch.int64:
        raise TypeError(f"torch.ops.fnebm: {name} must have dtype torch.int64, got {t.dtype}")


def _c():
    # the C library, or None (unavailable, or switched off by the tests): then the eager functions'
    # NumPy path, the same words
    return _random._c_library() if _random._C_EAGER else None


def _draw(name: str):
    def impl(key: Tensor, shape, dtype: torch.dtype) -> Tensor:
        _int64("key", key)
        lib = _c()
        if lib is None:
            return getattr(_random, name)(key, tuple(shape), dtype).contiguous()
        return _random._draw_c(lib, name, key, tuple(shape), dtype)

    return impl


def _split(key: Tensor, num: int) -> Tensor:
    _int64("key", key)
    lib = _c()
    if lib is None:
        batch = tuple(key.shape[:-1])
        layout = torch.empty((2, num) + batch, dtype=torch.int64).permute(*range(2, 2 + len(batch)), 1, 0)
        return _like(layout, _random.split(key, num))
    return _random._split_c(lib, key, num)


def _fold_in(key: Tensor, data: Tensor) -> Tensor:
    _int64("key", key)
    _int64("data", data)
    lib = _c()
    if lib is None:
        shape = tuple(torch.broadcast_shapes(tuple(key.shape[:-1]), tuple(data.shape)))
        return _like(torch.empty((2,) + shape, dtype=torch.int64).movedim(0, -1), _random.fold_in(key, data))
    return _random._fold_in_c(lib, key, data)


if not _DEFINED:
    LIBRARY.impl("normal", _draw("normal"), "CPU")
    LIBRARY.impl("uniform", _draw("uniform"), "CPU")
    LIBRARY.impl("split", _split, "CPU")
    LIBRARY.impl("fold_in", _fold_in, "CPU")


# ----------------------------------------------------------------------------- shapes, for the compiler


def _draw_fake(key: Tensor, shape, dtype: torch.dtype) -> Tensor:
    return key.new_empty(tuple(key.shape[:-1]) + tuple(shape), dtype=dtype)


def _split_fake(key: Tensor, num) -> Tensor:
    batch = tuple(key.shape[:-1])
    # (2, num, *batch) in memory, (*batch, num, 2) to the caller: the eager path's layout
    return key.new_empty((2, num) + batch).permute(*range(2, 2 + len(batch)), 1, 0)


def _fold_in_fake(key: Tensor, data: Tensor) -> Tensor:
    # word-major (2, *shape) in memory, (*shape, 2) to the caller: the eager path's layout
    shape = tuple(torch.broadcast_shapes(tuple(key.shape[:-1]), tuple(data.shape)))
    return key.new_empty((2,) + shape).movedim(0, -1)


if not _DEFINED:
    torch.library.register_fake("fnebm::normal", _draw_fake, lib=LIBRARY)
    torch.library.register_fake("fnebm::uniform", _draw_fake, lib=LIBRARY)
    torch.library.register_fake("fnebm::split", _split_fake, lib=LIBRARY)
    torch.library.register_fake("fnebm::fold_in", _fold_in_fake, lib=LIBRARY)


# ----------------------------------------------------------------------------- vmap: a batch of keys


def _draw_vmap(op):
    def rule(info, in_dims, key, shape, dtype):
        return op(_batch_first(key, in_dims[0], info.batch_size), shape, dtype), 0

    return rule


def _split_vmap(info, in_dims, key, num):
    return torch.ops.fnebm.split(_batch_first(key, in_dims[0], info.batch_size), num), 0


def _fold_in_vmap(info, in_dims, key, data):
    # each call's own batch shape is broadcast(key batch, data); the vmapped axis goes first, and
    # the shorter of the two is padded with ones on the left to that rank below the vmapped axis
    kdim, ddim = in_dims
    kbatch = key.shape[:-1] if kdim is None else key.movedim(kdim, 0).shape[1:-1]
    dshape = data.shape if ddim is None else data.movedim(ddim, 0).shape[1:]
    rank = max(len(kbatch), len(dshape))
    k = _batch_first(key, kdim, info.batch_size)
    d = _batch_first(data, ddim, info.batch_size)
    k = k.reshape((k.shape[0],) + (1,) * (rank - len(kbatch)) + tuple(k.shape[1:]))
    d = d.reshape((d.shape[0],) + (1,) * (rank - len(dshape)) + tuple(d.shape[1:]))
    return torch.ops.fnebm.fold_in(k, d), 0


if not _DEFINED:
    torch.library.register_vmap("fnebm::normal", _draw_vmap(torch.ops.fnebm.normal), lib=LIBRARY)
    torch.library.register_vmap("fnebm::uniform", _draw_vmap(torch.ops.fnebm.uniform), lib=LIBRARY)
    torch.library.register_vmap("fnebm::split", _split_vmap, lib=LIBRARY)
    torch.library.register_vmap("fnebm::fold_in", _fold_in_vmap, lib=LIBRARY)
