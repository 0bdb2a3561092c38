"""Where an eager neural Langevin step's time goes on a GPU (issue 26): fnebm's eager step against the plain loop.

    python bench/gpu_profile_user.py [--workload mlp784] [--steps 20]

Profiles ``--steps`` steps of bench/user.py's workload with torch.profiler, after a warm-up: fnebm's
``sample_chain(compile=False)`` (the path ``compile="auto"`` takes for a short run) and the plain
loop; prints the wall time per step, the CUDA kernel launches per step, and the operators with the
most host time and the most calls. Needs a CUDA device (``--allow-cpu`` for a smoke test). Writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import user  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="mlp784")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--allow-cpu", action="store_true")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    import fnebm
    from fnebm import energies

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_profile_user.py: no CUDA device", file=sys.stderr)
        sys.exit(2)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    net, x0 = user.make_net(args.workload).to(dev), user.start(args.workload).to(dev)
    n = args.steps

    def fnebm_run():
        alg = fnebm.langevin(energies.bind(*energies.from_module(net)), user.H, user.S)
        state = torch.func.vmap(alg.init)(x0)
        return fnebm.sample_chain(alg.step, state, fnebm.random.key(0, device=dev), n, thin=n, progress=False,
                                  compile=False)[1]

    rows = {"fnebm eager": fnebm_run, "plain": user.make_plain(net, x0, n)}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    for name, fn in rows.items():
        fn()
        fn()
        sync()
        t = time.perf_counter()
        for _ in range(3):
            fn()
        sync()
        wall = (time.perf_counter() - t) / 3
        with profile(activities=acts) as prof:
            fn()
            sync()
        ev = prof.key_averages()
        launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                          "cudaLaunchKernelExC"))
        print(f"\n== {name}: {wall / n * 1e3:.3f} ms per step (wall, {n} steps); "
              f"{launches / n:.1f} kernel launches per step")
        print(ev.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
        top = sorted(ev, key=lambda e: -e.count)[:15]
        print("most called: " + ", ".join(f"{e.key} x{e.count / n:.1f}" for e in top))


if __name__ == "__main__":
    main()
