"""compile="auto" across processes on bench/user.py's 2-D MLP (10,000 chains x 200 steps): what each
call of a loop costs beside the plain PyTorch loop, in a first process (nothing recorded: it compiles
once its eager time passes a compile's cost) and in a second one that reads what the first measured
(the compiled steps' time over the eager steps', RunnerCache.gain), on the same caches.

    python bench/auto_gain.py [--calls 8] [--workload mlp2d] [--tree PATH] [--json bench/results-auto-gain.json]

``--tree``: the checkout whose fnebm runs (default this one), e.g. a worktree of an earlier commit.

Each process alternates fnebm and the plain loop call by call (A B A B) and reports each pair's
ratio and fnebm's plan (eager or compiled, and why). Both processes use one fresh cache folder
(Inductor's and fnebm's), removed at the end.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(workload: str, calls: int) -> dict:
    sys.path.insert(0, HERE)
    import warnings

    import torch

    import fnebm
    import user
    from fnebm import energies

    net, x0 = user.make_net(workload), user.start(workload)
    _, _, steps = user.WORKLOADS[workload]
    plans = []

    def run_fnebm():
        alg = fnebm.langevin(energies.bind(*energies.from_module(net)), user.H, user.S)
        state = torch.func.vmap(alg.init)(x0)
        _, trace, _ = fnebm.sample_chain(alg.step, state, fnebm.random.key(0), steps, thin=steps, progress=False,
                                         on_plan=plans.append)
        return trace[-1]

    plain = user.make_plain(net, x0, steps)
    warnings.simplefilter("ignore")  # the CompileNotice: the plan says it
    out = {"fnebm": [], "plain": [], "plans": [], "fnebm_file": fnebm.__file__}
    for _ in range(calls):
        for name, run in (("fnebm", run_fnebm), ("plain", plain)):
            t = time.perf_counter()
            run()
            out[name].append(time.perf_counter() - t)
        p = plans[-1]
        out["plans"].append({"engine": p.engine, "gain": getattr(p, "gain", None), "reason": p.reason})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--workload", default="mlp2d")
    ap.add_argument("--json", default=os.path.join(HERE, "results-auto-gain.json"))
    ap.add_argument("--tree", default=os.path.dirname(HERE))
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.workload, a.calls)))
        return
    cache = tempfile.mkdtemp(prefix="fnebm-auto-gain-")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               FNEBM_CACHE_DIR=os.path.join(cache, "fnebm"), PYTHONPATH=os.path.abspath(a.tree))
    results = {"workload": a.workload, "tree": os.path.abspath(a.tree), "loadavg_start": os.getloadavg(), "processes": []}
    try:
        for process in ("first", "second"):
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--calls", str(a.calls),
                                "--workload", a.workload], env=env, capture_output=True, text=True,
                               cwd=tempfile.gettempdir())
            if r.returncode != 0:
                raise RuntimeError(r.stderr[-3000:])
            w = json.loads(r.stdout.strip().splitlines()[-1])
            w["process"] = process
            results["processes"].append(w)
            print(f"{process} process")
            for i, (f, p, plan) in enumerate(zip(w["fnebm"], w["plain"], w["plans"])):
                gain = "" if plan["gain"] is None else f" gain {plan['gain']:.3g}"
                print(f"  call {i + 1}: fnebm {f:6.2f} s  plain {p:5.2f} s  {f / p:5.2f}x  {plan['engine']}{gain}")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    results["loadavg_end"] = os.getloadavg()
    with open(a.json, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
