"""Time to the first compiled result of a new neural energy's sampler, in fresh processes.

    python bench/compile_time.py [--only mlp784,mlp2d] [--rounds N] [--before TREE] [--json PATH] [--new-energy] [--peer]

Each measurement is one fresh process with empty TORCHINDUCTOR_CACHE_DIR and FNEBM_CACHE_DIR that
builds ``fnebm.langevin`` on the workload's MLP energy (bench/user.py's networks and sizes) and
calls ``fnebm.sample_chain(..., compile=True)`` once: the seconds of that call (the compile and
one run), the import apart. With ``--before TREE`` the same runs alternate, call by call, with
fnebm imported from TREE (e.g. a checkout of an earlier commit), and the per-pair ratios'
median is printed. The compile is also split into Dynamo's trace, AOT autograd and Inductor
from ``torch._dynamo.utils.compile_times`` where torch reports them.

``--peer``: the floor beside it, in the same rounds on the same networks: the plain loop's step
(bench/user.py's update, its gradient by ``torch.func.grad``) given to ``torch.compile`` as a user
would, the loop and ``torch.randn_like`` in Python; its first 60-step loop's seconds, and the median
of the per-round ratios fnebm / plain compiled.

``--new-energy``: the issue's case, a new network on a machine that has compiled before. The
caches (Inductor's and fnebm's) persist across this run's processes, one per tree, primed by
one unmeasured run; every measured run builds the network with a number of layers and a hidden
width (channels for the ConvNet) no earlier run used: no graph is reused, only what a machine
keeps (the vector-ISA probe's builds, the C libraries, and any generated kernel whose source
is the same, such as the draws of a shape seen before).
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
WORKLOAD_NAMES = ("mlp784", "mlp2d", "conv28")

# what both children share: the network and start of the workload (the width and depth from the
# environment), and the report of the compile's phases
_HEAD = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["BENCH_DIR"])
t0 = time.perf_counter()
import torch
"""
_SETUP = r"""
import user
imported = time.perf_counter() - t0
net = user.make_net(sys.argv[1], width=int(os.environ.get("BENCH_WIDTH", "0")) or None,
                    depth=int(os.environ.get("BENCH_DEPTH", "0")) or None)
x0 = user.start(sys.argv[1]); steps = user.WORKLOADS[sys.argv[1]][2]
"""
_TAIL = r"""
from torch._dynamo.utils import compile_times
phases = "\n".join(l for l in compile_times("str").splitlines() if not l.startswith("pass."))  # not the passes one by one
print(json.dumps({"import_s": imported, "first_s": first, "warm_s": warm, "phases": phases[:4000]}))
"""

_CHILD = _HEAD + "import fnebm\nfrom fnebm import energies\n" + _SETUP + r"""
alg = fnebm.langevin(energies.bind(*energies.from_module(net)), user.H, user.S)
state = torch.func.vmap(alg.init)(x0)
t0 = time.perf_counter()
fnebm.sample_chain(alg.step, state, fnebm.random.key(0), steps, thin=steps, progress=False, compile=True)
first = time.perf_counter() - t0
t0 = time.perf_counter()
fnebm.sample_chain(alg.step, state, fnebm.random.key(0), steps, thin=steps, progress=False, compile=True)
warm = time.perf_counter() - t0
""" + _TAIL

# the floor: the plain loop's step (bench/user.py's update) given to torch.compile as a user would, its
# gradient by torch.func.grad (torch.autograd.grad breaks the graph), the loop and the draws in Python
_PEER_CHILD = _HEAD + _SETUP + r"""
def step(x):
    g = torch.func.grad(lambda y: net(y).sum())(x)
    return x - user.H * g + user.S * (2 * user.H) ** 0.5 * torch.randn_like(x)

def run():
    x = x0
    for _ in range(steps):
        x = compiled(x)
    return x
t0 = time.perf_counter()
compiled = torch.compile(step, fullgraph=True)  # timed: its first call imports Dynamo, as fnebm's does
run()
first = time.perf_counter() - t0
t0 = time.perf_counter()
run()
warm = time.perf_counter() - t0
""" + _TAIL


