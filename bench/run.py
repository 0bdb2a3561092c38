"""fnebm side by side with its peers, in one process run.

    python bench/run.py [--quick] [--repeats N] [--json PATH] [--only W1,W1out,W2,W3,W4,W5,W6,RNG] [--fresh-cache]
                        [--reuse-freed-memory]

Workloads (fixed, so that runs compare over time):
  W1     unadjusted Langevin, 10-D double well (h=2, b=1), 10,000 chains x 100 steps, eta=0.01
         (fnebm's default backend: on the CPU the C whole-chain kernel); peers: TorchEBM
         LangevinDynamics + DoubleWellModel, a plain PyTorch eager autograd loop, JAX (jit +
         vmap(grad) + lax.scan), and fnebm's compiled runner (backend="compiled")
  W1out  W1 for fnebm alone, the trace allocated per call (as in W1) against the trace
         buffers of an earlier call passed back as sample_chain(out=...)
  W3     MALA, same target and sizes; peers: BlackJAX mala (jit + vmap + lax.scan), and fnebm's
         compiled runner (backend="compiled")
  W4     CD-10 training: 10 training steps of an MLP energy 2-128-128-1 (SiLU; fnebm train's model:
         no output bias, + 0.01 |x|^2 / 2), batch 1,024 of eight Gaussians (the same batches for
         both), negatives from 10 unadjusted Langevin steps started at the data (step 0.01, noise
         scale 0.1: x - h grad E + 0.1 sqrt(2h) xi), no energy regulariser, Adam lr 1e-3; both start
         from the same weights and every call trains from them again. fnebm:
         losses.contrastive_divergence under torch.func.grad_and_value plus Adam as tree_maps,
         one torch.compile(fullgraph=True) step called 10 times; peer: TorchEBM
         ContrastiveDivergence + LangevinDynamics + torch.optim.Adam, eager (loss.backward(),
         opt.step()); variant row: fnebm's same step run eagerly (what a short run would use).
         --quick: batch 256, k = 3, 5 steps. The model both reach after 2,000 steps:
         bench/w4_quality.py (slow; not part of this run).
  W5     MALA, 10-D Gaussian with diagonal precision (1, 2, ..., 10), mean 0: a sweep over 16
         step sizes (10**-3 .. 10**-0.5, log-spaced) x 1,024 chains x 200 steps in one call,
         per-chain step sizes. fnebm: one fnebm.mala(target, step_sizes) over 16,384 chains
         (flat, each step size repeated 1,024 times) and, as a variant, over chain axes
         (16, 1024) with step sizes (16,) and chain_ndim=2; peer: BlackJAX mala with
         jax.vmap over step sizes and chains in jit + lax.scan. Also "sweep": a run with
         new step-size values (fnebm: a new sampler; BlackJAX: the same jitted function,
         the step sizes a traced argument), which must not compile again.
  W2     HMC, 100-D Gaussian with diagonal covariance (scales 0.1 .. 1, linearly spaced),
         1,000 chains x 50 iterations x 10 leapfrog steps, eps = 0.05, identity mass matrix;
         peers: BlackJAX hmc (jit + vmap + lax.scan), TorchEBM HamiltonianMonteCarlo +
         GaussianModel (its Gaussian: a dense precision matrix)
  W6     NUTS with window adaptation (500 warm-up + 1,000 draws), 50-D correlated Gaussian
         (AR(1) covariance 0.9**|i-j|, mean 0, float32), 64 chains started at the same standard normal
         draws, initial step size 50**-0.25 (fnebm's default), diagonal mass matrix, target
         acceptance 0.8, max tree depth 10. Adaptation per chain in both (BlackJAX's
         window_adaptation is one chain's: jax.vmap of warmup.run over the chains; fnebm:
         window_adaptation(..., pooled=False)), then nuts with each chain's parameters; each
         call does warm-up + draws (one jit for BlackJAX; two compiled calls for fnebm).
         The target: BlackJAX's log density -0.5 x.P.x with the dense precision P (the inverse
         covariance); fnebm's row fnebm.energies.Gaussian(0, L) with L the Cholesky factor of P
         (energy 0.5 |L^T x|^2, the same density; fnebm.nuts then runs each transition in its C
         kernel, each chain building its own tree); variant rows: the same with compile="auto"
         (sample_chain's default: here it runs the warm-up and the draws eagerly, around the C
         kernel) instead of compile=True, and fnebm with the energy as the plain function
         0.5 x.P.x, which the torch kernel runs (every chain in lockstep).
         Reported besides the times: min over the 50 coordinates of the bulk ESS
         (fnebm.diagnostics.ess_bulk of the (draws, chains, dim) draws), and ESS/s with compile
         excluded (min ESS / warm time) and included (min ESS / cold time). --quick: 50 warm-up
         + 100 draws, 8 chains.
  RNG    10**6 standard normals: fnebm.random.normal compiled vs torch.randn

Every implementation keeps the whole trajectory (draws x chains x dim), as a sampler's user
would. Method (the machine is noisy): each implementation's first call is timed alone (cold,
compilation included: the time to first result); then the warm calls are interleaved round
by round (fnebm, peer 1, peer 2, ..., fnebm, peer 1, ...) for --repeats rounds. warm = the
median of an implementation's warm calls; ratio = the median over rounds of (peer time in
round r / fnebm time in round r) (> 1: fnebm is faster).
fnebm's cold time depends on Inductor's on-disk cache: by default the machine's cache is used
(a second process reuses the compiled graphs); --fresh-cache points Inductor at an empty
directory, which gives the cold time of a first run ever.
Peers are optional (`pip install -e .[bench]`); a missing one is reported, not fatal.
"""

