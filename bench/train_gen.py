"""Flow matching and equilibrium matching training steps: fnebm against TorchEBM 0.8.9, and what they learn.

    python bench/train_gen.py speed   [--pairs 40] [--batch 4096] [--hidden 256] [--threads 1] [--json PATH]
    python bench/train_gen.py first   --objective fm|eqm --impl NAME     (one fresh process: first-call time)
    python bench/train_gen.py quality [--steps 1000] [--seeds 3] [--json PATH]

The workload (issue 25): an MLP 2-256-256-2 (SiLU) on eight Gaussians (fnebm.datasets), batch
4,096, Adam 1e-3 (torch.optim, the same for every implementation, so the loss and its
gradient are what differ). Flow matching's field also takes the time: its first layer has
3 inputs, (x, t). EqM's field is time-invariant (TorchEBM hands it a zeroed clock, which the
network ignores); EqM's defaults: linear path, truncated decay a = 0.8, lambda = 4.

``speed``: per objective, the implementations' steps interleaved step by step (A B A B ...)
in one process after a warm-up, and the median of the per-pair time ratios TorchEBM / fnebm:

- ``torchebm``: ``FlowMatchingLoss(net)`` / ``EquilibriumMatchingLoss(net)``, ``loss.backward()``;
- ``fnebm-eager``: ``fnebm.losses.flow_matching`` / ``equilibrium_matching`` on the same
  module's parameters bound as a batched field (``bind_field(mlp_batch, params, batched=True)``),
  ``loss.backward()``;
- ``fnebm-vmap``: the same with the per-sample field (``bind_field(mlp, params)``), mapped by ``vmap``;
- ``fnebm-bf16`` / ``fnebm-bf16-compiled``: ``fnebm-eager`` / ``-compiled`` with ``autocast=torch.bfloat16``
  (the field's forward, hence its GEMMs forward and backward, in bfloat16; the loss in float32).
  Opt-in: TorchEBM 0.8.9 refuses mixed precision off CUDA (``setup_mixed_precision`` falls back
  to float32 with a warning), so its step stays float32 on a CPU;
- ``fnebm-compiled``: the same loss under ``torch.compile(fullgraph=True)`` (Inductor; the
  backward is AOTAutograd's compiled one).

The first call (compile) is timed apart: ``first`` runs one implementation's first steps in a
fresh process, run twice by ``speed`` (cold: an empty Inductor cache directory; second process:
the cache the first left).

``quality``: for each objective, seed and implementation, the same initial weights trained
``--steps`` steps on the same batches (fnebm's data; each library its own noise and times),
then sampled by the same sampler from the same noise (flow: 100 Euler steps of the ODE from
N(0, I); EqM: 200 steps of fnebm.eqm's Nesterov descent, step 0.03, momentum 0.35, from
N(0, I)) and scored: squared MMD to 2,000 data points (fnebm.cli.train_report.mmd2) and the eight
modes' weights (the fraction of samples nearest each centre; ``off_mode``: farther than three
standard deviations from all).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import fnebm
from fnebm import datasets
from fnebm import losses as L
from fnebm import random as fr

CENTRES = torch.tensor([[4.0 * math.cos(i * math.pi / 4), 4.0 * math.sin(i * math.pi / 4)] for i in range(8)],
                       dtype=torch.float64) / 1.414
MODE_RADIUS = 3 * 0.5 / 1.414
LR = 1e-3


def make_net(din: int, hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # nn.Linear's own initialisation; both implementations copy this module
    return torch.nn.Sequential(torch.nn.Linear(din, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.SiLU(), torch.nn.Linear(hidden, 2))


class TimeNet(torch.nn.Module):
    """TorchEBM's calling convention, ``model(x, t)``, around the same Sequential."""

    def __init__(self, net: torch.nn.Module, time_input: bool):
        super().__init__()
        self.net, self.time_input = net, time_input

    def forward(self, x, t):
        return self.net(torch.cat([x, t[:, None]], 1) if self.time_input else x)


def mlp(p: dict, x: torch.Tensor, *t: torch.Tensor) -> torch.Tensor:
    """The Sequential's maths for one sample, on its parameter dict (``0.weight``, ...)."""
    h = torch.cat([x, t[0][None]]) if t else x
    h = torch.nn.functional.silu(torch.nn.functional.linear(h, p["0.weight"], p["0.bias"]))
    h = torch.nn.functional.silu(torch.nn.functional.linear(h, p["2.weight"], p["2.bias"]))
    return torch.nn.functional.linear(h, p["4.weight"], p["4.bias"])


def mlp_batch(p: dict, x: torch.Tensor, *t: torch.Tensor) -> torch.Tensor:
    """The same maths on a batch ``x: (n, 2)``, ``t: (n,)``: ``addmm`` per layer, as the module runs."""
    h = torch.cat([x, t[0][:, None]], 1) if t else x
    h = torch.nn.functional.silu(torch.nn.functional.linear(h, p["0.weight"], p["0.bias"]))
    h = torch.nn.functional.silu(torch.nn.functional.linear(h, p["2.weight"], p["2.bias"]))
    return torch.nn.functional.linear(h, p["4.weight"], p["4.bias"])


