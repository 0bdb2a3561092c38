"""What every ``fnebm`` subcommand shares: its errors (one line on stderr), device and
output-path checks, and atomic writes of the files it produces."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

PROG = "fnebm"


# ----------------------------------------------------------------------------- errors


class UsageError(Exception):
    """A bad argument: one line on stderr, exit status 2."""


class RunError(Exception):
    """A failure after the arguments were accepted (e.g. a write failed): exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage over several lines and exit
        raise UsageError(message)


def _one_line(message: Any) -> str:
    return " ".join(str(message).split()) or "unknown error"



def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {name!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
        return dev
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != dev.type:
        raise UsageError(f"--device {name}: no {dev.type} device on this machine (use cpu or cuda)")
    return dev


def _destination(flag: str, path: str) -> str:
    """The file ``path`` will replace (symlinks followed), or UsageError; probes the directory."""
    if not path:
        raise UsageError(f"{flag}: empty path")
    real = os.path.realpath(path)
    if os.path.isdir(real):
        raise UsageError(f"{flag} {path}: is a directory")
    if os.path.lexists(real) and not os.path.isfile(real):
        raise UsageError(f"{flag} {path}: exists and is not a regular file")
    parent = os.path.dirname(real)
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: directory {os.path.dirname(path) or '.'} does not exist")
    try:  # os.access is wrong for root and for read-only mounts: try what the write will do
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".fnebm-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path}: directory {os.path.dirname(path) or '.'} is not writable ({e.strerror})") from None
    return real


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)



def _float_or_none(x: Any) -> float | None:
    return None if x is None else float(x)


def _fmt(x: float | None, spec: str = ".3g", missing: str = "n/a (needs >= 4 kept draws)") -> str:
    return missing if x is None else format(x, spec)



def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(files: list[tuple[str, Callable[[BinaryIO], None]]]) -> None:
    """Write each ``(path, write)`` to a temporary file beside ``path``; once all are complete,
    ``os.replace`` each onto its path. If a write fails, every temporary file is removed and
    no ``path`` is touched; an existing file is only ever replaced by a complete one."""
    temps: list[tuple[str, str]] = []
    mode = 0o666 & ~_umask()  # mkstemp makes 0600 files; give what open() would
    try:
        for path, write in files:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.", suffix=".tmp")
            temps.append((tmp, path))
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
        for tmp, path in temps:
            os.replace(tmp, path)
    finally:
        for tmp, _ in temps:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass



# ----------------------------------------------------------------------------- memory


def format_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} PiB"  # unreachable


def available_memory(device: torch.device) -> int | None:
    """Bytes that a run can still allocate on ``device``: free device memory on CUDA, the kernel's
    MemAvailable (else free physical pages) on the CPU; ``None`` where it cannot be told."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


_OOM_MARKS = ("out of memory", "can't allocate memory", "not enough memory", "defaultcpuallocator",
              "failed to allocate", "cannot allocate memory")


def is_out_of_memory(e: BaseException) -> bool:
    """An allocator's failure: ``torch.OutOfMemoryError`` on a GPU, a ``RuntimeError`` (or
    ``MemoryError``) from the CPU allocator."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _OOM_MARKS)


# ----------------------------------------------------------------------- compile times


_COMPILE_TIMES = "fnebm-cli-compile-times.json"


def _compile_times_path() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return os.path.join(cache_dir(), _COMPILE_TIMES)
    except Exception:  # noqa: BLE001  (a private module: any failure means no record)
        return None


def compile_cache_dir() -> str | None:
    """Where Inductor keeps compiled code between processes (``None`` if unknown)."""
    path = _compile_times_path()
    return None if path is None else os.path.dirname(path)


def compile_times() -> dict[str, dict[str, float]]:
    """Compile times measured on this machine: ``{configuration: {"first": s, "last": s}}``. Kept
    beside Inductor's on-disk cache, so clearing the cache clears them too."""
    path = _compile_times_path()
    if path is None:
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)
            and all(isinstance(v.get(f), (int, float)) for f in ("first", "last"))}


def record_compile_time(config: str, seconds: float) -> None:
    """Remember how long ``config`` took to compile (best effort: a failure is ignored)."""
    path = _compile_times_path()
    if path is None:
        return
    data = compile_times()
    entry = data.get(config)
    data[config] = {"first": entry["first"] if entry else round(seconds, 2), "last": round(seconds, 2)}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{_COMPILE_TIMES}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except (OSError, UnboundLocalError):
            pass


def write_outputs(outputs: list[tuple[str, str, str, Callable[[BinaryIO], None]]]) -> None:
    """Write each ``(label, shown_path, path, write)`` with :func:`write_atomic` (all or none),
    then print one ``label  shown_path`` line each; a failed write is one :class:`RunError` line."""
    try:
        write_atomic([(path, write) for _, _, path, write in outputs])
    except OSError as e:
        raise RunError(f"cannot write {e.filename or 'output'}: {e.strerror or e}") from None
    for label, shown, _, _ in outputs:
        print(f"{label:<12} {shown}")
