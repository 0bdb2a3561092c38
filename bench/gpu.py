"""GPU workloads for fnebm's hand-written Triton kernels (issue 10). Needs a CUDA device.

    python bench/gpu.py [--only G1,G2] [--repeats N] [--peak-gbps GBPS] [--json PATH]
    python bench/gpu.py --compile-only      # no GPU needed: compile the kernels for sm_90a

Workloads:
  G1  unadjusted Langevin, double well (h = 2, b = 1), 1,024 chains x 128-D x 200 steps,
      step size 0.01, the whole trajectory kept (TorchEBM's published A100 figure for this
      configuration: 82 ms eager).
  G2  MALA, the same double well, 10,000 chains x 100-D x 1,000 steps, step size 0.01, the
      whole trajectory kept (4.0 GB of float32).

Implementations, per workload: TorchEBM 0.8 eager (LangevinDynamics + DoubleWellModel; it has
no MALA, so on G2 its unadjusted Langevin is timed as the nearest peer and labelled so),
fnebm compiled (sample_chain(backend="compiled"): Inductor's own Triton code) and fnebm kernels
(sample_chain(backend="triton"): one launch of fnebm.kernels.langevin_chain).

Method (as bench/run.py): each implementation's first call is timed alone (cold: compile
included, the time to first result), then warm calls are interleaved round by round for
--repeats rounds, the device synchronised around every call; warm = the median of an
implementation's warm calls, ratio = the median over rounds of the per-round ratio.
Roofline: the trajectory's bytes (draws x chains x dim x 4) over the warm time, as a fraction
of the device's peak HBM bandwidth (--peak-gbps, or a table of known devices). The targets
(issue 10): kernels >= 100x TorchEBM eager, >= 2x Inductor's code, >= 70 % of HBM on G2.

Without CUDA the benchmark refuses to run (exit status 2): no GPU figure is ever estimated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

# peak HBM bandwidth, GB/s, by a substring of torch.cuda.get_device_name()
_PEAK_GBPS = {"H200": 4800.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0, "A100": 1555.0}

WORKLOADS = {
    "G1": dict(sampler="langevin", chains=1024, dim=128, steps=200),
    "G2": dict(sampler="mala", chains=10_000, dim=100, steps=1000),
}
H, B, ETA = 2.0, 1.0, 0.01


def _fail(message: str) -> None:
    print(f"bench/gpu.py: {message}", file=sys.stderr)
    sys.exit(2)


def _sync() -> None:
    torch.cuda.synchronize()


def fnebm_run(w: dict, backend: str):
    import fnebm
    from fnebm import energies as E
    from fnebm import random as fr

    energy = E.double_well(H, B, dtype=torch.float32, device="cuda")
    alg = fnebm.mala(energy, ETA) if w["sampler"] == "mala" else fnebm.langevin(energy, ETA)
    x0 = fr.normal(fr.key(0, "cuda"), (w["chains"], w["dim"]))
    state = torch.func.vmap(alg.init)(x0)
    key = fr.key(1, "cuda")
    compile = {"compiled": True, "triton": "auto"}[backend]

    def run():
        return fnebm.sample_chain(alg.step, state, key, w["steps"], backend=backend, compile=compile, progress=False)

    return run


def torchebm_run(w: dict):
    from torchebm.core import DoubleWellModel
    from torchebm.samplers import LangevinDynamics

    sampler = LangevinDynamics(DoubleWellModel(barrier_height=H, b=B), step_size=ETA, noise_scale=1.0, device="cuda")
    x0 = torch.randn(w["chains"], w["dim"], device="cuda")

    def run():
        return sampler.sample(x=x0.clone(), n_steps=w["steps"], return_trajectory=True)

    return run


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def measured_write_gbps(nbytes: int, repeats: int = 7) -> float:
    """The write ceiling measured on this device: fill a buffer of the trajectory's size (bytes written / median time)."""
    buf = torch.empty(nbytes // 4, device="cuda")
    buf.fill_(0.5)
    times = [_timed(lambda: buf.fill_(1.0)) for _ in range(repeats)]
    del buf
    return nbytes / statistics.median(times) / 1e9


def bench(name: str, w: dict, repeats: int, peak: float, which=("compiled", "torchebm")) -> dict:
    impls = {"fnebm kernels": fnebm_run(w, "triton")}
    if "compiled" in which:
        impls["fnebm compiled"] = fnebm_run(w, "compiled")
    try:
        if "torchebm" not in which:
            raise ImportError(name="torchebm (not asked for)")
        label = "TorchEBM 0.8 eager" + (" (unadjusted Langevin: no MALA in TorchEBM)" if w["sampler"] == "mala" else "")
        impls[label] = torchebm_run(w)
    except ImportError as e:
        print(f"{name}: TorchEBM missing ({e.name})", file=sys.stderr)
    rows = {k: {"cold_s": _timed(fn), "warm_s": []} for k, fn in impls.items()}
    for _ in range(repeats):
        for k, fn in impls.items():
            rows[k]["warm_s"].append(_timed(fn))
    base = rows["fnebm kernels"]["warm_s"]
    trace_bytes = w["steps"] * w["chains"] * w["dim"] * 4
    fill = measured_write_gbps(trace_bytes)
    out = {"workload": name, **w, "device": torch.cuda.get_device_name(), "peak_gbps": peak, "fill_gbps": fill,
           "loadavg": [round(x, 2) for x in os.getloadavg()], "rows": {}}
    for k, r in rows.items():
        warm = statistics.median(r["warm_s"])
        out["rows"][k] = {
            "cold_s": r["cold_s"],
            "warm_s": warm,
            "kernels_speedup": statistics.median(a / b for a, b in zip(r["warm_s"], base)),
            "trace_gbps": trace_bytes / warm / 1e9,
            "hbm_fraction": trace_bytes / warm / 1e9 / peak,
            "fill_fraction": trace_bytes / warm / 1e9 / fill,
        }
    return out


def compile_only() -> None:
    """Compile every kernel variant for sm_90a (no GPU needed) and print registers and spills."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        _fail("--compile-only compiles real Triton code: unset TRITON_INTERPRET")
    import importlib
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget

    from fnebm.kernels import families

    lc = importlib.import_module("fnebm.kernels.langevin_chain")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    target = GPUTarget("cuda", 90, 32)

    def report(label, fn, signature, constexprs, num_warps):
        c = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                           options={"num_warps": num_warps})
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(c.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
        os.unlink(f.name)
        lines = [s.split("info    :")[-1].strip() for s in (info.stdout + info.stderr).splitlines()
                 if "registers" in s or "spill" in s]
        print(f"{label:58s} {' | '.join(lines)}")

    pointers = {"key_ptr": "*i64", "acc_ptr": "*i8", "div_ptr": "*i8"}
    for chains, dim in ((1024, 128), (10_000, 100), (64, lc.MAX_DIM)):
        m, block_c, block_m, num_warps = lc._grid(chains, dim)
        for fname, family in ((f.name, f.id) for f in families.FAMILIES if families.TRITON in f.engines):
            for mala in (False, True):
                sig = {a: pointers.get(a, "*fp32" if a.endswith("_ptr") else "i32")
                       for a in lc.langevin_chain_kernel.arg_names}
                sig.update(ENERGY="constexpr", MALA="constexpr", BLOCK_C="constexpr", BLOCK_M="constexpr")
                report(f"langevin_chain {fname} mala={mala} {chains}x{dim} ({block_c}x{block_m}, {num_warps} warps)",
                       lc.langevin_chain_kernel, sig, dict(ENERGY=family, MALA=mala, BLOCK_C=block_c, BLOCK_M=block_m),
                       num_warps)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="G1,G2", help="comma-separated workloads (G1, G2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-gbps", type=float, default=None, help="the device's peak HBM bandwidth, GB/s")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--skip", default="", help="comma-separated rows to leave out: compiled, torchebm")
    p.add_argument("--compile-only", action="store_true", help="compile the kernels for sm_90a and report registers")
    args = p.parse_args(argv)
    if args.compile_only:
        return compile_only()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    bad = [n for n in names if n not in WORKLOADS]
    if bad:
        _fail(f"--only: unknown workload(s) {bad}; choose from {sorted(WORKLOADS)}")
    if args.repeats < 1:
        _fail(f"--repeats must be >= 1, got {args.repeats}")
    if not torch.cuda.is_available():
        _fail("needs a CUDA device (these are the GPU workloads; nothing is estimated without one)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        _fail("TRITON_INTERPRET=1 would time the interpreter: unset it")
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or next((v for k, v in _PEAK_GBPS.items() if k in name), None)
    if peak is None:
        _fail(f"peak HBM bandwidth of {name!r} unknown: pass --peak-gbps")
    results = []
    for n in names:
        r = bench(n, WORKLOADS[n], args.repeats, peak,
                  tuple(x for x in ("compiled", "torchebm") if x not in args.skip.split(",")))
        results.append(r)
        print(f"{n} on {r['device']} (peak {peak:.0f} GB/s; a fill of the trajectory's size wrote at "
              f"{r['fill_gbps']:.0f} GB/s), load average {r['loadavg']}")
        for k, row in r["rows"].items():
            print(f"  {k:60s} cold {row['cold_s']:8.3f} s  warm {row['warm_s'] * 1e3:9.2f} ms  "
                  f"kernels {row['kernels_speedup']:7.2f}x faster  trace {row['trace_gbps']:7.1f} GB/s "
                  f"({100 * row['hbm_fraction']:.1f} % of peak, {100 * row['fill_fraction']:.1f} % of fill)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
