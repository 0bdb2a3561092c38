"""Time to first result: each implementation's first call in a fresh process, beside the peers.

    python bench/cold.py [--only W1,W3] [--rounds N] [--warm N] [--threads T] [--json PATH] [--quick]

Every measurement runs in a new Python process (``python bench/cold.py --worker IMPL WORKLOAD``),
so nothing is warm but the disk. Per (workload, implementation) it reports:
  import   seconds to import the library (torch / jax) in that process
  first    seconds of the first call (building the sampler and its graph included, import not):
           the time to first result
  warm     median of the next --warm calls in the same process
For fnebm, four rows:
  fnebm (auto, empty cache)        the default, sample_chain(compile="auto", backend="auto"): on
                                   the CPU the C whole-chain kernel, built by cc into an empty
                                   FNEBM_CACHE_DIR first (a first run ever on a machine)
  fnebm (auto, second process)     the same with that directory: the library is loaded
  fnebm (compiled, empty cache)    backend="compiled" (torch.compile) with Inductor's on-disk cache
                                   pointed at an empty directory
  fnebm (compiled, second process) the same again with that directory
JAX keeps no compilation cache on disk by default, so its every process is a first one.

Method (the machine is noisy): the implementations are run in turn, round by round (A B C ...
A B C ...), --rounds rounds, and each row quotes the median over rounds; ratios are medians of
the per-round ratios against the JAX/BlackJAX peer of the same round. Workloads are W1 and W3 of
bench/run.py (10-D double well, 10,000 chains x 100 steps; --quick: 1,000 x 20).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

IMPLS = {
    "W1": ["fnebm (auto, empty cache)", "fnebm (auto, second process)", "fnebm (compiled, empty cache)",
           "fnebm (compiled, second process)", "JAX", "TorchEBM 0.8", "PyTorch eager"],
    "W3": ["fnebm (auto, empty cache)", "fnebm (auto, second process)", "fnebm (compiled, empty cache)",
           "fnebm (compiled, second process)", "BlackJAX"],
}
PEER = {"W1": "JAX", "W3": "BlackJAX"}


# ----------------------------------------------------------------------------- worker


def _worker(impl: str, workload: str, n_warm: int, quick: bool) -> dict:
    t0 = time.perf_counter()
    if impl.startswith(("JAX", "BlackJAX")):
        import jax  # noqa: F401
    else:
        import torch  # noqa: F401
    import_s = time.perf_counter() - t0
    sys.path.insert(0, HERE)
    import run as bench  # bench/run.py: the workloads' definitions, shared

    size = dict(chains=1_000, steps=20) if quick else dict(chains=10_000, steps=100)
    t0 = time.perf_counter()
    if impl.startswith("fnebm"):
        import fnebm
        from fnebm import energies
        from fnebm import random as fr

        backend, compile = ("auto", "auto") if impl.startswith("fnebm (auto") else ("compiled", True)
        make = fnebm.langevin if workload == "W1" else fnebm.mala
        alg = make(energies.double_well(bench.H, bench.B), bench.ETA)
        state = torch.func.vmap(alg.init)(fr.normal(fr.key(0), (size["chains"], bench.DIM)))
        plans = []

        def call():
            return fnebm.sample_chain(alg.step, state, fr.key(1), size["steps"], compile=compile, backend=backend,
                                      progress=False, on_plan=plans.append)[1]
    else:
        make = {"JAX": bench.jax_langevin, "BlackJAX": bench.blackjax_mala, "TorchEBM 0.8": bench.torchebm_langevin,
                "PyTorch eager": bench.torch_eager_langevin}[impl]
        call, plans = make(**size), None
    call()
    first_s = time.perf_counter() - t0
    warm = []
    for _ in range(n_warm):
        t0 = time.perf_counter()
        call()
        warm.append(time.perf_counter() - t0)
    out = dict(import_s=import_s, first_s=first_s, warm_s=warm)
    if plans:
        out["plans"] = [p.reason for p in plans[:1]] + [p.reason for p in plans[-1:]]
    return out


# ----------------------------------------------------------------------------- driver


def _spawn(impl, workload, n_warm, quick, threads, cache_dir):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TORCHINDUCTOR_CACHE_DIR=cache_dir,
               FNEBM_CACHE_DIR=os.path.join(cache_dir, "fnebm"),
               XLA_FLAGS=f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'}")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, workload, "--warm", str(n_warm)]
    if quick:
        cmd.append("--quick")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        return dict(error=(res.stderr.strip().splitlines() or ["failed"])[-1])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="W1,W3")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", nargs=2, metavar=("IMPL", "WORKLOAD"))
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker[0], args.worker[1], args.warm, args.quick)))
        return 0
    import torch

    workloads = args.only.split(",")
    unknown = [w for w in workloads if w not in IMPLS]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; choose from {list(IMPLS)}")
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"load {os.getloadavg()[0]:.2f}, rounds {args.rounds}")
    results = {}
    for w in workloads:
        runs = {impl: [] for impl in IMPLS[w]}
        for r in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="fnebm-cold-") as cache:
                for impl in IMPLS[w]:  # "empty cache" comes before "second process": it fills the cache
                    runs[impl].append(_spawn(impl, w, args.warm, args.quick, args.threads, cache))
        peer = runs[PEER[w]]
        print(f"\n## {w}  (load {os.getloadavg()[0]:.2f})")
        print(f"{'implementation':34} {'import s':>9} {'first s':>9} {'warm ms':>9} {'first / peer first':>19}")
        rows = []
        for impl, rs in runs.items():
            ok = [x for x in rs if "error" not in x]
            if not ok:
                print(f"{impl:34} error: {rs[0]['error']}")
                continue
            imp = statistics.median(x["import_s"] for x in ok)
            first = statistics.median(x["first_s"] for x in ok)
            warm = statistics.median(statistics.median(x["warm_s"]) for x in ok) if args.warm else float("nan")
            ratio = statistics.median(x["first_s"] / q["first_s"] for x, q in zip(rs, peer)
                                      if "error" not in x and "error" not in q)
            print(f"{impl:34} {imp:9.2f} {first:9.2f} {1e3 * warm:9.1f} {ratio:19.2f}")
            rows.append(dict(impl=impl, import_s=imp, first_s=first, warm_s=warm, first_over_peer=ratio, runs=rs))
        results[w] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=args.threads, rounds=args.rounds, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
