"""Building and loading the C kernels (:mod:`fnebm.kernels.cpu_chain`, :mod:`fnebm.kernels.cpu_nuts`, and
:mod:`fnebm.random`'s eager CPU draws, :mod:`fnebm._random_cpu`). It lives below :mod:`fnebm.random` (it
imports only torch); :mod:`fnebm.kernels._cbuild` is another name for this module.

A :class:`CLibrary` is compiled on first use with the system C compiler (``$CC``, else ``cc``) for
this machine's CPU (a ``.cpp`` source as C++: the compiler driver takes the language from the
suffix, and the library is linked with libstdc++), its objects in parallel, into
``$FNEBM_CACHE_DIR`` or ``~/.cache/fnebm`` (falling back to a per-user temporary folder) under a name that hashes the sources, the flags,
the compiler (its ``--version``, remembered there too: :func:`compiler_version`), the CPU and
torch's version; later processes load it from there. The build is
atomic (compiled beside the target, then renamed) and holds a file lock, so concurrent processes
build once. Where no compiler works, :meth:`CLibrary.available` says why and callers fall back.

An installation may carry its own builds (:data:`PREBUILT`, ``fnebm/kernels/_prebuilt``): ``pip
install`` of fnebm compiles the libraries of :data:`LIBRARIES` for the installing machine
(``setup.py`` calls :func:`prebuild`), so that its first run builds nothing. Such a library is
loaded only where it was built for this very build: the same sources, flags, CPU (its instruction
sets) and architecture, recorded beside it as an identity, and its SHA-256 the recorded one; any
other (a wheel carried to another CPU, an edited source in a checkout, a damaged file) is passed
over, and the library is built into the cache as above. ``FNEBM_PREBUILT=0`` passes them over too.

A cached library is checked before it is loaded: its SHA-256 and size are recorded beside it at
build time (``<name>.so.sha256``, written after the library, each by an atomic rename), and a
library whose record is missing or does not match — truncated by a full disk, overwritten, left
by a killed build, damaged in a copy — is never loaded: it is rebuilt (or, if that fails, the
callers fall back and :attr:`CLibrary.why` says why). Loading a damaged shared library can kill
the process (SIGBUS, SIGILL) before Python sees an error; the checksum keeps it from being opened,
and a fresh build is loaded once in a child process before it is put in place.
After a build, older builds of the same library in that folder are pruned: the
:data:`KEEP` most recently used stay, and any used in the last day (another installation may
still load them); temporary build folders left by killed builds are removed after an hour.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

# -O2: as fast as -O3 here (the loops that matter are `omp simd`, vectorised either way; W1 27.6 vs
# 28.2 ms, W3 38.4 vs 39.5 ms) and half the build time of -O3 (build times: docs/performance.md).
# -mprefer-vector-width=512 (x86 only): GCC's tuning for AVX-512 CPUs picks 256-bit vectors unless
# told; the chain kernel's blocks are 16 float32 chains, one 512-bit register (ignored where there is none).
FLAGS = ("-O2", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC") + (
    ("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ())


# Enters the cache name: a library built before the checksum records existed is not looked for
_FORMAT = b"fnebm-cbuild-2"
KEEP = 3  # builds of each library kept in a cache folder (the one just built included) ...
_RECENT_S = 86400.0  # ... besides those used in the last day (several installations at work)
_STALE_BUILD_S = 3600.0  # a temporary build folder older than this was left by a killed build


KERNELS = Path(__file__).resolve().parent / "kernels"  # the C sources, their header, and PREBUILT

# The libraries fnebm builds, written once for the modules that load them and for prebuild():
# stem -> ((source, defines) per object, compiled at once), the files the build reads
LIBRARIES: dict[str, tuple[tuple[tuple[str, tuple[str, ...]], ...], tuple[str, ...]]] = {
    # fnebm._random_cpu: one source compiled twice (the float32 draws; the float64 draws and the keys)
    "cpu_random": ((("_cpu_random.c", ("-DFNEBM_RANDOM_PART=0",)), ("_cpu_random.c", ("-DFNEBM_RANDOM_PART=1",))),
                   ("_cpu_random.c", "_cpu_common.h")),
    # fnebm.kernels.cpu_chain: Langevin and MALA are the one source compiled twice (-DFNEBM_MALA=0/1)
    "cpu_chain": ((("_cpu_chain.c", ("-DFNEBM_MALA=0",)), ("_cpu_chain.c", ("-DFNEBM_MALA=1",))),
                  ("_cpu_chain.c", "_cpu_common.h")),
    # fnebm.kernels.cpu_nuts. -ffp-contract=off: no fused multiply-adds, so a - c * b rounds as torch's
    # two operations do (the kernel's tree decisions compare against thresholds; the fewer rounding
    # differences the better)
    "cpu_nuts": ((("_cpu_nuts.c", ("-ffp-contract=off",)),), ("_cpu_nuts.c", "_cpu_common.h")),
    # fnebm.kernels.cpu_trips: C++ (it catches a compiled graph's exceptions), linked with libstdc++
    "cpu_trips": ((("_cpu_trips.cpp", ()),), ("_cpu_trips.cpp",)),
}

# What the installation built (prebuild(), from setup.py): <stem>.so, its checksum record, and
# <stem>.so.identity, the build's identity (CLibrary.identity)
PREBUILT = KERNELS / "_prebuilt"


def library(stem: str, setup: Callable[[ctypes.CDLL], None]) -> "CLibrary":
    """The :class:`CLibrary` of :data:`LIBRARIES`' ``stem``, its sources in :data:`KERNELS`."""
    objects, files = LIBRARIES[stem]
    return CLibrary(stem, [(KERNELS / src, defines) for src, defines in objects], [KERNELS / f for f in files], setup)


