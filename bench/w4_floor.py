"""W4's floor beside fnebm's compiled CD-10 step, alternated call by call in one process.

    python bench/w4_floor.py [--pairs N] [--batch 1024] [--k 10] [--profile] [--json PATH]

The floor is the work any implementation of W4's step runs (bench/run.py, W4: MLP 2-128-128-1
with SiLU, batch 1,024, CD-10 from the data): the large matrix products and the SiLU
nonlinearity, timed alone as ATen calls into preallocated outputs (``torch.mm(out=)``,
``torch.sigmoid(out=)``), nothing else:

* ``2 (k + 1)`` products ``[batch,128]·[128,128]`` (each of the sampler's ``k + 1``
  evaluations of E and dE/dx: the hidden layer forward, and its transpose backward) and 4
  weight gradients ``[128,batch]·[batch,128]`` (the loss's parameter gradients);
* ``2 (k + 1)`` ``sigmoid`` passes over ``[batch,128]`` (one per hidden layer per evaluation:
  SiLU's forward and its derivative can share one).

That is the count docs/benchmarks.md gave (22 + 4 products, 22 sigmoids: 3.1-3.3 ms on the
AVX-512 hosts); it leaves out the small products of the 2-wide and 1-wide layers, the draws,
the update, Adam and the call itself, so no implementation reaches it. fnebm's side: one
call of bench/run.py's compiled train step (``w4_fnebm_step``: CD loss under
``torch.func.grad_and_value`` plus Adam, one ``fullgraph`` graph). Each pair times both, the
order alternating; reported: medians and the median of per-pair ratios (step / floor).

``--profile``: torch.profiler over 20 compiled steps after the pairs, the ops by self CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def floor_fn(batch: int, k: int, hidden: int = 128):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(batch, hidden, generator=g)
    w = torch.randn(hidden, hidden, generator=g) / hidden**0.5
    at = a.t().contiguous()
    outs = [torch.empty(batch, hidden) for _ in range(2)]
    wout = torch.empty(hidden, hidden)
    sig = torch.empty(batch, hidden)
    n_act, n_w, n_sig = 2 * (k + 1), 4, 2 * (k + 1)

    def run():
        for i in range(n_act):
            torch.mm(a, w, out=outs[i & 1])
        for _ in range(n_w):
            torch.mm(at, a, out=wout)
        for _ in range(n_sig):
            torch.sigmoid(a, out=sig)

    return run, (n_act, n_w, n_sig)


def step_fn(batch: int, k: int):
    import run as bench  # bench/run.py

    from fnebm import energies
    from fnebm import random as fr
    from fnebm.cli.train_model import mlp_energy

    energy = energies.bind(mlp_energy, bench.w4_params())
    opt = bench.w4_adam_init(energy)
    data = bench.w4_batches(batch, 1)[0]
    key = fr.key(2)
    step = bench.w4_fnebm_step(k, compiled=True)

    def run():
        return step(energy, opt, data, key)

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=31)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    load_before = os.getloadavg()
    floor, counts = floor_fn(a.batch, a.k)
    t0 = time.perf_counter()
    step = step_fn(a.batch, a.k)
    step()
    cold = time.perf_counter() - t0
    for _ in range(5):
        step(), floor()
    ts, tf = [], []
    for i in range(a.pairs):
        order = (step, floor) if i % 2 == 0 else (floor, step)
        for fn in order:
            t = time.perf_counter()
            fn()
            (ts if fn is step else tf).append(time.perf_counter() - t)
    ratios = [s / f for s, f in zip(ts, tf)]
    out = dict(torch=torch.__version__, threads=torch.get_num_threads(), batch=a.batch, k=a.k,
               floor_counts=dict(zip(("act_mm", "weight_mm", "sigmoid"), counts)),
               load_before=load_before, load_after=os.getloadavg(), cold_s=cold,
               step_ms=1e3 * statistics.median(ts), floor_ms=1e3 * statistics.median(tf),
               ratio=statistics.median(ratios), step_all_ms=[1e3 * t for t in ts],
               floor_all_ms=[1e3 * t for t in tf])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {load_before} -> {out['load_after']}")
    print(f"first step (compile or cache) {cold:.1f} s; {a.pairs} alternating pairs")
    print(f"fnebm compiled CD-{a.k} step  {out['step_ms']:.2f} ms")
    print(f"floor ({counts[0]} + {counts[1]} mm, {counts[2]} sigmoid)  {out['floor_ms']:.2f} ms")
    print(f"step / floor (median of per-pair ratios)  {out['ratio']:.3f}")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
