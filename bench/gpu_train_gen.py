"""Issue 25 on a GPU: the couplings on CUDA tensors, and flow / EqM training steps against TorchEBM 0.8.9.

    python bench/gpu_train_gen.py [--pairs 20] [--out results.json]

Steps (each implementation its own copy of the network and ``torch.optim.Adam(1e-3)``; warm,
interleaved A B C ..., then reversed; ratio = median of per-pair TorchEBM fp32 / fnebm):
- ``mlp``: bench/train_gen.py's MLP 2-256-256-2 (SiLU), eight Gaussians, batch 4,096;
- ``cifar``: a small U-Net on 3x32x32 (``ConvNet``: 64/128/256 channels, GroupNorm, SiLU, the time as an
  extra input channel for flow matching), batch 128 of N(0, I) "images" (speed only).
Implementations: ``torchebm`` (fp32), ``torchebm-bf16`` (its ``setup_mixed_precision(True,
torch.bfloat16)``), ``fnebm`` (eager, batched field, fp32), ``fnebm-bf16`` (``autocast=torch.bfloat16``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_gen as T  # noqa: E402

from fnebm import couplings as C  # noqa: E402
from fnebm import losses as L  # noqa: E402
from fnebm import random as fr  # noqa: E402


class ConvNet(torch.nn.Module):
    """A small U-Net on 3x32x32: 64 channels at 32x32, 128 at 16x16, 256 at 8x8, skips by concatenation,
    GroupNorm + SiLU; the time (flow matching) enters as an extra input channel. About 2.4 M parameters."""

    def __init__(self, time_input: bool, ch: int = 64):
        super().__init__()
        self.time_input = time_input
        nn = torch.nn

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU())

        self.inc = block(4 if time_input else 3, ch)
        self.down1 = nn.Sequential(nn.AvgPool2d(2), block(ch, 2 * ch))
        self.down2 = nn.Sequential(nn.AvgPool2d(2), block(2 * ch, 4 * ch))
        self.up2 = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec2 = block(4 * ch + 2 * ch, 2 * ch)
        self.up1 = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec1 = block(2 * ch + ch, ch)
        self.out = nn.Conv2d(ch, 3, 1)

    def forward(self, x, t=None):
        if self.time_input:
            x = torch.cat([x, t[:, None, None, None].expand(-1, 1, *x.shape[2:])], 1)
        h1 = self.inc(x)
        h2 = self.down1(h1)
        h3 = self.down2(h2)
        d2 = self.dec2(torch.cat([self.up2(h3), h2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), h1], 1))
        return self.out(d1)


def conv_field(net, p, x, *t):
    return torch.func.functional_call(net, p, (x, *t))


def make(kind: str, objective: str, device):
    torch.manual_seed(0)
    if kind == "mlp":
        return T.make_net(3 if objective == "fm" else 2, 256, 0).to(device)
    return ConvNet(objective == "fm").to(device)


class Step:
    def __init__(self, impl, kind, objective, net):
        self.net = copy.deepcopy(net)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        self.impl, self.objective = impl, objective
        self.params = dict(self.net.named_parameters())
        if impl.startswith("torchebm"):
            from torchebm.losses import EquilibriumMatchingLoss, FlowMatchingLoss

            model = T.TimeNet(self.net, objective == "fm") if kind == "mlp" else _Clock(self.net, objective == "fm")
            cls = FlowMatchingLoss if objective == "fm" else EquilibriumMatchingLoss
            self.loss = cls(model, device=next(self.net.parameters()).device)
            if impl == "torchebm-bf16":
                self.loss.setup_mixed_precision(True, torch.bfloat16)
        else:
            fn = T.mlp_batch if kind == "mlp" else functools.partial(conv_field, self.net)
            auto = torch.bfloat16 if impl == "fnebm-bf16" else None
            lossf = L.flow_matching if objective == "fm" else L.equilibrium_matching
            self.loss = lambda b, k: lossf(L.bind_field(fn, self.params, batched=True), b, k, autocast=auto)[0]

    def __call__(self, batch, key):
        loss = self.loss(batch) if self.impl.startswith("torchebm") else self.loss(batch, key)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


class _Clock(torch.nn.Module):
    def __init__(self, net, time_input):
        super().__init__()
        self.net, self.time_input = net, time_input

    def forward(self, x, t):
        return self.net(x, t) if self.time_input else self.net(x)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(kind, objective, device, pairs, impls):
    net = make(kind, objective, device)
    steps = {i: Step(i, kind, objective, net) for i in impls}
    shape = (4096, 2) if kind == "mlp" else (128, 3, 32, 32)
    data = [(T.batches(1, 4096, seed=i)[0].to(device) if kind == "mlp" else
             fr.normal(fr.key(i, device=device), shape)) for i in range(pairs + 5)]
    first = {}
    for name, st in steps.items():
        sync(device)
        t0 = time.perf_counter()
        st(data[0], fr.key(0, device=device))
        sync(device)
        first[name] = time.perf_counter() - t0
        for i in range(1, 5):
            st(data[i], fr.key(i, device=device))
    times = {i: [] for i in impls}
    for j in range(pairs):
        order = impls if j % 2 == 0 else impls[::-1]
        for name in order:
            sync(device)
            t0 = time.perf_counter()
            steps[name](data[5 + j], fr.key(5 + j, device=device))
            sync(device)
            times[name].append(time.perf_counter() - t0)
    res = {"first_call_s": first, "median_ms": {n: 1e3 * statistics.median(v) for n, v in times.items()}}
    for name in impls[1:]:
        r = [a / b for a, b in zip(times[impls[0]], times[name])]
        res[f"ratio_{impls[0]}_over_{name}"] = statistics.median(r)
    return res


def couplings_check(device):
    out = {}
    x0, x1 = fr.normal(fr.key(1, device=device), (4096, 2)), fr.normal(fr.key(2, device=device), (4096, 2)) + 2
    sync(device)
    t0 = time.perf_counter()
    a, b = C.sinkhorn_ot(x0, x1, fr.key(3, device=device), epsilon=0.05, n_iters=100)
    sync(device)
    out["sinkhorn_4096_ms"] = 1e3 * (time.perf_counter() - t0)
    out["sinkhorn_device"] = str(b.device)
    out["sinkhorn_mean_sq_dist"] = float(((a - b) ** 2).sum(1).mean())
    out["independent_mean_sq_dist"] = float(((x0 - x1) ** 2).sum(1).mean())
    y0, y1 = x0[:256], x1[:256]
    t0 = time.perf_counter()
    a, b = C.exact_ot(y0, y1)
    out["exact_256_ms"] = 1e3 * (time.perf_counter() - t0)
    out["exact_device"] = str(b.device)
    out["exact_mean_sq_dist"] = float(((a - b) ** 2).sum(1).mean())
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--kinds", default="mlp,cifar")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    result["couplings"] = couplings_check(device)
    print(json.dumps(result), flush=True)
    impls = ["torchebm", "torchebm-bf16", "fnebm", "fnebm-bf16"]
    for kind in args.kinds.split(","):
        for objective in ("fm", "eqm"):
            r = bench(kind, objective, device, args.pairs, impls)
            result[f"{kind}/{objective}"] = r
            print(kind, objective, json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