from __future__ import annotations

import argparse
import gc
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
W5_PRECISION = [float(i) for i in range(1, DIM + 1)]  # diagonal precision of W5's Gaussian (mean 0)


class Missing(Exception):
    """A peer that is not installed."""


class Bench:
    """One implementation of a workload: ``run()`` does the timed work; ``sweep()`` (optional)
    does it with new parameter values on every call; ``compiles()`` (optional) counts the
    compilations so far, to check that a sweep compiled nothing."""

    def __init__(self, run: Callable[[], object], sweep: Callable[[], object] | None = None,
                 compiles: Callable[[], int] | None = None):
        self.run, self.sweep, self.compiles = run, sweep, compiles


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ----------------------------------------------------------------------------- fnebm


def fnebm_chain(make_alg, chains, steps, out=False, backend="auto"):
    # backend "auto" is what a user gets: on the CPU, Langevin and MALA on the double well run in
    # the C whole-chain kernel (fnebm.kernels.cpu_chain)
    alg = make_alg(energies.double_well(H, B))
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(0), (chains, DIM)))
    key = fr.key(1)
    kw = dict(compile=True, progress=False, backend=backend)
    if not out:
        return lambda: fnebm.sample_chain(alg.step, state, key, steps, **kw)[1]
    _, trace, info = fnebm.sample_chain(alg.step, state, key, steps, **kw)
    bufs = (trace, info)  # the buffers of an earlier call, filled in place from now on
    return lambda: fnebm.sample_chain(alg.step, state, key, steps, out=bufs, **kw)[1]


def fnebm_langevin(chains, steps):
    return fnebm_chain(lambda e: fnebm.langevin(e, ETA), chains, steps)


def fnebm_langevin_compiled(chains, steps):
    # the compiled runner (torch.compile/Inductor), which served W1 before the C kernel
    return fnebm_chain(lambda e: fnebm.langevin(e, ETA), chains, steps, backend="compiled")


def fnebm_langevin_out(chains, steps):
    return fnebm_chain(lambda e: fnebm.langevin(e, ETA), chains, steps, out=True)


def fnebm_mala(chains, steps):
    return fnebm_chain(lambda e: fnebm.mala(e, ETA), chains, steps)


def fnebm_mala_compiled(chains, steps):
    return fnebm_chain(lambda e: fnebm.mala(e, ETA), chains, steps, backend="compiled")


def _w5_step_sizes(n_sizes: int, sweep: int = 0) -> torch.Tensor:
    """W5's step sizes, 10**-3 .. 10**-0.5 log-spaced; sweep i > 0 scales them by 1 + i/100 (new values)."""
    return torch.logspace(-3, -0.5, n_sizes) * (1 + sweep / 100)


def _fnebm_sweep(sizes, chains, steps, flat):
    target = energies.gaussian(torch.zeros(DIM), precision=torch.tensor(W5_PRECISION))
    x0 = fr.normal(fr.key(0), (sizes, chains, DIM))
    key = fr.key(1)

    def per_chain(h):  # flat: one step size per chain of 16,384; else one per row of (16, 1024)
        return h.repeat_interleave(chains) if flat else h

    alg = fnebm.mala(target, per_chain(_w5_step_sizes(sizes)))
    if flat:
        state, ndim = torch.func.vmap(alg.init)(x0.reshape(sizes * chains, DIM)), 1
    else:
        state, ndim = torch.func.vmap(torch.func.vmap(alg.init))(x0), 2

    def run():
        return fnebm.sample_chain(alg.step, state, key, steps, compile=True, progress=False, chain_ndim=ndim)[1]

    n_sweeps = 0

    def sweep():  # a new sampler, new step-size values of the same shape
        nonlocal n_sweeps
        n_sweeps += 1
        new = fnebm.mala(target, per_chain(_w5_step_sizes(sizes, n_sweeps)))
        return fnebm.sample_chain(new.step, state, key, steps, compile=True, progress=False, chain_ndim=ndim)[1]

    return Bench(run, sweep, _dynamo_graphs)


