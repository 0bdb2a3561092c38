"""Shared targets and compiled runs: compiling costs seconds on a 2-core CPU, so each sampler
graph is built once per session and every test that needs it reuses it."""

import math
import os

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run and machine (fixed keys, as every other
# statistical test here): a CI run neither flakes nor depends on a local example database.
# `pytest --hypothesis-profile=explore` draws fresh ones, to hunt for new counterexamples.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("ci")

# Triton reads TRITON_INTERPRET once, when it is first imported — which torch.compile may do
# in any test. Without a GPU, the Triton tests run under the interpreter: set it before that.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The C libraries an install compiled into the package (fnebm/kernels/_prebuilt: `pip install -e`
# builds them in the checkout) are passed over, so that the tests of the kernels' build and cache
# build as a first run without them does (child processes inherit this); the tests of the prebuilt
# libraries turn them back on (tests/test_kernel_cache.py), and .ci/wheel_check.sh checks a wheel's.
os.environ["FNEBM_PREBUILT"] = "0"

# One intra-op thread: the tests' tensors are small (time goes to dispatch and compiling, not to
# arithmetic), and on a 2-core machine with any neighbour process two OpenMP threads spin at
# every barrier (measured 10-40x slower per step). FNEBM_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("FNEBM_TEST_THREADS", "1")))

import fnebm
from fnebm import energies as E

# no test compiles in the background unless it says so with a cache of its own (the default cache waits)
assert fnebm.chain.default_cache.background is False

# compile="auto" reads what compiles took on this machine (fnebm._inductor): the tests start from
# none recorded and record none, so earlier runs on this machine do not move their plans
from fnebm import _inductor  # noqa: E402

_inductor._times = []
_inductor._times_path = lambda: None
from fnebm import random as fr

F64 = torch.float64


def walled(x):
    """Finite for x[0] < 0.5, +inf beyond: proposals across the wall must never be taken."""
    return torch.where(x[0] < 0.5, 0.5 * (x * x).sum(), torch.full_like(x[0], math.inf))

MEAN = torch.tensor([1.0, -1.0], dtype=F64)
COV = torch.tensor([[1.0, 0.8], [0.8, 1.0]], dtype=F64)
N_CHAINS = 4096


@pytest.fixture(scope="session")
def target():
    """A correlated 2-D Gaussian, float64."""
    return E.gaussian(MEAN, COV)


@pytest.fixture(scope="session")
def start(target):
    """Initial positions far from the target's mean: (N_CHAINS, 2)."""
    return 3.0 * fr.normal(fr.key(100), (N_CHAINS, 2), dtype=F64)


@pytest.fixture(scope="session")
def mala_alg(target):
    return fnebm.mala(target, step_size=0.3)


@pytest.fixture(scope="session")
def langevin_alg(target):
    return fnebm.langevin(target, step_size=0.05)


@pytest.fixture(scope="session")
def mala_run(mala_alg, start):
    """Compiled MALA: 300 burn-in + 300 kept steps over N_CHAINS chains."""
    state = torch.func.vmap(mala_alg.init)(start)
    return fnebm.sample_chain(mala_alg.step, state, fr.key(1), 300, burn_in=300, compile=True, progress=False)


@pytest.fixture(scope="session")
def langevin_run(langevin_alg, start):
    """Compiled unadjusted Langevin: 400 burn-in + 200 kept steps over N_CHAINS chains."""
    state = torch.func.vmap(langevin_alg.init)(start)
    return fnebm.sample_chain(langevin_alg.step, state, fr.key(2), 200, burn_in=400, compile=True, progress=False)


def pytest_configure(config):
    # A compiled test that quietly fell back to eager would still pass: make the fallback's warning an
    # error. Here, not in pyproject.toml: an ini filter naming fnebm's class imports fnebm (and
    # Triton with it) before this file sets TRITON_INTERPRET, and every Triton test then fails.
    config.addinivalue_line("filterwarnings", "error::fnebm.chain.runner.CompileFallbackWarning")
