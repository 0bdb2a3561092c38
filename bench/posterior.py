"""User log densities written as plain functions: NUTS with window adaptation and MALA, fnebm against BlackJAX.

    python bench/posterior.py [--only logreg,schools,gauss100,mala] [--repeats N] [--rounds N]
                              [--json PATH] [--fnebm-compile {default,auto,true,false}]
                              [--fnebm-tree PATH] [--timeout S] [--calls N] [--quick] [--device cpu|cuda]

Issue 26, goal 3 (measured here, not optimised): first result <= 2x BlackJAX's first call, warm
ESS per second >= BlackJAX's. Every target is a plain function of one position vector, float32,
the same data and the same starting points on both sides (numpy, fixed seeds):

  logreg    Bayesian logistic regression, 1,000 rows x 25 coefficients (X ~ N(0, 1), true
            coefficients ~ N(0, 0.5^2), y ~ Bernoulli(sigmoid(X b)), numpy seed 0), prior N(0, 1):
            energy sum(softplus(X b) - y X b) + |b|^2 / 2
  schools   eight schools, non-centred, 10-D (mu, log tau, 8 theta_tilde): mu ~ N(0, 5),
            tau ~ HalfCauchy(5) (with the log-tau Jacobian), theta_tilde ~ N(0, 1),
            y_j ~ N(mu + tau theta_tilde_j, sigma_j), the standard data
  gauss100  a 100-D Gaussian, covariance D R D with R the AR(1) correlation 0.9^|i-j| and D
            scales log-spaced 0.1 .. 10: energy 0.5 x.P.x with the dense precision P
            (computed in float64, stored float32)
  NUTS on these three: 4 chains started at the same N(0, 1) draws (numpy seed 1), 1,000 warm-up
  iterations of window adaptation (Stan's windows, diagonal mass matrix, target acceptance 0.8)
  + 1,000 draws, max tree depth 10. Both libraries' defaults are these (target 0.8 for NUTS,
  depth 10, diagonal), except where they differ by design, left at each one's default:
  the initial step size (BlackJAX 1.0, fnebm d^-1/4) and pooling (BlackJAX adapts each chain on
  its own; fnebm's pooled=None pools over the 4 chains: one step size and mass matrix).
    fnebm     what its docs show a user (docs/api.md "Adaptation"):
              ``warmup = fnebm.window_adaptation(fnebm.nuts, energy, 1000)``,
              ``state, parameters, _ = warmup.run(x0, key)`` (its default compile=None: True, or,
              for NUTS in C on such an energy, eager steps whose evaluations compile as
              nuts(compile_energy=) says),
              ``fnebm.sample_chain(fnebm.nuts(energy, **parameters).step, state, key, 1000)`` (its
              defaults: compile="auto", backend="auto"). --fnebm-compile auto|true|false passes
              that compile= to both calls instead of leaving each on its default.
    blackjax  what BlackJAX's docs show for several chains: ``blackjax.window_adaptation(
              blackjax.nuts, logdensity)``, its ``run`` per chain under ``jax.vmap`` in one
              ``jax.jit``; then each chain's ``blackjax.nuts(logdensity, **parameters).step``
              in a ``jax.lax.scan``, ``jax.vmap``-ed over the chains, in a second ``jax.jit``
              (two jitted functions, so that the adaptation and the sampling time apart).
  mala      MALA on the logreg posterior: 1,024 chains x 1,000 steps, step size 2.5e-3 (x' = x - h
            grad E + sqrt(2h) xi on both sides), chains started at 0.1 N(0, 1) draws (numpy
            seed 2), every draw kept; diagnostics on the last 500.
    fnebm     ``alg = fnebm.mala(energy, 2.5e-3)``, ``torch.func.vmap(alg.init)(x0)``,
              ``fnebm.sample_chain(alg.step, state, key, 1000)`` on its defaults
    blackjax  ``blackjax.mala(logdensity, 2.5e-3)``: vmap of init and step, lax.scan, one jit
    plain     a PyTorch loop a user writes: the batched energy (X @ B.T), torch.autograd.grad,
              torch.randn with a seeded torch.Generator, the MH correction; no compile

Each call is timed from the start of the adaptation (building the warm-up included) to the draws
in hand (torch: CPU tensors; JAX: block_until_ready and a host copy). Phases:
  cold      a fresh process per implementation, empty caches: fnebm gets new
            TORCHINDUCTOR_CACHE_DIR and FNEBM_CACHE_DIR directories; JAX has no persistent cache
            (none is configured). Reported with the import excluded (the call alone) and
            included (process launch to draws in hand, interpreter start included); then the
            same call again in that process ("again", --calls 2).
  second    then one more fresh process holding every implementation of the workload, fnebm on
            the cache directories the cold process filled: its first call of each (in the order
            of that repeat) is the "second process" figure (for JAX, whose cache is in memory
            only, another cold call). In that process, after those first calls:
  warm      --rounds rounds of A B (C), the order alternating every round; medians of the
            calls and of the per-round ratios. Warm means steady state: before the rounds fnebm runs
            alone until a call announced a compile (compile="auto": a CompileNotice or an
            EnergyCompileNotice), and once more, at most 6 calls ("settle_calls" in the JSON). The draws of each implementation's last call give
            the diagnostics, all computed by fnebm.diagnostics (which matches ArviZ) on (draws,
            chains, dim): bulk ESS min and median over coordinates, ESS/s over the warm sampling
            time and over the warm adaptation + sampling time, mean integration steps
            (gradients) per transition, mean acceptance statistic, and the largest
            |mean_a - mean_b| / sqrt(mcse_a^2 + mcse_b^2) over coordinates (the posterior means
            agree within a few MCSE).
The implementations alternate (fnebm, blackjax[, plain], then the reverse order) over --repeats;
ratios are medians of per-pair (per-round) ratios, fnebm / peer: time < 1 and ESS/s > 1 mean
fnebm is faster (ESS/s ratio = ESS ratio / median per-round time ratio). Every worker runs with
OMP_WAIT_POLICY=PASSIVE; JAX on its defaults (float32, no XLA_FLAGS). --device cuda puts the torch
rows' data, starting points and keys on the GPU (synchronised before each time is read); JAX then
runs on its default platform, the GPU (XLA_PYTHON_CLIENT_PREALLOCATE=false, beside torch). A worker that runs past
--timeout seconds is stopped and reported as "> S s". The results go to
bench/results-posterior.json (or --json), with the CPU, /proc/loadavg before and after, and the
command line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

T_START = time.time()  # a worker's first moment (before its imports)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

NUTS_WORKLOADS = ("logreg", "schools", "gauss100")
ALL = NUTS_WORKLOADS + ("mala",)
CHAINS, WARMUP, DRAWS = 4, 1000, 1000
MALA_CHAINS, MALA_STEPS, MALA_STEP = 1024, 1000, 2.5e-3
MALA_KEEP = 500  # diagnostics on the last MALA_KEEP draws
MAX_SETTLE = 6  # fnebm's calls before the warm rounds, at most (see worker_warm)
DEVICE = "cpu"  # where the torch rows run (--device); JAX runs on its default platform for that device
IMPLS = {"logreg": ("fnebm", "blackjax"), "schools": ("fnebm", "blackjax"),
         "gauss100": ("fnebm", "blackjax"), "mala": ("fnebm", "blackjax", "plain")}

# ----------------------------------------------------------------------------- data (numpy)

SCHOOLS_Y = [28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0]
SCHOOLS_SIGMA = [15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0]


def data(workload: str) -> dict:
    """The workload's data and starting points, numpy float32 (both sides get the same arrays)."""
    import numpy as np

    if workload in ("logreg", "mala"):
        rng = np.random.RandomState(0)
        x = rng.standard_normal((1000, 25))
        beta = 0.5 * rng.standard_normal(25)
        y = (rng.uniform(size=1000) < 1.0 / (1.0 + np.exp(-x @ beta))).astype(np.float64)
        out = {"X": x.astype(np.float32), "y": y.astype(np.float32), "dim": 25}
    elif workload == "schools":
        out = {"y": np.array(SCHOOLS_Y, np.float32), "sigma": np.array(SCHOOLS_SIGMA, np.float32), "dim": 10}
    elif workload == "gauss100":
        d = 100
        i = np.arange(d)
        scales = np.logspace(-1.0, 1.0, d)
        cov = (0.9 ** np.abs(i[:, None] - i[None, :])) * scales[:, None] * scales[None, :]
        out = {"P": np.linalg.inv(cov).astype(np.float32), "dim": d}
    else:
        raise ValueError(workload)
    if workload == "mala":
        out["x0"] = (0.1 * np.random.RandomState(2).standard_normal((MALA_CHAINS, out["dim"]))).astype(np.float32)
    else:
        out["x0"] = np.random.RandomState(1).standard_normal((CHAINS, out["dim"])).astype(np.float32)
    return out


