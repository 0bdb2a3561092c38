"""Where W1's time goes: the full Langevin chain against its parts, each as its own scan.

    python bench/profile_w1.py [--chains 10000] [--steps 100] [--repeats 7] [--reuse-freed-memory]

Each variant is a batched step function ``step(state, keys: (chains, 2))`` (it takes every
chain's key at once, as fnebm's samplers do) run by fnebm.sample_chain (compiled, warm
medians), so the differences split the time into the trajectory and loop, RNG (key
derivation + normals), gradient and the rest (energy value, divergence checks, cached state).
"""

import argparse
import math
import statistics
import time
from typing import NamedTuple

import torch

import fnebm
from fnebm import energies
from fnebm import random as fr


class S(NamedTuple):
    position: torch.Tensor
    energy: torch.Tensor


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chains", type=int, default=10_000)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--reuse-freed-memory", action="store_true",
                   help="call fnebm.reuse_freed_memory() first: each trace reuses the freed pages of the last")
    a = p.parse_args()
    if a.reuse_freed_memory:
        fnebm.reuse_freed_memory()
    e = energies.double_well(2.0, 1.0)
    eta, scale = 0.01, math.sqrt(2 * 0.01)
    x0 = fr.normal(fr.key(0), (a.chains, 10))

    grad = torch.func.vmap(e.grad)  # the closed-form gradient, per chain

    def copy_only(s, key):  # the loop and the trajectory buffer, nothing else
        return S(s.position * 1.0, s.energy), ()

    def keys_only(s, key):  # sample_chain's per-step fold_in, and nothing else
        return S(s.position + key[..., :1].to(s.position.dtype) * 0, s.energy), ()

    def rng_only(s, key):  # fold_in + the normals
        return S(s.position + fr.normal(key, s.position.shape[1:]), s.energy), ()

    def grad_only(s, key):
        return S(s.position - eta * grad(s.position), s.energy), ()

    def analytic(s, key):  # Langevin with the closed-form gradient, no energy, no checks
        return S(s.position - eta * grad(s.position) + scale * fr.normal(key, s.position.shape[1:]), s.energy), ()

    alg = fnebm.langevin(e, eta)
    variants = {
        "full Langevin step (fnebm.langevin)": (alg.step, torch.func.vmap(alg.init)(x0)),
        "closed-form grad + noise only": (analytic, S(x0, torch.zeros(a.chains))),
        "fold_in + normal": (rng_only, S(x0, torch.zeros(a.chains))),
        "fold_in only": (keys_only, S(x0, torch.zeros(a.chains))),
        "gradient only (no RNG)": (grad_only, S(x0, torch.zeros(a.chains))),
        "copy only (loop + trajectory)": (copy_only, S(x0, torch.zeros(a.chains))),
    }
    key = fr.key(1)
    print(f"{a.chains} chains x {a.steps} steps, 10-D double well; warm medians of {a.repeats}"
          + ("; freed memory reused" if a.reuse_freed_memory else ""))
    for name, (step, state) in variants.items():
        run = lambda: fnebm.sample_chain(step, state, key, a.steps, compile=True, progress=False)  # noqa: E731
        t0 = time.perf_counter()
        run()
        cold = time.perf_counter() - t0
        warm = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            run()
            warm.append(time.perf_counter() - t0)
        print(f"  {name:<36} cold {cold:6.2f} s   warm {statistics.median(warm) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
