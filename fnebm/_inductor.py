"""How fnebm calls Inductor: the backend every compile of fnebm's own goes through.

* ``sample_chain``'s runners, ``profile_sampling``'s pieces and the compiled energy evaluations of
  :mod:`fnebm.samplers.evaluation` compile with :func:`inductor_backend`.
* Graphs holding a ``while_loop`` get Inductor's C++ wrapper on the CPU (see :func:`inductor_backend`).
* **The vector-ISA probe, once per machine.** Before its first C++ kernel in a process, Inductor checks
  each vector instruction set the CPU reports (AVX-512 VNNI, AVX-512, AVX2 on x86) by building a test
  library and loading it in a child Python process, one child per set: 1.3-2.3 s of every new
  process's first compile on this project's 2-core machine, and 5-7 s more with an empty Inductor
  cache (the builds). fnebm runs torch's probe once per machine (same torch, same compiler, same CPU
  flags) and, when every set passed, records that in its cache folder (:mod:`fnebm._cbuild`); its
  CPU compiles then tell Inductor the sets are usable (``cpp.vec_isa_ok``), which is what the probe
  finds. A user's own ``TORCHINDUCTOR_VEC_ISA_OK`` (or ``cpp.vec_isa_ok``) is left alone, and any
  surprise in torch's internals here means no record and torch's own probe.
* **A faster linker, where there is one.** Inductor links each CPU kernel library against
  ``libtorch_cpu`` (for Sleef's vector maths), and GNU ld's reading of that library's symbols is
  about 0.2 s of each kernel's ~1.05 s build here, where gold links it in a few hundredths. fnebm's
  CPU compiles pass ``-fuse-ld=gold`` (else ``lld``, not measured) to the compiler where a test
  link with it against torch's libraries worked once on this machine (recorded like the vector
  sets), and only while fnebm's backend compiles, on its thread (a user's compiles are left as
  they are); a build that still fails to link is compiled again with the compiler's own linker.
  The flag is kept out of the name of Inductor's precompiled header, which is shared with torch's own.

Lowest layer: imports torch, and :mod:`fnebm._cbuild` for the cache folder.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import operator
import os
import platform
import re
import shutil
import statistics
import sys
import threading
from typing import Callable

import torch

__all__ = ["inductor_backend", "innermost_call", "has_products", "inputs_on_cpu", "graph_keys", "record_graph", "compiled_before", "cache_hits",
           "record_gain", "recorded_gain",
           "compile_patches", "passive_openmp", "machine_compile_s", "record_compile_s", "fast_linker", "linking_fast"]

# Inductor does not put graphs holding a scan or a while_loop (NUTS, trajectory lengths as data)
# in its on-disk FX graph cache unless told the operator is safe to cache; the body is part of
# the graph it hashes, so it is.
_COMPILE_OPTIONS = {"unsafe_marked_cacheable_functions": {"torch.ops.higher_order.scan": torch.__version__,
                                                          "torch.ops.higher_order.while_loop": torch.__version__}}


def _has_while_loop(gm: torch.fx.GraphModule) -> bool:
    """Whether a traced graph holds a ``while_loop`` (NUTS, trajectory lengths as data), nested included."""
    loop_op = torch.ops.higher_order.while_loop
    return any(node.op == "call_function" and node.target is loop_op
               for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
               for node in module.graph.nodes)


# What calls a library's matrix product or convolution (MKL, oneDNN) in a traced graph: Inductor calls each
# from its wrapper as an extern kernel, with the output buffer it allocates first
_PRODUCT_FUNCTIONS = {"matmul", "mm", "bmm", "mv", "addmm", "addmv", "baddbmm", "addbmm", "einsum", "linear",
                      "bilinear", "tensordot", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                      "conv_transpose2d", "conv_transpose3d", "convolution"}
_PRODUCT_METHODS = {"matmul", "mm", "bmm", "mv", "addmm", "__matmul__", "__rmatmul__"}


def inputs_on_cpu(example_inputs) -> bool:
    """Whether every tensor among a graph's example inputs is on the CPU."""
    return all(t.device.type == "cpu" for t in example_inputs if isinstance(t, torch.Tensor))


def has_products(gm: torch.fx.GraphModule) -> bool:
    """Whether a traced graph (nested graphs included) calls a matrix product or a convolution: its
    compiled CPU code then calls a library (MKL, oneDNN) for each, and their gradients too."""
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function":
                if node.target is operator.matmul or getattr(node.target, "__name__", None) in _PRODUCT_FUNCTIONS:
                    return True
            elif node.op == "call_method" and node.target in _PRODUCT_METHODS:
                return True
            elif node.op == "call_module":
                sub = module.get_submodule(node.target) if isinstance(node.target, str) else None
                if isinstance(sub, (torch.nn.Linear, torch.nn.Bilinear, torch.nn.modules.conv._ConvNd)):
                    return True
    return False


