"""Time to the first compiled result of a new neural energy's sampler, in fresh processes.

    python bench/compile_time.py [--only mlp784,mlp2d] [--rounds N] [--before TREE] [--json PATH]

Each measurement is one fresh process with empty TORCHINDUCTOR_CACHE_DIR and FNEBM_CACHE_DIR that
builds ``fnebm.langevin`` on the workload's MLP energy (bench/user.py's networks and sizes) and
calls ``fnebm.sample_chain(..., compile=True)`` once: the seconds of that call (the compile and
one run), the import apart. With ``--before TREE`` the same runs alternate, call by call, with
fnebm imported from TREE (e.g. a checkout of an earlier commit), and the per-pair ratios'
median is printed. The compile is also split into Dynamo's trace, AOT autograd and Inductor
from ``torch._dynamo.utils.compile_times`` where torch reports them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_CHILD = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["BENCH_DIR"])
t0 = time.perf_counter()
import torch, fnebm
from fnebm import energies
import user
imported = time.perf_counter() - t0
net = user.make_net(sys.argv[1]); x0 = user.start(sys.argv[1]); steps = user.WORKLOADS[sys.argv[1]][2]
alg = fnebm.langevin(energies.bind(*energies.from_module(net)), user.H, user.S)
state = torch.func.vmap(alg.init)(x0)
t0 = time.perf_counter()
fnebm.sample_chain(alg.step, state, fnebm.random.key(0), steps, thin=steps, progress=False, compile=True)
first = time.perf_counter() - t0
t0 = time.perf_counter()
fnebm.sample_chain(alg.step, state, fnebm.random.key(0), steps, thin=steps, progress=False, compile=True)
warm = time.perf_counter() - t0
from torch._dynamo.utils import compile_times
print(json.dumps({"import_s": imported, "first_s": first, "warm_s": warm, "phases": compile_times("str")[:2000]}))
"""


def _one(tree: str, workload: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, PYTHONPATH=tree, BENCH_DIR=HERE, OMP_WAIT_POLICY="PASSIVE",
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), FNEBM_CACHE_DIR=os.path.join(cache, "fnebm"))
        done = subprocess.run([sys.executable, "-c", _CHILD, workload], env=env, capture_output=True, text=True,
                              timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"the child failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="mlp784")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--before", default=None, help="a tree to compare with (its fnebm imported from there)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    results = {"load_at_start": load, "workloads": {}}
    for workload in args.only.split(","):
        rows = []
        for r in range(args.rounds):
            row = {"after": _one(ROOT, workload)}
            if args.before:
                row["before"] = _one(args.before, workload)
            rows.append(row)
            print(workload, r, {k: round(v["first_s"], 2) for k, v in row.items()}, flush=True)
        summary = {"after_first_s": statistics.median(r["after"]["first_s"] for r in rows),
                   "after_warm_s": statistics.median(r["after"]["warm_s"] for r in rows)}
        if args.before:
            summary["before_first_s"] = statistics.median(r["before"]["first_s"] for r in rows)
            summary["after_over_before"] = statistics.median(r["after"]["first_s"] / r["before"]["first_s"] for r in rows)
        results["workloads"][workload] = {"rows": rows, "summary": summary}
        print(workload, summary, flush=True)
    with open("/proc/loadavg") as f:
        results["load_at_end"] = f.read().split()[:3]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