# ----------------------------------------------------------------------------- targets, per library


def torch_energy(workload: str, d: dict):
    """-log posterior (up to a constant) of one position (d,), a plain torch function."""
    import torch
    import torch.nn.functional as F

    if workload in ("logreg", "mala"):
        X, y = torch.from_numpy(d["X"]).to(DEVICE), torch.from_numpy(d["y"]).to(DEVICE)

        def energy(b):
            logits = X @ b
            return (F.softplus(logits) - y * logits).sum() + 0.5 * (b * b).sum()

    elif workload == "schools":
        ys, sigma = torch.from_numpy(d["y"]).to(DEVICE), torch.from_numpy(d["sigma"]).to(DEVICE)

        def energy(q):
            mu, log_tau, tt = q[0], q[1], q[2:]
            tau = log_tau.exp()
            theta = mu + tau * tt
            nll = 0.5 * (((ys - theta) / sigma) ** 2).sum()
            prior = 0.5 * (mu / 5.0) ** 2 + torch.log1p((tau / 5.0) ** 2) - log_tau + 0.5 * (tt * tt).sum()
            return nll + prior

    else:
        P = torch.from_numpy(d["P"]).to(DEVICE)

        def energy(x):
            return 0.5 * (x @ (P @ x))

    return energy


def jax_logdensity(workload: str, d: dict):
    import jax
    import jax.numpy as jnp

    if workload in ("logreg", "mala"):
        X, y = jnp.asarray(d["X"]), jnp.asarray(d["y"])

        def logdensity(b):
            logits = X @ b
            return -(jax.nn.softplus(logits) - y * logits).sum() - 0.5 * (b * b).sum()

    elif workload == "schools":
        ys, sigma = jnp.asarray(d["y"]), jnp.asarray(d["sigma"])

        def logdensity(q):
            mu, log_tau, tt = q[0], q[1], q[2:]
            tau = jnp.exp(log_tau)
            theta = mu + tau * tt
            nll = 0.5 * (((ys - theta) / sigma) ** 2).sum()
            prior = 0.5 * (mu / 5.0) ** 2 + jnp.log1p((tau / 5.0) ** 2) - log_tau + 0.5 * (tt * tt).sum()
            return -(nll + prior)

    else:
        P = jnp.asarray(d["P"])

        def logdensity(x):
            return -0.5 * (x @ (P @ x))

    return logdensity


