"""fnebm against an earlier fnebm on the same workloads: paired, alternated call by call.

    python bench/paired.py --before TREE [--only W1,W3,W6] [--rounds N] [--json PATH]

Two worker processes, one importing fnebm from TREE ("before", e.g. a checkout of an earlier
commit) and one from this tree ("after"), each build bench/run.py's fnebm implementation of a
workload (its default path, as a user calls it), run it twice to warm up, then take turns, one
call each per round (A B, then B A), on a quiet signal from this process. Printed: the median
per-round ratio after / before (< 1: faster now), with its quartiles, and each side's median.

Workloads: W1 (Langevin, 10,000 chains x 100 steps, 10-D double well: the C whole-chain
kernel), W3 (MALA, same), W6 (NUTS with window adaptation, 500 + 1,000, 64 chains, 50-D
Gaussian: the C NUTS transition), W6custom (W6 with the energy as a plain function: the
torch NUTS kernel, compiled).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MAKERS = {"W1": "fnebm_langevin(10_000, 100)", "W3": "fnebm_mala(10_000, 100)",
          "W6": "fnebm_nuts_window(64, 500, 1000)", "W6custom": "fnebm_nuts_window_custom(64, 500, 1000)"}

_WORKER = r"""
import sys, time, os
sys.path.insert(0, os.environ["BENCH_DIR"])
import run as bench
fn = eval("bench." + sys.argv[1])
fn(); fn()
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "go":
        break
    t0 = time.perf_counter(); fn(); print(time.perf_counter() - t0, flush=True)
"""


def _worker(tree: str, workload: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=tree, BENCH_DIR=HERE, OMP_WAIT_POLICY="PASSIVE")
    p = subprocess.Popen([sys.executable, "-c", _WORKER, MAKERS[workload]], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line.strip() != "ready":
        raise SystemExit(f"the {tree} worker failed on {workload}")
    return p


def _call(p: subprocess.Popen) -> float:
    p.stdin.write("go\n")
    p.stdin.flush()
    return float(p.stdout.readline())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--only", default="W1,W3,W6")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {"before": args.before, "load": [], "workloads": {}}
    for workload in args.only.split(","):
        before, after = _worker(args.before, workload), _worker(ROOT, workload)
        pairs = []
        for r in range(args.rounds):
            if r % 2 == 0:
                b, a = _call(before), _call(after)
            else:
                a, b = _call(after), _call(before)
            pairs.append((b, a))
        for p in (before, after):
            p.stdin.close()
            p.wait()
        ratios = sorted(a / b for b, a in pairs)
        q = statistics.quantiles(ratios, n=4)
        row = {"before_s": statistics.median(b for b, _ in pairs), "after_s": statistics.median(a for _, a in pairs),
               "after_over_before": statistics.median(ratios), "q1": q[0], "q3": q[2], "pairs": pairs}
        with open("/proc/loadavg") as f:
            out["load"].append(f.read().split()[:3])
        out["workloads"][workload] = row
        print(f"{workload}: before {row['before_s'] * 1e3:.1f} ms, after {row['after_s'] * 1e3:.1f} ms, "
              f"after/before {row['after_over_before']:.3f} ({q[0]:.3f}-{q[2]:.3f}), load {out['load'][-1]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
