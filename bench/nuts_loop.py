"""The C NUTS kernel's loop around a user's evaluation: microseconds a trip beyond the evaluation.

    python bench/nuts_loop.py [--transitions 200] [--repeats 3]

``fnebm.kernels.cpu_nuts.nuts_transitions`` on a 4-chain Gaussian written as a function (d = 10 and
100), one thread, with a small eager evaluation; a trip is one call of the evaluation (every chain
one integrator step). Prints, per d, the trips, the time a trip, the evaluation's own time (timed
alone) and their difference: what the kernel's loop adds (C, ctypes, the outputs' checks).
"""
import argparse
import time

import torch

from fnebm import random as fr
from fnebm.kernels import cpu_nuts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transitions", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    for d in (10, 100):
        x = fr.normal(fr.key(1), (4, d))
        e0, g0 = 0.5 * (x * x).sum(-1), x.clone()

        def evaluate(z):
            return 0.5 * (z * z).sum(-1), z.clone()

        trips = [0]

        def counted(z):
            trips[0] += 1
            return evaluate(z)

        keys = fr.split(fr.key(3), args.transitions * 4).reshape(args.transitions, 4, 2)
        best = float("inf")
        for _ in range(args.repeats):
            trips[0] = 0
            t = time.perf_counter()
            cpu_nuts.nuts_transitions(counted, x, e0, g0, keys, torch.tensor(0.3), torch.ones(d), False,
                                      max_tree_depth=10, coefficients=(0.5, 1.0, 0.5), divergence_threshold=1000.0)
            best = min(best, (time.perf_counter() - t) / trips[0])
        z, n = torch.randn(4, d), 20000
        t = time.perf_counter()
        for _ in range(n):
            counted(z)
        alone = (time.perf_counter() - t) / n
        print(f"d={d}: {trips[0]} trips, {best * 1e6:.1f} us a trip, the evaluation alone {alone * 1e6:.1f} us, "
              f"the loop {(best - alone) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