# ----------------------------------------------------------------------------- implementations
# Each maker returns run() -> (draws (draws, chains, dim) numpy/torch, stats dict, (t_adapt, t_sample)).


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _compile_kw(mode: str) -> dict:
    return {} if mode == "default" else {"compile": {"auto": "auto", "true": True, "false": False}[mode]}


def make_fnebm_nuts(workload: str, d: dict, mode: str):
    import torch
    import fnebm
    from fnebm import random as fr

    energy = torch_energy(workload, d)
    x0 = torch.from_numpy(d["x0"]).to(DEVICE)
    kw = _compile_kw(mode)

    def run():
        t0 = time.perf_counter()
        warmup = fnebm.window_adaptation(fnebm.nuts, energy, WARMUP)
        state, parameters, _ = warmup.run(x0, fr.key(1, device=DEVICE), **kw)
        _sync()
        t1 = time.perf_counter()
        alg = fnebm.nuts(energy, **parameters)
        _, trace, info = fnebm.sample_chain(alg.step, state, fr.key(2, device=DEVICE), DRAWS, **kw)
        _sync()
        t2 = time.perf_counter()
        stats = {"steps": info.num_integration_steps.double().mean().item(),
                 "accept": info.acceptance_rate.double().mean().item(),
                 "divergent": int(info.is_divergent.sum().item())}
        return trace, stats, (t1 - t0, t2 - t1)

    return run


