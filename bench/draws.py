"""Eager keyed draws on the CPU: fnebm.random (the C path, and the NumPy path it replaced) against
torch.randn / torch.rand for the same number of float32 values.

    python bench/draws.py [--rounds 41] [--inner 20] [--threads N] [--json bench/results-draws.json]

Cases (keys as a sampler holds them: one per chain, from fnebm.random.split):
  normal 128x784     128 chains x 784 values (the 784-D MLP Langevin step's noise)
  normal 10000x2     10,000 chains x 2 values (the 2-D toy sets)
  normal 4096x2      4,096 chains x 2 values
  normal 1x1000000   one key, a million values
  uniform 4096       one value per chain (an MH acceptance draw)
  fold_in 128, split 10000    the per-step keys
Each round times --inner calls of each implementation, alternated A B C (C path, NumPy path,
torch), and the figure is the median over rounds of the per-round ratio to torch (for the key
functions, to the NumPy path). torch's intra-op threads as set (default: all cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import torch

from fnebm import random as fr


def _host() -> dict:
    flags = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
        flags = next((ln.split(":", 1)[1] for ln in out.splitlines() if ln.startswith("Flags")), "")
    except (OSError, subprocess.SubprocessError, StopIteration):
        model = platform.processor()
    avx = sorted(f for f in flags.split() if f.startswith("avx"))
    return dict(cpu=model, avx_flags=avx, cores=os.cpu_count(), torch=torch.__version__,
                threads=torch.get_num_threads())


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return "n/a"


def _path(c: bool):
    def run(fn):
        saved = fr._C_EAGER
        fr._C_EAGER = c
        try:
            return fn()
        finally:
            fr._C_EAGER = saved
    return run


def _time(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if fr._c_library() is None:
        raise SystemExit(f"the C draws did not build: {__import__('fnebm._random_cpu').LIBRARY.why}")
    k128, k10k, k4k = (fr.split(fr.key(s), n) for s, n in ((0, 128), (1, 10_000), (2, 4096)))
    one = fr.key(3)
    cases = {
        "normal 128x784": (lambda: fr.normal(k128, (784,)), lambda: torch.randn(128, 784)),
        "normal 10000x2": (lambda: fr.normal(k10k, (2,)), lambda: torch.randn(10_000, 2)),
        "normal 4096x2": (lambda: fr.normal(k4k, (2,)), lambda: torch.randn(4096, 2)),
        "normal 1x1000000": (lambda: fr.normal(one, (1_000_000,)), lambda: torch.randn(1_000_000)),
        "uniform 4096": (lambda: fr.uniform(k4k, ()), lambda: torch.rand(4096)),
        "fold_in 128": (lambda: fr.fold_in(k128, 7), None),
        "split 10000": (lambda: fr.split(k10k), None),
    }
    c_path, numpy_path = _path(True), _path(False)
    load_before = _loadavg()
    results = {}
    for name, (ours, theirs) in cases.items():
        inner = max(1, args.inner // 10) if "1000000" in name else args.inner
        for f in (lambda: c_path(ours), lambda: numpy_path(ours)) + ((theirs,) if theirs else ()):
            f()  # warm
        rows = []
        for _ in range(args.rounds):
            row = [_time(lambda: c_path(ours), inner), _time(lambda: numpy_path(ours), inner)]
            if theirs:
                row.append(_time(theirs, inner))
            rows.append(row)
        med = [statistics.median(r[i] for r in rows) * 1e3 for i in range(len(rows[0]))]
        entry = dict(c_ms=med[0], numpy_ms=med[1],
                     c_over_numpy=statistics.median(r[0] / r[1] for r in rows))
        if theirs:
            entry.update(torch_ms=med[2], c_over_torch=statistics.median(r[0] / r[2] for r in rows),
                         numpy_over_torch=statistics.median(r[1] / r[2] for r in rows))
        results[name] = entry
        line = f"{name:18s} C {med[0]:8.4f} ms   NumPy path {med[1]:8.4f} ms   C/NumPy {entry['c_over_numpy']:.3f}"
        if theirs:
            line += f"   torch {med[2]:8.4f} ms   C/torch {entry['c_over_torch']:.2f}   NumPy/torch {entry['numpy_over_torch']:.2f}"
        print(line, flush=True)
    # how far the C normals are from the torch path's (the traced path's ops): relative to eps
    keys = fr.split(fr.key(11), 4096)
    ulps = {}
    for dtype in (torch.float32, torch.float64):
        a = c_path(lambda: fr.normal(keys, (784,), dtype)).double()
        saved = fr._NUMPY_EAGER
        fr._NUMPY_EAGER = False
        try:
            b = fr.normal(keys, (784,), dtype).double()
        finally:
            fr._NUMPY_EAGER = saved
        rel = (a - b).abs() / (torch.maximum(a.abs(), b.abs()).clamp_min(1e-300) * torch.finfo(dtype).eps)
        ulps[str(dtype)] = dict(max_eps=rel.max().item(), identical=(a == b).double().mean().item())
    print("C normal vs torch path, 4096 x 784:", ulps)
    out = dict(host=_host(), loadavg_before=load_before, loadavg_after=_loadavg(), rounds=args.rounds,
               inner=args.inner, results=results, normal_vs_torch_path=ulps)
    if args.json and os.path.exists(args.json):  # one file, a run per thread count
        with open(args.json) as f:
            runs = json.load(f)
    else:
        runs = {}
    runs[f"threads={out['host']['threads']}"] = out
    print(json.dumps(out["host"]), "load", load_before, "->", out["loadavg_after"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