def fnebm_mala_sweep_flat(sizes, chains, steps):
    return _fnebm_sweep(sizes, chains, steps, flat=True)


def fnebm_mala_sweep_2axes(sizes, chains, steps):
    return _fnebm_sweep(sizes, chains, steps, flat=False)


W2_DIM, W2_EPS, W2_LEAPFROG = 100, 0.05, 10


def _w2_scales():
    return torch.linspace(0.1, 1.0, W2_DIM)


def _w2_energy(precision, x):
    return 0.5 * (precision * x * x).sum()


def fnebm_hmc(chains, steps):
    import functools

    energy = functools.partial(_w2_energy, 1.0 / _w2_scales() ** 2)
    alg = fnebm.hmc(energy, W2_EPS, None, W2_LEAPFROG)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(0), (chains, W2_DIM)))
    key = fr.key(1)
    return lambda: fnebm.sample_chain(alg.step, state, key, steps, compile=True, progress=False)[1]


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


def torchebm_hmc(chains, steps):
    try:
        from torchebm.core import GaussianModel
        from torchebm.samplers import HamiltonianMonteCarlo
    except ImportError as e:
        raise Missing(f"torchebm ({e.name})") from None
    model = GaussianModel(torch.zeros(W2_DIM), torch.diag(_w2_scales() ** 2))
    sampler = HamiltonianMonteCarlo(model, step_size=W2_EPS, n_leapfrog_steps=W2_LEAPFROG)
    x0 = torch.randn(chains, W2_DIM)

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


def _blackjax():
    try:
        import blackjax
    except ImportError as e:
        raise Missing(f"blackjax ({e.name})") from None
    return blackjax


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
    blackjax = _blackjax()
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


def blackjax_hmc(chains, steps):
    jax, jnp = _jax()
    blackjax = _blackjax()
    precision = jnp.asarray((1.0 / _w2_scales() ** 2).numpy())
    alg = blackjax.hmc(lambda x: -0.5 * jnp.sum(precision * x * x), W2_EPS, jnp.ones(W2_DIM), W2_LEAPFROG)

    @jax.jit
    def chain(key, x0):
        states = jax.vmap(alg.init)(x0)

        def body(s, k):
            s, _ = jax.vmap(alg.step)(jax.random.split(k, chains), s)
            return s, s.position

        return jax.lax.scan(body, states, jax.random.split(key, steps))[1]

    key = jax.random.key(0)
    x0 = jax.random.normal(jax.random.key(1), (chains, W2_DIM))
    return lambda: chain(key, x0).block_until_ready()


def blackjax_mala_sweep(sizes, chains, steps):
    jax, jnp = _jax()
    blackjax = _blackjax()
    precision = jnp.asarray(W5_PRECISION, dtype=jnp.float32)

    def logdensity(x):
        return -0.5 * jnp.sum(precision * x * x)

    kernel = blackjax.mala.build_kernel()

    def one(k, s, h):  # one chain, step size h
        return kernel(k, s, logdensity, h)[0]

    step = jax.vmap(jax.vmap(one, in_axes=(0, 0, None)), in_axes=(0, 0, 0))  # step sizes, then chains

    @jax.jit
    def chain(key, x0, hs):  # hs: (sizes,), traced: new values reuse the compiled function
        states = jax.vmap(jax.vmap(lambda x: blackjax.mala.init(x, logdensity)))(x0)

        def body(s, k):
            s = step(jax.random.split(k, (sizes, chains)), s, hs)
            return s, s.position

        return jax.lax.scan(body, states, jax.random.split(key, steps))[1]

    key = jax.random.key(0)
    x0 = jax.random.normal(jax.random.key(1), (sizes, chains, DIM))
    hs = jnp.asarray(_w5_step_sizes(sizes).numpy())
    n_sweeps = 0

    def sweep():
        nonlocal n_sweeps
        n_sweeps += 1
        return chain(key, x0, jnp.asarray(_w5_step_sizes(sizes, n_sweeps).numpy())).block_until_ready()

    return Bench(lambda: chain(key, x0, hs).block_until_ready(), sweep, chain._cache_size)


# ----------------------------------------------------------------------------- W6: NUTS + window adaptation

W6_DIM, W6_RHO = 50, 0.9
W6_STEP_SIZE = W6_DIM ** -0.25  # both start the warm-up here (fnebm's default)


def _w6_precision() -> torch.Tensor:
    """The inverse of the AR(1) covariance 0.9**|i-j| (50 x 50), computed in float64, float32."""
    i = torch.arange(W6_DIM, dtype=torch.float64)
    return torch.linalg.inv(W6_RHO ** (i[:, None] - i[None, :]).abs()).float()


def _w6_start(chains: int) -> torch.Tensor:
    return fr.normal(fr.key(0), (chains, W6_DIM))