def make_blackjax_nuts(workload: str, d: dict):
    import numpy as np
    import jax
    import jax.numpy as jnp
    import blackjax

    logdensity = jax_logdensity(workload, d)
    warmup = blackjax.window_adaptation(blackjax.nuts, logdensity)  # defaults: diagonal, target 0.8

    @jax.jit
    def adapt(keys, x0):
        def one(k, x):
            (state, parameters), _ = warmup.run(k, x, num_steps=WARMUP)
            return state, parameters

        return jax.vmap(one)(keys, x0)

    @jax.jit
    def sample(keys, states, parameters):
        def one(k, s, p):
            alg = blackjax.nuts(logdensity, **p)  # max_num_doublings=10 by default

            def body(s, k):
                s, info = alg.step(k, s)
                return s, (s.position, info.num_integration_steps, info.acceptance_rate, info.is_divergent)

            return jax.lax.scan(body, s, jax.random.split(k, DRAWS))[1]

        return jax.vmap(one)(keys, states, parameters)

    x0 = jnp.asarray(d["x0"])
    k_warm, k_draw = jax.random.split(jax.random.key(3))

    def run():
        t0 = time.perf_counter()
        states, parameters = adapt(jax.random.split(k_warm, CHAINS), x0)
        jax.block_until_ready((states, parameters))
        t1 = time.perf_counter()
        pos, steps, acc, div = sample(jax.random.split(k_draw, CHAINS), states, parameters)
        draws = np.asarray(pos)  # (chains, draws, dim): a host copy (waits for the result)
        t2 = time.perf_counter()
        stats = {"steps": float(np.asarray(steps, np.float64).mean()),
                 "accept": float(np.asarray(acc, np.float64).mean()), "divergent": int(np.asarray(div).sum())}
        return draws.transpose(1, 0, 2), stats, (t1 - t0, t2 - t1)

    return run


def make_fnebm_mala(d: dict, mode: str):
    import torch
    import fnebm
    from fnebm import random as fr

    energy = torch_energy("mala", d)
    x0 = torch.from_numpy(d["x0"]).to(DEVICE)
    kw = _compile_kw(mode)

    def run():
        t0 = time.perf_counter()
        alg = fnebm.mala(energy, MALA_STEP)
        state = torch.func.vmap(alg.init)(x0)
        _, trace, info = fnebm.sample_chain(alg.step, state, fr.key(2, device=DEVICE), MALA_STEPS, **kw)
        _sync()
        t1 = time.perf_counter()
        return trace, {"accept": info.acceptance_rate.double().mean().item()}, (0.0, t1 - t0)

    return run


def make_blackjax_mala(d: dict):
    import numpy as np
    import jax
    import jax.numpy as jnp
    import blackjax

    mala = blackjax.mala(jax_logdensity("mala", d), MALA_STEP)

    @jax.jit
    def chain(key, x0):
        states = jax.vmap(mala.init)(x0)

        def body(s, k):
            s, info = jax.vmap(mala.step)(jax.random.split(k, MALA_CHAINS), s)
            return s, (s.position, info.acceptance_rate)

        return jax.lax.scan(body, states, jax.random.split(key, MALA_STEPS))[1]

    x0 = jnp.asarray(d["x0"])
    key = jax.random.key(3)

    def run():
        t0 = time.perf_counter()
        pos, acc = chain(key, x0)
        draws = np.asarray(pos)  # (steps, chains, dim)
        t1 = time.perf_counter()
        return draws, {"accept": float(np.asarray(acc, np.float64).mean())}, (0.0, t1 - t0)

    return run


def make_plain_mala(d: dict):
    import torch
    import torch.nn.functional as F

    X, y = torch.from_numpy(d["X"]).to(DEVICE), torch.from_numpy(d["y"]).to(DEVICE)
    x0 = torch.from_numpy(d["x0"]).to(DEVICE)
    h = MALA_STEP

    def energy(b):  # (chains, dim) -> (chains,)
        logits = b @ X.T
        return (F.softplus(logits) - y * logits).sum(1) + 0.5 * (b * b).sum(1)

    def value_and_grad(b):
        b = b.detach().requires_grad_(True)
        e = energy(b)
        (g,) = torch.autograd.grad(e.sum(), b)
        return e.detach(), g

    def run():
        t0 = time.perf_counter()
        gen = torch.Generator(device=DEVICE).manual_seed(3)
        x = x0.clone()
        e, g = value_and_grad(x)
        trace = torch.empty(MALA_STEPS, *x.shape, device=DEVICE)
        acc = torch.empty(MALA_STEPS, x.shape[0], device=DEVICE)
        for t in range(MALA_STEPS):
            xp = x - h * g + (2 * h) ** 0.5 * torch.randn(x.shape, generator=gen, device=DEVICE)
            ep, gp = value_and_grad(xp)
            # log q(x | x') - log q(x' | x), q(a | b) = N(a; b - h grad E(b), 2h)
            fwd = ((xp - x + h * g) ** 2).sum(1)
            bwd = ((x - xp + h * gp) ** 2).sum(1)
            log_alpha = e - ep + (fwd - bwd) / (4 * h)
            a = torch.exp(torch.clamp(log_alpha, max=0.0))
            accept = torch.rand(x.shape[0], generator=gen, device=DEVICE) < a
            x = torch.where(accept[:, None], xp, x)
            e = torch.where(accept, ep, e)
            g = torch.where(accept[:, None], gp, g)
            trace[t] = x
            acc[t] = a
        _sync()
        t1 = time.perf_counter()
        return trace, {"accept": acc.double().mean().item()}, (0.0, t1 - t0)

    return run


