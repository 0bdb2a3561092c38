"""Where the time of the whole-chain kernels goes on a GPU (issue 10): the sample_chain call
against the bare op, a CUDA-kernel profile of one call, and a sweep of the launch grid.

    python bench/gpu_probe.py [--only G1,G2] [--sweep] [--ncu G2]

``--ncu W`` runs workload W's op once and exits (wrap it in ``ncu -k regex:langevin_chain``).
Needs a CUDA device; prints a table, writes nothing.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu import ETA, WORKLOADS, fnebm_run  # noqa: E402


def events(fn, repeats: int = 7) -> float:
    """Median milliseconds of ``fn`` by CUDA events, after one warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def bare_op(w: dict):
    """The op alone: fresh trace buffers, one launch, no sample_chain around it."""
    import fnebm
    from fnebm import energies as E
    from fnebm import random as fr
    lc = importlib.import_module("fnebm.kernels.langevin_chain")

    energy = E.double_well(2.0, 1.0, dtype=torch.float32, device="cuda")
    alg = fnebm.mala(energy, ETA) if w["sampler"] == "mala" else fnebm.langevin(energy, ETA)
    x0 = fr.normal(fr.key(0, "cuda"), (w["chains"], w["dim"]))
    st = torch.func.vmap(alg.init)(x0)
    keys = fr.split(fr.key(1, "cuda"), w["chains"])
    h = torch.tensor(ETA, device="cuda")
    start = torch.zeros((), dtype=torch.int64, device="cuda")
    if w["sampler"] == "mala":
        return lambda: lc.mala_chain(energy, st.position, st.energy, st.grad, keys, start, h, n_steps=w["steps"])
    return lambda: lc.langevin_chain(energy, st.position, st.energy, st.grad, keys, start, h, n_steps=w["steps"])


def profile(fn) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def sweep(w: dict) -> None:
    import triton

    lc = importlib.import_module("fnebm.kernels.langevin_chain")

    original = lc._grid
    m, bc0, bm, nw0 = original(w["chains"], w["dim"])
    run = bare_op(w)
    print(f"  default grid: BLOCK_C={bc0} BLOCK_M={bm} num_warps={nw0}, {triton.cdiv(w['chains'], bc0)} programs")
    for bc in (1, 2, 4, 8, 16):
        for nw in (1, 2, 4, 8):
            if bc * bm * 4 < 32 * nw:  # fewer elements than threads
                continue
            lc._grid = lambda n, d, bc=bc, nw=nw: (m, bc, bm, nw)
            try:
                ms = events(run, 5)
            except Exception as e:  # noqa: BLE001 - a probe: report and go on
                print(f"  BLOCK_C={bc:2d} num_warps={nw}: {type(e).__name__}: {e}"[:160])
                continue
            finally:
                lc._grid = original
            print(f"  BLOCK_C={bc:2d} num_warps={nw}: {ms:8.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="G1,G2")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--ncu", default=None)
    p.add_argument("--cprofile", action="store_true", help="host time of a sample_chain call, by function")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_probe.py: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    if a.ncu:
        run = bare_op(WORKLOADS[a.ncu])
        run()
        torch.cuda.synchronize()
        return
    for name in a.only.split(","):
        w = WORKLOADS[name]
        call, op = fnebm_run(w, "triton"), bare_op(w)
        print(f"{name}: sample_chain(backend='triton') {events(call):.3f} ms, bare op {events(op):.3f} ms")
        print(f"{name}: profile of one sample_chain call")
        profile(call)
        if a.cprofile:
            import cProfile
            import pstats

            torch.cuda.synchronize()
            with cProfile.Profile() as pr:
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)
        if a.sweep:
            sweep(w)


if __name__ == "__main__":
    main()