def fnebm_loss(objective: str, params: dict, batch: torch.Tensor, key: torch.Tensor,
               per_sample: bool = False, autocast: torch.dtype | None = None) -> torch.Tensor:
    field = L.bind_field(mlp, params) if per_sample else L.bind_field(mlp_batch, params, batched=True)
    if objective == "fm":
        return L.flow_matching(field, batch, key, autocast=autocast)[0]
    return L.equilibrium_matching(field, batch, key, autocast=autocast)[0]


def torchebm_loss(objective: str, net: torch.nn.Module):
    from torchebm.losses import EquilibriumMatchingLoss, FlowMatchingLoss

    model = TimeNet(net, objective == "fm")
    cls = FlowMatchingLoss if objective == "fm" else EquilibriumMatchingLoss
    return cls(model, device="cpu")


class Trainer:
    """One implementation's training step on its own copy of the network and its own Adam."""

    def __init__(self, impl: str, objective: str, net: torch.nn.Module):
        self.impl, self.objective = impl, objective
        self.net = copy.deepcopy(net)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=LR)
        if impl == "torchebm":
            self.loss = torchebm_loss(objective, self.net)
        elif impl == "fnebm-compiled":
            self.loss = torch.compile(functools.partial(fnebm_loss, objective), fullgraph=True)
        elif impl == "fnebm-bf16":
            self.loss = functools.partial(fnebm_loss, objective, autocast=torch.bfloat16)
        elif impl == "fnebm-bf16-compiled":
            self.loss = torch.compile(functools.partial(fnebm_loss, objective, autocast=torch.bfloat16),
                                      fullgraph=True)
        elif impl == "fnebm-vmap":
            self.loss = functools.partial(fnebm_loss, objective, per_sample=True)
        else:
            self.loss = functools.partial(fnebm_loss, objective)
        self.params = dict(self.net.named_parameters())

    def step(self, batch: torch.Tensor, key: torch.Tensor, generator: torch.Generator | None = None) -> float:
        if self.impl == "torchebm":
            loss = self.loss(batch, generator=generator)
        else:
            loss = self.loss(self.params, batch, key)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.detach()


def batches(n: int, batch: int, seed: int = 1):
    data = datasets.get("eight_gaussians")
    return [data(fr.fold_in(fr.key(seed), i), batch) for i in range(n)]


# ------------------------------------------------------------------------------ speed


def speed(args) -> dict:
    impls = args.impls.split(",")
    out: dict = {}
    data = batches(args.pairs + args.warmup, args.batch)
    for objective in ("fm", "eqm"):
        net = make_net(3 if objective == "fm" else 2, args.hidden, 0)
        trainers = {i: Trainer(i, objective, net) for i in impls}
        gens = torch.Generator().manual_seed(0)
        first = {}
        for name, tr in trainers.items():  # first calls (compile for fnebm-compiled), then warm-up
            t0 = time.perf_counter()
            tr.step(data[0], fr.key(0), gens)
            first[name] = time.perf_counter() - t0
            for i in range(1, args.warmup):
                tr.step(data[i], fr.fold_in(fr.key(0), i), gens)
        times = {i: [] for i in impls}
        for j in range(args.pairs):
            b, k = data[args.warmup + j], fr.fold_in(fr.key(0), args.warmup + j)
            order = impls if j % 2 == 0 else impls[::-1]  # A B C, C B A: neither always goes first
            for name in order:
                t0 = time.perf_counter()
                trainers[name].step(b, k, gens)
                times[name].append(time.perf_counter() - t0)
        res = {"first_call_s": first, "median_ms": {n: 1e3 * statistics.median(v) for n, v in times.items()}}
        for name in impls[1:]:  # torchebm first
            ratios = [a / b for a, b in zip(times["torchebm"], times[name])]
            q = statistics.quantiles(ratios, n=4)
            res[f"speedup_{name}"] = {"median": statistics.median(ratios), "q1": q[0], "q3": q[2]}
        out[objective] = res
        print(objective, json.dumps(res, indent=1), flush=True)
    return out


def first_call(args) -> None:
    """One fresh process: the first step and the next 4 of one implementation (printed as JSON)."""
    data = batches(5, args.batch)
    tr = Trainer(args.impl, args.objective, make_net(3 if args.objective == "fm" else 2, args.hidden, 0))
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    tr.step(data[0], fr.key(0), gen)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(1, 5):
        tr.step(data[i], fr.fold_in(fr.key(0), i), gen)
    print(json.dumps({"first_s": first, "next_ms": 1e3 * (time.perf_counter() - t0) / 4}))


