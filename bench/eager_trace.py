"""Eager runs that keep every draw: time, page faults and peak memory, fnebm trees and the plain loop.

    python bench/eager_trace.py [--before TREE] [--rounds N] [--calls N] [--fixed-heap] [--json PATH]

bench/posterior.py's MALA workload (a logistic-regression log density written as a function,
1,024 chains x 1,000 steps, step size 2.5e-3, every draw kept: a 98 MB trace), eagerly
(``compile=False``), from this tree ("after") and from ``--before`` when given, and the plain
loop of bench/posterior.py: a fresh process per implementation and round, ``--calls`` calls in
each, the implementations alternated round by round. Per call: seconds, minor page faults
(getrusage) and the process's peak RSS. ``--fixed-heap`` runs every process with glibc's
thresholds fixed (MALLOC_MMAP_THRESHOLD_=32 MiB, MALLOC_TRIM_THRESHOLD_=64 MiB: what
``fnebm.reuse_freed_memory`` sets from Python), else glibc's adaptive defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(impl: str, calls: int) -> None:
    sys.path.insert(0, HERE)
    import posterior as P
    import torch

    d = P.data("mala")
    if impl == "plain":
        run = P.make_plain_mala(d)
    else:
        import fnebm
        from fnebm import random as fr

        energy, x0 = P.torch_energy("mala", d), torch.from_numpy(d["x0"])

        def run():
            alg = fnebm.mala(energy, P.MALA_STEP)
            state = torch.func.vmap(alg.init)(x0)
            return fnebm.sample_chain(alg.step, state, fr.key(2), P.MALA_STEPS, compile=False, progress=False)

    out = []
    for _ in range(calls):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        run()
        seconds, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        out.append({"s": round(seconds, 3), "faults": r1.ru_minflt - r0.ru_minflt, "maxrss_mb": round(r1.ru_maxrss / 1024)})
    print("@@" + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", help="another fnebm checkout to run beside this one")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--fixed-heap", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--worker")
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.calls)
    impls = {"after": ROOT, "plain": None}
    if a.before:
        impls = {"before": os.path.abspath(a.before), **impls}
    res = {k: [] for k in impls}
    for r in range(a.rounds):
        for name in (list(impls) if r % 2 == 0 else list(impls)[::-1]):
            env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
            if a.fixed_heap:
                env.update(MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(64 << 20))
            if impls[name]:
                env["PYTHONPATH"] = impls[name]
            done = subprocess.run([sys.executable, __file__, "--worker", "fnebm" if impls[name] else "plain",
                                   "--calls", str(a.calls)], env=env, capture_output=True, text=True, check=True)
            calls = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("@@"))[2:])
            res[name].append(calls)
            print(name, calls, "load %.2f" % os.getloadavg()[0], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "fixed_heap": a.fixed_heap, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
