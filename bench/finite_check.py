"""The eager divergence check (fnebm.samplers.base.all_finite) for many chains of a small position:
fnebm's C rows against NumPy's isfinite-and-all (``fnebm.random._C_EAGER = False``), alternated.

    python bench/finite_check.py [--chains 10000] [--dim 2]

Layouts: the energies and both events row-major, and the position chain-innermost (how
sample_chain's eager engine holds a small event: a 2-D MLP's Langevin state), as the step calls it.
Median microseconds per call over 9 rounds of 300 calls, one thread.
"""
import argparse
import statistics
import time

import torch

from fnebm import random as fr
from fnebm.samplers.base import all_finite


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", type=int, default=10_000)
    ap.add_argument("--dim", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    n, d = a.chains, a.dim
    e, g = torch.randn(n), torch.randn(n, d)
    p = torch.randn(n, d).t().contiguous().t()  # chain-innermost
    cases = {"row-major": (e, g, g), "position chain-innermost": (e, g, p)}
    times = {(c, way): [] for c in cases for way in ("C", "NumPy")}
    for _ in range(9):
        for c, args in cases.items():
            for way in ("C", "NumPy"):
                fr._C_EAGER = way == "C"
                t0 = time.perf_counter()
                for _ in range(300):
                    all_finite(*args, n_batch=1)
                times[(c, way)].append((time.perf_counter() - t0) / 300 * 1e6)
    fr._C_EAGER = True
    for c in cases:
        cm, nm = statistics.median(times[(c, "C")]), statistics.median(times[(c, "NumPy")])
        print(f"{n} chains x {d}, {c}: C {cm:.1f} us, NumPy {nm:.1f} us ({nm / cm:.2f}x)")


if __name__ == "__main__":
    main()