def make(impl: str, workload: str, mode: str):
    d = data(workload)
    if workload == "mala":
        return {"fnebm": lambda: make_fnebm_mala(d, mode), "blackjax": lambda: make_blackjax_mala(d),
                "plain": lambda: make_plain_mala(d)}[impl]()
    return {"fnebm": lambda: make_fnebm_nuts(workload, d, mode),
            "blackjax": lambda: make_blackjax_nuts(workload, d)}[impl]()


def _imports(impls) -> None:
    """The libraries an implementation needs, imported before its first call (timed apart)."""
    for impl in impls:
        if impl == "fnebm":
            import fnebm  # noqa: F401
        elif impl == "blackjax":
            import jax  # noqa: F401
            import blackjax  # noqa: F401
        else:
            import torch  # noqa: F401


# ----------------------------------------------------------------------------- diagnostics (fnebm.diagnostics)


def diagnose(draws) -> dict:
    """Bulk ESS (min, median over coordinates), means and MCSE of a (draws, chains, dim) array."""
    import numpy as np
    import torch
    from fnebm import diagnostics

    t = draws.cpu() if isinstance(draws, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(draws))
    t = t.float()
    ess = diagnostics.ess_bulk(t, layout="draws_chains").double()
    return {"ess_min": float(ess.min()), "ess_median": float(ess.median()),
            "mean": t.double().mean((0, 1)).tolist(),
            "mcse": diagnostics.mcse_mean(t, layout="draws_chains").double().tolist()}


# ----------------------------------------------------------------------------- workers


def _emit(obj) -> None:
    print("@@RESULT " + json.dumps(obj), flush=True)


def worker_single(impl: str, workload: str, mode: str, calls: int) -> None:
    """One implementation in a fresh process: the import, the first call, then `calls - 1` more."""
    _imports([impl])
    t_imported = time.time()
    run = make(impl, workload, mode)
    out = {"import_s": t_imported - T_START, "calls": []}
    for _ in range(calls):
        _, stats, (ta, ts) = run()
        if not out["calls"]:
            out["first_result_at"] = time.time()  # the parent subtracts its launch time
        out["calls"].append({"adapt_s": ta, "sample_s": ts, "total_s": ta + ts, **stats})
    _emit(out)


def worker_warm(impls: list[str], workload: str, mode: str, rounds: int) -> None:
    """Every implementation in one process: a first call of each, then `rounds` alternating rounds."""
    _imports(impls)
    runs = {impl: make(impl, workload, mode) for impl in impls}
    out = {"first": {}, "rounds": [], "diagnostics": {}, "stats": {}}
    last = {}
    for impl in impls:
        _, stats, (ta, ts) = runs[impl]()
        out["first"][impl] = {"adapt_s": ta, "sample_s": ts, "total_s": ta + ts}
    # warm = steady state: fnebm's compile="auto" compiles its evaluation once the eager ones have
    # taken as long as a compile is expected to (announced by an EnergyCompileNotice or CompileNotice);
    # before the rounds, fnebm runs alone until a call announced one, and once more (its thread count
    # is then timed again), at most MAX_SETTLE calls ("settle_calls" in the JSON, with the notices)
    out["settle_calls"], out["settle_notices"] = 0, []
    if "fnebm" in runs:
        announced = False
        while out["settle_calls"] < MAX_SETTLE:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                runs["fnebm"]()
            out["settle_calls"] += 1
            notices = [type(w.message).__name__ for w in seen if type(w.message).__name__.endswith("CompileNotice")]
            out["settle_notices"].append(notices)
            if announced:
                break
            announced = bool(notices)
    for r in range(rounds):
        order = impls if r % 2 == 0 else impls[::-1]
        row = {}
        for impl in order:
            draws, stats, (ta, ts) = runs[impl]()
            row[impl] = {"adapt_s": ta, "sample_s": ts, "total_s": ta + ts}
            last[impl] = (draws, stats)
        out["rounds"].append(row)
    for impl, (draws, stats) in last.items():
        if workload == "mala":
            draws = draws[-MALA_KEEP:]
        out["diagnostics"][impl] = diagnose(draws)
        out["stats"][impl] = stats
    _emit(out)