def _w6_energy(precision, x):
    return 0.5 * (x @ (precision @ x))


def _w6_gaussian():
    """The W6 target as fnebm.energies.Gaussian: mean 0 and the lower Cholesky factor of P (float64, then float32)."""
    tril = torch.linalg.cholesky(_w6_precision().double()).float()
    return fnebm.energies.Gaussian(torch.zeros(W6_DIM), tril)


def _fnebm_nuts_window(energy, chains, warmup, draws, compile=True):
    # its own cache of compiled graphs: "auto" would otherwise reuse the graphs another row compiled
    cache = fnebm.chain.RunnerCache()
    x0 = _w6_start(chains)
    k_warm, k_draw = fr.key(1), fr.key(2)
    adapt = fnebm.window_adaptation(fnebm.nuts, energy, warmup, pooled=False, target_acceptance_rate=0.8,
                                    is_mass_matrix_diagonal=True, initial_step_size=W6_STEP_SIZE)

    def run():
        state, parameters, _ = adapt.run(x0, k_warm, compile=compile, cache=cache)
        alg = fnebm.nuts(energy, **parameters)
        return fnebm.sample_chain(alg.step, state, k_draw, draws, compile=compile, progress=False,
                                  cache=cache)[1]  # (draws, chains, d)

    return run


def fnebm_nuts_window(chains, warmup, draws):
    """fnebm.energies.Gaussian: fnebm.nuts runs each transition in its C kernel (each chain its own tree)."""
    return _fnebm_nuts_window(_w6_gaussian(), chains, warmup, draws)


def fnebm_nuts_window_auto(chains, warmup, draws):
    """As fnebm_nuts_window with compile="auto" (sample_chain's default): it runs eagerly here, as
    the steps are fast enough that a compile would not pay for itself."""
    return _fnebm_nuts_window(_w6_gaussian(), chains, warmup, draws, compile="auto")


def fnebm_nuts_window_custom(chains, warmup, draws):
    """The energy as a plain function 0.5 x.P.x: the torch kernel (all chains in lockstep, compiled)."""
    import functools

    return _fnebm_nuts_window(functools.partial(_w6_energy, _w6_precision()), chains, warmup, draws)


def blackjax_nuts_window(chains, warmup, draws):
    jax, jnp = _jax()
    blackjax = _blackjax()
    precision = jnp.asarray(_w6_precision().numpy())

    def logdensity(x):
        return -0.5 * (x @ (precision @ x))

    adapt = blackjax.window_adaptation(blackjax.nuts, logdensity, is_mass_matrix_diagonal=True,
                                       initial_step_size=W6_STEP_SIZE, target_acceptance_rate=0.8)
    kernel = blackjax.nuts.build_kernel()

    @jax.jit
    def chain(key, x0):
        k_warm, k_draw = jax.random.split(key)

        def warm_one(k, x):  # one chain's warm-up: BlackJAX's window_adaptation is per chain
            (state, parameters), _ = adapt.run(k, x, num_steps=warmup)
            return state, parameters

        states, parameters = jax.vmap(warm_one)(jax.random.split(k_warm, chains), x0)

        def step_one(k, s, p):
            return kernel(k, s, logdensity, p["step_size"], p["inverse_mass_matrix"])[0]

        def body(s, k):
            s = jax.vmap(step_one)(jax.random.split(k, chains), s, parameters)
            return s, s.position

        return jax.lax.scan(body, states, jax.random.split(k_draw, draws))[1]  # (draws, chains, d)

    key = jax.random.key(3)
    x0 = jnp.asarray(_w6_start(chains).numpy())
    return lambda: chain(key, x0).block_until_ready()


def _min_ess_bulk(trace) -> float:
    """Min over coordinates of the bulk ESS of a (draws, chains, dim) trace (torch or JAX)."""
    import numpy as np

    if not isinstance(trace, torch.Tensor):
        trace = torch.from_numpy(np.array(trace))  # a writable copy
    return float(fnebm.diagnostics.ess_bulk(trace.float(), layout="draws_chains").min())


# ----------------------------------------------------------------------------- W4: CD training
#
# The model is `fnebm train`'s (fnebm.cli.train_model.mlp_energy): an MLP 2-128-128-1 with SiLU, no
# output bias, plus 0.01 |x|^2 / 2; both sides start from the same weights (mlp_init(key(0))),
# train on the same batches and take the same number of sampler and optimiser steps.

W4_HIDDEN, W4_ETA, W4_NOISE, W4_LR = 128, 0.01, 0.1, 1e-3
W4_ADAM = (0.9, 0.999, 1e-8)  # torch.optim.Adam's defaults


def w4_params() -> dict[str, torch.Tensor]:
    """The initial weights, as fnebm train draws them (PyTorch's nn.Linear init, from key(0))."""
    from fnebm.cli.train_model import mlp_init

    return mlp_init(fr.key(0), W4_HIDDEN, torch.float32)