def passive_openmp() -> bool:
    """Whether OpenMP's waiting threads sleep (``OMP_WAIT_POLICY=PASSIVE``: ``import fnebm``
    before torch, and the ``fnebm`` command, set it unless the user did).

    A NUTS trip is a dozen short parallel loops, each ending at a barrier, and threads that
    sleep at every barrier made it 3x slower than serial code. Measured with
    ``bench/nuts_trip.py`` (64 chains x 50-D, two threads, passive, runs alternated), per trip:
    691-694 us parallel against 216-228 us serial on an idle machine, 278-281 against 221-227
    beside one busy process. So under that policy a graph holding a ``while_loop`` is
    generated serial. Threads that spin (libgomp's default, or ``OMP_WAIT_POLICY=ACTIVE``) run
    the parallel loop faster on an idle machine (175-196 us) and 3x slower beside a busy
    process (659 us); that choice is the user's, and the graph stays parallel.
    """
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


# ----------------------------------------------------------------------------- the vector-ISA record

_isa_known: bool | None = None  # this process: None until looked up; then whether the record exists


def _stamp(program: str) -> str | None:
    """``program``'s real path and modification time (what changes when it is replaced), or ``None``."""
    path = shutil.which(program) or program
    try:
        real = os.path.realpath(path)
        return f"{real}:{os.stat(real).st_mtime_ns}"
    except OSError:
        return None


def _isa_record() -> tuple[list, str] | None:
    """``(folders, file name)`` of this machine's record (torch, compiler and CPU flags in its
    name), or ``None`` where fnebm does not record (not x86-64 Linux, or the user set the option)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    from torch._inductor import config

    if config.cpp.vec_isa_ok is not None:
        return None
    from fnebm import _cbuild

    stamp = _stamp(_cxx())
    if stamp is None:
        return None
    digest = hashlib.sha256("\0".join((torch.__version__, stamp, _cbuild._cpu_id())).encode()).hexdigest()[:20]
    return _cbuild.cache_dirs(), f"inductor-vec-isa-{digest}.ok"


def compile_patches() -> dict:
    """Inductor options for fnebm's CPU compiles: ``{"cpp.vec_isa_ok": True}`` where this machine's
    record says torch's probe passed for every vector ISA the CPU reports, else ``{}``.

    Without a record, torch's probe runs here, once in the process (what Inductor's first compile
    would run anyway), and a pass for every set writes the record. Every compile then carries the
    same option, so Inductor's on-disk caches serve the first process and the later ones alike."""
    global _isa_known
    if _isa_known is None:
        _isa_known = False
        try:
            record = _isa_record()
            if record is not None:
                folders, name = record
                # a record counts only in a folder of this user's own (as the C libraries, fnebm._cbuild)
                from fnebm import _cbuild

                _isa_known = (any((folder / name).is_file() and _cbuild._usable(folder) for folder in folders)
                              or _probe_and_record(folders, name))
        except Exception:  # pragma: no cover - no record, torch's own probe
            _isa_known = False
    return {"cpp.vec_isa_ok": True} if _isa_known else {}


def _probe_and_record(folders: list, name: str) -> bool:
    from torch._inductor import cpu_vec_isa

    from fnebm import _cbuild

    # the sets the CPU reports, by its flags (as valid_vec_isa_list lists them, without calling bool()
    # on them, which torch caches); then torch's own test build and load of each (check_build), run
    # here whatever any earlier call in this process cached
    flags = cpu_vec_isa.x86_isa_checker()
    reported = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    if not reported:
        return False
    # the sets' test builds at once (each its own files and lock; the compiler and the load run in child
    # processes): 6.4 s -> 3.6 s on this project's 2-core machine with an empty Inductor cache
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(reported) + 1) as pool:
        # and the linker's test link (fast_linker), which a machine without this record has not run
        # either: beside the probe's builds rather than after them (0.3 s of a first compile here)
        pool.submit(fast_linker)
        passed = list(pool.map(lambda isa: isa.check_build(cpu_vec_isa.VecISA._avx_code), reported))
    if not all(passed):
        return False  # a set the CPU reports did not build or load: Inductor decides as without fnebm
    for folder in folders:
        if _cbuild._usable(folder):
            (folder / name).write_text(" ".join(str(isa) for isa in reported) + "\n")
            return True
    return False


# ----------------------------------------------------------------------------- the linker

FAST_LINKER = True  # False: fnebm's compiles link with the compiler's default linker, as torch's do
# -fuse-ld=NAME and the program it runs, in order of preference: gold is what was measured here
# (docs/performance.md); lld, where gold is absent, is tried the same way
_LINKERS = (("gold", "ld.gold"), ("lld", "ld.lld"))
_LINK_TEST = "2"  # enters the records' names: a change to the test link tests again
_linker: str | None | bool = False  # this process: False until looked up, then "fuse-ld=NAME" or None
_linker_lock = threading.Lock()
_scope = threading.local()  # .linker: the flag while this thread compiles through inductor_backend


def _cxx() -> str:
    """Inductor's C++ compiler as its option names it (``cpp.cxx``: a tuple whose last entry is the
    compiler, or a plain string)."""
    from torch._inductor import config

    cxx = config.cpp.cxx
    return (cxx if isinstance(cxx, str) else cxx[-1]) or "g++"


