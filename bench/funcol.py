"""Functional collectives inside a compiled graph against a collective after it (gloo, CPU).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/funcol.py

Per-chain sums and sums of squares of a (2048, 10) block, all-reduced across the ranks: (a)
``funcol.all_reduce`` inside ``torch.compile(fullgraph=True)``; (b) the compiled statistics,
then ``dist.all_reduce`` outside. Prints, for each, the first call's seconds (compile
included), the median of 50 warm calls in microseconds, and two reduced values (equal in both).
"""
import os, time, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
torch.manual_seed(r)
x = torch.randn(2048, 10)

def stats_funcol(x):  # per-chain statistics reduced inside the compiled graph
    s = torch.stack((x.sum(0), (x * x).sum(0)))
    return funcol.all_reduce(s, "sum", dist.group.WORLD)

def stats_local(x):
    return torch.stack((x.sum(0), (x * x).sum(0)))

out = {}
for name, fn in (("funcol inside compile", stats_funcol), ("compile, then dist.all_reduce outside", stats_local)):
    torch._dynamo.reset()
    c = torch.compile(fn, fullgraph=True)
    t = time.perf_counter()
    try:
        y = c(x)
        if name.startswith("compile, then"):
            dist.all_reduce(y)
        y = y.clone()
        cold = time.perf_counter() - t
        ts = []
        for _ in range(50):
            t = time.perf_counter(); z = c(x)
            if name.startswith("compile, then"):
                dist.all_reduce(z)
            z = z + 0  # funcol results are waited on at first use
            ts.append(time.perf_counter() - t)
        ts.sort()
        out[name] = (round(cold, 2), round(ts[25] * 1e6), y[0, :2].tolist())
    except Exception as e:
        out[name] = f"{type(e).__name__}: {str(e)[:200]}"
if r == 0:
    for k, v in out.items(): print(k, "->", v)
dist.barrier(); dist.destroy_process_group()
