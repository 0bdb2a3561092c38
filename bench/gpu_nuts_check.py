"""NUTS with window adaptation on bench/posterior.py's logistic regression, on a GPU, one process, each phase timed.

    python bench/gpu_nuts_check.py [--warmup 100] [--draws 100]

Prints what sample_chain planned (on_plan), every warning, and the time of the warm-up and the sampling,
twice (the second call warm). Needs a CUDA device (--allow-cpu for a smoke test). Writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import posterior  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--allow-cpu", action="store_true")
    args = ap.parse_args()
    import torch

    import fnebm
    from fnebm import random as fr

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_nuts_check.py: no CUDA device", file=sys.stderr)
        sys.exit(2)
    dev = posterior.DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    warnings.simplefilter("always")
    d = posterior.data("logreg")
    energy = posterior.torch_energy("logreg", d)
    x0 = torch.from_numpy(d["x0"]).to(dev)
    for call in range(2):
        t0 = time.perf_counter()
        warmup = fnebm.window_adaptation(fnebm.nuts, energy, args.warmup)
        state, parameters, _ = warmup.run(x0, fr.key(1, device=dev), on_plan=lambda p: print("  warm-up plan:", p.engine, p.transition, p.reason))
        sync()
        t1 = time.perf_counter()
        alg = fnebm.nuts(energy, **parameters)
        _, trace, info = fnebm.sample_chain(alg.step, state, fr.key(2, device=dev), args.draws,
                                            on_plan=lambda p: print("  sampling plan:", p.engine, p.transition, p.reason))
        sync()
        t2 = time.perf_counter()
        print(f"call {call + 1}: warm-up {t1 - t0:.2f} s, sampling {t2 - t1:.2f} s; "
              f"steps/transition {info.num_integration_steps.double().mean().item():.1f}, "
              f"accept {info.acceptance_rate.double().mean().item():.3f}", flush=True)


if __name__ == "__main__":
    main()