def w4_batches(batch: int, steps: int, seed: int = 1) -> torch.Tensor:
    """``steps`` batches of eight Gaussians, ``(steps, batch, 2)``; batch t from ``fold_in(key(seed), t)``."""
    from fnebm import datasets

    return torch.stack([datasets.eight_gaussians(fr.fold_in(fr.key(seed), t), batch) for t in range(steps)])


def w4_adam_init(params):
    """Adam's state ``(m, v, b1**t, b2**t)``; the powers are (1,) tensors (a 0-dim CPU float input
    is read as a Python scalar by Dynamo, which then restarts its analysis: docs/training.md)."""
    from torch.utils import _pytree as pytree

    zeros = lambda: pytree.tree_map(torch.zeros_like, params)  # noqa: E731
    return zeros(), zeros(), torch.ones(1), torch.ones(1)


def w4_adam(params, grads, state, lr=W4_LR):
    """One Adam step as ``tree_map``s, torch.optim.Adam's arithmetic (bias-corrected moments, eps outside the root)."""
    from torch.utils import _pytree as pytree

    b1, b2, eps = W4_ADAM
    m, v, p1, p2 = state
    m = pytree.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = pytree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    p1, p2 = p1 * b1, p2 * b2
    params = pytree.tree_map(lambda p, m, v: p - lr * (m / (1 - p1)) / ((v / (1 - p2)).sqrt() + eps),
                             params, m, v)
    return params, (m, v, p1, p2)


_W4_STEPS: dict[tuple[int, bool], Callable] = {}


def w4_fnebm_step(k: int, compiled: bool = True) -> Callable:
    """fnebm's CD-k training step ``(energy, opt_state, batch, key) -> (energy, opt_state, loss)``:
    ``torch.func.grad_and_value`` of ``losses.contrastive_divergence`` (chains from the data,
    ``k`` Langevin steps, step 0.01, noise scale 0.1) and Adam, compiled once per process as one
    ``fullgraph`` graph (the sampler's steps unrolled: docs/training.md); ``compiled=False``: eager."""
    if (k, compiled) not in _W4_STEPS:
        from fnebm import losses

        def sampler(energy):
            return fnebm.langevin(energy, W4_ETA, W4_NOISE)

        def cd(energy, batch, key):
            return losses.contrastive_divergence(energy, batch, key, sampler=sampler, n_steps=k, init="data")

        def train_step(energy, opt_state, batch, key):
            grads, (loss, _) = torch.func.grad_and_value(cd, has_aux=True)(energy, batch, key)
            energy, opt_state = w4_adam(energy, grads, opt_state)
            return energy, opt_state, loss

        _W4_STEPS[k, compiled] = torch.compile(train_step, fullgraph=True) if compiled else train_step
    return _W4_STEPS[k, compiled]


def fnebm_cd(batch, k, steps, compiled=True):
    from fnebm.cli.train_model import mlp_energy

    energy0 = energies.bind(mlp_energy, w4_params())
    batches = w4_batches(batch, steps)
    keys = torch.stack([fr.fold_in(fr.key(2), t) for t in range(steps)])
    step = w4_fnebm_step(k, compiled)

    def run():  # `steps` training steps from the initial weights (a pure function: every call the same)
        energy, opt_state, values = energy0, w4_adam_init(energy0), []
        for t in range(steps):
            energy, opt_state, loss = step(energy, opt_state, batches[t], keys[t])
            values.append(loss)
        return torch.stack(values)

    return run


def fnebm_cd_eager(batch, k, steps):
    return fnebm_cd(batch, k, steps, compiled=False)


def w4_torchebm_model(params: dict[str, torch.Tensor]):
    """fnebm train's energy as a TorchEBM ``BaseModel`` (``nn.Linear`` layers) holding a copy of ``params``."""
    try:
        from torchebm.core import BaseModel
    except ImportError as e:
        raise Missing(f"torchebm ({e.name})") from None
    from fnebm.cli.train_options import TETHER

    class MLPEnergy(BaseModel):
        def __init__(self):
            super().__init__()
            h = params["w1"].shape[0]
            self.l0, self.l1 = torch.nn.Linear(2, h), torch.nn.Linear(h, h)
            self.l2 = torch.nn.Linear(h, 1, bias=False)
            with torch.no_grad():
                for layer, w, b in ((self.l0, "w0", "b0"), (self.l1, "w1", "b1"), (self.l2, "w2", None)):
                    layer.weight.copy_(params[w].T)
                    if b is not None:
                        layer.bias.copy_(params[b])

        def forward(self, x):  # (n, 2) -> (n,)
            h = torch.nn.functional.silu(self.l0(x))
            h = torch.nn.functional.silu(self.l1(h))
            return self.l2(h).squeeze(-1) + (0.5 * TETHER) * (x * x).sum(-1)

    return MLPEnergy()