def fast_linker() -> str | None:
    """``"fuse-ld=gold"`` or ``"fuse-ld=lld"`` (Inductor's spelling of a flag, without its dash)
    where that linker is installed and a test link with Inductor's C++ compiler against torch's
    libraries worked on this machine, else ``None``. The outcome for each linker (worked or not) is
    recorded once per machine in fnebm's cache folder (torch's version, the compiler's and the
    linker's real paths and modification times in the record's name). Linux only, never when
    :data:`FAST_LINKER` is off. Looked up once per process."""
    global _linker
    if not FAST_LINKER:
        return None
    with _linker_lock:
        if _linker is False:
            _linker = None
            try:
                _linker = _find_linker()
            except Exception:  # noqa: BLE001 - any surprise: the compiler's own linker
                _linker = None
        return _linker


def _find_linker() -> str | None:
    if sys.platform != "linux":
        return None
    from fnebm import _cbuild

    cxx = shutil.which(_cxx())
    compiler = _stamp(cxx) if cxx else None
    if compiler is None:
        return None
    folders = [f for f in _cbuild.cache_dirs() if _cbuild._usable(f)]
    for name, program in _LINKERS:
        linker = _stamp(program) if shutil.which(program) else None
        if linker is None:
            continue
        digest = hashlib.sha256("\0".join((torch.__version__, compiler, linker, _LINK_TEST)).encode()).hexdigest()[:20]
        stem = f"inductor-linker-{name}-{digest}"
        if any((folder / f"{stem}.ok").is_file() for folder in folders):
            return f"fuse-ld={name}"
        if any((folder / f"{stem}.no").is_file() for folder in folders):
            continue
        worked = _test_link(cxx, name)
        for folder in folders[:1]:  # the first folder of this user's own
            with contextlib.suppress(OSError):
                (folder / f"{stem}.{'ok' if worked else 'no'}").write_text(f"{program}\n")
        if worked:
            return f"fuse-ld={name}"
    return None


def _test_link(cxx: str, name: str) -> bool:
    """Whether ``cxx -fuse-ld=NAME`` links a small shared library against torch's libraries with
    OpenMP, as Inductor links its kernels, and the library loads here (about 0.3 s, once per machine)."""
    import ctypes
    import subprocess
    import tempfile

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    with tempfile.TemporaryDirectory(prefix="fnebm-ld-") as work:
        src, lib = os.path.join(work, "t.cpp"), os.path.join(work, "t.so")
        with open(src, "w") as f:
            f.write('#include <cmath>\nextern "C" double fnebm_t(double x) { return std::exp(x); }\n')
        done = subprocess.run([cxx, "-shared", "-fPIC", f"-fuse-ld={name}", src, "-o", lib, f"-L{torch_lib}",
                               "-ltorch", "-ltorch_cpu", "-fopenmp"], capture_output=True, timeout=60)
        if done.returncode != 0 or not os.path.isfile(lib):
            return False
        try:
            fn = ctypes.CDLL(lib).fnebm_t
        except OSError:
            return False
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_double]
        return fn(0.0) == 1.0


def _gave_up_linker() -> None:
    """A build failed with the faster linker: this process links with the compiler's own from now on."""
    global _linker
    with _linker_lock:
        _linker = None


_hooked = False


def _hook_linker() -> bool:
    """Wrap Inductor's optimisation flags once so that, while :data:`_scope` names a linker, its link
    flags carry it (``torch._inductor.cpp_builder._get_optimization_cflags``: a private function, so
    anything unexpected leaves it as it is). ``True`` when the wrapper is in place."""
    global _hooked
    with _linker_lock:
        if _hooked:
            return True
        try:
            from torch._inductor import cpp_builder
        except ImportError:  # pragma: no cover - another torch layout
            return False
        original = getattr(cpp_builder, "_get_optimization_cflags", None)
        if not callable(original):
            return False

        def _get_optimization_cflags(*args, **kwargs):
            out = original(*args, **kwargs)
            flag = getattr(_scope, "linker", None)
            if (flag and isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list)
                    and not any(str(f).startswith("fuse-ld=") for f in out[1])):
                return out[0], [*out[1], flag]
            return out

        _get_optimization_cflags.__wrapped__ = original
        cpp_builder._get_optimization_cflags = _get_optimization_cflags
        _hooked = True
        _hook_header()
        return True


def _hook_header() -> None:
    """Keep the linker flag out of the name Inductor gives its precompiled header: it names the
    header by the kernel's command line, link flags included, though the header's compile links
    nothing. Without this the first compile with the flag builds a second copy of the header
    (about 5 s and 150 MB here) instead of using the one torch's and fnebm's earlier compiles built.
    (``torch._inductor.codecache._precompile_header``: private; anything unexpected leaves it be.)"""
    try:
        from torch._inductor import codecache
    except ImportError:  # pragma: no cover - another torch layout
        return
    original = getattr(codecache, "_precompile_header", None)
    if not callable(original):
        return
    _HEADER_ORIGINAL[0] = original

    def _precompile_header(header, hashable_cmd_line, *args, **kwargs):
        flag = getattr(_scope, "linker", None)
        if flag and isinstance(hashable_cmd_line, str):
            hashable_cmd_line = hashable_cmd_line.replace(f" -{flag}", "")
        return _HEADER_ORIGINAL[0](header, hashable_cmd_line, *args, **kwargs)

    _precompile_header.__wrapped__ = original
    codecache._precompile_header = _precompile_header