# ----------------------------------------------------------------------------- the parent


def _env(impl_tree: str | None, cache: str | None) -> dict:
    env = dict(os.environ)
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # JAX beside torch on one GPU: allocate as needed
    for k in ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_X64", "XLA_FLAGS"):
        env.pop(k, None)
    if impl_tree:
        env["PYTHONPATH"] = impl_tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
        env["FNEBM_CACHE_DIR"] = os.path.join(cache, "fnebm")
    return env


def _spawn(args_list: list[str], env: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *args_list]
    t_launch = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"timeout": timeout, "wall_s": time.time() - t_launch}
    wall = time.time() - t_launch
    for line in p.stdout.splitlines():
        if line.startswith("@@RESULT "):
            res = json.loads(line[len("@@RESULT "):])
            res["wall_s"] = wall
            if "first_result_at" in res:
                res["first_with_import_s"] = res.pop("first_result_at") - t_launch
            return res
    return {"error": (p.stderr or p.stdout)[-3000:], "rc": p.returncode, "wall_s": wall}


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x, unit="", digits=2):
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:.{digits}f}{unit}"


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return "n/a"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        name = next(l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name"))
        flags = next(l for l in info.splitlines() if l.startswith("flags"))
        return f"{name}, {'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'no AVX2'}, {os.cpu_count()} CPUs"
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def _time_or_timeout(res: dict, key: str):
    if "timeout" in res:
        return f">{res['timeout']:.0f} s"
    if "error" in res:
        return "error"
    if key == "first_with_import_s":
        return res.get(key)
    i = {"first": 0, "again": 1}.get(key)
    return res["calls"][i]["total_s"] if i is not None and i < len(res["calls"]) else None


def run_workload(workload: str, args) -> dict:
    impls = list(IMPLS[workload])
    mode = args.fnebm_compile
    common = ["--workload", workload, "--fnebm-compile", mode, "--device", args.device] + (["--quick"] if args.quick else [])
    tree = {impl: (args.fnebm_tree if impl == "fnebm" else None) for impl in impls}
    out = {"impls": impls, "cold": {i: [] for i in impls}, "warm": []}
    for rep in range(args.repeats):
        order = impls if rep % 2 == 0 else impls[::-1]
        cache = tempfile.mkdtemp(prefix="fnebm-posterior-")
        for impl in order:  # cold: one fresh process each, empty caches
            res = _spawn(["--worker", "single", "--impl", impl, "--calls", str(args.calls), *common],
                         _env(tree[impl], cache if impl == "fnebm" else None), args.timeout)
            out["cold"][impl].append(res)
            print(f"  {workload} cold {impl}: first {_fmt(_time_or_timeout(res, 'first'), ' s')}, "
                  f"with import {_fmt(_time_or_timeout(res, 'first_with_import_s'), ' s')}, "
                  f"again {_fmt(_time_or_timeout(res, 'again'), ' s')}", flush=True)
        # second process (fnebm on the caches the cold process filled) and warm rounds: one process
        # holding every implementation; its first call of each is the "second" figure
        res = _spawn(["--worker", "warm", "--impls", ",".join(order), "--rounds", str(args.rounds), *common],
                     _env(args.fnebm_tree, cache), args.timeout * (1 + args.rounds))
        shutil.rmtree(cache, ignore_errors=True)
        out["warm"].append(res)
        if "rounds" in res:
            for impl in impls:
                r = [row[impl] for row in res["rounds"]]
                print(f"  {workload} second {impl}: {_fmt(res['first'][impl]['total_s'], ' s')}; warm: all "
                      f"{_fmt(_med([x['total_s'] for x in r]), ' s', 3)}, "
                      f"sampling {_fmt(_med([x['sample_s'] for x in r]), ' s', 3)}", flush=True)
        else:
            print(f"  {workload} second/warm: " + (f"timeout > {res['timeout']:.0f} s" if "timeout" in res
                                                   else res.get("error", "")[-1500:]), flush=True)
    out["summary"] = summarise(workload, out)
    return out


def summarise(workload: str, out: dict) -> dict:
    impls = out["impls"]
    warm = [w for w in out["warm"] if "rounds" in w]
    rounds = [row for w in warm for row in w["rounds"]]
    diag = warm[-1] if warm else None
    s = {i: {} for i in impls}
    for impl in impls:
        rs = out["cold"][impl]
        ok = [r for r in rs if "calls" in r]
        if ok:
            s[impl]["cold"] = _med([r["calls"][0]["total_s"] for r in ok])
            s[impl]["cold_adapt"] = _med([r["calls"][0]["adapt_s"] for r in ok])
            s[impl]["cold_with_import"] = _med([r["first_with_import_s"] for r in ok])
            s[impl]["cold_again"] = _med([r["calls"][1]["total_s"] for r in ok if len(r["calls"]) > 1])
            s[impl]["import"] = _med([r["import_s"] for r in ok])
        elif rs:
            s[impl]["cold"] = _time_or_timeout(rs[0], "first")
        if warm:
            s[impl]["second"] = _med([w["first"][impl]["total_s"] for w in warm])
        elif out["warm"] and "timeout" in out["warm"][0]:
            s[impl]["second"] = f">{out['warm'][0]['timeout']:.0f} s (with the warm rounds)"
        if rounds:
            rows = [row[impl] for row in rounds]
            s[impl]["warm_total"] = _med([r["total_s"] for r in rows])
            s[impl]["warm_sample"] = _med([r["sample_s"] for r in rows])
            s[impl]["warm_adapt"] = _med([r["adapt_s"] for r in rows])
            dg = diag["diagnostics"][impl]
            s[impl].update({k: dg[k] for k in ("ess_min", "ess_median")})
            s[impl].update(diag["stats"][impl])
            for stat in ("ess_min", "ess_median"):
                s[impl][f"{stat}_per_s_sample"] = dg[stat] / s[impl]["warm_sample"]
                s[impl][f"{stat}_per_s_total"] = dg[stat] / s[impl]["warm_total"]
    ratios = {}
    for peer in impls[1:]:
        r = {}
        pairs = [(a, b) for a, b in zip(out["cold"]["fnebm"], out["cold"][peer]) if "calls" in a and "calls" in b]
        if pairs:
            r["cold"] = _med([a["calls"][0]["total_s"] / b["calls"][0]["total_s"] for a, b in pairs])
            r["cold_with_import"] = _med([a["first_with_import_s"] / b["first_with_import_s"] for a, b in pairs])
            if all(len(a["calls"]) > 1 and len(b["calls"]) > 1 for a, b in pairs):
                r["cold_again"] = _med([a["calls"][1]["total_s"] / b["calls"][1]["total_s"] for a, b in pairs])
        if warm:
            r["second"] = _med([w["first"]["fnebm"]["total_s"] / w["first"][peer]["total_s"] for w in warm])
        if rounds:
            r["warm_total"] = _med([row["fnebm"]["total_s"] / row[peer]["total_s"] for row in rounds])
            r["warm_sample"] = _med([row["fnebm"]["sample_s"] / row[peer]["sample_s"] for row in rounds])
            dg = diag["diagnostics"]
            for stat in ("ess_min", "ess_median"):
                ess_ratio = dg["fnebm"][stat] / dg[peer][stat]
                # fnebm's ESS/s over the peer's: the ESS ratio over the median per-round time ratio
                r[f"{stat}_per_s_sample"] = ess_ratio / r["warm_sample"]
                r[f"{stat}_per_s_total"] = ess_ratio / r["warm_total"]
            ma, mb = dg["fnebm"]["mean"], dg[peer]["mean"]
            sa, sb = dg["fnebm"]["mcse"], dg[peer]["mcse"]
            z = [abs(x - y) / max((u * u + v * v) ** 0.5, 1e-30) for x, y, u, v in zip(ma, mb, sa, sb)]
            r["max_mean_z"] = max(z)
            r["n_coords"] = len(z)
        ratios[peer] = r
    s["ratios_fnebm_over"] = ratios
    return s


def print_table(workload: str, s: dict, impls) -> None:
    print(f"\n{workload}: times in s (cold = fresh process, empty caches, import excluded / included; "
          "second = 2nd process on its caches; again = the same call once more in that process; warm = median of rounds)")
    hdr = ("impl", "cold", "+import", "again", "second", "warm", "warm samp", "ESSmin", "ESSmed",
           "ESSmin/s samp", "ESSmin/s all", "ESSmed/s samp", "steps/tr", "accept")
    print(" | ".join(f"{h:>9}" for h in hdr))
    for impl in impls:
        x = s[impl]
        row = (impl, _fmt(x.get("cold")), _fmt(x.get("cold_with_import")), _fmt(x.get("cold_again"), "", 3),
               _fmt(x.get("second")), _fmt(x.get("warm_total"), "", 3), _fmt(x.get("warm_sample"), "", 3),
               _fmt(x.get("ess_min"), "", 0), _fmt(x.get("ess_median"), "", 0),
               _fmt(x.get("ess_min_per_s_sample"), "", 0), _fmt(x.get("ess_min_per_s_total"), "", 0),
               _fmt(x.get("ess_median_per_s_sample"), "", 0), _fmt(x.get("steps"), "", 1), _fmt(x.get("accept"), "", 3))
        print(" | ".join(f"{v:>9}" for v in row))
    for peer, r in s["ratios_fnebm_over"].items():
        print(f"  fnebm / {peer}: time cold {_fmt(r.get('cold'))}x (with import {_fmt(r.get('cold_with_import'))}x), "
              f"second {_fmt(r.get('second'))}x, warm all {_fmt(r.get('warm_total'))}x, "
              f"warm sampling {_fmt(r.get('warm_sample'))}x; ESS/s ratio (min ESS) sampling "
              f"{_fmt(r.get('ess_min_per_s_sample'))}x, all {_fmt(r.get('ess_min_per_s_total'))}x; "
              f"means: max |diff|/MCSE {_fmt(r.get('max_mean_z'))} over {r.get('n_coords', '-')} coordinates")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(ALL), help="comma-separated subset of " + ",".join(ALL))
    p.add_argument("--repeats", type=int, default=1,
                   help="repeats of (a cold process per implementation, then one second process holding all)")
    p.add_argument("--rounds", type=int, default=2, help="warm rounds (A B alternating) in each second process")
    p.add_argument("--json", default=os.path.join(HERE, "results-posterior.json"))
    p.add_argument("--fnebm-compile", choices=("default", "auto", "true", "false"), default="default",
                   help="default: each call on its own default (warmup.run compile=True, sample_chain compile='auto'); "
                        "else that compile= for both")
    p.add_argument("--fnebm-tree", default=None, help="run fnebm from this checkout (PYTHONPATH in the workers)")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per worker process before it is stopped")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the torch rows run (JAX uses its default platform: the GPU when there is one)")
    # worker mode (internal)
    p.add_argument("--quick", action="store_true", help="a smoke test: 100 + 100 NUTS iterations, 100 MALA steps")
    p.add_argument("--worker", choices=("single", "warm"))
    p.add_argument("--impl")
    p.add_argument("--impls")
    p.add_argument("--workload")
    p.add_argument("--calls", type=int, default=2, help="calls in each cold process (the 2nd: 'again')")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("posterior.py: --device cuda: no CUDA device", file=sys.stderr)
            sys.exit(2)
    if args.quick:
        global WARMUP, DRAWS, MALA_STEPS, MALA_KEEP
        WARMUP, DRAWS, MALA_STEPS, MALA_KEEP = 100, 100, 100, 50

    if args.worker == "single":
        return worker_single(args.impl, args.workload, args.fnebm_compile, args.calls)
    if args.worker == "warm":
        return worker_warm(args.impls.split(","), args.workload, args.fnebm_compile, args.rounds)

    only = [w for w in args.only.split(",") if w]
    bad = [w for w in only if w not in ALL]
    if bad:
        print(f"posterior.py: --only: unknown workload(s) {', '.join(bad)}; expected some of {', '.join(ALL)}",
              file=sys.stderr)
        sys.exit(2)
    record = {"command": " ".join([os.path.basename(sys.executable), "bench/posterior.py", *sys.argv[1:]]),
              "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "cpu": _cpu(),
              "loadavg_before": _loadavg(), "fnebm_tree": args.fnebm_tree or ROOT,
              "fnebm_compile": args.fnebm_compile, "python": platform.python_version(), "device": args.device,
              "workloads": {}}
    try:
        import importlib.metadata as md

        record["versions"] = {n: md.version(n) for n in ("torch", "jax", "jaxlib", "blackjax", "numpy")}
    except Exception:  # noqa: BLE001
        pass
    print(f"{record['cpu']}; load {record['loadavg_before']}", flush=True)
    t0 = time.time()
    for w in only:
        record["workloads"][w] = run_workload(w, args)
        print_table(w, record["workloads"][w]["summary"], IMPLS[w])
        record["loadavg_after"] = _loadavg()
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    record["elapsed_s"] = time.time() - t0
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
    print(f"\nload before {record['loadavg_before']}, after {record['loadavg_after']}; "
          f"{record['elapsed_s']:.0f} s in all; {args.json}")


if __name__ == "__main__":
    main()
