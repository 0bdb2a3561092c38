"""NUTS compiled at W6's draw size (64 chains, the 50-D AR(1) Gaussian, depth 10): the time per
trip of its while_loop, i.e. per lockstep leapfrog step of all chains.

    python bench/nuts_trip.py                      # 64 chains, 100 transitions, step 0.35
    CHAINS=8 STEPS=50 DEPTH=6 EXTRA=0 python bench/nuts_trip.py

A trip is one iteration of the compiled loop; a transition costs as many trips as its longest
trajectory (``num_integration_steps.max()`` over chains). ``checksum`` is the sum of the draws:
two versions of the code that agree on it took the same trees.
"""
import os, sys, time, functools, statistics
import torch
import fnebm
from fnebm import random as fr
D, RHO = 50, 0.9
i = torch.arange(D, dtype=torch.float64)
prec = torch.linalg.inv(RHO ** (i[:, None] - i[None, :]).abs()).float()
def energy(precision, x):
    return 0.5 * (x @ (precision @ x))
chains = int(os.environ.get("CHAINS", 64)); steps = int(os.environ.get("STEPS", 100))
DEPTH=int(os.environ.get("DEPTH",10))
if os.environ.get("EXTRA","1")=="0":
    import importlib; nm = importlib.import_module("fnebm.samplers.nuts")
    k = nm.build_kernel(uturn_extra_checks=False)
    st = functools.partial(k, energy_fn=functools.partial(energy, prec), step_size=torch.tensor(0.35), inverse_mass_matrix=torch.ones(D), max_tree_depth=DEPTH)
    alg = fnebm.nuts(functools.partial(energy, prec), torch.tensor(0.35), torch.ones(D), max_tree_depth=DEPTH)._replace(step=st)
else:
    alg = fnebm.nuts(functools.partial(energy, prec), torch.tensor(0.35), torch.ones(D), max_tree_depth=DEPTH)
x0 = fr.normal(fr.key(0), (chains, D))
state = torch.func.vmap(alg.init)(x0)
t = time.perf_counter()
ch, tr, info = fnebm.sample_chain(alg.step, state, fr.key(2), steps, compile=True, progress=False)
cold = time.perf_counter() - t
print(f"cold {cold:.1f}s", flush=True)
ts = []
for r in range(int(os.environ.get("REPEATS", 3))):
    t = time.perf_counter()
    ch, tr, info = fnebm.sample_chain(alg.step, state, fr.key(2), steps, compile=True, progress=False)
    ts.append(time.perf_counter() - t)
trips = info.num_integration_steps.max(-1).values.sum().item()
print(f"warm {statistics.median(ts):.3f}s {ts}; max-steps trips {trips}; mean steps {info.num_integration_steps.float().mean():.1f}; "
      f"per trip {statistics.median(ts)/trips*1e6:.0f} us; acc {info.acceptance_rate.mean():.3f}; checksum {tr.double().sum().item():.6f}")
