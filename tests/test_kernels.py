"""fnebm.kernels under TRITON_INTERPRET=1 on CPU: the whole-chain kernels against the samplers they run.

Same key, same noise: the kernel's in-kernel normals are fnebm.random.normal's (to about 2 ulp:
the Philox words agree bit for bit, log/cos/sin are the interpreter's NumPy ones against
torch's), and its chains equal fnebm.chain.run of fnebm.langevin / fnebm.mala to float32 tolerance.
"""

import importlib
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import pytest
import torch

pytest.importorskip("triton")

from fnebm import random as fr  # noqa: E402

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                       reason="needs TRITON_INTERPRET=1 or a GPU"),
]

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
# Normals: the interpreter's float32 log/cos/sin against torch's differ by an ulp or two.
TOL = dict(rtol=2e-6, atol=1e-6)


def _keys(chains):
    k = fr.key(17, device=DEVICE)
    return k if chains == () else fr.split(k, torch.Size(chains).numel()).reshape(*chains, 2)


_PHILOX_CASES = {
    "split": lambda k, ks: fr.split(k, 7),
    "split of a batch": lambda k, ks: fr.split(ks, 3),
    "fold_in": lambda k, ks: fr.fold_in(ks, 2**40 + 17),
    "fold_in of a vector": lambda k, ks: fr.fold_in(k, torch.arange(6, device=k.device)),
    "normal": lambda k, ks: fr.normal(ks, (3, 5)),
    "uniform": lambda k, ks: fr.uniform(k, (9,)),
    "no keys": lambda k, ks: fr.split(ks[:0], 3),
    "7 rounds, broadcast": lambda k, ks: torch.stack(fr.philox4x32(
        torch.arange(5, device=k.device), k[1], torch.tensor([[1], [2**32 - 1]], device=k.device),
        k[0] * 0, k[0], k[1], rounds=7)),
}


@pytest.mark.parametrize("case", list(_PHILOX_CASES))
def test_eager_philox_kernel_gives_the_torch_paths_bits(monkeypatch, case):
    """fnebm.random's eager path on a CUDA device (one Triton kernel for the Philox blocks)
    gives the bits of the torch path (the path compiled code takes), for keys, draws and a
    broadcast call of the block function itself."""
    k = fr.key(2**63 + 12345, device=DEVICE)
    ks = fr.split(k, 5)
    monkeypatch.setattr(fr, "_NUMPY_EAGER", False)
    monkeypatch.setattr(fr, "_TRITON_EAGER_DEVICES", ())
    monkeypatch.setattr(fr, "_TRITON_DRAWS", False)  # the block kernel (the one-launch draws: test_random_triton.py)
    want = _PHILOX_CASES[case](k, ks)
    launches = []
    real = fr._philox_triton
    monkeypatch.setattr(fr, "_philox_triton", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    monkeypatch.setattr(fr, "_TRITON_EAGER_DEVICES", (DEVICE,))
    got = _PHILOX_CASES[case](k, ks)
    assert launches, "the Triton path did not run"
    assert got.dtype == want.dtype and torch.equal(got, want)


# ------------------------------------------------------------ whole chains (langevin_chain)

import fnebm  # noqa: E402
from fnebm import energies as E  # noqa: E402
from fnebm.chain import run as run_chain  # noqa: E402
# the package exports the function langevin_chain, which hides the module of the same name
lc = importlib.import_module("fnebm.kernels.langevin_chain")

# Whole chains under the interpreter cost ~0.15 s per step (each Triton device-function call
# re-patches triton.language), so these runs are a handful of steps on a few chains.
# Kernel against sampler: the normals differ by ~2 ulp and the closed forms are summed in another
# order, so after a few steps positions agree to a few float32 ulps of their size.
CHAIN_TOL = dict(rtol=1e-5, atol=1e-5)


def _covered(name, d=6):
    f32 = dict(dtype=torch.float32, device=DEVICE)
    if name == "double_well":
        return E.double_well(1.0, 0.8, **f32)
    if name == "harmonic":
        return E.harmonic(2.0, **f32)
    if name == "gaussian":
        return E.gaussian(torch.linspace(-1.0, 1.0, d), precision=torch.linspace(0.5, 2.0, d), **f32)
    return E.rastrigin(1.0, **f32)


COVERED = ["double_well", "harmonic", "gaussian", "rastrigin"]


def _start(energy, chains, d, seed=0):
    x = fr.normal(fr.key(seed, DEVICE), chains + (d,))
    return x, _over(energy, x), _over(energy.grad, x)


def _over(fn, x):
    # an energy takes one sample (d,): map it over the leading axes
    for _ in range(x.ndim - 1):
        fn = torch.func.vmap(fn)
    return fn(x)


def _assert_chain_close(got, want):
    assert len(got) == len(want)
    for name, a, b in zip(got._fields, got, want):
        if a.dtype == torch.bool:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, **CHAIN_TOL, msg=name)


