"""What every ``fnebm`` subcommand shares: its errors (one line on stderr), device and
output-path checks, atomic writes of the files it produces, and running under ``torchrun``
(the process group, each rank's device, errors reported once by rank 0)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, BinaryIO, NamedTuple

import torch
from torch import Tensor

PROG = "fnebm"


# ----------------------------------------------------------------------------- errors


class UsageError(Exception):
    """A bad argument: one line on stderr, exit status 2."""


class RunError(Exception):
    """A failure after the arguments were accepted (e.g. a write failed): exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage over several lines and exit
        if launched_rank() != 0:  # every rank parses the same argv: rank 0 says it
            quiet_exit(2, message)
        raise UsageError(message)

    def _print_message(self, message: str, file: Any = None) -> None:  # --help, --version: rank 0 only
        if launched_rank() == 0:
            super()._print_message(message, file)


def _one_line(message: Any) -> str:
    return " ".join(str(message).split()) or "unknown error"


def _parse_device(name: str) -> torch.device:
    try:
        return torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {name!r} (use cpu, cuda or cuda:N)") from None


def _device(name: str | None) -> torch.device:
    if launched():
        return _launched_device(name)
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = _parse_device(name)
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



def format_rows(rows: list[tuple[str, str]]) -> list[str]:
    """A summary's ``(name, value)`` rows as aligned lines, as every command prints them."""
    return [f"{k:<12} {v}" for k, v in rows]


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


# ----------------------------------------------------------------------------- torchrun
#
# Under torchrun every rank runs the whole command with the same arguments. The command starts the
# process group (gloo on the CPU, NCCL with one GPU per rank), checks its arguments on every rank and
# agrees on the outcome, so a bad argument is one line from rank 0 and exit status 2 on every rank.

GROUP_TIMEOUT_S = 900  # a collective waits this long for a peer (compiles on a loaded machine are slow)
QUIET_WAIT_S = 60      # a rank other than 0 that stops on an error waits this long for rank 0 to report it


def launched() -> bool:
    """Whether a ``torch.distributed`` launcher (torchrun) started this process: ``RANK`` and
    ``WORLD_SIZE`` are set."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def launched_rank() -> int:
    """This process's global rank: from the process group if one is running, else from torchrun's
    ``RANK`` (0 when not launched)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _env_int("RANK", 0) if launched() else 0


