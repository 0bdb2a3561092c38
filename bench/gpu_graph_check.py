"""Eager steps replayed from a CUDA graph, checked on a GPU (issue 26): the same draws as one-by-one
eager steps, a capture the energy refuses, and the time per step.

    python bench/gpu_graph_check.py [--torch-draws]

For Langevin, MALA and HMC on a neural energy (and MALA on a function), runs sample_chain(compile=False)
with fnebm.chain.engines._CUDA_GRAPHS on and off and compares every output bit for bit; then an
energy that reads a value on the host inside (``.item()``): the capture fails, the steps run one by
one, and the device still works after; then bench/user.py's 784-D MLP Langevin (128 chains x 60
steps) both ways, alternated, and the per-pair ratio. Needs a CUDA device. Writes nothing.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import torch
    from torch import nn

    import fnebm
    from fnebm import energies as E
    from fnebm import random as fr
    from fnebm.chain import engines

    if not torch.cuda.is_available():
        print("gpu_graph_check.py: no CUDA device", file=sys.stderr)
        sys.exit(2)
    if "--torch-draws" in sys.argv[1:]:  # keys and draws by torch operations instead of Triton's kernels
        fnebm.random._TRITON_EAGER_DEVICES = ()
        fnebm.random._TRITON_DRAWS = False
        print("keys and draws by torch operations (no Triton)")
    dev = "cuda"
    torch.manual_seed(0)  # the check's weights
    net = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 1)).to(dev)
    neural = E.bind(*E.from_module(net))

    def run(alg, steps=40, graphs=True, chains=256, **kw):
        engines._CUDA_GRAPHS = graphs
        try:
            state = torch.func.vmap(alg.init)(fr.normal(fr.key(3, device=dev), (chains, 32)))
            out = fnebm.sample_chain(alg.step, state, fr.key(1, device=dev), steps, progress=False, compile=False, **kw)
            torch.cuda.synchronize()
            return out
        finally:
            engines._CUDA_GRAPHS = True

    def same(a, b):
        la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
        return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))

    algs = {
        "langevin mlp": fnebm.langevin(neural, 0.01, 0.05),
        "mala mlp": fnebm.mala(neural, 0.01),
        "hmc mlp": fnebm.hmc(neural, 0.02, torch.ones(32, device=dev), 4),
        "mala function": fnebm.mala(lambda x: 0.5 * (x * x).sum() + 0.1 * (x[0] ** 4), 0.1),
    }
    ok = True
    for name, alg in algs.items():
        for kw in ({}, {"thin": 5, "burn_in": 3}, {"chunk_size": 12}):
            eq = same(run(alg, **kw), run(alg, graphs=False, **kw))
            ok &= eq
            print(f"{name} {kw}: graphed equals one-by-one: {eq}")

    def host_read(xs):  # a batched energy that reads a value on the host: not capturable
        return 0.5 * (xs * xs).sum(-1) + 0.0 * float(xs.detach().abs().max().item())

    alg = fnebm.mala(E.batched(host_read), 0.1)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(3, device=dev), (8, 32)))
    keys = fr.split(fr.key(5, device=dev), 8)
    g, failed = engines._Graphed.make(alg.step, keys, state, torch.tensor(0, device=dev))
    print(f"host-reading energy: captured {g is not None}; reason: {failed.reason if failed else None}")
    eq = same(run(alg, chains=8), run(alg, graphs=False, chains=8))
    torch.cuda.empty_cache()  # refused if the failed capture had left the allocator "capturing"
    after = same(run(algs["langevin mlp"]), run(algs["langevin mlp"], graphs=False))
    ok &= eq and after and g is None
    print(f"host-reading energy: sample_chain equals one-by-one: {eq}; a graphed run after it still equal: {after}")

    import user

    def langevin(graphs, workload="mlp784"):
        net7, x0 = nets[workload]
        engines._CUDA_GRAPHS = graphs
        try:
            alg = fnebm.langevin(E.bind(*E.from_module(net7)), user.H, user.S)
            state = torch.func.vmap(alg.init)(x0)
            return fnebm.sample_chain(alg.step, state, fr.key(0, device=dev), 60, thin=60, progress=False)[1]
        finally:
            engines._CUDA_GRAPHS = True

    nets = {w: (user.make_net(w).to(dev), user.start(w).to(dev)) for w in ("mlp784", "conv28")}
    # the ConvNet: is cuDNN's backward itself deterministic from call to call, graphed or not?
    a, b, c, d = langevin(True, "conv28"), langevin(True, "conv28"), langevin(False, "conv28"), langevin(False, "conv28")
    print(f"conv28: graphed twice equal {torch.equal(a, b)}, one-by-one twice equal {torch.equal(c, d)}, graphed vs "
          f"one-by-one equal {torch.equal(a, c)}, max |diff| {float((a - c).abs().max()):.3g} "
          f"(positions up to {float(c.abs().max()):.3g}); cudnn.deterministic={torch.backends.cudnn.deterministic}")
    torch.backends.cudnn.deterministic = True
    a, c = langevin(True, "conv28"), langevin(False, "conv28")
    print(f"conv28 with cudnn.deterministic=True: graphed vs one-by-one equal {torch.equal(a, c)}, "
          f"max |diff| {float((a - c).abs().max()):.3g}")
    torch.backends.cudnn.deterministic = False
    t = {True: [], False: []}
    for r in range(9):
        for graphs in ((True, False) if r % 2 == 0 else (False, True)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            langevin(graphs)
            torch.cuda.synchronize()
            t[graphs].append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(t[True][2:], t[False][2:])]
    print(f"mlp784 128x60 Langevin: graphed {statistics.median(t[True][2:]) * 1e3:.2f} ms, one-by-one "
          f"{statistics.median(t[False][2:]) * 1e3:.2f} ms, per-pair ratio median {statistics.median(ratios):.3f}; "
          f"first calls {t[True][0]:.3f} / {t[False][0]:.3f} s")
    print("ALL OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