def w4_torchebm_params(model) -> dict[str, torch.Tensor]:
    """The weights of a :func:`w4_torchebm_model` as fnebm train's parameter dict (to evaluate it the same way)."""
    return {"w0": model.l0.weight.detach().T.contiguous(), "b0": model.l0.bias.detach().clone(),
            "w1": model.l1.weight.detach().T.contiguous(), "b1": model.l1.bias.detach().clone(),
            "w2": model.l2.weight.detach().T.contiguous()}


def w4_torchebm_trainer(model, k):
    """TorchEBM's CD-k: ``ContrastiveDivergence`` (chains from the data, as fnebm's ``init="data"``;
    its energy regulariser, 0.001 by default, set to 0 like fnebm's ``alpha``) with
    ``LangevinDynamics(step_size=0.01, noise_scale=0.1)`` (its Euler-Maruyama update
    ``x - h grad E + noise_scale sqrt(2 h) xi`` is fnebm.langevin's), and ``torch.optim.Adam``."""
    from torchebm.losses import ContrastiveDivergence
    from torchebm.samplers import LangevinDynamics

    sampler = LangevinDynamics(model, step_size=W4_ETA, noise_scale=W4_NOISE)
    loss_fn = ContrastiveDivergence(model, sampler, k_steps=k, energy_reg_weight=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=W4_LR, betas=W4_ADAM[:2], eps=W4_ADAM[2])

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss, _ = loss_fn(batch)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def torchebm_cd(batch, k, steps):
    model = w4_torchebm_model(w4_params())
    initial = {n: t.clone() for n, t in model.state_dict().items()}
    batches = w4_batches(batch, steps)
    torch.manual_seed(0)  # TorchEBM draws its noise from the global generator

    def run():  # `steps` training steps from the initial weights and a fresh Adam, like fnebm's call
        model.load_state_dict(initial)
        step = w4_torchebm_trainer(model, k)
        return torch.stack([step(batches[t]) for t in range(steps)])

    return run


# ----------------------------------------------------------------------------- RNG


def fnebm_normal(n):
    draw = torch.compile(lambda k: fr.normal(k, (n,)), fullgraph=True)
    key = fr.key(0)
    return lambda: draw(key)


def torch_randn(n):
    return lambda: torch.randn(n)


# ----------------------------------------------------------------------------- driver

WORKLOADS = {
    "W1": dict(
        title="unadjusted Langevin, 10-D double well, {chains} chains x {steps} steps",
        ours=("fnebm", fnebm_langevin),
        peers=[("TorchEBM 0.8", torchebm_langevin), ("PyTorch eager", torch_eager_langevin), ("JAX", jax_langevin),
               ("fnebm compiled runner", fnebm_langevin_compiled)],
        full=dict(chains=10_000, steps=100),
        quick=dict(chains=1_000, steps=20),
    ),
    "W1out": dict(
        title="W1, fnebm alone: trace buffers reused via out= vs a new trace per call",
        ours=("fnebm out= (reused)", fnebm_langevin_out),
        peers=[("fnebm new trace", fnebm_langevin)],
        full=dict(chains=10_000, steps=100),
        quick=dict(chains=1_000, steps=20),
    ),
    "W3": dict(
        title="MALA, 10-D double well, {chains} chains x {steps} steps",
        ours=("fnebm", fnebm_mala),
        peers=[("BlackJAX", blackjax_mala), ("fnebm compiled runner", fnebm_mala_compiled)],
        full=dict(chains=10_000, steps=100),
        quick=dict(chains=1_000, steps=20),
    ),
    "W2": dict(
        title="HMC, 100-D diagonal Gaussian (scales 0.1..1), {chains} chains x {steps} iterations x 10 leapfrog steps",
        ours=("fnebm", fnebm_hmc),
        peers=[("BlackJAX", blackjax_hmc), ("TorchEBM 0.8", torchebm_hmc)],
        full=dict(chains=1_000, steps=50),
        quick=dict(chains=100, steps=10),
    ),
    "W5": dict(
        title="MALA step-size sweep, 10-D Gaussian (diagonal precision 1..10), {sizes} step sizes x {chains} chains x {steps} steps",
        ours=("fnebm (flat chains)", fnebm_mala_sweep_flat),
        peers=[("BlackJAX", blackjax_mala_sweep), ("fnebm (2 chain axes)", fnebm_mala_sweep_2axes)],
        full=dict(sizes=16, chains=1_024, steps=200),
        quick=dict(sizes=16, chains=64, steps=20),
    ),
    "W4": dict(
        title="{steps} CD-{k} training steps, MLP 2-128-128-1 (SiLU), batch {batch}, Langevin 0.01 / noise 0.1, Adam",
        ours=("fnebm", fnebm_cd),
        peers=[("TorchEBM 0.8", torchebm_cd), ("fnebm eager (no compile)", fnebm_cd_eager)],
        full=dict(batch=1_024, k=10, steps=10),
        quick=dict(batch=256, k=3, steps=5),
    ),
    "W6": dict(
        title="NUTS + window adaptation, 50-D AR(1) Gaussian (rho 0.9), {chains} chains, {warmup} warm-up + {draws} draws",
        ours=("fnebm", fnebm_nuts_window),
        peers=[("BlackJAX", blackjax_nuts_window), ("fnebm, compile=\"auto\"", fnebm_nuts_window_auto),
               ("fnebm, energy as a function", fnebm_nuts_window_custom)],
        full=dict(chains=64, warmup=500, draws=1_000),
        quick=dict(chains=8, warmup=50, draws=100),
        ess=True,  # run() returns the (draws, chains, dim) trace; rows get min bulk ESS and ESS/s
    ),
    "RNG": dict(
        title="{n} standard normals (float32)",
        ours=("fnebm", fnebm_normal),
        peers=[("torch.randn", torch_randn)],
        full=dict(n=10**6),
        quick=dict(n=10**6),
    ),
}


