"""Where a process's first call goes on a GPU (issue 26): fnebm's defaults with the eager draws in
Triton (as shipped) or in torch operations, against the plain loop, each in fresh processes.

    python bench/gpu_first_call.py [--rounds 3] [--workload mlp784]

Each worker process imports fnebm and torch, starts CUDA, builds bench/user.py's workload on the
GPU and times one implementation's first call, second call and the median of 5 more (warm).
Rows: ``plain`` (bench/user.py's loop), ``triton`` (fnebm's defaults), ``torch`` (fnebm's defaults
with ``fnebm.random._TRITON_EAGER_DEVICES = ()`` and ``_TRITON_DRAWS = False``: keys and draws by
torch operations, which the step's CUDA graph then holds as more, smaller kernels).
``--steps N`` runs N steps a call instead of the workload's; ``--profile ROW`` prints a cProfile of
ROW's first call in a fresh process (after one ``triton`` process has filled the caches). The first
process of all (a ``triton`` row) fills Triton's on-disk cache and is reported apart. Also times
``import triton`` after ``import torch`` in a fresh process. Needs CUDA; writes nothing.
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


def worker(row: str, workload: str, steps: int | None = None, profile: bool = False) -> dict:
    t0 = time.perf_counter()
    import fnebm  # noqa: F401
    import torch

    t_import = time.perf_counter() - t0
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t_cuda = time.perf_counter() - t0 - t_import
    sys.path.insert(0, HERE)
    import gpu_user
    import user

    if row == "torch":
        fnebm.random._TRITON_EAGER_DEVICES = ()
        fnebm.random._TRITON_DRAWS = False
    net, x0 = gpu_user._net_and_start(workload, "cuda")
    steps = steps or gpu_user.WORKLOADS[workload][2]
    run = user.make_plain(net, x0, steps) if row == "plain" else gpu_user.make_fnebm(net, x0, steps, None)
    ts = []
    for i in range(7):
        torch.cuda.synchronize()
        t = time.perf_counter()
        if profile and i == 0:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            out = prof.runcall(run)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
            st = pstats.Stats(prof).sort_stats("cumulative")
            st.print_stats(45)
            st.sort_stats("tottime").print_stats(25)
            continue
        out = run()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return {"import_s": t_import, "cuda_init_s": t_cuda, "first_s": ts[0], "second_s": ts[1],
            "warm_s": statistics.median(ts[2:]), "triton_loaded": "triton" in sys.modules,
            "final": out.double().sum().item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", default="mlp784")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--profile", default=None, help="a row whose first call is profiled, instead of the rounds")
    ap.add_argument("--worker", default=None)
    args = ap.parse_args()
    if args.worker:
        print("@@ " + json.dumps(worker(args.worker, args.workload, args.steps, args.profile == args.worker)), flush=True)
        return
    import torch

    if not torch.cuda.is_available():
        print("gpu_first_call.py: no CUDA device", file=sys.stderr)
        sys.exit(2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))

    def spawn(row):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", row, "--workload", args.workload]
        cmd += ["--steps", str(args.steps)] if args.steps else []
        cmd += ["--profile", args.profile] if args.profile else []
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        if args.profile:
            print(r.stdout[-12000:], r.stderr[-3000:])
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("@@ ")]
        if r.returncode or not lines:
            return {"error": r.stderr[-1500:]}
        return json.loads(lines[-1][3:])

    print("machine's first fnebm process (fills Triton's cache):", json.dumps(spawn("triton")))
    if args.profile:
        spawn(args.profile)
        return
    imp = subprocess.run([sys.executable, "-c", "import torch, time; t = time.perf_counter(); import triton; "
                          "print(time.perf_counter() - t)"], capture_output=True, text=True, timeout=60)
    print(f"import triton after import torch: {imp.stdout.strip()} s")
    rows = {"plain": [], "triton": [], "torch": []}
    for r in range(args.rounds):
        order = list(rows)[r % 3:] + list(rows)[:r % 3]
        for row in order:
            rows[row].append(spawn(row))
    for row, rs in rows.items():
        ok = [x for x in rs if "error" not in x]
        for x in rs:
            if "error" in x:
                print(f"{row}: FAILED {x['error']}")
        if not ok:
            continue
        med = {k: statistics.median(x[k] for x in ok) for k in ("import_s", "cuda_init_s", "first_s", "second_s", "warm_s")}
        print(f"{row:7s} " + "  ".join(f"{k} {v:.3f}" for k, v in med.items())
              + f"  triton loaded: {ok[0]['triton_loaded']}  final sum {ok[0]['final']:.6f}")
    for row in ("triton", "torch"):
        pairs = [(a["first_s"] / b["first_s"], a["warm_s"] / b["warm_s"]) for a, b in zip(rows[row], rows["plain"])
                 if "error" not in a and "error" not in b]
        if pairs:
            print(f"{row} / plain: first call {statistics.median(p[0] for p in pairs):.2f}x, "
                  f"warm {statistics.median(p[1] for p in pairs):.2f}x (medians of per-round ratios)")


if __name__ == "__main__":
    main()
