"""fnebm.random.normal under torch.compile vs torch.randn, 10**6 float32 on this machine.

    python bench/rng.py [--n 1000000] [--repeats 50]

Prints cold (first call, compile included) and warm medians, and the ratio randn / fnebm.
"""

import argparse
import statistics
import time

import torch

from fnebm import random as fr


def _median_s(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10**6)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    key = fr.key(0)
    draw = torch.compile(lambda k: fr.normal(k, (args.n,)), fullgraph=True)
    t0 = time.perf_counter()
    draw(key)
    cold = time.perf_counter() - t0
    ours = _median_s(lambda: draw(key), args.repeats)
    theirs = _median_s(lambda: torch.randn(args.n), args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, n={args.n}")
    print(f"fnebm.random.normal (compiled): cold {cold:.2f} s, warm median {ours * 1e3:.3f} ms")
    print(f"torch.randn:                    warm median {theirs * 1e3:.3f} ms")
    print(f"ratio randn / fnebm: {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