_HEADER_ORIGINAL: list = [None]  # torch's _precompile_header, which the wrapper calls


def _linker_applies() -> bool:
    """Whether Inductor's current options leave the linker to fnebm: not where torch picks one itself
    (link-time optimisation, cross-compiling) nor under max-autotune, whose CPU templates build on
    threads of their own (outside this thread's scope: every choice would be built twice)."""
    from torch._inductor import config

    aot = config.aot_inductor
    return not (getattr(aot, "enable_lto", False) or getattr(aot, "cross_target_platform", None)
                or config.max_autotune or config.max_autotune_gemm)


@contextlib.contextmanager
def linking_fast(on: bool = True):
    """Within: this thread's Inductor builds link with :func:`fast_linker` (where there is one and it
    applies); ``on=False``: with the compiler's own linker. Yields the flag in effect, or ``None``.

    Only the builds made on this thread inside the block carry it: kernels Inductor builds later (a
    training graph's backward, compiled at its first ``backward()``) link as torch makes them."""
    flag = fast_linker() if on and _linker_applies() else None
    if flag is not None and not _hook_linker():
        flag = None
    before = getattr(_scope, "linker", None)
    _scope.linker = flag
    try:
        yield flag
    finally:
        _scope.linker = before


def _build_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is Inductor's C++ build error."""
    try:
        from torch._inductor.exc import CppCompileError
    except ImportError:  # pragma: no cover - another torch layout
        return False
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, CppCompileError):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


# ----------------------------------------------------------------------------- measured compile times
# What a compile costs on this machine, for compile="auto"'s ski-rental rule (sample_chain's runners,
# the NUTS energy evaluations): the seconds of fnebm's recent first compiled calls here (a compile
# and one run, Inductor's on-disk cache hits included), kept per torch version in the cache folder,
# so a new process starts from what compiles took on this machine rather than an assumed figure.

_TIMES_KEPT = 16
_times: list | None = None  # this process's view: read once, then extended by its own compiles
_times_lock = threading.Lock()


def _times_path():
    from fnebm import _cbuild

    for folder in _cbuild.cache_dirs():
        if _cbuild._usable(folder):
            return folder / f"compile-times-{torch.__version__.replace('+', '-')}.json"
    return None


def _read_times() -> list:
    global _times
    if _times is None:
        found = []
        try:
            path = _times_path()
            if path is not None and path.is_file():
                found = [(str(k), float(t)) for k, t in json.loads(path.read_text())
                         if isinstance(t, (int, float)) and t > 0 and math.isfinite(t)]
        except Exception:  # noqa: BLE001 - a damaged or foreign file: no record
            found = []
        _times = _last_per_kind(found)
    return _times


def _last_per_kind(times: list) -> list:
    """The last :data:`_TIMES_KEPT` entries of each kind, in their order (a kind recorded often, such as
    compiles served by the cache, does not push another kind's out)."""
    kept, counts = [], collections.Counter()
    for entry in reversed(times):
        counts[entry[0]] += 1
        if counts[entry[0]] <= _TIMES_KEPT:
            kept.append(entry)
    return kept[::-1]


def machine_compile_s(kind: str) -> float | None:
    """The median of the recorded first compiled calls of ``kind`` on this machine (``"chain"`` or
    ``"energy"``: first compiles; ``"chain-cached"``, ``"energy-cached"``: compiles served by Inductor's
    on-disk cache), or ``None`` when none is recorded."""
    with _times_lock:
        times = [t for k, t in _read_times() if k == kind]
    return statistics.median(times) if times else None


def record_compile_s(kind: str, seconds: float) -> None:
    """Add one measured first compiled call of ``kind`` to this machine's record (the last
    :data:`_TIMES_KEPT`): under a lock file, the file is read again, extended and written whole to a
    temporary file that is renamed over it, so processes recording at once keep each other's entries."""
    global _times
    if not (seconds > 0 and math.isfinite(seconds)):
        return
    with _times_lock:
        try:
            path = _times_path()
        except Exception:  # noqa: BLE001 - no cache folder (no home directory...): nothing recorded
            return
        if path is None:  # nowhere to keep it: this process's own compiles are known to their callers
            return
        try:
            with _file_lock(path):
                _times = None
                times = _read_times()
                times.append((kind, max(round(float(seconds), 3), 0.001)))
                times[:] = _last_per_kind(times)
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(times))
                os.replace(tmp, path)
        except OSError:
            return


# ----------------------------------------------------------------------------- graphs compiled before
# Which graphs this machine compiled, by a description of what was compiled (fnebm._signature), with
# the keys of the Inductor graphs they gave: a later process compiling the same finds them in
# Inductor's on-disk cache (as long as those entries are there), and that compile costs a fraction of
# a first one (Dynamo's trace, the cache's lookups and the library's load: the eight-schools
# evaluation's first compiled call took 10.3-13.3 s with empty caches and 3.1-4.1 s in the next process
# on this project's 2-core host). compile="auto" then expects that instead of a first compile's time.

