"""MALA's fused step on a GPU (fnebm.kernels.mala_step) against the torch operations it replaces.

    python bench/gpu_mala_step.py [--device cuda] [--rounds 7] [--steps 1000]

bench/posterior.py's ``mala`` workload (a logistic regression written as a function, 1,024
chains x 1,000 steps, ``sample_chain`` on its defaults: eager steps replayed from a CUDA graph)
with the fused step (the default) and with it switched off (``mala_step._DEVICES = ()``),
alternated call by call in one process: the warm time of each (median) and the median of the
per-round ratios; then the two traces compared (equal bits, largest difference, decisions).
Also each path one by one (no graph replay), which shows the launches' host cost. Writes nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    import torch

    import fnebm
    import posterior as P
    from fnebm import random as fr
    from fnebm.chain import engines
    from fnebm.kernels import mala_step

    P.DEVICE = args.device
    d = P.data("mala")
    energy = P.torch_energy("mala", d)
    x0 = torch.from_numpy(d["x0"]).to(args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def call(fused: bool, graphed: bool = True):
        mala_step._DEVICES = (args.device,) if fused else ()
        engines._CUDA_GRAPHS = graphed
        try:
            alg = fnebm.mala(energy, P.MALA_STEP)
            state = torch.func.vmap(alg.init)(x0)
            sync()
            t = time.perf_counter()
            _, trace, info = fnebm.sample_chain(alg.step, state, fr.key(2, device=args.device), args.steps,
                                                 compile=False)
            sync()
            return time.perf_counter() - t, trace, info
        finally:
            mala_step._DEVICES = ("cuda",)
            engines._CUDA_GRAPHS = True

    for graphed in (True, False):
        call(True, graphed), call(False, graphed)  # warm-up: kernels, captures
        times = {True: [], False: []}
        ratios = []
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            got = {f: call(f, graphed)[0] for f in order}
            for f in order:
                times[f].append(got[f])
            ratios.append(got[True] / got[False])
        label = "graphed" if graphed else "one by one"
        print(f"{label}: fused {statistics.median(times[True]) * 1e3:.1f} ms, torch ops "
              f"{statistics.median(times[False]) * 1e3:.1f} ms per {args.steps}-step call; fused / torch "
              f"{statistics.median(ratios):.3f}x (median of {args.rounds} alternated pairs)", flush=True)
    _, tf, inf_f = call(True)
    _, tt, inf_t = call(False)
    same = (tf == tt).double().mean().item()
    diff = (tf - tt).abs().max().item()
    acc = (inf_f.is_accepted == inf_t.is_accepted).double().mean().item()
    first_diff = (tf != tt).flatten(1).any(1).nonzero()
    print(f"trace: {same:.6f} of values equal bit for bit, max |diff| {diff:.3g}; decisions equal {acc:.6f}; "
          f"first draw that differs: {first_diff[0].item() if len(first_diff) else None}; acceptance "
          f"{inf_f.acceptance_rate.double().mean().item():.4f} against {inf_t.acceptance_rate.double().mean().item():.4f}")


if __name__ == "__main__":
    main()