def processes(args) -> dict:
    """Cold (empty Inductor cache) and second-process first-call times of fnebm-compiled, and the others' first calls."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for objective in ("fm", "eqm"):
            for impl, runs in (("torchebm", ("fresh",)), ("fnebm-eager", ("fresh",)),
                               ("fnebm-compiled", ("cold", "second_process")), ("fnebm-bf16", ("fresh",)),
                               ("fnebm-bf16-compiled", ("cold", "second_process"))):
                for run in runs:
                    cmd = [sys.executable, __file__, "first", "--objective", objective, "--impl", impl,
                           "--batch", str(args.batch), "--hidden", str(args.hidden), "--threads", str(args.threads)]
                    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                    out[f"{objective}/{impl}/{run}"] = json.loads(r.stdout.strip().splitlines()[-1])
                    print(objective, impl, run, out[f"{objective}/{impl}/{run}"], flush=True)
    return out


# ---------------------------------------------------------------------------- quality


@torch.no_grad()
def sample(objective: str, net: torch.nn.Module, n: int = 2000, seed: int = 99) -> torch.Tensor:
    x = fr.normal(fr.key(seed), (n, 2))
    if objective == "fm":
        steps = 100
        for i in range(steps):
            t = torch.full((n, 1), i / steps)
            x = x + net(torch.cat([x, t], 1)) / steps
        return x
    field = functools.partial(mlp, {k: v.detach() for k, v in net.named_parameters()})
    alg = fnebm.eqm(field, 0.03, 0.35)
    state = torch.func.vmap(alg.init)(x)
    keys = fr.split(fr.key(0), n)
    for _ in range(200):
        state, _ = alg.step(state, keys)
    return state.position


def score(x: torch.Tensor, data: torch.Tensor) -> dict:
    from fnebm.cli.train_report import mmd2

    x = x.double()
    ok = torch.isfinite(x).all(1)
    d = torch.cdist(x[ok], CENTRES)
    nearest = d.argmin(1)
    weights = torch.bincount(nearest, minlength=8).double() / ok.sum()
    return {"mmd2": mmd2(x[ok], data), "mode_weights": [round(float(w), 4) for w in weights],
            "max_mode_weight_error": float((weights - 1 / 8).abs().max()),
            "off_mode": float((d.min(1).values > MODE_RADIUS).double().mean()), "nonfinite": int((~ok).sum())}


def quality(args) -> dict:
    data = datasets.get("eight_gaussians")(fr.key(12345), 2000, torch.float64)
    out: dict = {}
    for objective in ("fm", "eqm"):
        rows = {name: [] for name in args.impls.split(",")}
        for seed in range(args.seeds):
            net = make_net(3 if objective == "fm" else 2, args.hidden, seed)
            train = batches(args.steps, args.batch, seed=100 + seed)
            for impl in rows:
                tr = Trainer(impl, objective, net)
                gen = torch.Generator().manual_seed(seed)
                t0 = time.perf_counter()
                for i, b in enumerate(train):
                    tr.step(b, fr.fold_in(fr.key(seed), i), gen)
                s = score(sample(objective, tr.net), data)
                s["train_s"] = time.perf_counter() - t0
                rows[impl].append(s)
                print(objective, impl, seed, json.dumps(s), flush=True)
        summary = {}
        for impl, rs in rows.items():
            m = [r["mmd2"] for r in rs]
            e = [r["max_mode_weight_error"] for r in rs]
            summary[impl] = {"mmd2": m, "mmd2_mean": statistics.mean(m), "mmd2_sd": statistics.stdev(m) if len(m) > 1 else 0,
                             "max_mode_weight_error": e, "off_mode": [r["off_mode"] for r in rs]}
        out[objective] = {"runs": rows, "summary": summary}
        print(objective, json.dumps(summary, indent=1), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("speed", "first", "quality"))
    p.add_argument("--pairs", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--objective", default="fm")
    p.add_argument("--impl", default="fnebm-compiled")
    p.add_argument("--no-processes", action="store_true", help="speed: skip the fresh-process first-call runs")
    p.add_argument("--impls", default=None, help="comma-separated, torchebm first (default: speed: torchebm,"
                   "fnebm-eager,fnebm-compiled,fnebm-vmap,fnebm-bf16,fnebm-bf16-compiled; quality: torchebm,fnebm-eager)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.impls is None:
        args.impls = ("torchebm,fnebm-eager,fnebm-compiled,fnebm-vmap,fnebm-bf16,fnebm-bf16-compiled"
                      if args.what == "speed" else "torchebm,fnebm-eager")
    if args.what == "first":
        first_call(args)
        return
    meta = {"cpu": _cpu(), "threads": args.threads, "torch": torch.__version__, "batch": args.batch,
            "hidden": args.hidden, "loadavg_before": open("/proc/loadavg").read().split()[:3]}
    result = {"meta": meta}
    if args.what == "speed":
        result["warm"] = speed(args)
        if not args.no_processes:
            result["first_call"] = processes(args)
    else:
        meta.update(steps=args.steps, seeds=args.seeds)
        result["quality"] = quality(args)
    meta["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    if args.json:
        old = json.load(open(args.json)) if os.path.exists(args.json) else {}
        default = args.impls == ("torchebm,fnebm-eager,fnebm-compiled,fnebm-vmap,fnebm-bf16,fnebm-bf16-compiled"
                                 if args.what == "speed" else "torchebm,fnebm-eager")
        old[args.what if default else f"{args.what}:{args.impls}"] = result
        with open(args.json, "w") as f:
            json.dump(old, f, indent=1)


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
