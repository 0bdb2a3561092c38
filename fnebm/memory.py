"""Keep freed memory in the process, so that a new trace reuses pages that are already mapped.

A sampling run returns its trace in a fresh buffer (W1's is 40 MB). glibc's ``malloc`` maps a
block that large afresh from the kernel on every call and gives it back when it is freed, so
every call touches new pages: one page fault per 4 KiB, the kernel zeroing each page. On a
2-core Intel Xeon that was 9-10 ms of W1's 39 ms (10,000 chains x 100 steps of 10-D Langevin:
docs/performance.md, "Fresh pages for every trace"). A program that samples again and again
(repeated runs, sweeps, benchmarks) pays it on every call. Smaller blocks are often recycled
already (glibc's adaptive threshold follows the sizes freed, up to 32 MiB), but not always: an
eager run of 100,000 chains, with 4 MB temporaries, counted 33,434 page faults per run, and 0
with this.

:func:`reuse_freed_memory` raises glibc's thresholds so that blocks below a limit are taken
from the heap and stay there when freed: the next call of the same size finds them mapped.
It is a setting of the whole process (every library in it, the peers of a benchmark included)
and an opt-in: nothing in fnebm calls it. The cost is memory: the process keeps memory it no
longer uses instead of returning it to the system (up to ``limit_bytes`` free at the top of its
heap, more where freed blocks sit between live ones). The allocators
that PyTorch's CPU tuning guide suggests (jemalloc, tcmalloc through ``LD_PRELOAD``) keep
freed memory too, and this is the same idea without preloading anything.
"""

from __future__ import annotations

import ctypes
import sys

from fnebm import _checks

__all__ = ["reuse_freed_memory"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library this process already uses
        libc.gnu_get_libc_version  # noqa: B018  (musl and others lack it)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def reuse_freed_memory(limit_bytes: int = 2**30) -> bool:
    """Let freed blocks smaller than ``limit_bytes`` stay in the process for reuse (glibc ``malloc``).

    Sets ``M_MMAP_THRESHOLD`` (blocks above it are still mapped and unmapped on their own) and
    ``M_TRIM_THRESHOLD`` (free memory at the top of the heap is given back to the system only
    beyond it) to ``limit_bytes``, as ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in
    the environment would, but from Python and at any time. It applies to the whole process, and
    glibc's adaptive threshold (which follows the sizes freed, up to 32 MiB) is off from then on;
    call it once, early, in a program that allocates large tensors again and again. Blocks
    allocated by threads other than the main one come from heaps of at most 64 MiB: larger ones
    are still mapped afresh (torch allocates a compiled run's outputs on the calling thread).

    Args:
        limit_bytes: an int in ``[2**20, 2**31 - 1]`` (1 MiB to 2 GiB): blocks below it are kept
            (a block of exactly this size, with malloc's header, is still mapped afresh), and it is
            the most free memory the process keeps at the top of its heap. The default,
            1 GiB, covers a trace of 10,000 chains x 1,000 steps x 25 float32 values.

    Returns:
        True where glibc accepted both settings (Linux with glibc); False elsewhere (macOS,
        Windows, musl) or where glibc refuses the threshold (an older glibc may take at most
        32 MiB), and then nothing is changed. True says only that glibc took the settings: with
        another allocator preloaded (jemalloc, tcmalloc through ``LD_PRELOAD``) they have no
        effect, and that allocator's own caching applies instead.
    """
    limit = _checks.check_int("limit_bytes", limit_bytes)
    if not 2**20 <= limit <= 2**31 - 1:
        raise ValueError(f"limit_bytes must be in [2**20, 2**31 - 1] (1 MiB to 2 GiB), got {limit}")
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success; the trim threshold is only set once the mmap threshold is taken
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, limit)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, limit))