_GRAPHS_KEPT = 256


def _record_path(stem: str):
    """``<stem>-<torch version>.json`` beside the compile times (``None`` where there is no cache folder)."""
    times = _times_path()
    return None if times is None else times.with_name(f"{stem}-{torch.__version__.replace('+', '-')}.json")


def _read_record(path, valid: Callable[[object], bool]) -> dict:
    """A record of ``{description: value}`` at ``path``, the entries whose value is ``valid``; ``{}`` where
    there is none or it is damaged."""
    try:
        found = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    except Exception:  # noqa: BLE001 - a damaged or foreign file: no record
        return {}
    if not isinstance(found, dict):
        return {}
    return {k: v for k, v in found.items() if isinstance(k, str) and valid(v)}


def _put_record(path, valid: Callable[[object], bool], key: str, value: object, kept: int) -> None:
    """Set ``key`` to ``value`` in the record at ``path`` (the most recent ``kept`` keys kept): under a lock
    file, read again and written whole to a temporary file renamed over it. Raises what the file system raises."""
    with _file_lock(path):
        entries = _read_record(path, valid)
        entries.pop(key, None)
        entries[key] = value
        while len(entries) > kept:
            entries.pop(next(iter(entries)))
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)


def _graphs_path():
    return _record_path("compiled-graphs")


def _graph_list(v: object) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v)


def _read_graphs(path) -> dict:
    return _read_record(path, _graph_list)


def graph_keys(compiled: Callable) -> list[str]:
    """The on-disk cache keys of the Inductor graphs inside ``compiled`` (what :func:`inductor_backend`
    returned), found as :func:`innermost_call` finds the graph; ``[]`` where there is none or this
    torch keeps them elsewhere."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError:  # pragma: no cover - another torch layout
        return []
    keys: list[str] = []
    for graph in _graphs_inside(compiled, CompiledFxGraph):
        key = getattr(graph, "_fx_graph_cache_key", None)
        if isinstance(key, str) and key and key not in keys:
            keys.append(key)
    return keys


def _graph_cache_on() -> bool:
    """Whether this process's Inductor keeps its graph cache: its options where Inductor is imported
    already, else what they start from (the environment). Never imports Inductor (with Dynamo, seconds
    that an eager run does not otherwise pay)."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        return bool(config.fx_graph_cache) and not config.force_disable_caches
    env = os.environ
    return env.get("TORCHINDUCTOR_FX_GRAPH_CACHE", "1") != "0" and env.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "0") != "1"


def _inductor_cache_dir() -> str:
    """Inductor's cache folder as ``torch._inductor.runtime.cache_dir_utils.cache_dir`` names it (the
    variable, else ``torchinductor_<user>`` in the temporary folder), without creating it or importing
    Inductor."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if root is not None:
        return os.path.abspath(root)
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if utils is not None:
        return os.path.abspath(utils.default_cache_dir())
    import getpass
    import re
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.abspath(os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)))


def _cached(key: str) -> bool:
    """Whether Inductor's on-disk graph cache (``TORCHINDUCTOR_CACHE_DIR``, or its default folder)
    holds an entry for ``key`` (the folder Inductor writes it to: ``fxgraph/<key[1:3]>/<key>``)."""
    try:
        # only looked at: Inductor's own cache_dir() would also create the folder and set the variable
        root = _inductor_cache_dir()
        folder = os.path.join(root, "fxgraph", key[1:3], key)
        if not os.path.isdir(folder):
            return False
        with os.scandir(folder) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


def record_graph(signature: str | None, keys: list[str]) -> None:
    """Note that what ``signature`` describes compiled on this machine to the graphs ``keys`` (the
    last :data:`_GRAPHS_KEPT` signatures kept, in the cache folder beside the compile times)."""
    if not signature or not keys:
        return
    try:
        path = _graphs_path()
        if path is not None:
            _put_record(path, _graph_list, signature, list(keys), _GRAPHS_KEPT)
    except Exception:  # noqa: BLE001 - no cache folder, or one this process cannot write: nothing recorded
        return


def compiled_before(signature: str | None) -> bool:
    """Whether what ``signature`` describes was compiled on this machine and every graph it gave is
    still in Inductor's on-disk cache (then compiling it again is mostly a cache hit)."""
    if not signature:
        return False
    try:
        keys = _read_graphs(_graphs_path()).get(signature)
        if not keys or not _graph_cache_on():
            return False  # the cache is off in this process: a compile here is a first one
        return all(_cached(k) for k in keys)
    except Exception:  # noqa: BLE001 - no cache folder, an unreadable record: not known
        return False


# ----------------------------------------------------------------------------- what compiling bought
# How much faster the compiled code of what a signature describes ran than its eager steps on this
# machine: the ratio of the two best measured rates (compiled seconds per step / eager seconds per
# step). compile="auto" weighs a compile against what it saves, not against the whole eager time
# (bench/user.py's 2-D MLP Langevin runner: 0.60-0.68 on this project's 2-core host, so a later
# process rents for 1 / 0.4 of the eager time it rented for before; a runner whose compiled steps
# buy nothing is not compiled again in every new process).