@pytest.mark.parametrize("piece", [None, 3, 1], ids=["one piece", "pieces of 3", "pieces of 1"])
def test_chain_noise_schedule_and_tails(monkeypatch, piece):
    """Harmonic k = 2 with h = 1/2 makes every step x' = x - x + 1 * xi = xi exactly, so the
    trace *is* the kernel's noise: draw j must be fnebm.random.normal(fold_in(keys, t), d) at
    the stream index t of step burn_in + (j + 1) thin - 1. 3 chains in a block of 4 and d = 37
    (a ragged last lane) leave tails; the buffers are views into larger NaN/True-filled ones,
    whose extra row must stay untouched. Also with the launch run in pieces of 3 and 1 steps
    (the per-step keys' buffer made small), whose boundaries cut through burn-in and thinning.
    ~7 interpreted steps (~1 s)."""
    chains, d, start, burn_in, n_steps, thin = (3,), 37, 5, 2, 5, 2
    if piece is not None:
        monkeypatch.setattr(lc, "_KEYS_BYTES", 12 * 3 * piece)
    energy = E.harmonic(2.0, dtype=torch.float32, device=DEVICE)
    x, e, g = _start(energy, chains, d)
    keys = _keys(chains)
    n_kept = n_steps // thin
    trace_buf = torch.full((n_kept + 1,) + chains + (d,), float("nan"), device=DEVICE)
    div_buf = torch.ones((n_kept + 1,) + chains, dtype=torch.bool, device=DEVICE)
    half, one = torch.tensor(0.5, device=DEVICE), torch.tensor(1.0, device=DEVICE)
    start_t = torch.tensor(start, device=DEVICE)
    final = lc.run_into(energy, x, e, g, keys, start_t, half, one, (trace_buf[:n_kept], div_buf[:n_kept]), mala=False,
                        n_total=burn_in + n_steps, first=burn_in + thin - 1, thin=thin, n_keep=n_kept, j0=0)
    for j in range(n_kept):
        t = start + burn_in + (j + 1) * thin - 1
        torch.testing.assert_close(trace_buf[j], fr.normal(fr.fold_in(keys, t), (d,)), **TOL)
    assert not div_buf[:n_kept].any()
    assert trace_buf[n_kept].isnan().all() and div_buf[n_kept].all()  # nothing written past the end
    last = fr.normal(fr.fold_in(keys, start + burn_in + n_steps - 1), (d,))
    torch.testing.assert_close(final[0], last, **TOL)
    torch.testing.assert_close(final[1], _over(energy, last), **TOL)
    torch.testing.assert_close(final[2], 2.0 * last, **TOL)


def _sampler_run(alg, x, keys, start, n_steps, burn_in, thin):
    """The sampler's own steps (fnebm.chain.run, eager) from the same keys, kept as the kernel keeps
    them: ``(position, energy, grad, trace, *info)``."""
    init = alg.init
    for _ in range(x.ndim - 1):
        init = torch.func.vmap(init)
    final, trace, info = run_chain(alg.step, init(x), keys, burn_in + n_steps, start=start)
    kept = slice(burn_in + thin - 1, burn_in + n_steps, thin)
    return (final.position, final.energy, final.grad, trace[kept], *(t[kept] for t in info))


