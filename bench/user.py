"""The energies users write: neural short-run Langevin, fnebm against a plain PyTorch loop and TorchEBM.

    python bench/user.py [--only mlp784,mlp2d,conv28] [--rounds N] [--warm N] [--json PATH]
                         [--before PATH] [--after PATH] [--quick]

Workloads (float32, CPU), only the final negatives kept, as inside EBM training:
  mlp784  an MLP energy 784-256-256-1 (SiLU) on 784-D inputs, 128 chains x 60 steps
  mlp2d   an MLP energy 2-128-128-1 (SiLU) on 2-D inputs, 10,000 chains x 200 steps
  conv28  a small ConvNet energy on 1x28x28 images (two stride-2 3x3 convolutions, 16 and 32
          channels, SiLU, a linear read-out), 64 chains x 60 steps; positions travel flat (784,)
          and the network's first layer unflattens them (fnebm's samplers take flat positions)
The update is x' = x - h grad E(x) + s sqrt(2 h) xi (h = 0.01, s = 0.05) everywhere.

Implementations:
  fnebm     ``fnebm.sample_chain(fnebm.langevin(energies.bind(*energies.from_module(net)), h, s).step,
            ...)`` on its defaults (compile="auto", backend="auto"), the sampler built and the chains
            initialised inside every call (as a training loop does), keeping the last draw only
            (``thin=steps``). Run from two trees when --before is given: "before" (e.g. /work/main)
            and "after" (this tree), each on its own PYTHONPATH.
  plain     the loop a user writes in five minutes: ``torch.autograd.grad(net(x).sum(), x)``,
            ``torch.randn_like``, no compile.
  TorchEBM  ``torchebm.samplers.LangevinDynamics(model, step_size=h, noise_scale=s).sample(x=x0,
            n_steps=steps)`` on the same network (TorchEBM 0.8.9).

Phases (the machine is shared and noisy: everything alternates, A B A B, and the figures are
medians of per-round or per-pair ratios to the plain loop, which runs beside each):
  cold      the first call in a fresh process with empty TORCHINDUCTOR_CACHE_DIR and FNEBM_CACHE_DIR
            (the C libraries an install compiled into a tree's package are used: a tree without them
            builds them into the empty cache)
            (import not included; the import is reported apart, and import + first call as
            "import_and_cold": what a fresh script waits for), and the second call there
  second    the first call of a second process with those (now filled) cache directories
  warm      one process per fnebm tree holding fnebm, plain and TorchEBM, after two calls of each,
            --warm rounds of A B C: per-pair ratios
Every worker process runs with OMP_WAIT_POLICY=PASSIVE (what ``import fnebm`` sets when it is
imported before torch), so that the peers run on the same footing on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WORKLOADS = {
    # name: (event shape, chains, steps)
    "mlp784": ((784,), 128, 60),
    "mlp2d": ((2,), 10_000, 200),
    "conv28": ((784,), 64, 60),  # 1x28x28 images, flat (the net's first layer unflattens them)
}
QUICK = {"mlp784": 20, "mlp2d": 20, "conv28": 20}
H, S = 0.01, 0.05


# ----------------------------------------------------------------------------- workloads


def make_net(workload: str, width: int | None = None, depth: int | None = None):
    """The workload's network; ``width`` replaces its hidden width (its channels for the ConvNet) and
    ``depth`` its number of hidden layers (for the ConvNet, 1x1 convolutions added after the second),
    so a compile-time run can build a network no cache has seen (bench/compile_time.py --new-energy)."""
    import torch
    from torch import nn

    torch.manual_seed(0)  # the benchmark's weights (library code never seeds)
    if workload in ("mlp784", "mlp2d"):
        d_in, w = (784, width or 256) if workload == "mlp784" else (2, width or 128)
        layers = [nn.Linear(d_in, w), nn.SiLU()]
        for _ in range((depth or 2) - 1):
            layers += [nn.Linear(w, w), nn.SiLU()]
        net = nn.Sequential(*layers, nn.Linear(w, 1))
    else:
        # fnebm's samplers take flat positions (dim,): the images travel flat and the net unflattens
        w = width or 32
        extra = [m for _ in range((depth or 2) - 2) for m in (nn.Conv2d(w, w, 1), nn.SiLU())]
        net = nn.Sequential(nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, 16, 3, stride=2), nn.SiLU(), nn.Conv2d(16, w, 3, stride=2), nn.SiLU(),
                            *extra, nn.Flatten(), nn.Linear(w * 6 * 6, 1))
    return net.requires_grad_(False)


def start(workload: str):
    import torch

    event, chains, _ = WORKLOADS[workload]
    g = torch.Generator().manual_seed(1)
    return torch.rand((chains, *event), generator=g) if workload != "mlp2d" else torch.randn((chains, 2), generator=g)


def make_fnebm(net, x0, steps):
    import torch

    import fnebm
    from fnebm import energies

    def run():
        alg = fnebm.langevin(energies.bind(*energies.from_module(net)), H, S)
        state = torch.func.vmap(alg.init)(x0)
        _, trace, _ = fnebm.sample_chain(alg.step, state, fnebm.random.key(0), steps, thin=steps, progress=False,
                                         on_plan=lambda plan: PLANS.append("compiled" if plan.compiled else "eager"))
        return trace[-1]

    return run


PLANS: list[str] = []  # what each fnebm call ran (on_plan), reported by the worker


def make_plain(net, x0, steps):
    import torch

    def run():
        x = x0.clone()
        for _ in range(steps):
            x.requires_grad_(True)
            (g,) = torch.autograd.grad(net(x).sum(), x)
            x = (x - H * g + S * (2 * H) ** 0.5 * torch.randn_like(x)).detach()
        return x

    return run


def make_torchebm(net, x0, steps):
    from torchebm.core import BaseModel
    from torchebm.samplers import LangevinDynamics

    class Model(BaseModel):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x).squeeze(-1)

    sampler = LangevinDynamics(Model(), step_size=H, noise_scale=S)

    def run():
        return sampler.sample(x=x0.clone(), n_steps=steps)

    return run


MAKERS = {"fnebm": make_fnebm, "plain": make_plain, "TorchEBM": make_torchebm}


def _worker(impls: list[str], workload: str, calls: int, warm_rounds: int, steps: int) -> dict:
    t0 = time.perf_counter()
    if "fnebm" in impls:
        import fnebm  # noqa: F401  (first, as a user of fnebm imports it)
    import torch

    import_s = time.perf_counter() - t0
    net, x0 = make_net(workload), start(workload)
    runs = {name: MAKERS[name](net, x0, steps) for name in impls}
    out = {"import_s": import_s, "threads": torch.get_num_threads(), "calls": {}, "warm": {n: [] for n in impls},
           "fnebm_plans": PLANS}
    for name, run in runs.items():  # the first `calls` calls of each, in turn
        ts = []
        for _ in range(calls):
            t = time.perf_counter()
            run()
            ts.append(time.perf_counter() - t)
        out["calls"][name] = ts
    for _ in range(warm_rounds):  # A B C A B C ...
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            out["warm"][name].append(time.perf_counter() - t)
    return out


# ----------------------------------------------------------------------------- driver


def _spawn(tree: str | None, impls, workload, calls, warm, steps, cache: str | None) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    if tree is not None:
        env["PYTHONPATH"] = tree
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
        env["FNEBM_CACHE_DIR"] = os.path.join(cache, "fnebm")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", ",".join(impls), workload,
           str(calls), str(warm), str(steps)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if r.returncode != 0:
        raise RuntimeError(f"worker {impls} {workload} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _med(xs):
    return statistics.median(xs) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=7)
    ap.add_argument("--before", default=None, help="a tree whose fnebm is the 'before' figure (e.g. /work/main)")
    ap.add_argument("--after", default=ROOT, help="the tree measured as 'after' (default: this one)")
    ap.add_argument("--json", default=os.path.join(HERE, "results-user.json"))
    ap.add_argument("--quick", action="store_true", help="20 steps, 1 round, 3 warm rounds (a smoke run)")
    ap.add_argument("--no-torchebm", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.warm = 1, 3
    trees = {"after": a.after} if a.before is None else {"before": a.before, "after": a.after}
    import importlib.util

    has_torchebm = importlib.util.find_spec("torchebm") is not None
    if not has_torchebm and not a.no_torchebm:
        print("torchebm is not installed (pip install torchebm==0.8.9): its rows are left out")
    peers = ["plain"] + ([] if a.no_torchebm or not has_torchebm else ["TorchEBM"])
    load0 = os.getloadavg()
    results = {"host": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version(),
                        "loadavg_start": load0},
               "trees": trees, "h": H, "s": S, "workloads": {}}
    for workload in a.only.split(","):
        event, chains, steps = WORKLOADS[workload]
        steps = QUICK[workload] if a.quick else steps
        rows = {f"fnebm {t}": {"cold": [], "cold_second_call": [], "second_process": [], "import": []} for t in trees}
        rows.update({p: {"cold": [], "cold_second_call": [], "second_process": [], "import": []} for p in peers})
        plans = {}
        for _ in range(a.rounds):  # A B A B: one fresh process per implementation, in turn
            for label in rows:
                tree = trees[label.split()[1]] if label.startswith("fnebm") else a.after
                impl = "fnebm" if label.startswith("fnebm") else label
                cache = tempfile.mkdtemp(prefix="fnebm-user-bench-")
                try:
                    first = _spawn(tree, [impl], workload, 2, 0, steps, cache)
                    again = _spawn(tree, [impl], workload, 1, 0, steps, cache)
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
                rows[label]["cold"].append(first["calls"][impl][0])
                rows[label]["cold_second_call"].append(first["calls"][impl][1])
                rows[label]["second_process"].append(again["calls"][impl][0])
                rows[label]["import"].append(first["import_s"])
                if impl == "fnebm":
                    plans.setdefault(label, []).append(first["fnebm_plans"] + again["fnebm_plans"])
        warm = {}
        for t, tree in trees.items():  # one process per tree: fnebm beside the peers, call by call
            w = _spawn(tree, ["fnebm"] + peers, workload, 2, a.warm, steps, None)
            warm[f"fnebm {t}"] = w["warm"]
            warm[f"fnebm {t}"]["plans"] = w["fnebm_plans"]
        for r in rows.values():  # what a fresh script waits for: the import, then the first call
            r["import_and_cold"] = [i + c for i, c in zip(r["import"], r["cold"])]
        summary = {}
        for label, r in rows.items():
            s = {k: _med(v) for k, v in r.items()}
            for peer in peers:
                if label == peer:
                    continue
                for phase in ("import_and_cold", "cold", "cold_second_call", "second_process"):
                    s[f"{phase}_ratio_to_{peer}"] = _med([x / y for x, y in zip(r[phase], rows[peer][phase])])
            if label in plans:
                s["cold_plans"] = plans[label]
            if label in warm:
                w = warm[label]
                s["warm_s"] = _med(w["fnebm"])
                s["warm_plans"] = w["plans"]
                for peer in peers:
                    s[f"warm_{peer}_s"] = _med(w[peer])
                    s[f"warm_ratio_to_{peer}"] = _med([x / y for x, y in zip(w["fnebm"], w[peer])])
            summary[label] = s
        results["workloads"][workload] = {"event": event, "chains": chains, "steps": steps, "rounds": a.rounds,
                                          "raw": rows, "warm_raw": warm, "summary": summary}
        _print(workload, chains, steps, summary, peers)
    results["host"]["loadavg_end"] = os.getloadavg()
    with open(a.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"load average {load0} -> {results['host']['loadavg_end']}; wrote {a.json}")


def _print(workload, chains, steps, summary, peers):
    print(f"\n{workload}: {chains} chains x {steps} steps (seconds; ratios: medians of per-round/per-pair ratios)")
    cols = ["import", "import_and_cold", "cold", "cold_second_call", "second_process", "warm_s"]
    print(f"{'':16s}" + "".join(f"{c:>18s}" for c in cols) + "".join(f"{'warm/' + p:>16s}" for p in peers))
    for label, s in summary.items():
        cells = "".join(f"{s.get(c) if s.get(c) is None else round(s[c], 3)!s:>18s}" for c in cols)
        ratios = "".join(f"{s.get('warm_ratio_to_' + p) if s.get('warm_ratio_to_' + p) is None else round(s['warm_ratio_to_' + p], 2)!s:>16s}" for p in peers)
        print(f"{label:16s}{cells}{ratios}")
        for p in peers:
            if f"cold_ratio_to_{p}" in s:
                print(f"{'':16s}  to {p}: import+first {s[f'import_and_cold_ratio_to_{p}']:.2f}x, "
                      f"cold {s[f'cold_ratio_to_{p}']:.2f}x, second call "
                      f"{s[f'cold_second_call_ratio_to_{p}']:.2f}x, second process {s[f'second_process_ratio_to_{p}']:.2f}x")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        impls, workload, calls, warm, steps = sys.argv[2].split(","), sys.argv[3], *map(int, sys.argv[4:7])
        print(json.dumps(_worker(impls, workload, calls, warm, steps)))
    else:
        main()
