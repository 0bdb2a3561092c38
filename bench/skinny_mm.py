"""CPU matrix products with a skinny output against their transposes (fnebm/_inductor.py's pass).

    python bench/skinny_mm.py [--threads 1]

For each (M, K, N): the forward product of a batched linear predictor, ``A @ Bt.T`` ((M, N) output,
``Bt`` (N, K) a transposed view), against ``(Bt @ A.T).T``'s product ``Bt @ A.T`` ((N, M) output);
and the backward-like product ``A.T @ R.T`` ((K, N) output) against ``R @ A`` ((N, K)). Microseconds,
the best of 3 repeats of 2,000 calls into preallocated outputs, on --threads torch threads.
The pass rewrites outputs of at most 8 columns and at least 4x as many rows.
"""

import argparse
import timeit

import torch

SHAPES = [(1000, 25, 4), (1000, 100, 4), (10000, 25, 4), (200, 50, 8), (100, 100, 4), (1000, 25, 1),
          (64, 784, 4), (1000, 25, 16), (4, 1000, 25), (1000, 4, 25), (256, 256, 16), (5000, 10, 32)]


def _us(f) -> float:
    f()
    return min(timeit.repeat(f, number=2000, repeat=3)) / 2000 * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'M, K, N':>16s} | {'A @ Bt.T':>9s} {'Bt @ A.T':>9s} | {'A.T @ R.T':>9s} {'R @ A':>9s}  (us, {args.threads} thread(s))")
    g = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        a, bt, r = (torch.randn(s, generator=g) for s in ((m, k), (n, k), (n, m)))
        o1, o2, o3, o4 = torch.empty(m, n), torch.empty(n, m), torch.empty(k, n), torch.empty(n, k)
        fwd, fwd_t = _us(lambda: torch.mm(a, bt.T, out=o1)), _us(lambda: torch.mm(bt, a.T, out=o2))
        bwd, bwd_t = _us(lambda: torch.mm(a.T, r.T, out=o3)), _us(lambda: torch.mm(r, a, out=o4))
        print(f"{str((m, k, n)):>16s} | {fwd:9.1f} {fwd_t:9.1f} | {bwd:9.1f} {bwd_t:9.1f}")


if __name__ == "__main__":
    main()