def _one(tree: str, workload: str, machine: str | None = None, width: int = 0, depth: int = 0, child: str = _CHILD) -> dict:
    """One fresh process. ``machine=None``: empty caches (a machine that never compiled). Else
    ``machine`` is a cache folder this tree's earlier runs filled (a machine that has compiled
    before), and ``width`` and ``depth`` give the network a hidden width and a number of layers no
    run used: a new energy (a new depth is a new graph; a new width alone is not, since Dynamo's
    automatic dynamic shapes, remembered on disk, compile the widths of a shape seen before as one graph)."""
    with tempfile.TemporaryDirectory() as cache:
        root = machine or cache
        env = dict(os.environ, PYTHONPATH=tree, BENCH_DIR=HERE, OMP_WAIT_POLICY="PASSIVE", BENCH_WIDTH=str(width), BENCH_DEPTH=str(depth),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"), FNEBM_CACHE_DIR=os.path.join(root, "fnebm"))
        # cwd: not the checkout, whose fnebm `python -c` would import before PYTHONPATH's (so --before
        # measured this tree on both sides until this was set)
        done = subprocess.run([sys.executable, "-c", child, workload], env=env, capture_output=True, text=True,
                              timeout=1800, cwd=cache)
        if done.returncode != 0:
            raise SystemExit(f"the child failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="mlp784")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--before", default=None, help="a tree to compare with (its fnebm imported from there)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--peer", action="store_true",
                    help="also the floor: the plain loop's step given to torch.compile (torch.func.grad for its "
                         "gradient), alternated with fnebm's runs on the same networks")
    ap.add_argument("--new-energy", action="store_true",
                    help="a machine that has compiled before: caches kept across this run's processes (one "
                         "priming run per tree first), and every measured run a network width none has seen")
    args = ap.parse_args()
    machines = {}
    if args.new_energy:
        for name, tree in (("after", ROOT), ("before", args.before), ("peer", ROOT if args.peer else None)):
            if tree:
                machines[name] = tempfile.mkdtemp(prefix=f"fnebm-compile-{name}-")
                _one(tree, args.only.split(",")[0], machines[name], width=7, depth=1,  # priming: ISA probe, C libraries
                     child=_PEER_CHILD if name == "peer" else _CHILD)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    results = {"load_at_start": load, "new_energy": args.new_energy, "workloads": {}}
    for workload in args.only.split(","):
        rows = []
        for r in range(args.rounds):
            width = 0 if not args.new_energy else 100 + 3 * r + 50 * list(WORKLOAD_NAMES).index(workload)
            depth = 0 if not args.new_energy else 3 + r
            row = {"after": _one(ROOT, workload, machines.get("after"), width, depth)}
            if args.before:
                row["before"] = _one(args.before, workload, machines.get("before"), width, depth)
            if args.peer:
                row["peer"] = _one(ROOT, workload, machines.get("peer"), width, depth, child=_PEER_CHILD)
            rows.append(row)
            print(workload, r, {k: round(v["first_s"], 2) for k, v in row.items()}, flush=True)
        summary = {"after_first_s": statistics.median(r["after"]["first_s"] for r in rows),
                   "after_warm_s": statistics.median(r["after"]["warm_s"] for r in rows)}
        if args.before:
            summary["before_first_s"] = statistics.median(r["before"]["first_s"] for r in rows)
            summary["after_over_before"] = statistics.median(r["after"]["first_s"] / r["before"]["first_s"] for r in rows)
        if args.peer:
            summary["peer_first_s"] = statistics.median(r["peer"]["first_s"] for r in rows)
            summary["peer_warm_s"] = statistics.median(r["peer"]["warm_s"] for r in rows)
            summary["after_over_peer"] = statistics.median(r["after"]["first_s"] / r["peer"]["first_s"] for r in rows)
        results["workloads"][workload] = {"rows": rows, "summary": summary}
        print(workload, summary, flush=True)
    with open("/proc/loadavg") as f:
        results["load_at_end"] = f.read().split()[:3]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