@pytest.mark.parametrize("name", COVERED)
@pytest.mark.parametrize("sampler", ["langevin", "mala"])
def test_chain_matches_the_sampler(name, sampler):
    """Kernel against fnebm.chain.run of the sampler itself on 2 x 3 chains of d = 6: per-chain
    step sizes (MALA, large enough that both decisions occur) or per-chain noise scales
    (Langevin), burn-in 1, thin 2, from stream index 3. ~5 interpreted steps (~1 s) each."""
    chains, d = (2, 3), 6
    energy = _covered(name, d)
    x, e, g = _start(energy, chains, d)
    keys = _keys(chains)
    kw = dict(n_steps=4, burn_in=1, thin=2)
    if sampler == "mala":
        top = 0.05 if name == "rastrigin" else 0.8  # Rastrigin's curvature is 2 + 4 pi^2 a
        h = torch.linspace(0.002 if name == "rastrigin" else 0.05, top, 6, device=DEVICE).reshape(chains)
        got = lc.mala_chain(energy, x, e, g, keys, 3, h, **kw)
        alg = fnebm.mala(energy, h)
    else:
        s = torch.linspace(0.0, 1.0, 6, device=DEVICE).reshape(chains)
        got = lc.langevin_chain(energy, x, e, g, keys, 3, torch.tensor(0.05, device=DEVICE), s, **kw)
        alg = fnebm.langevin(energy, 0.05, s)
    want = _sampler_run(alg, x, keys, 3, **kw)
    assert got.trace.shape == want[3].shape == (2,) + chains + (d,)
    _assert_chain_close(got, want)
    if sampler == "mala":
        assert got.is_accepted.any() and not got.is_accepted.all()


def test_mala_in_pieces_equals_one_launch(monkeypatch):
    """MALA run in pieces of 2 steps (final state carried between launches, the uniforms from
    the per-step buffer) gives exactly what one piece gives."""
    chains, d = (5,), 6
    energy = _covered("double_well", d)
    x, e, g = _start(energy, chains, d)
    args = (energy, x, e, g, _keys(chains), 3, torch.tensor(0.3, device=DEVICE))
    kw = dict(n_steps=6, burn_in=1, thin=2)
    whole = lc.mala_chain(*args, **kw)
    monkeypatch.setattr(lc, "_KEYS_BYTES", 12 * 5 * 2)
    pieces = lc.mala_chain(*args, **kw)
    assert 0 < pieces.is_accepted.float().mean() < 1  # both decisions occur
    for a, b in zip(whole, pieces):
        assert torch.equal(a, b)


def test_chain_rejects_what_it_does_not_cover():
    keys = _keys((3,))
    x = torch.zeros(3, 4, device=DEVICE)
    e, g = torch.zeros(3, device=DEVICE), x
    with pytest.raises(TypeError, match="float32"):
        lc.langevin_chain(E.harmonic(dtype=torch.float64, device=DEVICE), x.double(), e.double(), g.double(), keys, 0,
                          0.1, n_steps=2)
    with pytest.raises(TypeError, match="Rosenbrock"):
        lc.mala_chain(E.rosenbrock(dtype=torch.float32, device=DEVICE), x, e, g, keys, 0, 0.1, n_steps=2)
    full = E.gaussian(torch.zeros(4), torch.eye(4) + 0.5, dtype=torch.float32, device=DEVICE)
    with pytest.raises(TypeError, match="full precision"):
        lc.mala_chain(full, x, e, g, keys, 0, 0.1, n_steps=2)
    big = torch.zeros(3, lc.MAX_DIM + 1, device=DEVICE)
    with pytest.raises(ValueError, match="MAX_DIM"):
        lc.langevin_chain(E.harmonic(dtype=torch.float32, device=DEVICE), big, e, big, keys, 0, 0.1, n_steps=2)
    with pytest.raises(ValueError, match="thin"):
        lc.langevin_chain(E.harmonic(dtype=torch.float32, device=DEVICE), x, e, g, keys, 0, 0.1, n_steps=2, thin=3)


