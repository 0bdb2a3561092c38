"""Thin CPU matrix products in fnebm's compiled graphs: as library calls (MKL) or as the elementwise
code and reductions of fnebm's post-grad pass (fnebm/_inductor.py, ``_thin_mm``), side by side.

    python bench/thin_mm.py [--rounds 7]

Each case is compiled twice with fnebm's Inductor backend, the pass on and off
(``fnebm._inductor.THIN_PRODUCTS``), on one thread; the two compiled functions are timed alternately
(A B A B), the best of ``--rounds`` rounds of 300 calls each, in microseconds, and the values checked
against eager. The cases are the products of a network on 2-D inputs (10,000 chains) and of a
linear predictor for 2 chains.
"""

from __future__ import annotations

import argparse
import time
import types

import torch
import torch.nn.functional as F

from fnebm import _inductor

CASES = {
    "input layer: silu(x[10000,2] @ W0[2,128] + b)": (lambda x, w: F.silu(torch.addmm(w[0], x, w)),
                                                       (10000, 2), (2, 128)),
    "output layer: silu(h[10000,128]) @ w[128,1]": (lambda h, w: F.silu(h) @ w, (10000, 128), (128, 1)),
    "input gradient: W0[2,128] @ G^T[128,10000]": (lambda w, g: (w @ g.T).T.contiguous(), (2, 128), (10000, 128)),
    "predictor, 2 chains: X[1000,25] @ B^T[25,2]": (lambda x, b: x @ b.T, (1000, 25), (2, 25)),
    "its gradient: X^T[25,1000] @ R^T[1000,2] (left alone)": (lambda x, r: x.T @ r.T, (1000, 25), (2, 1000)),
}


def _own(fn, tag):
    """``fn`` with a code object of its own (Dynamo caches compiled code per code object)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def best(fn, args, n=300, rounds=7):
    for _ in range(20):
        fn(*args)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn(*args)
        times.append((time.perf_counter() - t) / n)
    return min(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, 1 thread; microseconds a call, best of {a.rounds} x 300 (alternated)")
    print(f"{'case':58s} {'pass on':>9s} {'pass off':>9s}")
    for i, (name, (fn, s1, s2)) in enumerate(CASES.items()):
        args = (torch.randn(s1, generator=g), torch.randn(s2, generator=g))
        compiled = {}
        for on in (True, False):
            _inductor.THIN_PRODUCTS = on
            c = torch.compile(_own(fn, f"{i}_{int(on)}"), backend=_inductor.inductor_backend, dynamic=False)
            torch.testing.assert_close(c(*args), fn(*args), rtol=1e-4, atol=1e-4)
            compiled[on] = c
        _inductor.THIN_PRODUCTS = True
        times = {True: [], False: []}
        for r in range(a.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                times[on].append(best(compiled[on], args, rounds=1))
        print(f"{name:58s} {min(times[True]):9.1f} {min(times[False]):9.1f}")


if __name__ == "__main__":
    main()
