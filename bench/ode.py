"""DOPRI5 through a small MLP velocity: fnebm's ``odeint`` against ``torchdiffeq.odeint``.

    python bench/ode.py [--batch 10000] [--rtol 1e-5] [--repeats 7] [--threads 1] [--device cpu]
                        [--json bench/results-ode.json] [--no-cold] [--quick]

Workload: 10,000 2-D samples pushed from N(0, I) at t = 0 to t = 1 through a velocity MLP
2-128-128-2 with the time as a third input (SiLU), trained for a few hundred flow-matching steps
on eight Gaussians first (seeded), so the field bends as a learned one does. Every row solves
the same problem at the same ``rtol``/``atol`` and reports:

  nfe        evaluations of the network (batched calls)
  err_max    max |x(1) - reference| over the batch, the reference a float64 torchdiffeq dopri5
  err_rms    the same, RMS            solve at rtol = atol = 1e-12 (neutral to both)
  warm_s     median wall time over --repeats rounds; the rows run in turn each round (A B C ...)
  ratio      median over rounds of (torchdiffeq's time / this row's time) in the same round
  first_s    the first call in this process (compiles included), then the warm rounds

and, unless --no-cold, the compiled rows' first call in a fresh process with an empty Inductor
cache of its own (cold) and again with that cache (second process).

Rows: ``torchdiffeq`` (eager, as used); ``torchdiffeq + compiled net`` (the network through
``torch.compile``, the solver's Python loop as is); ``fnebm eager``; ``fnebm compiled k=K``
(``compile=True, check_every=K``: K attempted steps per compiled region and per host read);
``fnebm compiled k=1 max-autotune`` (``compile={"mode": "max-autotune-no-cudagraphs"}``:
Inductor's own GEMM kernels with the bias and SiLU fused); ``fnebm per-sample ...`` (each
sample its own step size).
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

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def make_net(device: str, steps: int = 300) -> torch.nn.Module:
    """2-128-128-2 (time as a third input), flow matching on eight Gaussians, seeded."""
    from fnebm import datasets
    from fnebm import random as fr

    torch.manual_seed(0)  # the bench's own network init; library code never reads the global RNG
    net = torch.nn.Sequential(torch.nn.Linear(3, 128), torch.nn.SiLU(), torch.nn.Linear(128, 128), torch.nn.SiLU(),
                              torch.nn.Linear(128, 2)).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    key = fr.key(0)
    for i in range(steps):
        k1, k2, k3 = fr.split(fr.fold_in(key, i), 3)
        x1 = datasets.eight_gaussians(k1, 512).to(device)
        x0 = fr.normal(k2, (512, 2)).to(device)
        t = fr.uniform(k3, (512, 1)).to(device)
        xt = t * x1 + (1 - t) * x0
        loss = (net(torch.cat((xt, t), 1)) - (x1 - x0)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def velocity(net):
    def f(t, x):
        tt = t.expand(x.shape[0]) if t.ndim == 0 else t
        return net(torch.cat((x, tt.to(x.dtype)[:, None]), 1))
    return f


AUTOTUNE = {"mode": "max-autotune-no-cudagraphs"}


def rows(net, x0, rtol: float, ks: list[int]):
    """name -> a zero-argument call returning (x(1), nfe)."""
    import torchdiffeq

    from fnebm.integrators import ode

    t = torch.tensor([0.0, 1.0], device=x0.device)
    f = velocity(net)
    compiled_net = torch.compile(net)
    fc = velocity(compiled_net)

    def td(fn):
        def run():
            calls = [0]

            def counted(t, x):
                calls[0] += 1
                return fn(t, x)
            return torchdiffeq.odeint(counted, x0, t, method="dopri5", rtol=rtol, atol=rtol)[-1], calls[0]
        return run

    def ours(**kw):
        def run():
            x, info = ode.odeint(f, x0, t, ode.dopri5, rtol=rtol, atol=rtol, trajectory=False, **kw)
            return x, int(info.nfe.max())
        return run

    out = {"torchdiffeq": td(f), "torchdiffeq + compiled net": td(fc), "fnebm eager": ours()}
    for k in ks:
        out[f"fnebm compiled k={k}"] = ours(compile=True, check_every=k)
    if x0.device.type == "cpu":
        out["fnebm compiled k=1 max-autotune"] = ours(compile=AUTOTUNE, check_every=1)
    else:  # CUDA graphs: a chunk of steps is one launch
        for k in ks:
            out[f"fnebm compiled k={k} reduce-overhead"] = ours(compile={"mode": "reduce-overhead"}, check_every=k)
    out["fnebm per-sample compiled k=1"] = ours(compile=True, check_every=1, per_sample=True)
    out["fnebm per-sample eager"] = ours(per_sample=True)
    return out


def reference(net, x0):
    import copy

    import torchdiffeq
    f64 = copy.deepcopy(net).double()
    t = torch.tensor([0.0, 1.0], dtype=torch.float64, device=x0.device)
    return torchdiffeq.odeint(velocity(f64), x0.double(), t, method="dopri5", rtol=1e-12, atol=1e-12)[-1]


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _worker(args) -> None:
    """One compiled row's first call in this (fresh) process: prints JSON."""
    torch.set_num_threads(args.threads)
    from fnebm import random as fr
    net = make_net(args.device, 60 if args.quick else 300)
    x0 = fr.normal(fr.key(1), (args.batch, 2)).to(args.device)
    run = rows(net, x0, args.rtol, [args.worker_k])[args.worker]
    t0 = time.perf_counter()
    run()
    sync(args.device)
    print(json.dumps({"first_s": time.perf_counter() - t0}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=10_000)
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ks", default="1,8")
    p.add_argument("--json", default=os.path.join(HERE, "results-ode.json"))
    p.add_argument("--no-cold", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-k", type=int, default=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return _worker(args)
    torch.set_num_threads(args.threads)
    import torchdiffeq

    from fnebm import random as fr
    load_before = os.getloadavg()
    ks = [int(k) for k in args.ks.split(",")]
    net = make_net(args.device, 60 if args.quick else 300)
    x0 = fr.normal(fr.key(1), (args.batch, 2)).to(args.device)
    ref = reference(net, x0)
    calls = rows(net, x0, args.rtol, ks)
    results = {}
    with torch.no_grad():
        for name, run in calls.items():
            t0 = time.perf_counter()
            x, nfe = run()
            sync(args.device)
            first = time.perf_counter() - t0
            err = (x.double() - ref).abs()
            results[name] = {"impl": name, "nfe": nfe, "err_max": err.max().item(),
                             "err_rms": err.square().mean().sqrt().item(), "first_s": first, "times": []}
            print(f"{name:32s} first call {first:7.2f} s  nfe {nfe}  err_max {err.max().item():.2e}", flush=True)
        for _ in range(args.repeats):
            for name, run in calls.items():
                sync(args.device)
                t0 = time.perf_counter()
                run()
                sync(args.device)
                results[name]["times"].append(time.perf_counter() - t0)
    base = results["torchdiffeq"]["times"]
    for r in results.values():
        r["warm_s"] = statistics.median(r["times"])
        r["ratio_vs_torchdiffeq"] = statistics.median(b / a for a, b in zip(r["times"], base))
    if not args.no_cold:
        names = [f"fnebm compiled k={k}" for k in ks] + (["fnebm compiled k=1 max-autotune"] if args.device == "cpu" else [])
        for name in names:  # each row its own empty Inductor cache, then a second process on it
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
                for phase in ("cold_s", "second_process_s"):
                    cmd = [sys.executable, __file__, "--worker", name, "--worker-k", name.split("=")[1].split()[0],
                           "--batch", str(args.batch), "--rtol", str(args.rtol), "--threads", str(args.threads),
                           "--device", args.device] + (["--quick"] if args.quick else [])
                    t0 = time.perf_counter()
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                    results[name][phase] = json.loads(out.stdout.strip().splitlines()[-1])["first_s"]
                    results[name][phase + "_process_total"] = time.perf_counter() - t0
    print(f"\n{'impl':32s} {'nfe':>5s} {'err_max':>9s} {'err_rms':>9s} {'first_s':>8s} {'warm_s':>8s} {'x td':>6s}"
          f" {'cold_s':>7s} {'2nd_s':>7s}")
    for r in results.values():
        print(f"{r['impl']:32s} {r['nfe']:5d} {r['err_max']:9.2e} {r['err_rms']:9.2e} {r['first_s']:8.2f} "
              f"{r['warm_s']:8.3f} {r['ratio_vs_torchdiffeq']:6.2f} {r.get('cold_s', float('nan')):7.1f} "
              f"{r.get('second_process_s', float('nan')):7.1f}")
    machine = {"python": platform.python_version(), "torch": torch.__version__, "torchdiffeq": torchdiffeq.__version__,
               "threads": args.threads, "device": args.device,
               "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "load_before": load_before, "load_after": os.getloadavg()}
    if args.device.startswith("cuda"):
        machine["gpu"] = torch.cuda.get_device_name()
    record = {"machine": machine, "workload": {"batch": args.batch, "dim": 2, "net": "2-128-128-2 + time, SiLU, 300 FM steps",
                                               "rtol": args.rtol, "atol": args.rtol, "t": [0, 1], "repeats": args.repeats},
              "method": "rows in turn each round (A B C ...); ratio = median over rounds of torchdiffeq's time / the row's",
              "results": list(results.values())}
    existing = {}
    if os.path.exists(args.json):
        with open(args.json) as fh:
            existing = json.load(fh)
    existing[f"{args.device}-threads{args.threads}-rtol{args.rtol:g}"] = record
    with open(args.json, "w") as fh:
        json.dump(existing, fh, indent=1)


if __name__ == "__main__":
    main()