def test_chain_ops_registered():
    """Schema, fake tensors and AOT dispatch of the MALA op, fake tensors of the Langevin one
    (opcheck runs the op several times: 2 chains, 2 steps; ~4 s in all)."""
    energy = _covered("double_well", 5)
    x, e, g = _start(energy, (2,), 5)
    keys = _keys((2,))
    t = torch.tensor(1, device=DEVICE)
    h = torch.tensor(0.1, device=DEVICE)
    family, scalars, vectors = lc._params(energy, 5)
    torch.library.opcheck(torch.ops.fnebm.mala_chain.default, (x, e, g, keys, t, h, scalars, vectors, family, 1, 1, 1),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    torch.library.opcheck(torch.ops.fnebm.langevin_chain.default,
                          (x, e, g, keys, t, h, torch.tensor(1.0, device=DEVICE), scalars, vectors, family, 2, 0, 1),
                          test_utils=("test_faketensor",))


# ------------------------------------------------------------ dispatch: sample_chain(backend=)

from fnebm.chain.loop import needs_grad  # noqa: E402
from fnebm.kernels import dispatch  # noqa: E402


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """backend="triton" may run the kernel on CPU tensors (under the interpreter): tests only."""
    monkeypatch.setattr(dispatch, "_INTERPRETER_ON_CPU", True)


def _engine(step, chain, backend, collect="position"):
    """The engine fnebm.kernels.dispatch picks for this chain (``"torch"`` when no kernel runs)."""
    req = dispatch.RunRequest(step, chain.state, chain.keys, chain.steps_taken, collect, needs_grad(step, chain.state))
    return dispatch.choose(req, backend).engine


def _alg(sampler, energy, chains):
    if sampler == "mala":  # per-chain step sizes, large enough that some proposals are rejected
        return fnebm.mala(energy, torch.linspace(0.1, 0.6, math.prod(chains), device=DEVICE).reshape(chains))
    return fnebm.langevin(energy, 0.05, 0.8)


def _assert_runs_close(a, b):
    (chain_a, trace_a, info_a), (chain_b, trace_b, info_b) = a, b
    torch.testing.assert_close(trace_a, trace_b, **CHAIN_TOL)
    for x, y in zip((*chain_a.state, *info_a), (*chain_b.state, *info_b)):
        if x.dtype == torch.bool:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, **CHAIN_TOL)
    assert type(info_a) is type(info_b) and type(chain_a.state) is type(chain_b.state)
    assert torch.equal(chain_a.keys, chain_b.keys) and torch.equal(chain_a.steps_taken, chain_b.steps_taken)


@pytest.mark.parametrize("sampler, name", [("langevin", "double_well"), ("mala", "gaussian")])
def test_sample_chain_triton_equals_eager(kernels_on_cpu, sampler, name):
    """sample_chain(backend="triton") against backend="eager" for the same key: 2 burn-in + 4
    steps thinned by 2 in one launch, then continued from the ChainState for 4 more in launches
    of 2 steps (chunk_size) into the caller's out= buffers. ~10 interpreted steps (~2 s)."""
    chains, d = (6,), 5
    energy = _covered(name, d)
    alg = _alg(sampler, energy, chains)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(5, DEVICE), chains + (d,)))
    kw = dict(burn_in=2, thin=2, progress=False)
    first = {b: fnebm.sample_chain(alg.step, state, fr.key(3, DEVICE), 4, backend=b, **kw) for b in ("triton", "eager")}
    _assert_runs_close(first["triton"], first["eager"])
    if sampler == "mala":
        accepted = first["eager"][2].is_accepted
        assert accepted.any() and not accepted.all()

    done, plans = [], []
    out = tuple(torch.zeros_like(t) for t in (first["triton"][1],)) + (type(first["triton"][2])(
        *(torch.zeros_like(t) for t in first["triton"][2])),)
    more = fnebm.sample_chain(alg.step, first["triton"][0], None, 4, thin=2, backend="triton", chunk_size=2, out=out,
                              on_chunk=lambda i, n, s: done.append((i, n)), on_plan=plans.append, progress=False)
    assert done == [(2, 4), (4, 4)]
    assert [(p.kernel, p.compiled, p.steps) for p in plans] == [(True, False, 4)]  # the plan says a kernel ran
    assert more[1] is out[0] and more[2][0] is out[1][0]  # written in place
    _assert_runs_close(more, fnebm.sample_chain(alg.step, first["eager"][0], None, 4, thin=2, backend="eager",
                                                progress=False))


