"""The eager Langevin step on bench/user.py's 2-D MLP (10,000 chains) against the plain PyTorch loop,
in one process, alternated call by call: fnebm as it runs (a module's energy keeps the small state
chain-outermost: ``fnebm.chain.engines._whole_batch_energy``) and with the state chain-innermost, as
the eager engine laid out every event up to 64 values before that.

    python bench/eager_gap.py [--steps 50] [--rounds 15]

Prints each way's median seconds per call, its median minor page faults per call, and the median
of the per-round ratios to the plain loop. ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
in the environment (e.g. 268435456 each) take glibc's page faults out of it.
"""
import argparse
import os
import resource
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    sys.path.insert(0, HERE)
    import torch

    import fnebm
    import fnebm.chain.engines as engines
    import user
    from fnebm import energies

    warnings.simplefilter("ignore")
    net, x0 = user.make_net("mlp2d"), user.start("mlp2d")
    n = a.steps

    def run_fnebm():
        alg = fnebm.langevin(energies.bind(*energies.from_module(net)), user.H, user.S)
        state = torch.func.vmap(alg.init)(x0)
        fnebm.sample_chain(alg.step, state, fnebm.random.key(0), n, thin=n, progress=False, compile=False)

    plain = user.make_plain(net, x0, n)
    ways = {"plain": plain, "fnebm": run_fnebm, "fnebm chain-innermost": run_fnebm}
    whole = getattr(engines, "_whole_batch_energy", None)
    times = {w: [] for w in ways}
    faults = {w: [] for w in ways}
    for _ in range(a.rounds):
        for w, run in ways.items():
            if whole is not None:
                engines._whole_batch_energy = (lambda step: False) if w == "fnebm chain-innermost" else whole
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            run()
            times[w].append(time.perf_counter() - t0)
            faults[w].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    if whole is not None:
        engines._whole_batch_energy = whole
    print(f"10,000 chains x {n} steps, {a.rounds} rounds, threads {torch.get_num_threads()}, load {os.getloadavg()}")
    for w in ways:
        ratio = "" if w == "plain" else \
            f", {statistics.median(x / p for x, p in zip(times[w], times['plain'])):.3f}x the plain loop"
        print(f"  {w}: {statistics.median(times[w]):.3f} s, {statistics.median(faults[w]):.0f} page faults{ratio}")


if __name__ == "__main__":
    main()