def prebuild(folder: Path | str | None = None, stems: Sequence[str] | None = None) -> dict[str, str | None]:
    """Compiles :data:`LIBRARIES` (or ``stems`` of them) into ``folder`` (default :data:`PREBUILT`)
    for this machine, each with its checksum record and identity, the libraries at once; what
    ``setup.py`` runs when fnebm is installed. Returns, per stem, ``None`` or why it was not built
    (no compiler, a failed build); it never raises for a failed build. It needs no torch."""
    from concurrent.futures import ThreadPoolExecutor

    folder = Path(PREBUILT if folder is None else folder)
    stems = list(LIBRARIES if stems is None else stems)
    cc = compiler()
    if cc is None:
        return {stem: f"no C compiler found (set CC; tried {os.environ.get('CC') or 'cc'})" for stem in stems}
    folder.mkdir(parents=True, exist_ok=True)

    def one(stem: str) -> str | None:
        lib = library(stem, lambda _: None)
        target = folder / f"{stem}.so"
        try:
            lib._compile(cc, target)
            _write_atomic(identity_path(target), lib.identity() + "\n")
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            return str(exc)
        return None

    with ThreadPoolExecutor(len(stems) or 1) as pool:
        return dict(zip(stems, pool.map(one, stems)))


def identity_path(library: Path) -> Path:
    """The file beside a prebuilt ``library`` that records the identity of its build."""
    return library.with_name(library.name + ".identity")


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def compiler() -> list[str] | None:
    """The compiler command, as ``$CC`` gives it (``"ccache gcc"`` and ``"gcc -m64"`` included), or ``None``."""
    words = shlex.split(os.environ.get("CC") or "cc")
    found = shutil.which(words[0]) if words else None
    return [found, *words[1:]] if found else None


_VERSIONS: dict[tuple[str, ...], str] = {}  # this process's answers of compiler_version
_VERSION_END = "\n#fnebm-version-end\n"  # a memo file without it was cut short: not used


def _compiler_identity(cc: list[str]) -> str | None:
    """The command's words with, for each that names an executable, its real path, size, modification
    time and inode: what changes when the compiler is replaced or upgraded. ``None`` if one cannot be read."""
    parts = []
    for word in cc:
        found = word if os.path.isabs(word) else (None if word.startswith("-") else shutil.which(word))
        parts.append(word)
        if found:
            try:
                real = os.path.realpath(found)
                st = os.stat(real)
            except OSError:
                return None
            parts.append(f"{real}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}")
    return "\0".join(parts)