def test_backend_rules(kernels_on_cpu, monkeypatch):
    """Which backend serves what, and why backend="triton" refuses (no kernel runs: cheap)."""
    energy = _covered("harmonic", 3)
    alg = fnebm.mala(energy, 0.1)
    x = fr.normal(fr.key(6, DEVICE), (4, 3))
    state = torch.func.vmap(alg.init)(x)
    key = fr.key(0, DEVICE)
    chain = fnebm.chain.init(state, key)

    def refuses(match, step=alg.step, chain=chain, collect="position", auto=None):
        with pytest.raises(ValueError, match=match):
            _engine(step, chain, "triton", collect)
        # "auto" then runs no kernel, or (on the CPU) the C kernel where it covers the run
        assert _engine(step, chain, "auto", collect) == (auto or "torch")

    def served(backend):
        return _engine(alg.step, chain, backend) != "torch"

    # on CPU: served by "triton" under the interpreter with the test switch; "auto" takes the
    # Triton kernel on CUDA and the C kernel on the CPU (where a C compiler builds it)
    from fnebm.kernels import cpu_chain

    c_engine = "c" if cpu_chain.available() is None else None
    assert served("triton")
    assert _engine(alg.step, chain, "auto") == ("triton" if DEVICE == "cuda" else c_engine or "torch")
    assert not served("torch") and not served("compiled") and not served("eager")
    refuses("not fnebm.langevin", step=fnebm.vmap_chains(lambda s, k: alg.step(s, k)))
    refuses("not fnebm.langevin", step=fnebm.hmc(energy, 0.1, num_integration_steps=3).step)
    refuses("collect", collect=None)
    refuses("Rosenbrock", step=fnebm.mala(E.rosenbrock(dtype=torch.float32, device=DEVICE), 0.1).step)
    # a full precision matrix: the Triton kernel refuses it, the C kernel takes it
    refuses("full precision", step=fnebm.mala(E.gaussian(torch.zeros(3), torch.eye(3) + 0.5, dtype=torch.float32,
                                                         device=DEVICE), 0.1).step,
            auto=None if DEVICE == "cuda" else c_engine)
    e64 = E.harmonic(2.0, dtype=torch.float64, device=DEVICE)
    alg64 = fnebm.mala(e64, 0.1)
    refuses("float32", step=alg64.step, chain=fnebm.chain.init(torch.func.vmap(alg64.init)(x.double()), key))
    refuses("LangevinState", step=fnebm.langevin(energy, 0.1).step)  # a MALAState given to Langevin
    refuses("gradient", step=fnebm.mala(energy, torch.tensor(0.1, device=DEVICE, requires_grad=True)).step)
    refuses("neither 0-dim nor per chain", step=fnebm.mala(energy, torch.full((5,), 0.1, device=DEVICE)).step)
    # out= buffers: checked before any launch; non-contiguous ones are filled by a copy (2 steps)
    with pytest.raises(ValueError, match="out"):
        fnebm.sample_chain(alg.step, state, key, 2, backend="triton", out=(torch.empty(2, 4, 3, device=DEVICE),))
    ref = fnebm.sample_chain(alg.step, state, key, 2, backend="triton", progress=False)
    strided = (torch.empty(3, 4, 2, device=DEVICE).permute(2, 1, 0),
               type(ref[2])(*(torch.empty_like(t.mT).mT for t in ref[2])))
    got = fnebm.sample_chain(alg.step, state, key, 2, backend="triton", out=strided, progress=False)
    assert got[1] is strided[0] and not got[1].is_contiguous()
    _assert_runs_close(got, ref)
    if DEVICE == "cpu":
        monkeypatch.setattr(dispatch, "_INTERPRETER_ON_CPU", False)
        refuses("not a CUDA device", auto=c_engine)
    with pytest.raises(ValueError, match="backend must be one of"):
        fnebm.sample_chain(alg.step, state, key, 2, backend="gpu")
    plans = []
    fnebm.sample_chain(alg.step, state, key, 2, backend="eager", compile=True, on_plan=plans.append, progress=False)
    assert not plans[0].compiled  # "eager" overrides compile
