"""The C whole-chain Langevin kernel (fnebm.kernels.cpu_chain) against the samplers it runs
(fnebm.langevin and fnebm.mala, stepped by fnebm.chain.run from the same keys), and sample_chain's
dispatch to it (backend="c", and "auto" on the CPU)."""

import os
import subprocess
import sys

import pytest
import torch

import fnebm
from fnebm import energies
from fnebm import random as fr
from fnebm.chain import engines as be
from fnebm.kernels import dispatch
from fnebm.kernels import cpu_chain

pytestmark = pytest.mark.skipif(cpu_chain.available() is not None,
                                reason=f"the C kernel is unavailable here: {cpu_chain.available()}")

F32 = torch.float32


def _outputs(n_draws, x, mala=False):
    chains = (n_draws,) + tuple(x.shape[:-1])
    flag = lambda: torch.empty(chains, dtype=torch.bool)  # noqa: E731
    if mala:
        return torch.empty((n_draws,) + tuple(x.shape)), torch.empty(chains), flag(), flag()
    return torch.empty((n_draws,) + tuple(x.shape)), flag()


def _run(energy, x, keys, n_steps, h=0.01, s=1.0, start=0, burn_in=0, thin=1, mala=False):
    """The kernel over a whole run, as backend.py calls it: (position, energy, grad, trace, *info)."""
    e, g = energy(x), energy.grad(x)
    h = torch.as_tensor(h, dtype=F32)
    s = torch.as_tensor(s, dtype=F32)
    n_kept = n_steps // thin
    outputs = _outputs(n_kept, x, mala)
    final = cpu_chain.run_into(energy, x, e, g, keys, start, h.expand(x.shape[:-1]).contiguous() if h.ndim else h,
                               s, outputs, mala=mala, n_total=burn_in + n_steps, first=burn_in + thin - 1,
                               thin=thin, n_keep=n_kept, j0=0)
    return final + outputs


def _sampler(energy, x, keys, n_steps, h=0.01, s=1.0, start=0, burn_in=0, thin=1, mala=False):
    """What the kernel must give: fnebm.langevin's or fnebm.mala's own steps (fnebm.chain.run,
    eager) from the same keys, kept as the kernel keeps them: (position, energy, grad, trace, *info)."""
    alg = fnebm.mala(energy, h) if mala else fnebm.langevin(energy, h, s)
    final, trace, info = fnebm.chain.run(alg.step, torch.func.vmap(alg.init)(x), keys, burn_in + n_steps, start=start)
    kept = slice(burn_in + thin - 1, burn_in + n_steps, thin)
    return (final.position, final.energy, final.grad, trace[kept], *(t[kept] for t in info))


@pytest.mark.parametrize("d", [1, 3, 4, 5, 10, 17])
def test_noise_is_the_fnebm_random_stream(d):
    # one step from x = 0, grad = 0 with h = 1/2 and noise scale 1 is the step's normal draw itself;
    # 37 chains (two full blocks of 16 and a partial one); a start past 2**32 uses the counter's high word
    n, start = 37, 2**32 + 5
    energy = energies.harmonic(1e-30)
    x = torch.zeros(n, d)
    keys = fr.split(fr.key(3), n)
    _, _, _, trace, div = _run(energy, x, keys, 1, h=0.5, start=start)
    want = fr.normal(fr.fold_in(keys, start), (d,))
    # the Philox words are exact; log, sin and cos are Cephes' polynomials (about 1 ulp)
    torch.testing.assert_close(trace[0], want, rtol=2e-6, atol=2e-6)
    assert not div.any()


def _energies(d):
    mean = torch.linspace(-1.0, 1.0, d)
    return {
        "double_well": energies.double_well(2.0, 1.0),
        "harmonic": energies.harmonic(1.5),
        "diagonal_gaussian": energies.Gaussian(mean, torch.linspace(0.5, 2.0, d)),
        "rastrigin": energies.rastrigin(3.0),
    }


