"""fnebm.random's eager draws on the CPU in compiled C (``fnebm/kernels/_cpu_random.c``): Philox, the
unit conversion, Box–Muller and the planar layout in one pass, OpenMP over blocks when there are
many. Imported by :mod:`fnebm.random` on its first eager CPU draw; the library is built once per
machine with the system C compiler and cached (:mod:`fnebm._cbuild`). Where it cannot be built,
:func:`load` gives ``None`` and :mod:`fnebm.random` keeps its NumPy path (the same Philox words).

The entry points take raw pointers: the callers pass contiguous outputs they allocated and key words
as 1-D int64 views (any stride). The GIL is released during a call (ctypes), and the functions keep
no state, so threads may call them at once.
"""

from __future__ import annotations

import ctypes

from fnebm._cbuild import library



def _setup(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    for name in ("fnebm_uniform_f32", "fnebm_uniform_f64", "fnebm_normal_f32", "fnebm_normal_f64", "fnebm_split"):
        fn = getattr(lib, name)
        fn.argtypes = [i64, ptr, ptr, i64, i64, ptr, c_int]
        fn.restype = c_int
    lib.fnebm_fold_in.argtypes = [i64, ptr, ptr, i64, ptr, i64, ptr, c_int]
    lib.fnebm_fold_in.restype = c_int
    for t in ("f32", "f64"):  # the eager samplers' elementwise helpers (fnebm.integrators.diffusion)
        getattr(lib, f"fnebm_em_{t}").argtypes = [i64, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr]
        getattr(lib, f"fnebm_em_{t}").restype = None
        getattr(lib, f"fnebm_rows_finite_{t}").argtypes = [i64, i64, ptr, ptr]
        getattr(lib, f"fnebm_rows_finite_{t}").restype = None
        getattr(lib, f"fnebm_all_finite_{t}").argtypes = [i64, ptr]
        getattr(lib, f"fnebm_all_finite_{t}").restype = c_int
        getattr(lib, f"fnebm_axpy_{t}").argtypes = [i64, i64, ptr, c_int, ptr, i64, ptr, ptr]
        getattr(lib, f"fnebm_axpy_{t}").restype = None
        getattr(lib, f"fnebm_mala_diff_{t}").argtypes = [i64, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr]
        getattr(lib, f"fnebm_mala_diff_{t}").restype = None


# one source compiled twice (the float32 draws; the float64 draws and the keys), in parallel
LIBRARY = library("cpu_random", _setup)


def load() -> ctypes.CDLL | None:
    """The loaded library (built now if this machine has none cached), or ``None`` (see :attr:`LIBRARY.why`)."""
    return LIBRARY.load()