def quiet_exit(code: int, message: Any = None) -> None:
    """Stop a rank other than 0 without a word, since rank 0 reports the same error.

    It first waits (up to :data:`QUIET_WAIT_S`): torchrun stops the other ranks as soon as one
    exits, so a rank that exited at once could stop rank 0 before rank 0 had printed. Had rank 0
    not stopped the run by then (an error this rank alone met), it prints ``message`` itself."""
    time.sleep(QUIET_WAIT_S)
    if message is not None:
        print(f"{PROG}: error: rank {launched_rank()}: {_one_line(message)}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _launched_device(name: str | None) -> torch.device:
    """Under torchrun: each rank's device. ``None``: GPU ``LOCAL_RANK`` when this machine has a GPU
    for every local rank, else the CPU. ``cuda``: GPU ``LOCAL_RANK`` (refused without a GPU per local
    rank). ``cuda:N`` only with one rank per machine (two ranks cannot share a GPU under NCCL)."""
    local_rank, local_ranks = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name is None:
        return torch.device("cuda", local_rank) if 0 < local_ranks <= gpus else torch.device("cpu")
    dev = _parse_device(name)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise UsageError(f"--device {name}: under torchrun, use cpu or cuda (each rank takes GPU LOCAL_RANK)")
    if gpus == 0:
        raise UsageError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
    if dev.index is None:
        if local_ranks > gpus:
            raise UsageError(f"--device cuda needs a GPU per local rank: {local_ranks} ranks on this machine, "
                             f"{gpus} GPU(s) (use --device cpu, or fewer --nproc-per-node)")
        return torch.device("cuda", local_rank)
    if local_ranks > 1:
        raise UsageError(f"--device {name} names one GPU, but {local_ranks} ranks run on this machine: use "
                         "--device cuda (each rank takes GPU LOCAL_RANK)")
    if dev.index >= gpus:
        raise UsageError(f"--device {name}: only {gpus} CUDA device(s) here")
    return dev


class Launch(NamedTuple):
    """Where this process runs: its device, its rank among ``world_size`` processes, and the process
    group's backend (``None`` without a group)."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    backend: str | None = None
    owned: bool = False  # this command started the group (and ends it)


def launch(device: str | None) -> Launch:
    """This process's :class:`Launch`; under torchrun, starts the process group first (gloo on the
    CPU, NCCL on GPUs). A group the caller already started is used as it is."""
    import torch.distributed as dist

    running = dist.is_available() and dist.is_initialized()
    if not launched() and not running:
        return Launch(_device(device))
    dev = _device(device)
    if running:
        return Launch(dev, dist.get_rank(), dist.get_world_size(), dist.get_backend())
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return Launch(dev, dist.get_rank(), dist.get_world_size(), backend, owned=True)


def run_launched(device: str | None, body: Callable[[Launch], int]) -> int:
    """``body(launch(device))``, then the group it started is ended. A bad argument (or a failed
    write) on a rank other than 0 ends that rank quietly (:func:`quiet_exit`): rank 0 reports it."""
    import torch.distributed as dist

    try:
        where = launch(device)
    except UsageError as e:
        if launched_rank() != 0:  # every rank checks the same --device: rank 0 says it
            quiet_exit(2, e)
        raise
    try:
        code = body(where)
        if where.owned and where.world_size > 1:
            # every rank done communicating before any tears the group down: a rank that
            # destroyed its gloo group while a peer still talked to it aborted once in CI
            # ("terminate called without an active exception", exit -6)
            dist.barrier()
        return code
    except (UsageError, RunError) as e:
        if where.rank == 0:
            raise
        if where.owned:
            dist.destroy_process_group()
            where = where._replace(owned=False)
        quiet_exit(2 if isinstance(e, UsageError) else 1, e)
        raise  # unreachable: quiet_exit raises SystemExit
    finally:
        if where.owned and dist.is_initialized():
            dist.destroy_process_group()


def agree(where: Launch, check: Callable[[], Any]) -> Any:
    """``check()`` on every rank, which then agree on the outcome: if it raised :class:`UsageError`
    on any rank, rank 0 prints that error (the lowest failing rank's, named when it is not rank 0)
    as one line, and every rank exits with status 2. Otherwise ``check()``'s result. One process:
    ``check()``."""
    if where.world_size == 1:
        return check()
    import torch.distributed as dist

    try:
        result, error = check(), None
    except UsageError as e:
        result, error = None, _one_line(e)
    errors: list[Any] = [None] * where.world_size
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return result
    r, error = failed[0]
    if where.rank == 0:
        print(f"{PROG}: error: {error if r == 0 else f'rank {r}: {error}'}", file=sys.stderr, flush=True)
    dist.barrier()  # the other ranks exit once rank 0 has printed
    raise SystemExit(2)


# ------------------------------------------------------------- figures of 2-D samples (train)


def _box(data: Tensor) -> tuple[Tensor, Tensor]:
    lo, hi = data.min(0).values, data.max(0).values
    pad = 0.05 * (hi - lo) + 0.25
    return lo - pad, hi + pad


def mmd2(x: Tensor, y: Tensor, scales: tuple[float, ...] = (0.1, 0.3, 1.0)) -> float:
    """Unbiased squared MMD between samples ``x`` and ``y`` with a sum of Gaussian kernels of the given widths."""
    x, y = x.double(), y.double()

    def k(a: Tensor, b: Tensor) -> Tensor:
        d2 = torch.cdist(a, b).square()
        return sum(torch.exp(-0.5 * d2 / s**2) for s in scales)

    n, m = x.shape[0], y.shape[0]
    kxx, kyy = k(x, x), k(y, y)
    sxx = (kxx.sum() - kxx.diagonal().sum()) / (n * (n - 1))
    syy = (kyy.sum() - kyy.diagonal().sum()) / (m * (m - 1))
    return float(sxx + syy - 2 * k(x, y).mean())