_GAINS_KEPT = 256


def _gains_path():
    return _record_path("compiled-gains")


def _ratio(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _read_gains(path) -> dict:
    return {k: float(v) for k, v in _read_record(path, _ratio).items()}


def record_gain(signature: str | None, ratio: float) -> None:
    """Note that the compiled code of what ``signature`` describes ran ``ratio`` times the eager steps'
    time per step on this machine (the last :data:`_GAINS_KEPT` signatures kept, beside the compile
    times; the latest measurement replaces an earlier one)."""
    if not signature or not (isinstance(ratio, float) and _ratio(ratio)):
        return
    try:
        path = _gains_path()
        if path is not None:
            _put_record(path, _ratio, signature, float(f"{ratio:.4g}"), _GAINS_KEPT)
    except Exception:  # noqa: BLE001 - no cache folder, or one this process cannot write: nothing recorded
        return


def recorded_gain(signature: str | None) -> float | None:
    """The compiled / eager time per step recorded on this machine for what ``signature`` describes
    (:func:`record_gain`), or ``None``."""
    if not signature:
        return None
    try:
        return _read_gains(_gains_path()).get(signature)
    except Exception:  # noqa: BLE001 - no cache folder, an unreadable record: not known
        return None


def cache_hits() -> tuple[int, int]:
    """Inductor's graph-cache hits and misses so far in this process (its counters)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover
        return 0, 0
    c = counters["inductor"]
    return int(c["fxgraph_cache_hit"]), int(c["fxgraph_cache_miss"])


@contextlib.contextmanager
def _file_lock(path):
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent writers may drop an entry (each write is still whole)
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------- the backend


# A CPU matrix product whose output is skinny (M x N, N <= _SKINNY_N, M >= _SKINNY_RATIO * N) runs as
# the transposed product, (B^T A^T)^T, whose output is wide: the batched form of a linear predictor
# (X @ beta for a few chains) and its gradient (X^T @ r) are such products, and MKL took 2-9x as long
# for them as for their transposes (1,000 x 25 data, 4 chains, one thread: 19.7 us against 6.5 us for
# X @ B^T, 27.9 against 6.6 us for X^T @ R^T; 10,000 rows: 200 against 53 and 331 against 59 us; the
# table is in docs/performance.md). Wider outputs are left alone (at N = 16-32 the transpose was as
# fast, or up to 5x slower).
_SKINNY_N = 8
_SKINNY_RATIO = 4


# A CPU matrix product with an inner dimension of at most _THIN_K (a network's layer on 2-D inputs) runs
# as _THIN_K products of a column by a row, added: elementwise code that Inductor fuses into the kernel
# reading the product (the layer's bias and activation), where MKL took 45-66 us for 1,024 x 2 x 128 (AVX2,
# one thread); one with one output column and a longer inner dimension (an energy's last layer, h @ w)
# as a row-wise dot product, and one with at most _THIN_MN output rows or columns (the gradient's
# pullback through a 2-D input layer) as a broadcast product summed over the inner dimension: reductions
# Inductor fuses with the kernel that makes their operand (MKL: 24-38 us for 1,024 x 128 x 1), taken
# only where the inner dimension is contiguous in both operands. They sum in another order than MKL:
# the same values to float rounding.
_THIN_K = 4
_THIN_MN = 2
THIN_PRODUCTS = True  # False: thin products stay library calls (the switch; it enters the pass's uuid)


def _thin_mm(graph: torch.fx.Graph, node: torch.fx.Node, a: torch.fx.Node, b: torch.fx.Node, vals: list,
             bias: torch.fx.Node | None = None) -> bool:
    """Rewrite ``node = mm(a, b)`` as elementwise code and a reduction where it is thin (above); whether it did."""
    aten = torch.ops.aten
    (m, k), n = vals[0].shape, vals[2].shape[1]
    if not THIN_PRODUCTS or not all(isinstance(v, int) for v in (m, k, n)) or m * n * k == 0:
        return False
    def call(op, *args):
        out = graph.call_function(op, args)
        out.meta["val"] = op(*[x.meta["val"] if isinstance(x, torch.fx.Node) else x for x in args])
        return out

    if k <= _THIN_K:
        with graph.inserting_before(node):
            total = None
            for i in range(k):  # a[:, i:i+1] * b[i:i+1, :], added in order
                term = call(aten.mul.Tensor, call(aten.slice.Tensor, a, 1, i, i + 1),
                            call(aten.slice.Tensor, b, 0, i, i + 1))
                total = term if total is None else call(aten.add.Tensor, total, term)
    elif vals[0].stride(1) != 1 or (vals[1].stride(0) != 1 and n > 1):
        return False  # a reduction down a column: the library's product is faster (the data's rows, X^T r)
    elif n == 1:
        with graph.inserting_before(node):
            total = call(aten.sum.dim_IntList, call(aten.mul.Tensor, a, call(aten.permute.default, b, [1, 0])),
                         [1], True)
    elif m <= _THIN_MN or n <= _THIN_MN:  # a few rows or columns: sum over the inner dimension of the broadcast
        with graph.inserting_before(node):
            total = call(aten.sum.dim_IntList, call(aten.mul.Tensor, call(aten.unsqueeze.default, a, 2),
                                                    call(aten.unsqueeze.default, b, 0)), [1])
    else:
        return False
    if bias is not None:
        with graph.inserting_before(node):
            total = call(aten.add.Tensor, bias, total)
    node.replace_all_uses_with(total)
    graph.erase_node(node)
    return True


def _skinny_mm_pass(graph: torch.fx.Graph) -> None:
    """Rewrite each CPU float ``mm(a, b)`` that is thin (:func:`_thin_mm`) as elementwise code and a
    reduction, and each other one with a skinny output as ``mm(b^T, a^T)^T`` (views: no copy)."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is aten.addmm.default and len(node.args) == 3
                and not node.kwargs):  # bias + a @ b (a linear layer): only where thin
            bias, a, b = node.args
            vals = [getattr(n, "meta", {}).get("val") for n in (a, b, node)]
            if (all(isinstance(v, torch.Tensor) for v in vals) and vals[2].device.type == "cpu"
                    and vals[2].dtype in (torch.float32, torch.float64)):
                _thin_mm(graph, node, a, b, vals, bias)
            continue
        if node.op != "call_function" or node.target is not aten.mm.default or len(node.args) != 2 or node.kwargs:
            continue
        a, b = node.args
        vals = [getattr(n, "meta", {}).get("val") for n in (a, b, node)]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            continue
        out = vals[2]
        m, n = out.shape
        if out.device.type != "cpu" or out.dtype not in (torch.float32, torch.float64):
            continue
        if _thin_mm(graph, node, a, b, vals):
            continue
        if not isinstance(m, int) or not isinstance(n, int) or not (n <= _SKINNY_N and m >= _SKINNY_RATIO * n):
            continue
        with graph.inserting_before(node):
            bt = graph.call_function(aten.permute.default, (b, [1, 0]))
            at = graph.call_function(aten.permute.default, (a, [1, 0]))
            prod = graph.call_function(aten.mm.default, (bt, at))
            back = graph.call_function(aten.permute.default, (prod, [1, 0]))
        bt.meta["val"] = vals[1].permute(1, 0)
        at.meta["val"] = vals[0].permute(1, 0)
        prod.meta["val"] = torch.ops.aten.mm.default(bt.meta["val"], at.meta["val"])
        back.meta["val"] = prod.meta["val"].permute(1, 0)
        node.replace_all_uses_with(back)
        graph.erase_node(node)


