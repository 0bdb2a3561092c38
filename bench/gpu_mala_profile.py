"""Where fnebm's first MALA call on a user-written posterior goes on a GPU (issue 26, goal 3).

    python bench/gpu_mala_profile.py [--device cuda] [--worker]

bench/posterior.py's ``mala`` workload (logistic regression written as a function, 1,024 chains x
1,000 steps) with fnebm's defaults: a first process fills the caches (Triton's), then a second
process prints its first call's plan (``on_plan``), its time and a cProfile of it, and its second
call's time. Writes nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(device: str, profile: bool) -> None:
    import cProfile
    import pstats

    import torch

    import fnebm
    from fnebm import random as fr

    sys.path.insert(0, HERE)
    import posterior as P

    P.DEVICE = device
    d = P.data("mala")
    energy = P.torch_energy("mala", d)
    x0 = torch.from_numpy(d["x0"]).to(device)

    def call(on_plan=None):
        alg = fnebm.mala(energy, P.MALA_STEP)
        state = torch.func.vmap(alg.init)(x0)
        out = fnebm.sample_chain(alg.step, state, fr.key(2, device=device), P.MALA_STEPS, on_plan=on_plan)
        P._sync()
        return out

    plans = []
    t = time.perf_counter()
    if profile:
        prof = cProfile.Profile()
        prof.runcall(call, plans.append)
    else:
        call(plans.append)
    first = time.perf_counter() - t
    t = time.perf_counter()
    call()
    second = time.perf_counter() - t
    print(f"first call {first:.3f} s (profiled: {profile}), second {second:.3f} s")
    for p in plans:
        print("plan:", p.engine, "|", p.reason)
    if profile:
        st = pstats.Stats(prof).sort_stats("cumulative")
        st.print_stats(40)
        st.sort_stats("tottime").print_stats(20)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.device, args.profile)
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    for profile in (False, False, True):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--device", args.device]
                           + (["--profile"] if profile else []), capture_output=True, text=True, timeout=150, env=env)
        print(r.stdout[-9000:], r.stderr[-2000:] if r.returncode else "")


if __name__ == "__main__":
    main()
