"""fnebm side by side with its peers, in one process run.

    python bench/run.py [--quick] [--repeats N] [--json PATH] [--only W1,W3,RNG] [--fresh-cache]

Workloads (fixed, so that runs compare over time):
  W1   unadjusted Langevin, 10-D double well (h=2, b=1), 10,000 chains x 100 steps, eta=0.01
       peers: TorchEBM LangevinDynamics + DoubleWellModel, a plain PyTorch eager autograd
       loop, JAX (jit + vmap(grad) + lax.scan)
  W3   MALA, same target and sizes; peer: BlackJAX mala (jit + vmap + lax.scan)
  RNG  10**6 standard normals: fnebm.random.normal compiled vs torch.randn

Every implementation keeps the whole trajectory (draws x chains x dim), as a sampler's user
would. Cold = the first call in this process (compilation included); warm = the median of
--repeats further calls. The ratio is peer warm / fnebm warm (> 1: fnebm is faster).
fnebm's cold time depends on Inductor's on-disk cache: by default the machine's cache is used
(a second process reuses the compiled graphs); --fresh-cache points Inductor at an empty
directory, which gives the cold time of a first run ever.
Peers are optional (`pip install -e .[bench]`); a missing one is reported, not fatal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

if "--fresh-cache" in sys.argv:  # Inductor reads its cache directory when torch is imported
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fnebm-bench-inductor-")

import torch  # noqa: E402

import fnebm  # noqa: E402
from fnebm import energies  # noqa: E402
from fnebm import random as fr  # noqa: E402

H, B, DIM, ETA = 2.0, 1.0, 10, 0.01


class Missing(Exception):
    """A peer that is not installed."""


def _timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    fn()
    cold = time.perf_counter() - t0
    warm = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - t0)
    return cold, statistics.median(warm)


# ----------------------------------------------------------------------------- fnebm


def fnebm_chain(make_alg, chains, steps):
    alg = make_alg(energies.double_well(H, B))
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(0), (chains, DIM)))
    key = fr.key(1)

    def run():
        return fnebm.sample_chain(alg.step, state, key, steps, progress=False)[1]

    return run


def fnebm_langevin(chains, steps):
    return fnebm_chain(lambda e: fnebm.langevin(e, ETA), chains, steps)


def fnebm_mala(chains, steps):
    return fnebm_chain(lambda e: fnebm.mala(e, ETA), chains, steps)


# ----------------------------------------------------------------------------- torch peers


def torch_eager_langevin(chains, steps):
    x0 = torch.randn(chains, DIM)  # a benchmark harness, not library code

    def energy(x):
        return H * ((x * x - B * B) ** 2).sum(-1)

    def run():
        x = x0.clone()
        traj = torch.empty(steps, chains, DIM)
        scale = math.sqrt(2 * ETA)
        for t in range(steps):
            x.requires_grad_(True)
            (g,) = torch.autograd.grad(energy(x).sum(), x)
            x = (x.detach() - ETA * g + scale * torch.randn_like(x)).detach()
            traj[t] = x
        return traj

    return run


def torchebm_langevin(chains, steps):
    try:
        from torchebm.core import DoubleWellModel
        from torchebm.samplers import LangevinDynamics
    except ImportError as e:
        raise Missing(f"torchebm ({e.name})") from None
    sampler = LangevinDynamics(DoubleWellModel(barrier_height=H, b=B), step_size=ETA, noise_scale=1.0)
    x0 = torch.randn(chains, DIM)

    def run():
        return sampler.sample(x=x0.clone(), n_steps=steps, return_trajectory=True)

    return run


# ----------------------------------------------------------------------------- JAX peers


def _jax():
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as e:
        raise Missing(f"jax ({e.name})") from None
    return jax, jnp


def _jax_energy(jnp):
    return lambda x: H * jnp.sum((x * x - B * B) ** 2)


def jax_langevin(chains, steps):
    jax, jnp = _jax()
    grad = jax.vmap(jax.grad(_jax_energy(jnp)))
    scale = math.sqrt(2 * ETA)

    @jax.jit
    def chain(key, x0):
        def body(x, k):
            x = x - ETA * grad(x) + scale * jax.random.normal(k, x.shape)
            return x, x

        return jax.lax.scan(body, x0, jax.random.split(key, steps))[1]

    key = jax.random.key(0)
    x0 = jax.random.normal(jax.random.key(1), (chains, DIM))
    return lambda: chain(key, x0).block_until_ready()


def blackjax_mala(chains, steps):
    jax, jnp = _jax()
    try:
        import blackjax
    except ImportError as e:
        raise Missing(f"blackjax ({e.name})") from None
    energy = _jax_energy(jnp)
    alg = blackjax.mala(lambda x: -energy(x), ETA)

    @jax.jit
    def chain(key, x0):
        states = jax.vmap(alg.init)(x0)

        def body(s, k):
            s, _ = jax.vmap(alg.step)(jax.random.split(k, chains), s)
            return s, s.position

        return jax.lax.scan(body, states, jax.random.split(key, steps))[1]

    key = jax.random.key(0)
    x0 = jax.random.normal(jax.random.key(1), (chains, DIM))
    return lambda: chain(key, x0).block_until_ready()


# ----------------------------------------------------------------------------- RNG


def fnebm_normal(n, _):
    draw = torch.compile(lambda k: fr.normal(k, (n,)), fullgraph=True)
    key = fr.key(0)
    return lambda: draw(key)


def torch_randn(n, _):
    return lambda: torch.randn(n)


# ----------------------------------------------------------------------------- driver

WORKLOADS = {
    "W1": dict(
        title="unadjusted Langevin, 10-D double well, {chains} chains x {steps} steps",
        ours=("fnebm", fnebm_langevin),
        peers=[("TorchEBM 0.8", torchebm_langevin), ("PyTorch eager", torch_eager_langevin), ("JAX", jax_langevin)],
        full=(10_000, 100),
        quick=(1_000, 20),
    ),
    "W3": dict(
        title="MALA, 10-D double well, {chains} chains x {steps} steps",
        ours=("fnebm", fnebm_mala),
        peers=[("BlackJAX", blackjax_mala)],
        full=(10_000, 100),
        quick=(1_000, 20),
    ),
    "RNG": dict(
        title="{chains} standard normals (float32)",
        ours=("fnebm", fnebm_normal),
        peers=[("torch.randn", torch_randn)],
        full=(10**6, 0),
        quick=(10**6, 0),
    ),
}


def run_workload(name, spec, quick, repeats):
    chains, steps = spec["quick" if quick else "full"]
    rows = []
    for label, make in [spec["ours"], *spec["peers"]]:
        row = dict(workload=name, impl=label)
        try:
            row["cold_s"], row["warm_s"] = _timed(make(chains, steps), repeats)
        except Missing as e:
            row["missing"] = str(e)
        rows.append(row)
    ours = rows[0].get("warm_s")
    for row in rows:
        if "warm_s" in row and ours:
            row["ratio"] = row["warm_s"] / ours
    return spec["title"].format(chains=chains, steps=steps), rows


def _fmt(row):
    if "missing" in row:
        return f"  {row['impl']:<16} {'missing: ' + row['missing']}"
    return f"  {row['impl']:<16} {row['cold_s']:>9.3f} {row['warm_s'] * 1e3:>13.2f} {row['ratio']:>10.2f}x"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None):
    parser = argparse.ArgumentParser(description="fnebm vs TorchEBM, PyTorch and JAX/BlackJAX, side by side")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--repeats", type=int, default=7, help="warm runs per implementation (median)")
    parser.add_argument(
        "--json", default=None, help="where to write the table as JSON (default: bench/results.json, or bench/results-quick.json with --quick)"
    )
    parser.add_argument("--only", default="W1,W3,RNG", help="comma-separated workloads")
    parser.add_argument("--fresh-cache", action="store_true", help="compile into an empty Inductor cache")
    args = parser.parse_args(argv)
    if args.json is None:
        args.json = "bench/results-quick.json" if args.quick else "bench/results.json"
    if args.repeats < 5:
        parser.error("--repeats must be >= 5")
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")

    machine = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        cpu=_cpu_model(),
        cores=os.cpu_count(),
        device="cpu",
        inductor_cache="fresh" if args.fresh_cache else "machine",
    )
    print(f"torch {machine['torch']}, {machine['threads']} threads, {machine['cores']} cores; warm = median of {args.repeats}")
    results = []
    for name in names:
        title, rows = run_workload(name, WORKLOADS[name], args.quick, args.repeats)
        print(f"\n{name}: {title}")
        print(f"  {'impl':<16} {'cold (s)':>9} {'warm (ms)':>13} {'peer/fnebm':>11}")
        for row in rows:
            print(_fmt(row))
        results.append(dict(workload=name, title=title, rows=rows))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(machine=machine, quick=args.quick, repeats=args.repeats, results=results), f, indent=2)
            f.write("\n")
        os.replace(tmp, args.json)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