def _pairs(mine: list[float], ours: list[float]) -> tuple[float, float]:
    """Median over rounds of mine[r] / ours[r], and of mine[r] - ours[r]."""
    return (statistics.median(m / o for m, o in zip(mine, ours)),
            statistics.median(m - o for m, o in zip(mine, ours)))


def run_workload(name, spec, quick, repeats):
    size = spec["quick" if quick else "full"]
    rows, benches = [], []
    for label, make in [spec["ours"], *spec["peers"]]:
        row = dict(workload=name, impl=label)
        try:
            b = make(**size)
            benches.append(b if isinstance(b, Bench) else Bench(b))
        except Missing as e:
            row["missing"] = str(e)
            benches.append(None)
        rows.append(row)
    live = [(row, b) for row, b in zip(rows, benches) if b is not None]
    # cold: each implementation's first call, alone (compilation included)
    for row, b in live:
        if spec.get("ess"):  # the draws of the first call (the same key every call: the same draws)
            t0 = time.perf_counter()
            trace = b.run()
            row["cold_s"] = time.perf_counter() - t0
            row["ess_min"] = _min_ess_bulk(trace)
            del trace
        else:
            row["cold_s"] = _time(b.run)
    # second sweep: the first call with new parameter values, and whether it compiled
    for row, b in live:
        if b.sweep is not None:
            before = b.compiles() if b.compiles else None
            row["sweep_first_s"] = _time(b.sweep)
            if before is not None:
                row["sweep_compiled"] = b.compiles() != before
    # warm: round-robin, one call of each implementation per round (A B A B)
    warm = {id(b): [] for _, b in live}
    sweeps = {id(b): [] for _, b in live if b.sweep is not None}
    for _ in range(repeats):
        gc.collect()
        for _, b in live:
            warm[id(b)].append(_time(b.run))
        for _, b in live:
            if b.sweep is not None:
                sweeps[id(b)].append(_time(b.sweep))
    ours = warm[id(benches[0])] if benches[0] is not None else None
    ours_sweep = sweeps.get(id(benches[0])) if benches[0] is not None else None
    for row, b in live:
        row["warm_s"] = statistics.median(warm[id(b)])
        row["warm_all_s"] = warm[id(b)]
        if "ess_min" in row:
            row["ess_per_s_warm"] = row["ess_min"] / row["warm_s"]
            row["ess_per_s_cold"] = row["ess_min"] / row["cold_s"]
        if ours:
            row["ratio"], row["delta_s"] = _pairs(warm[id(b)], ours)
        if id(b) in sweeps:
            row["sweep_s"] = statistics.median(sweeps[id(b)])
            row["sweep_all_s"] = sweeps[id(b)]
            if ours_sweep:
                row["sweep_ratio"], _ = _pairs(sweeps[id(b)], ours_sweep)
            if b.compiles:
                row["sweep_compiled"] = row.get("sweep_compiled", False)
    return spec["title"].format(**size), rows


def _fmt(row, sweep):
    if "missing" in row:
        return f"  {row['impl']:<24} {'missing: ' + row['missing']}"
    line = f"  {row['impl']:<24} {row['cold_s']:>9.3f} {row['warm_s'] * 1e3:>11.2f} {row['ratio']:>10.2f}x"
    if sweep and "sweep_s" in row:
        compiled = {True: "COMPILED", False: "no"}.get(row.get("sweep_compiled"), "?")
        line += (f" {row['sweep_first_s'] * 1e3:>12.2f} {row['sweep_s'] * 1e3:>11.2f} "
                 f"{row['sweep_ratio']:>9.2f}x  {compiled}")
    return line


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _vec_isa() -> str:
    """The vector ISA Inductor compiles CPU code for ("avx2", "avx512", ...; "" if none: scalar code).

    Inductor decides it by compiling a probe and loading it in a child Python; if that child
    fails (e.g. a file in the script's directory shadows a module the child imports: the child
    gets the parent's sys.path), every kernel silently comes out scalar, several times slower.
    """
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        return str(pick_vec_isa())
    except Exception as e:  # an Inductor without this module: say so rather than fail the run
        return f"unknown ({type(e).__name__})"


