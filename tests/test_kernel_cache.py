"""The C kernels' build cache (fnebm.kernels._cbuild): a damaged library is never loaded — it is
rebuilt, or the run falls back and says why — and older builds are pruned.

Each damaged case runs in a child process with its own FNEBM_CACHE_DIR: loading a damaged
shared library can kill the process (SIGBUS, SIGILL), so the test must survive that to fail.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fnebm.kernels import _cbuild

# In a child process: a run of the chain kernel (MALA) or the NUTS kernel, and the same run's
# eager / torch-kernel steps; what the library reports, as JSON
_RUN = """
import json, os, sys, torch, fnebm
from pathlib import Path
from fnebm import _cbuild, energies, random as fr
from fnebm.kernels import cpu_chain, cpu_nuts
if "TEST_PREBUILT" in os.environ:  # an installation's prebuilt libraries, as setup.py leaves them
    _cbuild.PREBUILT = Path(os.environ["TEST_PREBUILT"])
which = sys.argv[1]
plans = []
if which == "chain":
    alg, twin, module = fnebm.mala(energies.harmonic(2.0), 0.2), None, cpu_chain
else:
    energy = energies.gaussian(torch.zeros(3), torch.tensor([[1.0, 0.5, 0.0], [0.5, 1.0, 0.2], [0.0, 0.2, 1.0]]))
    alg, twin, module = fnebm.nuts(energy, 0.5), fnebm.nuts(energy, 0.5, backend="torch"), cpu_nuts
state = torch.func.vmap(alg.init)(fr.normal(fr.key(0), (40, 3)))
n = 30 if which == "chain" else 4
_, got, _ = fnebm.sample_chain(alg.step, state, fr.key(1), n, progress=False, on_plan=plans.append)
if which == "chain":
    _, want, _ = fnebm.sample_chain(alg.step, state, fr.key(1), n, backend="eager", progress=False)
else:
    _, want, _ = fnebm.sample_chain(twin.step, state, fr.key(1), n, progress=False, compile=False)
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
ran = plans[0].kernel if which == "chain" else module.LIBRARY.lib is not None
print(json.dumps(dict(kernel=ran, reason=plans[0].reason, build_s=module.build_seconds(),
                      damaged=module.LIBRARY.damaged, why=module.LIBRARY.why, origin=module.LIBRARY.origin,
                      passed_over=module.LIBRARY.passed_over)))
"""


def _child(cache: Path, which: str, **env) -> dict:
    done = subprocess.run([sys.executable, "-c", _RUN, which],
                          env=dict(os.environ, FNEBM_CACHE_DIR=str(cache), **env),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the child exited {done.returncode}: {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A cache folder holding intact builds of both kernels (built once for the module)."""
    cache = tmp_path_factory.mktemp("built")
    os.chmod(cache, 0o700)
    for which in ("chain", "nuts"):
        result = _child(cache, which)
        assert result["kernel"] and result["build_s"] > 0, result
    return cache


def _copy(built: Path, tmp_path: Path, stem: str = "cpu_nuts") -> tuple[Path, Path]:
    cache = tmp_path / "cache"
    shutil.copytree(built, cache)
    os.chmod(cache, 0o700)
    (library,) = cache.glob(f"{stem}-*.so")
    return cache, library


