"""The energies users write, on a GPU: neural short-run Langevin, fnebm against a plain PyTorch loop and TorchEBM.

    python bench/gpu_user.py [--only mlp784,mlp2d,conv28,mlp784x4096] [--rows ROWS] [--warm N] [--timeout S]
                             [--json PATH]

Issue 26's GPU half. The workloads, networks, update and starting points are bench/user.py's (an
MLP on 784-D inputs, 128 chains x 60 steps; a 2-D MLP, 10,000 chains x 200 steps; a small ConvNet
on 1x28x28 images, 64 chains x 60 steps), plus ``mlp784x4096`` (the 784-D MLP with 4,096 chains),
all moved to the GPU; only the final negatives are kept, as inside EBM training.

Rows (each workload in a fresh process with an empty TORCHINDUCTOR_CACHE_DIR and FNEBM_CACHE_DIR):
  plain            bench/user.py's loop: torch.autograd.grad(net(x).sum(), x), torch.randn_like
  plain bf16       the same loop with the forward under torch.autocast("cuda", torch.bfloat16)
                   (a reference for what bf16 gives; fnebm's samplers have no bf16 option)
  TorchEBM         LangevinDynamics(model, step_size, noise_scale).sample(x, n_steps) (0.8.9)
  fnebm            sample_chain on its defaults (compile="auto", backend="auto"), keys on the GPU
  fnebm one-by-one the same with the CUDA-graph replay of eager steps switched off
                   (fnebm.chain.engines._CUDA_GRAPHS = False): each eager step launched op by op
  fnebm compiled   sample_chain(compile=True) (a RunnerCache of its own: the default row never runs its graph)
  fnebm cudagraphs sample_chain(compile=True, cache=RunnerCache(backend=Inductor with
                   triton.cudagraphs=True)) -- mlp784 only (a probe: whether Inductor's CUDA graphs
                   take the compiled scan)

Phases: the first call of each row in turn (cold: compiles included), a second call of each, then
--warm rounds with the order rotating every round; warm = the median of a row's warm calls, ratio =
the median of the per-round ratios to the plain loop. The device is synchronised around every call.
The final positions of fnebm and fnebm compiled (same keys) are compared.

Without CUDA the script refuses to run (exit status 2), unless --allow-cpu (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import user  # noqa: E402  (bench/user.py: the networks, starting points, plain loop and TorchEBM)

WORKLOADS = dict(user.WORKLOADS, mlp784x4096=((784,), 4096, 60))
H, S = user.H, user.S


def _net_and_start(workload: str, device: str):
    base = "mlp784" if workload == "mlp784x4096" else workload
    net = user.make_net(base).to(device)
    if workload == "mlp784x4096":
        import torch

        x0 = torch.rand((4096, 784), generator=torch.Generator().manual_seed(1))
    else:
        x0 = user.start(base)
    return net, x0.to(device)


def make_fnebm(net, x0, steps, compile, cache=None, graphs=True):
    import torch

    import fnebm
    from fnebm import energies
    from fnebm.chain import engines

    plans = []

    def run():
        if not graphs:
            engines._CUDA_GRAPHS = False
            try:
                return body()
            finally:
                engines._CUDA_GRAPHS = True
        return body()

    def body():
        alg = fnebm.langevin(energies.bind(*energies.from_module(net)), H, S)
        state = torch.func.vmap(alg.init)(x0)
        kw = {} if compile is None else {"compile": compile}
        if cache is not None:
            kw["cache"] = cache
        _, trace, _ = fnebm.sample_chain(alg.step, state, fnebm.random.key(0, device=x0.device), steps, thin=steps,
                                         progress=False, on_plan=lambda p: plans.append(f"{p.engine}: {p.reason}"), **kw)
        return trace[-1]

    run.plans = plans
    return run


def make_plain_bf16(net, x0, steps):
    import torch

    def run():
        x = x0.clone()
        for _ in range(steps):
            x.requires_grad_(True)
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                e = net(x).float().sum()
            (g,) = torch.autograd.grad(e, x)
            x = (x - H * g + S * (2 * H) ** 0.5 * torch.randn_like(x)).detach()
        return x

    return run


def _cache(cudagraphs: bool = False):
    """A runner cache of the row's own, so that the default row's ``auto`` never runs a graph another
    row compiled (each row pays its own compile, as in a process of its own)."""
    from torch._inductor.compile_fx import compile_fx

    from fnebm.chain.runner import RunnerCache

    if not cudagraphs:
        return RunnerCache()
    return RunnerCache(backend=functools.partial(compile_fx, config_patches={"triton.cudagraphs": True}))


def worker(workload: str, warm_rounds: int, device: str, only_rows: str = "") -> dict:
    t0 = time.perf_counter()
    import fnebm  # noqa: F401
    import torch

    import_s = time.perf_counter() - t0
    net, x0 = _net_and_start(workload, device)
    steps = WORKLOADS[workload][2]
    rows = {
        "plain": user.make_plain(net, x0, steps),
        "plain bf16": make_plain_bf16(net, x0, steps),
        "fnebm": make_fnebm(net, x0, steps, None),
        "fnebm one-by-one": make_fnebm(net, x0, steps, None, graphs=False),
        "fnebm compiled": make_fnebm(net, x0, steps, True, cache=_cache()),
    }
    try:
        rows["TorchEBM"] = user.make_torchebm(net, x0, steps)
    except ImportError as exc:
        print(f"TorchEBM not run: {exc}", file=sys.stderr)
    if workload == "mlp784":
        rows["fnebm cudagraphs"] = make_fnebm(net, x0, steps, True, cache=_cache(cudagraphs=True))
    if only_rows:
        keep = set(only_rows.split(","))
        rows = {n: r for n, r in rows.items() if n in keep}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {"workload": workload, "chains": WORKLOADS[workload][1], "steps": steps, "import_s": import_s,
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "first": {}, "second": {}, "warm": {n: [] for n in rows}, "errors": {}, "results": {}}

    def timed(name):
        sync()
        t = time.perf_counter()
        res = rows[name]()
        sync()
        return time.perf_counter() - t, res

    for phase in ("first", "second"):
        for name in list(rows):
            try:
                out[phase][name], out["results"][name] = timed(name)
            except Exception as exc:  # noqa: BLE001 - a row that fails is reported, the others go on
                out["errors"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                del rows[name]
                out["warm"].pop(name, None)
            print(f"  {workload} {phase} {name}: {out[phase].get(name)}", file=sys.stderr, flush=True)
    names = list(rows)
    for r in range(warm_rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out["warm"][name].append(timed(name)[0])
    res = out.pop("results")
    if "fnebm" in res and "fnebm compiled" in res:
        a, b = res["fnebm"].float(), res["fnebm compiled"].float()
        out["fnebm_vs_compiled_max_abs_diff"] = float((a - b).abs().max())
    if "fnebm" in res and "fnebm one-by-one" in res:
        out["fnebm_graphed_equals_one_by_one"] = bool(torch.equal(res["fnebm"], res["fnebm one-by-one"]))
    out["plans"] = {n: r.plans for n, r in rows.items() if hasattr(r, "plans")}
    return out


def summarise(res: dict) -> dict:
    warm = res["warm"]
    rows = {}
    for name, ts in warm.items():
        ratios = [t / p for t, p in zip(ts, warm.get("plain", [])) if p]
        rows[name] = {"first_s": res["first"].get(name), "second_s": res["second"].get(name),
                      "warm_s": statistics.median(ts) if ts else None,
                      "warm_ratio_to_plain": statistics.median(ratios) if ratios else None}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="mlp784,mlp2d,conv28,mlp784x4096")
    ap.add_argument("--warm", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per workload's process")
    ap.add_argument("--json", default=os.path.join(HERE, "results-gpu-user.json"))
    ap.add_argument("--rows", default="", help="comma-separated rows to run (default: all; 'plain' is always run)")
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU (a smoke test of this script)")
    ap.add_argument("--worker", default=None)
    args = ap.parse_args()
    if args.worker:
        workload, device = args.worker.split(":")
        print("@@RESULT " + json.dumps(worker(workload, args.warm, device, args.rows)), flush=True)
        return
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("bench/gpu_user.py: no CUDA device (pass --allow-cpu for a smoke test on the CPU)", file=sys.stderr)
        sys.exit(2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    for workload in args.only.split(","):
        if workload not in WORKLOADS:
            print(f"bench/gpu_user.py: unknown workload {workload!r} (choose from {', '.join(WORKLOADS)})", file=sys.stderr)
            sys.exit(2)
        cache = tempfile.mkdtemp(prefix="fnebm-gpu-user-")
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   FNEBM_CACHE_DIR=os.path.join(cache, "fnebm"),
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"{workload}:{device}", "--warm", str(args.warm)] + (
            ["--rows", ",".join(["plain"] + [r for r in args.rows.split(",") if r != "plain"])] if args.rows else [])
        t = time.perf_counter()
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=tempfile.gettempdir())
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            results.append({"workload": workload, "timeout_s": args.timeout, "stderr_tail": err[-2000:]})
            print(f"{workload}: timed out after {args.timeout} s\n{err[-1500:]}")
            continue
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("@@RESULT ")]
        if r.returncode != 0 or not lines:
            results.append({"workload": workload, "returncode": r.returncode, "stderr_tail": r.stderr[-3000:]})
            print(f"{workload}: worker failed ({r.returncode})\n{r.stderr[-2500:]}")
            continue
        res = json.loads(lines[-1][len("@@RESULT "):])
        res["summary"] = summarise(res)
        res["wall_s"] = time.perf_counter() - t
        results.append(res)
        print(f"\n{workload} ({res['chains']} chains x {res['steps']} steps) on {res['device']}, torch {res['torch']}")
        print(f"  {'row':18s} {'first s':>9s} {'second s':>9s} {'warm ms':>9s} {'warm / plain':>12s}")
        for name, s in res["summary"].items():
            fmt = lambda v, k=1.0: "-" if v is None else f"{v * k:9.3f}"  # noqa: E731
            print(f"  {name:18s} {fmt(s['first_s'])} {fmt(s['second_s'])} {fmt(s['warm_s'], 1e3)} {fmt(s['warm_ratio_to_plain']):>12s}")
        for name, err in res["errors"].items():
            print(f"  {name}: FAILED {err}")
        print(f"  plans: {json.dumps(res['plans'])}")
        print(f"  fnebm vs compiled, final positions max |diff|: {res.get('fnebm_vs_compiled_max_abs_diff')}")
        print(f"  fnebm (graph replays) equals one-by-one bit for bit: {res.get('fnebm_graphed_equals_one_by_one')}")
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