_SKINNY = None  # the pass object, made on first use (it imports Inductor)


def _skinny_pass():
    """:func:`_skinny_mm_pass` as Inductor's custom post-grad pass, with a ``uuid`` (its source), so that
    Inductor's on-disk graph cache keeps serving compiles that carry it."""
    global _SKINNY
    if _SKINNY is None:
        import inspect

        from torch._inductor.custom_graph_pass import CustomGraphPass

        digest = hashlib.sha256((inspect.getsource(_skinny_mm_pass) + inspect.getsource(_thin_mm)
                                 + f"{_SKINNY_N},{_SKINNY_RATIO},{_THIN_K},{_THIN_MN}").encode()).hexdigest()

        class SkinnyMM(CustomGraphPass):
            def __call__(self, graph: torch.fx.Graph) -> None:
                _skinny_mm_pass(graph)

            def uuid(self) -> str:
                return f"{digest}-{int(THIN_PRODUCTS)}"  # the switch as it is at this compile

        _SKINNY = SkinnyMM()
    return _SKINNY


def inductor_backend(gm: torch.fx.GraphModule, example_inputs, extra: dict | None = None) -> Callable:
    """Inductor, with fnebm's options (:func:`compile_patches`), and its C++ wrapper for CPU graphs that hold a ``while_loop``.

    Inductor runs a compiled ``while_loop`` from its wrapper, which allocates every buffer of the
    body on every trip; with its default Python wrapper that was about a fifth of a NUTS trip
    at 64 chains x 50 dimensions (measured: 270 -> 211 us per trip with the C++ wrapper, the
    same draws). Graphs without a data-dependent loop (Langevin, MALA, HMC with a fixed length)
    gain nothing from it (W1, W3 measured equal) and keep the faster-compiling Python wrapper.
    """
    from torch._inductor.compile_fx import compile_fx

    patches = dict(_COMPILE_OPTIONS)
    on_cpu = inputs_on_cpu(example_inputs)
    if on_cpu:
        patches.update(compile_patches())
        if torch._inductor.config.post_grad_custom_post_pass is None:  # a user's own pass is left alone
            patches["post_grad_custom_post_pass"] = _skinny_pass()
    if on_cpu and _has_while_loop(gm):
        patches["cpp_wrapper"] = True
        if passive_openmp():
            patches["cpp.threads"] = 1
    patches.update(extra or {})
    with linking_fast(on_cpu) as linked:
        try:
            return compile_fx(gm, example_inputs, config_patches=patches)
        except Exception as exc:
            if linked is None or not _build_failed(exc):
                raise
            _gave_up_linker()  # a build this linker could not link: once more with the compiler's own
    return compile_fx(gm, example_inputs, config_patches=patches)