@pytest.mark.parametrize("name", ["double_well", "harmonic", "diagonal_gaussian", "rastrigin"])
def test_chain_matches_the_sampler(name):
    d, n = 5, 40
    energy = _energies(d)[name]
    assert cpu_chain.covers(energy) is None
    x = fr.normal(fr.key(1), (n, d))
    keys = fr.split(fr.key(2), n)
    # one step size per chain; Rastrigin's curvature (2 + 4 pi^2 a = 120 here) makes larger steps
    # chaotic, so that rounding differences grow until the chains part (measured: 2.0 after 12 steps at 0.05)
    h = torch.linspace(0.001, 0.006, n) if name == "rastrigin" else torch.linspace(0.005, 0.05, n)
    got = _run(energy, x, keys, 12, h=h, s=0.8, start=3, burn_in=4, thin=3)
    want = _sampler(energy, x, keys, 12, h=h, s=0.8, start=3, burn_in=4, thin=3)
    assert want[3].shape == (4, n, d)
    for a, b in zip(got[:4], want[:4]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert torch.equal(got[4], want[4])


@pytest.mark.parametrize("name", ["double_well", "harmonic", "diagonal_gaussian", "rastrigin"])
def test_mala_chain_matches_the_sampler(name):
    d, n = 5, 40
    energy = _energies(d)[name]
    x = fr.normal(fr.key(1), (n, d))
    keys = fr.split(fr.key(2), n)
    # acceptance from about 1 down to well below it (Rastrigin: see test_chain_matches_the_sampler)
    h = torch.linspace(0.002, 0.012, n) if name == "rastrigin" else torch.linspace(0.01, 0.3, n)
    got = _run(energy, x, keys, 12, h=h, start=3, burn_in=4, thin=3, mala=True)
    want = _sampler(energy, x, keys, 12, h=h, start=3, burn_in=4, thin=3, mala=True)
    for a, b in zip(got[:5], want[:5]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # the decisions: equal unless a log alpha lies within rounding of log u (none here)
    assert torch.equal(got[5], want[5]) and torch.equal(got[6], want[6])
    assert 0.1 < want[5].float().mean() < 0.95


def test_mala_rejects_and_flags_divergent_proposals_as_the_sampler_does():
    energy = energies.double_well(2.0, 1.0)
    x = 3.0 * fr.normal(fr.key(4), (64, 3))
    keys = fr.split(fr.key(5), 64)
    h = torch.logspace(-2, 9, 64)  # from well-behaved to proposals whose energy overflows float32
    got = _run(energy, x, keys, 6, h=h, mala=True)
    want = _sampler(energy, x, keys, 6, h=h, mala=True)
    assert want[6].any() and not want[6].all()
    assert torch.equal(got[6], want[6]) and torch.equal(got[5], want[5])
    assert (got[4][got[6]] == 0).all()  # a divergent proposal's acceptance rate is exp(-inf)
    torch.testing.assert_close(got[3], want[3], rtol=1e-4, atol=1e-4)


def test_divergent_moves_are_dropped_and_flagged_as_the_sampler_does():
    # a step size this large overflows the double well's gradient for some chains within a few steps
    energy = energies.double_well(2.0, 1.0)
    x = 3.0 * fr.normal(fr.key(4), (64, 3))
    keys = fr.split(fr.key(5), 64)
    got = _run(energy, x, keys, 6, h=0.2)
    want = _sampler(energy, x, keys, 6, h=0.2)
    assert want[4].any() and not want[4].all()
    assert torch.equal(got[4], want[4])
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[3]).all()
    torch.testing.assert_close(got[3], want[3], rtol=1e-4, atol=1e-4)


def test_thread_count_does_not_change_the_draws():
    energy = energies.double_well(2.0, 1.0)
    x = fr.normal(fr.key(6), (100, 10))
    keys = fr.split(fr.key(7), 100)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(energy, x, keys, 20)
        torch.set_num_threads(2)
        two = _run(energy, x, keys, 20)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


# ------------------------------------------------------------------------- sample_chain


def _state(n=50, d=10, energy=None, h=0.01):
    alg = fnebm.langevin(energy or energies.double_well(2.0, 1.0), h)
    return alg, torch.func.vmap(alg.init)(fr.normal(fr.key(0), (n, d)))


def test_auto_takes_the_c_kernel_on_the_cpu_and_torch_never_does():
    # compile concerns the torch engine only: backend="torch" is how to ask for the sampler's own steps
    alg, state = _state()
    plans = []
    fnebm.sample_chain(alg.step, state, fr.key(1), 5, progress=False, on_plan=plans.append)
    fnebm.sample_chain(alg.step, state, fr.key(1), 5, progress=False, compile=True, on_plan=plans.append)
    fnebm.sample_chain(alg.step, state, fr.key(1), 5, progress=False, compile=False, on_plan=plans.append)
    fnebm.sample_chain(alg.step, state, fr.key(1), 5, progress=False, backend="torch", compile=False,
                       on_plan=plans.append)
    assert [p.kernel for p in plans] == [True, True, True, False]
    assert [p.engine for p in plans] == ["c", "c", "c", "eager"]
    assert "C kernel" in plans[0].reason and plans[3].skipped == ()


@pytest.mark.parametrize("make", [fnebm.langevin, fnebm.mala])
def test_c_backend_equals_the_eager_steps(make):
    alg = make(energies.double_well(2.0, 1.0), 0.01)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(0), (50, 10)))
    kw = dict(burn_in=3, thin=2, progress=False)
    chain, trace, info = fnebm.sample_chain(alg.step, state, fr.key(1), 20, backend="c", **kw)
    chain_e, trace_e, info_e = fnebm.sample_chain(alg.step, state, fr.key(1), 20, backend="eager", **kw)
    torch.testing.assert_close(trace, trace_e, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chain.state.position, chain_e.state.position, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chain.state.energy, chain_e.state.energy, rtol=1e-4, atol=1e-4)
    for a, b in zip(info, info_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert int(chain.steps_taken) == int(chain_e.steps_taken) == 23


def test_chunks_continuations_and_out_buffers_are_exact():
    alg, state = _state()
    whole, trace, info = fnebm.sample_chain(alg.step, state, fr.key(1), 12, backend="c", progress=False)
    chunked = fnebm.sample_chain(alg.step, state, fr.key(1), 12, backend="c", progress=False, chunk_size=5)
    assert torch.equal(chunked[1], trace) and torch.equal(chunked[0].state.position, whole.state.position)
    first, head, _ = fnebm.sample_chain(alg.step, state, fr.key(1), 7, backend="c", progress=False)
    rest, tail, _ = fnebm.sample_chain(alg.step, first, None, 5, backend="c", progress=False)
    assert torch.equal(torch.cat([head, tail]), trace) and torch.equal(rest.state.grad, whole.state.grad)
    bufs = (torch.zeros_like(trace), type(info)(torch.ones_like(info.is_divergent)))
    _, filled, _ = fnebm.sample_chain(alg.step, state, fr.key(1), 12, backend="c", progress=False, out=bufs)
    assert filled.data_ptr() == bufs[0].data_ptr() and torch.equal(bufs[0], trace)
    assert torch.equal(bufs[1].is_divergent, info.is_divergent)


def test_launches_cut_by_time_give_the_same_draws(monkeypatch):
    # the C kernel's launches are cut to about be._SLICE_S each (so that Ctrl-C is seen): any cut,
    # within a burn-in, across kept steps, gives the bits of one launch
    alg = fnebm.mala(energies.harmonic(2.0), 0.2)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(0), (40, 3)))
    kw = dict(burn_in=13, thin=3, backend="c", progress=False, collect=fnebm.chain.position_and_energy)
    whole = fnebm.sample_chain(alg.step, state, fr.key(1), 60, **kw)
    monkeypatch.setattr(be, "_FIRST_SLICE_WORK", 200)  # a first launch of 1 step, then 8x, 64x, ...
    monkeypatch.setattr(be, "_SLICE_S", 1e-9)  # ... or as the rate says: 1 step each
    seen = []
    cut = fnebm.sample_chain(alg.step, state, fr.key(1), 60, **kw, on_chunk=lambda d, t, s: seen.append(d))
    assert seen == list(range(1, 74)) and torch.equal(cut[1][0], whole[1][0]) and torch.equal(cut[1][1], whole[1][1])
    assert all(torch.equal(a, b) for a, b in zip(cut[2], whole[2]))
    assert torch.equal(cut[0].state.position, whole[0].state.position)
    monkeypatch.setattr(be, "_SLICE_S", 1e9)
    seen.clear()
    grown = fnebm.sample_chain(alg.step, state, fr.key(1), 60, **kw, chunk_size=20, on_chunk=lambda d, t, s: seen.append(d))
    assert seen == [1, 9, 29, 49, 69, 73] and torch.equal(grown[1][0], whole[1][0])  # 8x each, at most chunk_size


