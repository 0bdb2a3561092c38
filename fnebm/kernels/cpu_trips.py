"""A C kernel's trips with a compiled energy, run in C++ without Python between them.

:mod:`fnebm.kernels.cpu_nuts` on a user's energy alternates the kernel's C (``resume``: take every
chain's energy and gradient, advance, write the next points) with an evaluation of the energy at
those points. When the evaluation is an Inductor graph built with the C++ wrapper
(:mod:`fnebm.samplers.evaluation`; :func:`fnebm._inductor.cpp_entry` gives its entry), :func:`run`
calls the graph and ``resume`` one after the other in C++ (``_cpu_trips.cpp`` beside this file) for
up to ``max_trips`` trips: the same graph on the same buffers, so the same draws bit for bit as
the Python loop, without its few microseconds a trip (the loop, ctypes, the generated wrapper's
argument lists and output tensors). Where the library does not build (no C++ compiler) or
:data:`NATIVE` is off, the caller's Python loop makes the trips, as before.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable, Sequence

import torch
from torch import Tensor

from fnebm.kernels._cbuild import library

__all__ = ["NATIVE", "available", "run"]

NATIVE = True  # False: every trip from Python (the switch tests compare against)
made = 0  # trips this process made here (tests check that a loop took this path)


class _Args(ctypes.Structure):
    _fields_ = [("entry", ctypes.c_void_p), ("new_handle", ctypes.c_void_p), ("delete", ctypes.c_void_p),
                ("data_ptr", ctypes.c_void_p), ("n_inputs", ctypes.c_int64), ("inputs", ctypes.c_void_p),
                ("resume", ctypes.c_void_p), ("ctx", ctypes.c_void_p), ("pending", ctypes.c_void_p),
                ("max_ns", ctypes.c_int64)]


# called with the GIL held (PYFUNCTYPE, not the library's CFUNCTYPE): the graph's entry releases and retakes it
_TRIPS = ctypes.PYFUNCTYPE(ctypes.c_int64, ctypes.POINTER(_Args), ctypes.c_int64, ctypes.c_int64,
                           ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32))
_trips_fn: Callable | None = None
_shim: tuple[int, int, int] | None = None  # libtorch's aoti_torch_{new_tensor_handle, delete_tensor_object, get_data_ptr}


def _setup(lib: ctypes.CDLL) -> None:
    global _trips_fn
    _trips_fn = _TRIPS(ctypes.cast(lib.fnebm_trips, ctypes.c_void_p).value)


LIBRARY = library("cpu_trips", _setup)

# a prototype of its own (setting argtypes on ctypes.pythonapi's would change it for every user)
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
MAX_INPUTS = 256  # the C++ loop's (MAX_INPUTS in _cpu_trips.cpp)


def _address(fn: Callable) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _shim_functions() -> tuple[int, int, int] | None:
    """The addresses of the three libtorch C functions the loop calls, or ``None`` (another torch build)."""
    global _shim
    if _shim is None:
        try:
            torch_cpu = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
            _shim = (_address(torch_cpu.aoti_torch_new_tensor_handle),
                     _address(torch_cpu.aoti_torch_delete_tensor_object),
                     _address(torch_cpu.aoti_torch_get_data_ptr))
        except (OSError, AttributeError):
            _shim = (0, 0, 0)
    return _shim if all(_shim) else None


def available() -> str | None:
    """``None`` when :func:`run` can run trips (the library builds and loads, torch's C functions are
    found, :data:`NATIVE` is on), else why not (one phrase)."""
    if not NATIVE:
        return "fnebm.kernels.cpu_trips.NATIVE is off"
    why = LIBRARY.available()
    if why is not None:
        return why
    if _shim_functions() is None:
        return "this torch does not export its C tensor-handle functions (aoti_torch_*)"
    return None


def run(entry: int, inputs: Sequence[Tensor], resume: Callable, ctx: int, waiting: int, pending: Tensor,
        max_trips: int, max_s: float = 0.05) -> tuple[int, int, bool]:
    """Up to ``max_trips`` trips, or as many as fit in ``max_s`` seconds (the last one started before
    then): the graph at ``entry`` on ``inputs`` (its arguments, the positions among them a view of
    ``pending``), then ``resume(ctx, E, grad, pending)`` (a ctypes function of a kernel), until
    ``resume`` returns 0 or less. Returns ``(waiting, trips made, failed)``; on a failure the trip was
    not made (the caller makes it in Python, where the error has its message). A graph that fails
    with a Python error set (an operation it calls back into Python for) raises it from here.
    The caller has checked that :func:`available` is ``None``, that ``entry`` is a C++-wrapper graph's
    (:func:`fnebm._inductor.cpp_entry`) of these inputs, and that its two outputs are what ``resume``
    reads (contiguous float32 of the chains' sizes: fixed by the graph)."""
    new_handle, delete, data_ptr = _shim
    templates = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(list(inputs))
    try:
        handles = (ctypes.c_void_p * len(templates))(*[_capsule_pointer(c, None) for c in templates])
        args = _Args(entry, new_handle, delete, data_ptr, len(templates), ctypes.cast(handles, ctypes.c_void_p),
                     _address(resume), ctx, pending.data_ptr(), int(max_s * 1e9))
        trips, error = ctypes.c_int64(0), ctypes.c_int32(0)
        waiting = _trips_fn(ctypes.byref(args), waiting, max_trips, ctypes.byref(trips), ctypes.byref(error))
    finally:
        for c in templates:  # the handles back to tensors, freed with them
            torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(c)
    global made
    made += trips.value
    return waiting, trips.value, error.value != 0