def compiler_version(cc: list[str]) -> str:
    """``cc --version``'s output, which enters the libraries' cache names. Running the compiler costs
    about 20 ms in every process that loads a library, so the answer is kept on disk beside the
    libraries under a hash of :func:`_compiler_identity` (a replaced compiler is asked again)."""
    key = tuple(cc)
    if key in _VERSIONS:
        return _VERSIONS[key]
    ident = _compiler_identity(cc)
    memo = f"cc-{hashlib.sha256(ident.encode()).hexdigest()[:20]}.version" if ident is not None else None
    version = None
    if memo is not None:
        for folder in cache_dirs():
            with contextlib.suppress(OSError, UnicodeDecodeError):
                text = (folder / memo).read_text()
                if text.endswith(_VERSION_END):
                    version = text[: -len(_VERSION_END)]
                    break
    if version is None:
        try:
            version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise RuntimeError(f"the C compiler {cc} does not run: {exc}") from None
        if memo is not None:
            _write_memo(memo, version + _VERSION_END)
    _VERSIONS[key] = version
    return version


def _write_memo(name: str, text: str) -> None:
    """``text`` into ``name`` in the first usable cache folder, atomically; nothing on failure."""
    for folder in cache_dirs():
        if not _usable(folder):
            continue
        with contextlib.suppress(OSError):
            _write_atomic(folder / name, text)
        return


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


def cache_dirs() -> list[Path]:
    """Where a library may be built: ``$FNEBM_CACHE_DIR`` if set; else ``~/.cache/fnebm`` (or
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


@contextlib.contextmanager
def _try_lock(target: Path):
    """Yields whether this process holds ``target``'s build lock (without waiting for it)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: nothing is pruned
        yield False
        return
    try:
        f = open(target.with_suffix(".lock"), "a")
    except OSError:
        yield False
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False  # another process is building it now
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def record_path(library: Path) -> Path:
    """The file beside ``library`` that records its SHA-256 and size at build time."""
    return library.with_name(library.name + ".sha256")


def _digest(path: Path | str) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def check(library: Path) -> str | None:
    """``None`` when ``library`` is intact — its SHA-256 and size are those recorded at build
    time — else what is wrong with it (one phrase). It reads the file; it never loads it."""
    try:
        words = record_path(library).read_text().split()
    except FileNotFoundError:
        return "no checksum was recorded for it (a build that did not finish, or one from an older fnebm)"
    except (OSError, UnicodeDecodeError) as exc:
        return f"its checksum record cannot be read ({exc})"
    if len(words) != 2 or not re.fullmatch(r"[0-9a-f]{64}", words[0]) or not words[1].isdigit():
        return "its checksum record is damaged"
    try:
        digest, size = _digest(library)
    except FileNotFoundError:
        return "it is missing"
    except OSError as exc:
        return f"it cannot be read ({exc})"
    if size != int(words[1]):
        return f"it is {size} bytes, not the {words[1]} recorded at build time"
    if digest != words[0]:
        return "its SHA-256 is not the one recorded at build time"
    return None