def test_the_next_launch_is_sized_by_the_measured_rate():
    assert be._next_slice(100, be._SLICE_S / 2, 10**9) == 200
    assert be._next_slice(100, be._SLICE_S * 10, 10**9) == 10
    assert be._next_slice(100, 0.0, 10**9) == 800 and be._next_slice(100, 1e-9, 10**9) == 800  # at most 8x
    assert be._next_slice(100, 1e-9, 150) == 150 and be._next_slice(1, 1e3, 10) == 1
    x = torch.zeros(4000, 10)
    assert be._first_slice(x) == be._first_slice(x, energies.harmonic(1.0)) == (1 << 24) // 40000
    full = energies.gaussian(torch.zeros(10), torch.eye(10) + 0.5)  # d multiply-adds an element
    assert be._first_slice(x, full) == (1 << 24) // 400000 and not full.is_diagonal


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="waits for the library in /proc/<pid>/maps")
def test_ctrl_c_stops_a_long_c_kernel_run_promptly_and_keeps_earlier_outputs(tmp_path):
    # fnebm sample on a run of about ten minutes in the C kernel, interrupted a second after the
    # kernel's library is mapped (the run starts then): one line and exit 130 while the launch
    # in progress ends (about be._SLICE_S), not when a twentieth of the run has (minutes)
    import select
    import signal
    import time

    out = tmp_path / "draws.pt"
    out.write_bytes(b"an earlier run's draws")
    cmd = [sys.executable, "-m", "fnebm", "sample", "--energy", "gaussian", "--dim", "10", "--sampler", "mala",
           "--chains", "4000", "--steps", "2000000", "--thin", "2000000", "--burn-in", "0", "--no-progress",
           "--out", str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while "cpu_chain-" not in open(f"/proc/{p.pid}/maps").read():
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() else "no start"
            time.sleep(0.1)
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        ready, _, _ = select.select([p.stderr], [], [], 5.0)  # the line, within seconds of Ctrl-C
        assert ready, "no line on stderr within 5 s of SIGINT"
        assert p.stderr.readline() == "fnebm: interrupted\n"
        assert p.wait(timeout=120) == 130
        assert p.stderr.read() == "" and p.stdout.read() == ""
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert out.read_bytes() == b"an earlier run's draws"  # docs/cli.md: writes are atomic
    assert sorted(f.name for f in tmp_path.iterdir()) == ["draws.pt"]


@pytest.mark.parametrize("case, match", [
    ("wrapped", "fnebm.langevin"),
    ("float64", "float32"),
    ("rosenbrock", "Rosenbrock"),
    ("collect", "collect"),
])
def test_c_backend_says_why_it_cannot_run(case, match):
    energy = energies.rosenbrock() if case == "rosenbrock" else energies.double_well(2.0, 1.0, dtype=torch.float64
                                                                                    if case == "float64" else None)
    alg = fnebm.langevin(energy, 0.01)
    x = fr.normal(fr.key(0), (8, 3), torch.float64 if case == "float64" else F32)
    state = torch.func.vmap(alg.init)(x)
    step = (lambda s, k: alg.step(s, k)) if case == "wrapped" else alg.step
    collect = (lambda s: s.energy) if case == "collect" else None
    with pytest.raises(ValueError, match=match):
        fnebm.sample_chain(step, state, fr.key(1), 3, backend="c", collect=collect, progress=False)
    # "auto" runs them anyway, without the kernel
    plans = []
    fnebm.sample_chain(step, state, fr.key(1), 3, collect=collect, progress=False, on_plan=plans.append)
    assert not plans[0].kernel


def test_without_a_compiler_auto_falls_back_and_c_says_why(tmp_path):
    code = (
        "import torch, fnebm\n"
        "from fnebm import energies, random as fr\n"
        "from fnebm.kernels import cpu_chain\n"
        "alg = fnebm.langevin(energies.double_well(), 0.01)\n"
        "state = torch.func.vmap(alg.init)(fr.normal(fr.key(0), (8, 3)))\n"
        "plans = []\n"
        "fnebm.sample_chain(alg.step, state, fr.key(1), 3, progress=False, compile=False, on_plan=plans.append)\n"
        "fnebm.sample_chain(alg.step, state, fr.key(1), 3, progress=False, on_plan=plans.append)\n"
        "assert not plans[-1].kernel, plans\n"
        "assert 'the C kernel covers this run but could not be used (no C compiler found' in plans[-1].reason\n"
        "assert all(p.skipped[0].unavailable and p.skipped[0].engine == 'c' for p in plans), plans\n"
        "try:\n"
        "    fnebm.sample_chain(alg.step, state, fr.key(1), 3, backend='c', progress=False)\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), FNEBM_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert 'backend="c" cannot run this chain: no C compiler found' in done.stdout
    # no library built or left half-built (fnebm._inductor may keep its records of Inductor there)
    assert not any(p.suffix in (".so", ".o", ".tmp") for p in (tmp_path / "cache").glob("*"))


def test_the_library_is_built_once_and_then_loaded(tmp_path):
    code = "from fnebm.kernels import cpu_chain; assert cpu_chain.available() is None; print(cpu_chain.LIBRARY.lib._name)"
    env = dict(os.environ, FNEBM_CACHE_DIR=str(tmp_path))
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    # the build's lock file stays, and the compiler's --version answer (compiler_version)
    assert len(list(tmp_path.glob("cc-*.version"))) == 1
    built = sorted(p for p in tmp_path.iterdir() if p.suffix not in (".lock", ".version"))
    # the library and its checksum record; no temporary file left behind
    assert [p.suffix for p in built] == [".so", ".sha256"] and built[1].name == built[0].name + ".sha256"
    stamp = built[0].stat().st_mtime_ns
    second = subprocess.run([sys.executable, "-c", code + "; print(cpu_chain.build_seconds())"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and second.stdout.splitlines() == [first.stdout.strip(), "0.0"]
    assert built[0].stat().st_mtime_ns == stamp


def _why_not_c(step, chain):
    path = next(p for p in dispatch.FAST_PATHS if p.engine == "c" and p.scope == "chain")
    return dispatch.why_not(path, dispatch.RunRequest(step, chain.state, chain.keys, chain.steps_taken, "position",
                                                      False))


def test_why_not_c_is_none_for_a_covered_run():
    alg, state = _state(energy=energies.harmonic(2.0))
    chain = fnebm.chain.init(state, fr.key(0))
    assert _why_not_c(alg.step, chain) is None
    assert "MALAState" in _why_not_c(fnebm.mala(energies.harmonic(2.0), 0.1).step, chain)


def test_position_and_energy_are_written_by_the_kernel():
    alg, state = _state(energy=energies.Gaussian(torch.zeros(10), torch.linspace(0.5, 2.0, 10)))
    collect = fnebm.chain.position_and_energy
    plans = []
    chain, (xs, es), info = fnebm.sample_chain(alg.step, state, fr.key(1), 9, thin=3, collect=collect,
                                               progress=False, on_plan=plans.append)
    assert plans[0].kernel
    _, (xs_e, es_e), _ = fnebm.sample_chain(alg.step, state, fr.key(1), 9, thin=3, collect=collect,
                                            backend="eager", progress=False)
    torch.testing.assert_close(xs, xs_e, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(es, es_e, rtol=1e-4, atol=1e-5)
    assert es.shape == (3, 50)
    # out= with the pair: filled in place
    bufs = ((torch.empty_like(xs), torch.empty_like(es)), info)
    _, (xo, eo), _ = fnebm.sample_chain(alg.step, state, fr.key(1), 9, thin=3, collect=collect, out=bufs,
                                        progress=False)
    assert xo is bufs[0][0] and eo is bufs[0][1] and torch.equal(eo, es) and torch.equal(xo, xs)


def test_runs_inside_vmap_fall_back_and_equal_the_eager_steps():
    # sample_chain under torch.func.vmap holds wrapped tensors the kernel cannot read: "auto" runs
    # the eager steps, and "c" says why
    def run(x0, backend="auto"):
        alg = fnebm.langevin(energies.double_well(), 0.01)
        state = torch.func.vmap(alg.init)(x0)
        return fnebm.sample_chain(alg.step, state, fr.key(1), 3, progress=False, backend=backend)[1]

    x0 = fr.normal(fr.key(0), (2, 4, 3))
    got = torch.func.vmap(run)(x0)
    want = torch.stack([run(x, backend="eager") for x in x0])
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="torch.func transform"):
        torch.func.vmap(lambda x: run(x, backend="c"))(x0)


def test_run_into_checks_what_it_reads():
    energy = energies.double_well()
    x = torch.zeros(4, 3)
    keys = fr.split(fr.key(0), 4)
    outputs = _outputs(1, x)
    e, g = energy(x), energy.grad(x)
    one = torch.tensor(1.0)
    kw = dict(mala=False, n_total=1, first=0, thin=1, n_keep=1, j0=0)
    with pytest.raises(ValueError, match="step_size must hold 1 or 4"):
        cpu_chain.run_into(energy, x, e, g, keys, 0, torch.full((2,), 0.1), one, outputs, **kw)
    with pytest.raises(TypeError, match="step_size must be a float32"):
        cpu_chain.run_into(energy, x, e, g, keys, 0, torch.tensor(0.1, dtype=torch.float64), one, outputs, **kw)
    with pytest.raises(ValueError, match="keys must be"):
        cpu_chain.run_into(energy, x, e, g, keys[:3], 0, one, one, outputs, **kw)
    with pytest.raises(TypeError, match="keys must be an int64"):
        cpu_chain.run_into(energy, x, e, g, keys.to(torch.int32), 0, one, one, outputs, **kw)


def test_the_op_equals_the_samplers_and_traces_whole():
    energy = energies.double_well(2.0, 1.0)
    x = fr.normal(fr.key(8), (20, 4))
    keys = fr.split(fr.key(9), 20)
    h = torch.linspace(0.01, 0.1, 20)
    got = cpu_chain.mala_chain(energy, x, energy(x), energy.grad(x), keys, 5, h, n_steps=6, burn_in=2, thin=2)
    want = _sampler(energy, x, keys, 6, h=h, start=5, burn_in=2, thin=2, mala=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    got = cpu_chain.langevin_chain(energy, x, energy(x), energy.grad(x), keys, 5, 0.05, 0.5, n_steps=4)
    want = _sampler(energy, x, keys, 4, h=0.05, s=0.5, start=5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # one node in a fullgraph trace (aot_eager: the same trace as Inductor, without its C++ compile)
    run = torch.compile(lambda x, k: cpu_chain.langevin_chain(energy, x, energy(x), energy.grad(x), k, 5, 0.05, 0.5,
                                                              n_steps=4).trace, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(run(x, keys), got.trace)
    with pytest.raises(TypeError, match="Rosenbrock"):
        cpu_chain.langevin_chain(energies.rosenbrock(), x, x[:, 0], x, keys, 0, 0.1, n_steps=2)
    with pytest.raises(TypeError, match="float32"):
        x64 = x.double()
        e64 = energies.double_well(2.0, 1.0, dtype=torch.float64)
        cpu_chain.langevin_chain(e64, x64, e64(x64), e64.grad(x64), keys, 0, 0.1, n_steps=2)


@pytest.mark.parametrize("make", [fnebm.langevin, fnebm.mala])
def test_a_gaussian_with_a_full_precision_equals_the_eager_steps(make):
    d = 7
    a = fr.normal(fr.key(10), (d, d))
    target = energies.gaussian(torch.linspace(-1.0, 1.0, d), a @ a.T / d + 0.5 * torch.eye(d))
    assert not target.is_diagonal and cpu_chain.covers(target) is None
    alg = make(target, 0.05)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(11), (37, d)))
    plans = []
    chain, trace, info = fnebm.sample_chain(alg.step, state, fr.key(12), 20, progress=False, on_plan=plans.append)
    chain_e, trace_e, info_e = fnebm.sample_chain(alg.step, state, fr.key(12), 20, backend="eager", progress=False)
    assert plans[0].kernel
    torch.testing.assert_close(trace, trace_e, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chain.state.energy, chain_e.state.energy, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chain.state.grad, chain_e.state.grad, rtol=1e-4, atol=1e-5)
    for got, want in zip(info, info_e):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the op takes it too
    x = state.position
    op = cpu_chain.langevin_chain(target, x, state.energy, state.grad, fr.split(fr.key(12), 37), 0, 0.05,
                                  n_steps=3)
    assert op.trace.shape == (3, 37, d) and torch.isfinite(op.trace).all()


def test_a_gaussian_whose_factor_is_not_triangular_is_computed_whole():
    # after a training step L is no longer triangular (docs/training.md): the kernel must use all of it
    d = 4
    tril = torch.linalg.cholesky(torch.eye(d) + 0.5)
    factor = tril + 0.3 * torch.triu(torch.ones(d, d), 1)  # upper entries a gradient step could leave
    target = energies.Gaussian(torch.linspace(-1.0, 1.0, d), factor)
    for make in (fnebm.langevin, fnebm.mala):
        alg = make(target, 0.05)
        state = torch.func.vmap(alg.init)(fr.normal(fr.key(13), (33, d)))
        _, trace, info = fnebm.sample_chain(alg.step, state, fr.key(14), 10, backend="c", progress=False)
        _, trace_e, info_e = fnebm.sample_chain(alg.step, state, fr.key(14), 10, backend="eager", progress=False)
        torch.testing.assert_close(trace, trace_e, rtol=1e-4, atol=1e-5)
        for got, want in zip(info, info_e):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_an_energy_for_another_dimension_is_refused_not_misread():
    # the state holds 5-D chains, the step a 3-D Gaussian: the kernel would read the Gaussian's
    # parameters at the wrong size, so it says why and "auto" leaves the run to the eager steps
    g3 = energies.gaussian(torch.zeros(3), torch.eye(3) + 0.5)
    g5 = energies.gaussian(torch.zeros(5), torch.eye(5) + 0.5)
    state = torch.func.vmap(fnebm.mala(g5, 0.1).init)(fr.normal(fr.key(0), (4, 5)))
    step = fnebm.mala(g3, 0.1).step
    with pytest.raises(ValueError, match="does not take the position's 5 elements"):
        fnebm.sample_chain(step, state, fr.key(1), 2, backend="c", progress=False)
    chain = fnebm.chain.init(state, fr.key(1))
    assert "dim == 3" in _why_not_c(step, chain)
    x = state.position
    with pytest.raises(ValueError, match="dim"):
        cpu_chain.run_into(g3, x, state.energy, state.grad, fr.split(fr.key(1), 4), 0, torch.tensor(0.1),
                           torch.tensor(1.0), _outputs(1, x, True), mala=True, n_total=1, first=0, thin=1,
                           n_keep=1, j0=0)


def test_the_op_takes_new_parameter_values_without_a_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    x = fr.normal(fr.key(15), (20, 3))
    keys = fr.split(fr.key(16), 20)

    @torch.compile(fullgraph=True, backend=counter)
    def run(target, h, x, keys):
        return cpu_chain.mala_chain(target, x, target(x), target.grad(x), keys, 0, h, n_steps=3).trace

    for scale, h in ((1.0, 0.1), (2.0, 0.05), (0.5, 0.2)):  # new energy parameters and step sizes
        target = energies.gaussian(torch.zeros(3), scale * (torch.eye(3) + 0.5))
        want = cpu_chain.mala_chain(target, x, target(x), target.grad(x), keys, 0, h, n_steps=3).trace
        torch.testing.assert_close(run(target, torch.tensor(h), x, keys), want)
    assert counter.frame_count == 1