def main(argv=None):
    parser = argparse.ArgumentParser(description="fnebm vs TorchEBM, PyTorch and JAX/BlackJAX, side by side")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--repeats", type=int, default=11, help="warm rounds (each implementation once per round)")
    parser.add_argument(
        "--json", default=None, help="where to write the table as JSON (default: bench/results.json, or bench/results-quick.json with --quick)"
    )
    parser.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads")
    parser.add_argument("--fresh-cache", action="store_true", help="compile into an empty Inductor cache")
    parser.add_argument("--reuse-freed-memory", action="store_true",
                        help="call fnebm.reuse_freed_memory() first: freed blocks up to 1 GiB stay mapped in "
                             "this process, for every implementation (the peers included), so a new trace "
                             "finds its pages mapped")
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
        load_before=_load(),
        inductor_vec_isa=_vec_isa(),
        reuse_freed_memory=fnebm.reuse_freed_memory() if args.reuse_freed_memory else False,
    )
    for mod in ("jax", "blackjax", "torchebm"):
        try:
            machine[mod] = __import__(mod).__version__
        except (ImportError, AttributeError):
            machine[mod] = None
    print(f"torch {machine['torch']}, {machine['threads']} threads, {machine['cores']} cores, "
          f"Inductor ISA {machine['inductor_vec_isa'] or 'none'}, load {machine['load_before']}; "
          f"{args.repeats} warm rounds, interleaved"
          + ("; freed memory reused (fnebm.reuse_freed_memory, every row)" if machine["reuse_freed_memory"] else ""))
    if machine["inductor_vec_isa"] in ("", "INVALID_VEC_ISA"):
        print("warning: Inductor found no usable vector ISA: fnebm's compiled CPU code will be scalar "
              "and the figures will not represent it")
    if machine["load_before"] and machine["load_before"][0] > 0.5:
        print("warning: the machine is busy (1-minute load average > 0.5): compiled torch code on "
              "every core suffers most from a competing process; the figures will be noisy")
    results = []
    for name in names:
        title, rows = run_workload(name, WORKLOADS[name], args.quick, args.repeats)
        sweep = any("sweep_s" in row for row in rows)
        first = rows[0]["impl"]
        print(f"\n{name}: {title}")
        header = f"  {'impl':<24} {'cold (s)':>9} {'warm (ms)':>11} {'ratio':>11}"
        if sweep:
            header += f" {'sweep 1 (ms)':>12} {'sweep (ms)':>11} {'sweep x':>10}  compiled"
        print(header)
        for row in rows:
            print(_fmt(row, sweep))
        print(f"  ratio: median over rounds of (row's time / {first}'s time in the same round)")
        if any("ess_min" in row for row in rows):
            print(f"  {'impl':<24} {'min ESS':>9} {'ESS/s warm':>11} {'ESS/s cold':>11} {'ESS/s ratio':>12}")
            ours_rate = rows[0].get("ess_per_s_warm")
            for row in rows:
                if "ess_min" in row:
                    vs = f"{ours_rate / row['ess_per_s_warm']:>11.2f}x" if ours_rate else ""
                    print(f"  {row['impl']:<24} {row['ess_min']:>9.0f} {row['ess_per_s_warm']:>11.1f} "
                          f"{row['ess_per_s_cold']:>11.1f} {vs}")
            print("  min ESS: min over coordinates of the bulk ESS of the draws; ESS/s warm = min ESS / warm "
                  "(compile excluded), cold = min ESS / cold (compile included); ESS/s ratio = "
                  f"{first}'s ESS/s warm / the row's (> 1: {first} better)")
        if name == "W1out" and "delta_s" in rows[-1]:
            print(f"  out= saves {rows[-1]['delta_s'] * 1e3:.2f} ms per call (median of per-round differences)")
        results.append(dict(workload=name, title=title, rows=rows))
    machine["load_after"] = _load()
    print(f"\nload average after: {machine['load_after']}")
    if args.json:
        tmp = args.json + ".tmp"
        method = ("cold: each implementation's first call alone; warm: --repeats rounds, one call of "
                  "each implementation per round in table order; ratio: median over rounds of "
                  "(this row's time / the first row's time) in the same round")
        with open(tmp, "w") as f:
            json.dump(dict(machine=machine, quick=args.quick, repeats=args.repeats, method=method,
                           results=results), f, indent=2)
            f.write("\n")
        os.replace(tmp, args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