def _probe_load(library: str) -> None:
    """Loads a fresh build in a child process first (tens of milliseconds, once per build): a
    library that kills the process that loads it is never published. Only a death by a signal
    counts; a child that cannot load it for another reason (its own library path) is no verdict."""
    code = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
    try:
        done = subprocess.run([sys.executable, "-S", "-c", code, library], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return
    if done.returncode < 0:
        raise RuntimeError(f"the freshly built C kernel kills the process that loads it "
                           f"(signal {-done.returncode} in a child process)")


class CLibrary:
    """One shared library: ``objects`` are ``(source, defines)`` pairs compiled at once, then linked.

    ``files`` are every file the build reads (sources and headers: they enter the cache name);
    ``setup(lib)`` declares the entry points' ctypes signatures after loading.
    """

    def __init__(self, stem: str, objects: Sequence[tuple[Path, Sequence[str]]], files: Sequence[Path],
                 setup: Callable[[ctypes.CDLL], None]) -> None:
        self.stem = stem
        self.objects = [(Path(src), tuple(defines)) for src, defines in objects]
        self.files = [Path(f) for f in files]
        self.setup = setup
        self.lib: ctypes.CDLL | None = None
        self.why: str | None = None  # why the library is unavailable, once a build failed
        self.build_s = 0.0  # seconds this process spent compiling it (0 when it was found on disk)
        self.damaged: str | None = None  # a damaged cached copy this process found (and rebuilt)
        # where the loaded library came from: "prebuilt" (the installation's), "cache" (built by an
        # earlier process), "built" (by this one); None until it is loaded
        self.origin: str | None = None
        self.passed_over: str | None = None  # why the installation's prebuilt library was not taken
        self._lock = threading.Lock()

    def name(self, cc: list[str]) -> str:
        """The file name: a hash of the sources, the flags, the compiler, the CPU and torch."""
        import torch

        version = compiler_version(cc)
        try:
            parts = [f.read_bytes() for f in self.files]
        except OSError as exc:  # e.g. a package that did not ship one of them
            raise RuntimeError(f"cannot read {exc.filename}, which the C kernel builds from (an incomplete "
                               f"installation of fnebm?): {exc.strerror}") from None
        parts += [repr([(s.name, d) for s, d in self.objects]).encode(), " ".join(cc[1:] + list(FLAGS)).encode(),
                  version.encode(), _cpu_id().encode(), torch.__version__.encode(), _FORMAT]
        digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
        return f"{self.stem}-{digest}.so"

    def identity(self) -> str:
        """What a prebuilt library must have been built from to be loaded here: a hash of the
        sources, the objects' defines, the flags, the CPU's instruction sets and the architecture
        (not the compiler: any build for this CPU will do; not torch, which the libraries do not link)."""
        parts = [f.read_bytes() for f in self.files]
        parts += [repr([(s.name, d) for s, d in self.objects]).encode(), " ".join(FLAGS).encode(),
                  _cpu_id().encode(), platform.machine().encode(), _FORMAT]
        return hashlib.sha256(b"\0".join(parts)).hexdigest()

    def _prebuilt(self) -> Path | None:
        """The installation's build of this library where it is one for this machine and intact;
        else ``None``, with :attr:`passed_over` saying why when there was one."""
        if os.environ.get("FNEBM_PREBUILT", "1").strip() == "0":
            return None
        path = PREBUILT / f"{self.stem}.so"
        try:
            recorded = identity_path(path).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None  # none was built (an editable install, a checkout, no compiler at install)
        try:
            if recorded != self.identity():
                self.passed_over = ("it was built for another CPU, other sources or other flags "
                                    "(a wheel built elsewhere, or sources edited since)")
                return None
        except OSError:
            return None
        problem = check(path)
        if problem is not None:
            self.passed_over = f"the installation's {path} is damaged: {problem}"
            return None
        return path

    def _cached(self, name: str) -> tuple[Path | None, str | None]:
        """``(an intact cached library, None)``, or ``(None, what is wrong with a damaged one)``, or
        ``(None, None)`` when there is none."""
        damaged = None
        for folder in cache_dirs():
            path = folder / name
            if path.exists() and _usable(folder):
                problem = check(path)
                if problem is None:
                    return path, None
                damaged = damaged or f"the cached {path} is damaged: {problem}"
        return None, damaged

    def built(self) -> bool:
        """Whether it is ready without compiling: loaded, failed for good, or found intact on disk."""
        if self.lib is not None or self.why is not None:
            return True
        if self._prebuilt() is not None:
            return True
        cc = compiler()
        if cc is None:
            return True  # nothing will be compiled
        try:
            return self._cached(self.name(cc))[0] is not None
        except RuntimeError:
            return True

    def _build(self, cc: list[str]) -> Path:
        name = self.name(cc)
        found, damaged = self._cached(name)
        if found is not None:
            return found
        folders = cache_dirs()
        usable = [f for f in folders if _usable(f)]
        if not usable:
            raise RuntimeError(f"cannot write the build cache ({', '.join(map(str, folders))}: missing, not writable, "
                               "or writable by others); set FNEBM_CACHE_DIR to a folder of your own")
        target = usable[0] / name
        t0 = time.perf_counter()
        with _build_lock(target):  # one process builds; the others wait, then load its library
            problem = check(target)  # another process may have built it while this one waited
            if problem is not None:
                if target.exists() or damaged:
                    self.damaged = damaged or f"the cached {target} is damaged: {problem}"
                try:
                    self._compile(cc, target)
                except RuntimeError as exc:
                    if self.damaged:
                        raise RuntimeError(f"{self.damaged}; rebuilding it failed: {exc}") from None
                    raise
                self.build_s += time.perf_counter() - t0
                self._prune(target)
        return target

    def _prune(self, keep: Path) -> None:
        """Removes older builds of this library from ``keep``'s folder (all but the :data:`KEEP`
        most recently used, ``keep`` among them, and those used in the last day; none that another
        process is building) and the temporary folders of builds killed more than an hour ago.
        Never raises."""
        pattern = re.compile(re.escape(self.stem) + r"-[0-9a-f]{20}\.so")
        folder = keep.parent
        try:
            entries = list(folder.iterdir())
        except OSError:
            return
        others = []
        now = time.time()
        for p in entries:
            try:
                if pattern.fullmatch(p.name) and p.name != keep.name:
                    # last use: a load touches the checksum record (or the library's own time)
                    record = record_path(p)
                    used = max(p.stat().st_mtime, record.stat().st_mtime if record.exists() else 0.0)
                    others.append((used, p))
                elif p.name.startswith(".build-") and p.is_dir() and now - p.stat().st_mtime > _STALE_BUILD_S:
                    shutil.rmtree(p, ignore_errors=True)
            except OSError:
                continue
        others.sort(reverse=True)
        for used, p in others[KEEP - 1:]:
            if now - used < _RECENT_S:
                continue
            with _try_lock(p) as held:
                if not held:
                    continue
                for f in (p, record_path(p), p.with_suffix(".lock")):
                    with contextlib.suppress(OSError):
                        f.unlink()  # a process that has it loaded keeps its mapping

    def _compile(self, cc: list[str], target: Path) -> None:
        # compile beside the target and rename: another process never loads a half-written library.
        # The objects compile at once (the chain kernel's two: about 0.6x the time of one after the other on 2 cores).
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
            objects = [os.path.join(work, f"part{i}.o") for i in range(len(self.objects))]
            jobs = [subprocess.Popen([*cc, *FLAGS, *defines, "-c", str(src), "-o", obj],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                    for (src, defines), obj in zip(self.objects, objects)]
            errors = [job.communicate(timeout=300)[1] for job in jobs]
            for job, err in zip(jobs, errors):
                if job.returncode != 0:
                    first = (err.strip().splitlines() or ["no message"])[0]
                    raise RuntimeError(f"{' '.join(cc)} failed to build the C kernel: {first}")
            tmp = os.path.join(work, f"{self.stem}.so")
            cxx = ["-lstdc++"] if any(src.suffix == ".cpp" for src, _ in self.objects) else []
            done = subprocess.run([*cc, "-shared", "-fopenmp", *objects, "-o", tmp, "-lm", *cxx], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                first = (done.stderr.strip().splitlines() or ["no message"])[0]
                raise RuntimeError(f"{' '.join(cc)} failed to link the C kernel: {first}")
            os.chmod(tmp, 0o755)
            _probe_load(tmp)
            digest, size = _digest(tmp)
            record = os.path.join(work, "record")
            with open(record, "w") as f:
                f.write(f"{digest} {size}\n")
            # the library first, then its record: a reader in between finds no record (or a damaged
            # library's old one) and waits on the lock; a build killed between the two leaves a
            # library without a record, which the next process rebuilds
            os.replace(tmp, target)
            os.replace(record, record_path(target))

    def load(self) -> ctypes.CDLL | None:
        """The loaded library (built now if needed), or ``None`` with :attr:`why` set."""
        with self._lock:
            if self.lib is not None or self.why is not None:
                return self.lib
            path = self._prebuilt()
            if path is not None:
                try:
                    lib = ctypes.CDLL(str(path))
                except OSError as exc:
                    self.passed_over = f"the installation's {path} does not load: {exc}"
                else:
                    self.setup(lib)
                    self.lib, self.origin = lib, "prebuilt"
                    return lib
            cc = compiler()
            if cc is None:
                self.why = f"no C compiler found (set CC; tried {os.environ.get('CC') or 'cc'})"
                return None
            try:
                path = self._build(cc)
                lib = ctypes.CDLL(str(path))
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                self.why = str(exc)
                return None
            with contextlib.suppress(OSError):
                os.utime(record_path(path))  # the last use, which pruning keeps the most recent of
            self.setup(lib)
            self.lib, self.origin = lib, ("built" if self.build_s > 0 else "cache")
            return lib

    def available(self) -> str | None:
        """``None`` when the library is built (or builds now) and loads, else why not (one phrase)."""
        self.load()
        return self.why