def innermost_call(compiled: Callable) -> Callable | None:
    """The generated ``call(args)`` of the one Inductor CPU graph inside ``compiled`` (what
    :func:`inductor_backend` returned), or ``None`` where this is not plainly so.

    ``compiled`` is AOTAutograd's runtime wrapper around Inductor's graph: for an inference graph of
    plain CPU tensors it passes the inputs through and returns the outputs, and its layers (the
    Dynamo-disable context, the argument list, the first-call context, the output code's profiler
    and metrics hooks) cost about 3.5 us a call (eight schools' evaluation: 8.5 -> 5 us). The
    graph is found among the wrappers' closures (AOTAutograd's private layout: any surprise gives
    ``None``), and only a graph whose inputs it does not mutate, on the CPU only, without CUDA
    graphs. The caller still checks, on one call, that the graph gives what the wrapper gives
    (:class:`fnebm.samplers.evaluation._Evaluation`) before it calls the graph on its own.
    The returned function takes a list it empties (Inductor's boxed calling convention)."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError:  # pragma: no cover - another torch layout: the wrapper as it is
        return None
    found = _graphs_inside(compiled, CompiledFxGraph)
    if len(found) != 1:
        return None
    (graph,) = found
    absent = object()  # an attribute this torch does not have: not plainly so
    call = getattr(graph, "current_callable", None)
    mutated = (getattr(graph, "mutated_inputs", absent), getattr(graph, "mutated_input_idxs", absent))
    devices = getattr(graph, "device_types", absent)
    if (call is None or any(m is absent or m for m in mutated) or devices is absent or set(devices) != {"cpu"}
            or getattr(graph, "cudagraph_info", None) is not None):
        return None
    return call


# Inductor's C++ wrapper, as torch 2.13 generates it: the entry's signature (its C++ name) and what its
# source must say for cpp_entry to hand its address on
_ENTRY_SYMBOL = "_Z19inductor_entry_implPP16AtenTensorOpaqueS1_"  # inductor_entry_impl(AtenTensorHandle*, AtenTensorHandle*)
_ENTRY_STEALS = re.compile(r"auto inputs = steal_from_raw_handles_to_raii_handles\(input_handles, (\d+)\);")
_ENTRY_OUTPUT = re.compile(r"output_handles\[(\d+)\] = ")


def cpp_entry(compiled: Callable, n_inputs: int) -> int | None:
    """The address of the C++ entry of the one Inductor CPU graph inside ``compiled`` (what
    :func:`inductor_backend` returned with ``cpp_wrapper=True``), ``inductor_entry_impl(input
    handles, output handles)``, for :mod:`fnebm.kernels.cpu_trips` to call without Python; or
    ``None`` where this is not plainly so: not a C++-wrapper graph, another torch's layout, or a
    generated source that does not say what the caller relies on (that the entry takes
    ``n_inputs`` input handles, which it steals, and gives two outputs, which it hands over).
    Like :func:`innermost_call`, only for a graph that mutates no input."""
    if innermost_call(compiled) is None:
        return None
    try:
        from torch._inductor.output_code import CompiledFxGraph

        (graph,) = _graphs_inside(compiled, CompiledFxGraph)
        source = graph.source_code
        call = graph.current_callable
        # the generated module's call(args): a closure over the Python binding of the entry
        (binding,) = [c.cell_contents for c in call.__closure__]
        path = sys.modules[binding.__module__].__file__
    except Exception:  # noqa: BLE001 - any other layout: no entry
        return None
    steals = _ENTRY_STEALS.findall(source)
    outputs = sorted(int(i) for i in _ENTRY_OUTPUT.findall(source))
    if (getattr(binding, "__name__", None) != "inductor_entry_cpp" or not str(path).endswith(".so")
            or "void inductor_entry_impl(" not in source or steals != [str(n_inputs)] or outputs != [0, 1]):
        return None
    try:
        import ctypes

        return ctypes.cast(getattr(ctypes.PyDLL(path), _ENTRY_SYMBOL), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _graphs_inside(compiled: Callable, kind: type) -> list:
    """The distinct objects of ``kind`` (Inductor's compiled graphs) among ``compiled``'s wrappers'
    closures, ``__wrapped__`` chains and AOTAutograd's cache wrapper (``compiled_fn``), 8 levels deep."""
    found: list = []
    seen: set[int] = set()
    todo: list = [(compiled, 0)]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen or depth > 8:
            continue
        seen.add(id(obj))
        if isinstance(obj, kind):
            found.append(obj)
            continue
        cells = getattr(obj, "__closure__", None) if callable(obj) else None
        for cell in cells or ():
            try:
                todo.append((cell.cell_contents, depth + 1))
            except ValueError:  # an empty cell
                pass
        for name in ("__wrapped__", "compiled_fn"):  # functools.wraps chains; AOTAutograd's cache wrapper
            inner = getattr(obj, name, None)
            if inner is not None and not isinstance(obj, type):
                todo.append((inner, depth + 1))
    return list({id(g): g for g in found}.values())