def _damage(library: Path, how: str) -> None:
    data = library.read_bytes()
    if how == "half":
        os.truncate(library, len(data) // 2)
    elif how == "random":
        library.write_bytes(os.urandom(len(data)))
    elif how == "empty":
        os.truncate(library, 0)
    elif how == "flipped":  # one byte of the code changed, the size kept
        i = len(data) // 2
        library.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    elif how == "no record":
        _cbuild.record_path(library).unlink()
    else:
        raise ValueError(how)


# the NUTS kernel builds in a third of the chain kernel's time: it takes most cases
@pytest.mark.parametrize("which, how", [("chain", "half"), ("nuts", "half"), ("nuts", "random"), ("nuts", "empty")])
def test_a_damaged_library_is_rebuilt_and_the_kernel_runs(built, tmp_path, which, how):
    cache, library = _copy(built, tmp_path, "cpu_chain" if which == "chain" else "cpu_nuts")
    _damage(library, how)
    assert _cbuild.check(library) is not None
    result = _child(cache, which)  # exits 0 (not SIGBUS or SIGILL), the kernel's draws equal to its twin's
    assert result["kernel"], result
    assert result["build_s"] > 0 and result["damaged"] and str(library) in result["damaged"]
    assert _cbuild.check(library) is None  # the rebuilt library is intact, and recorded (a later process
    # loads it without building: test_cpu_chain.py::test_the_library_is_built_once_and_then_loaded)


def test_a_failed_rebuild_falls_back_and_says_why(built, tmp_path):
    # a compiler that reports the real one's version (so the cache name is the same) but cannot build
    cache, library = _copy(built, tmp_path)
    _damage(library, "flipped")
    fake = tmp_path / "fake-cc"
    real = shutil.which(os.environ.get("CC") or "cc")
    fake.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then exec {real} --version; fi\n'
                    'echo "fake-cc: cannot build" >&2\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    result = _child(cache, "nuts", CC=str(fake))
    assert not result["kernel"], result  # the torch kernel ran (the child compared the draws)
    assert "damaged" in result["why"] and "rebuilding it failed" in result["why"] and "fake-cc" in result["why"]
    assert "the NUTS C kernel covers this run but could not be used" in result["reason"]
    assert result["why"] in result["reason"]
    assert _cbuild.check(library) is not None  # left as it was: nothing was loaded or replaced


def test_a_fresh_build_that_crashes_its_loader_is_never_loaded(tmp_path):
    # a compiler whose linked library is cut to half (as a full disk would): the child process that
    # loads it first dies of SIGBUS, so the run falls back and says why instead of dying itself
    fake = tmp_path / "fake-cc"
    real = shutil.which(os.environ.get("CC") or "cc")
    fake.write_text(f'#!/bin/sh\n{real} "$@" || exit $?\n'
                    'for a in "$@"; do [ "$prev" = -o ] && out="$a"; prev="$a"; done\n'
                    'case " $* " in *" -shared "*) head -c $(( $(wc -c < "$out") / 2 )) "$out" > "$out.cut" '
                    '&& mv "$out.cut" "$out";; esac\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    result = _child(cache, "nuts", CC=str(fake))
    assert not result["kernel"] and "kills the process that loads it" in result["why"], result
    assert "could not be used" in result["reason"]
    assert not list(cache.glob("cpu_nuts-*.so"))  # nothing was published


def test_a_rebuild_prunes_older_builds_but_not_one_being_built(built, tmp_path):
    cache, library = _copy(built, tmp_path)
    _damage(library, "no record")
    old = [cache / f"cpu_nuts-{i:020x}.so" for i in range(5)]
    now = time.time()
    for i, p in enumerate(old):  # used 2 .. 6 days ago
        p.write_bytes(b"old build")
        _cbuild.record_path(p).write_text("0" * 64 + " 9\n")
        for f in (p, _cbuild.record_path(p)):
            os.utime(f, (now - 86400 * (i + 2),) * 2)
    recent = cache / "cpu_nuts-ffffffffffffffffffff.so"  # beyond KEEP, but used in the last day
    recent.write_bytes(b"another installation's build")
    os.utime(recent, (now - 3600,) * 2)
    other = cache / "cpu_chain-00000000000000000000.so"  # another library: never touched
    other.write_bytes(b"nuts")
    os.utime(other, (now - 86400 * 30,) * 2)
    stale, fresh = cache / ".build-killed", cache / ".build-running"
    stale.mkdir()
    fresh.mkdir()
    os.utime(stale, (now - 7200,) * 2)
    import fcntl

    with open(old[4].with_suffix(".lock"), "w") as lock:  # "another process is building it"
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = _child(cache, "nuts")
    assert result["kernel"] and result["build_s"] > 0
    kept = sorted(p.name for p in cache.glob("cpu_nuts-*.so"))
    # the rebuilt library, the KEEP - 1 most recently used others, the one used today and the locked one
    assert kept == sorted([library.name, recent.name, old[0].name, old[4].name])
    assert _cbuild.KEEP == 3
    for p in old[1:4]:
        assert not _cbuild.record_path(p).exists() and not p.with_suffix(".lock").exists()
    assert other.exists() and fresh.exists() and not stale.exists()


def test_check_reads_the_record(tmp_path):
    library = tmp_path / "x-0.so"
    library.write_bytes(b"\x7fELF" + bytes(100))
    assert "no checksum" in _cbuild.check(library)
    digest, size = _cbuild._digest(library)
    _cbuild.record_path(library).write_text(f"{digest} {size}\n")
    assert _cbuild.check(library) is None
    _cbuild.record_path(library).write_text("garbage")
    assert "damaged" in _cbuild.check(library)
    _cbuild.record_path(library).write_text(f"{digest} {size}\n")
    library.write_bytes(b"\x7fELF" + bytes(99) + b"\x01")
    assert "SHA-256" in _cbuild.check(library)
    os.truncate(library, 10)
    assert "10 bytes" in _cbuild.check(library)


def test_the_package_data_ships_every_file_the_kernels_build_from():
    # a wheel without one of them cannot build the kernels (.ci/wheel_check.sh checks a real wheel)
    import fnmatch
    import tomllib

    from fnebm import _random_cpu
    from fnebm.kernels import cpu_chain, cpu_nuts, cpu_trips

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["fnebm"]
    package = root / "fnebm"
    libraries = (_random_cpu.LIBRARY, cpu_chain.LIBRARY, cpu_nuts.LIBRARY, cpu_trips.LIBRARY)
    assert sorted(lib.stem for lib in libraries) == sorted(_cbuild.LIBRARIES)  # setup.py prebuilds these
    for library in libraries:
        for f in {*library.files, *(src for src, _ in library.objects)}:
            rel = f.resolve().relative_to(package).as_posix()
            assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not in the package data {globs}"


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> Path:
    """What an installation carries: the NUTS kernel built by prebuild() (setup.py's step)."""
    folder = tmp_path_factory.mktemp("prebuilt") / "_prebuilt"
    assert _cbuild.prebuild(folder, stems=["cpu_nuts"]) == {"cpu_nuts": None}
    assert sorted(p.name for p in folder.iterdir()) == ["cpu_nuts.so", "cpu_nuts.so.identity", "cpu_nuts.so.sha256"]
    return folder


def test_an_installations_prebuilt_library_is_loaded_and_nothing_is_built(prebuilt, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    # even with no compiler: the installation built it (the child compares the draws with the torch kernel's)
    result = _child(cache, "nuts", TEST_PREBUILT=str(prebuilt), CC=str(tmp_path / "no-such-cc"), FNEBM_PREBUILT="1")
    assert result["kernel"] and result["origin"] == "prebuilt" and result["build_s"] == 0, result
    assert result["passed_over"] is None
    assert not list(cache.glob("cpu_nuts-*")), list(cache.iterdir())


@pytest.mark.parametrize("how", ["another machine", "damaged", "turned off"])
def test_a_prebuilt_library_not_for_this_build_is_passed_over(built, prebuilt, tmp_path, how):
    # a wheel carried to another CPU (or sources edited since), a damaged file, FNEBM_PREBUILT=0:
    # the library comes from the cache (or a build) as without one, and the reason is kept
    folder = tmp_path / "_prebuilt"
    shutil.copytree(prebuilt, folder)
    library, env = folder / "cpu_nuts.so", {"FNEBM_PREBUILT": "1"}
    if how == "another machine":
        _cbuild.identity_path(library).write_text("0" * 64 + "\n")
    elif how == "damaged":
        _damage(library, "half")
    else:
        env["FNEBM_PREBUILT"] = "0"
    cache, _ = _copy(built, tmp_path)
    result = _child(cache, "nuts", TEST_PREBUILT=str(folder), **env)
    assert result["kernel"] and result["origin"] == "cache" and result["build_s"] == 0, result
    want = {"another machine": "built for another CPU", "damaged": "is damaged", "turned off": None}[how]
    assert (result["passed_over"] is None) if want is None else (want in result["passed_over"]), result


def test_prebuild_without_a_compiler_says_why_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    got = _cbuild.prebuild(tmp_path / "_prebuilt")
    assert sorted(got) == sorted(_cbuild.LIBRARIES)
    assert all("no C compiler found" in why for why in got.values()), got
    assert not (tmp_path / "_prebuilt").exists()


def test_the_build_step_loads_cbuild_without_torch(tmp_path):
    # setup.py runs _cbuild.py on its own in pip's build environment, where torch is not installed
    code = ("import importlib.util, sys; sys.modules['torch'] = None\n"
            "spec = importlib.util.spec_from_file_location('cb', sys.argv[1])\n"
            "cb = importlib.util.module_from_spec(spec); spec.loader.exec_module(cb)\n"
            "print(sorted(cb.LIBRARIES), cb.KERNELS)")
    done = subprocess.run([sys.executable, "-c", code, _cbuild.__file__], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "cpu_nuts" in done.stdout and str(Path(_cbuild.__file__).parent / "kernels") in done.stdout



@pytest.mark.parametrize("sampler, note", [
    ("mala", "the C kernel covers this run but could not be used (no C compiler found"),
    ("nuts", "the NUTS C kernel covers this run but could not be used (no C compiler found"),
])
def test_the_summary_says_why_a_c_kernel_did_not_run(tmp_path, sampler, note):
    # as from a wheel that cannot build the kernels: the run falls back, and its path line says why
    cmd = [sys.executable, "-m", "fnebm", "sample", "--sampler", sampler, "--energy", "gaussian", "--dim", "2",
           "--chains", "16", "--steps", "20", "--burn-in", "10", "--no-progress"]
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), FNEBM_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (path,) = [line for line in done.stdout.splitlines() if line.startswith("path ")]
    assert note in path, path


def test_the_compilers_version_is_asked_once_and_again_when_the_compiler_changes(tmp_path, monkeypatch):
    # `cc --version` enters the cache names; its answer is kept beside the libraries (running the
    # compiler cost ~20 ms in every process), keyed by the executable's path, size, time and inode
    fake = tmp_path / "bin" / "fakecc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho fakecc 1.0\n")
    fake.chmod(0o755)
    monkeypatch.setattr(_cbuild, "cache_dirs", lambda: [tmp_path / "cache"])
    runs = []
    real_run = subprocess.run

    def counting(cmd, *a, **kw):
        runs.append(cmd)
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(_cbuild.subprocess, "run", counting)
    cc = [str(fake), "-m64"]
    monkeypatch.setattr(_cbuild, "_VERSIONS", {})
    assert _cbuild.compiler_version(cc) == "fakecc 1.0\n" and len(runs) == 1
    monkeypatch.setattr(_cbuild, "_VERSIONS", {})  # a new process: read from the cache folder
    assert _cbuild.compiler_version(cc) == "fakecc 1.0\n" and len(runs) == 1
    assert _cbuild.compiler_version([str(fake)]) == "fakecc 1.0\n" and len(runs) == 2  # another command

    fake.write_text("#!/bin/sh\necho fakecc 2.0 upgraded\n")  # replaced: size and time change
    monkeypatch.setattr(_cbuild, "_VERSIONS", {})
    assert _cbuild.compiler_version(cc) == "fakecc 2.0 upgraded\n" and len(runs) == 3

    for memo in (tmp_path / "cache").glob("cc-*.version"):  # a memo cut short is not used
        memo.write_text(memo.read_text()[:5])
    monkeypatch.setattr(_cbuild, "_VERSIONS", {})
    assert _cbuild.compiler_version(cc) == "fakecc 2.0 upgraded\n" and len(runs) == 4
    assert not list((tmp_path / "cache").glob(".tmp-*"))
