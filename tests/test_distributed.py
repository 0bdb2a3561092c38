"""fnebm.distributed: the chain layout across ranks, and 2 gloo processes on CPU.

The multi-process tests spawn 2 processes (``torch.multiprocessing``, spawn) that meet in a
gloo group through a file store, with a 60 s timeout on the group's collectives. The parent
polls them with its own deadline: a rank that raises fails the test at once (the other rank
is terminated, not waited for), and a run past the deadline is killed and fails.
"""

import datetime
import os
import time
import warnings

import pytest
import torch
import torch.multiprocessing as mp

import fnebm
from fnebm import diagnostics as fd
from fnebm import distributed as fdist
from fnebm import energies as E
from fnebm import random as fr

F64 = torch.float64
N_CHAINS = 9  # 5 + 4: ranks hold different numbers of chains
N_STEPS, BURN_IN = 40, 10
DEADLINE = 300  # seconds for a whole spawned run (two aot_eager compiles on a loaded 2-core machine)


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("n, w", [(9, 2), (8, 2), (7, 3), (5, 5)])
def test_blocks_cover_the_chains_in_order(n, w):
    key = fr.key(3)
    slices = [fdist.chain_slice(n, rank_=r, world_size_=w) for r in range(w)]
    assert [s.start for s in slices] == [0, *[s.stop for s in slices[:-1]]] and slices[-1].stop == n
    sizes = [s.stop - s.start for s in slices]
    assert max(sizes) - min(sizes) <= 1 and sizes == fdist.chain_counts(n, w)
    # the keys of the blocks, in rank order, are the single-process keys
    assert torch.equal(torch.cat([fr.split(key, n)[s] for s in slices]), fr.split(key, n))


def test_identity_without_process_group():
    assert not fdist.is_distributed() and fdist.rank() == 0 and fdist.world_size() == 1
    key = fr.key(1)
    assert fdist.chain_slice(6) == slice(0, 6)
    assert torch.equal(fdist.local_keys(key, 6), fr.split(key, 6))
    keys = fr.split(key, 6)
    assert torch.equal(fdist.local_keys(keys), keys)
    x = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(fdist.shard(x), x)
    trace = fr.normal(fr.key(2), (50, 4, 3), F64)
    assert fdist.gather_chains(trace) is trace
    for name in ("rhat", "ess_bulk", "ess_tail", "ess", "mcse_mean", "mcse_sd"):
        assert torch.equal(getattr(fdist, name)(trace), getattr(fd, name)(trace))
    assert str(fdist.summary_table(trace)) == str(fd.summary_table(trace))


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_chains"):
        fdist.chain_counts(1, 2)
    with pytest.raises(TypeError, match="n_chains"):
        fdist.local_keys(fr.key(0))
    with pytest.raises(ValueError, match="n_chains"):
        fdist.local_keys(fr.split(fr.key(0), 4), 5)
    with pytest.raises(ValueError, match="rank"):
        fdist.chain_slice(4, rank_=2, world_size_=2)


# ----------------------------------------------------------------------- two processes


def _entry(rank, fn, store, nprocs, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=nprocs,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        fn(rank, *args)
        # every rank done before any tears the group down: a rank that destroyed it (and its file
        # store) while the other was still leaving its last collective once aborted that rank
        # ("terminate called without an active exception", SIGABRT) in a full-suite run
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(fn, tmp_path, *args, nprocs=2, deadline=DEADLINE):
    """Run ``fn(rank, *args)`` in ``nprocs`` gloo processes; re-raise a rank's error at once.

    A rank killed by SIGABRT ("terminate called without an active exception", from torch's native
    threads; seen twice in about fifteen full-suite runs, never when the file ran alone, and not
    reproduced) is run again once, in fresh processes on a fresh store; a Python error in a rank,
    a wrong result or a second crash fails the test."""
    for attempt in range(2):
        try:
            return _spawn_once(fn, tmp_path / f"store{attempt}", args, nprocs, deadline)
        except mp.ProcessExitedException as exc:
            if attempt or exc.signal_name != "SIGABRT":
                raise
            warnings.warn(f"a rank was killed by {exc.signal_name}; running the {nprocs} processes again")


def _spawn_once(fn, store, args, nprocs, deadline):
    ctx = mp.start_processes(
        _entry, args=(fn, str(store), nprocs, args), nprocs=nprocs, join=False, start_method="spawn"
    )
    end = time.monotonic() + deadline
    while not ctx.join(timeout=1):  # raises as soon as a rank fails, after terminating the others
        if time.monotonic() > end:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the {nprocs} processes did not finish within {deadline} s")


def _target():
    return E.gaussian(torch.tensor([1.0, -1.0], dtype=F64), torch.tensor([[1.0, 0.8], [0.8, 1.0]], dtype=F64))


def _tied_trace():
    """(41, N_CHAINS, 3): odd draws, ties (values rounded to 0.25), one NaN in a late chain."""
    t = torch.round(4 * fr.normal(fr.key(11), (41, N_CHAINS, 3), F64)) / 4
    t[:, :, 1] += torch.linspace(0, 2, N_CHAINS, dtype=F64)  # chains disagree: R-hat > 1
    t[7, N_CHAINS - 1, 2] = torch.nan
    return t


def _sampling_worker(rank, out):
    alg = fnebm.mala(_target(), 0.5)
    # the start from per-chain keys: this rank's rows, no global tensor
    x0 = 3.0 * fr.normal(fdist.local_keys(fr.key(100), N_CHAINS), (2,), F64)
    state = torch.func.vmap(alg.init)(x0)
    cache = fnebm.chain.RunnerCache(backend="aot_eager")
    keys = fdist.local_keys(fr.key(7), N_CHAINS)
    _, trace, info = fnebm.sample_chain(alg.step, state, keys, N_STEPS, burn_in=BURN_IN, cache=cache, progress=False)
    result = {
        "local_chains": trace.shape[1],
        "trace": fdist.gather_chains(trace),
        "info": fdist.gather_chains(info._asdict()),
        # empty leaves (an empty replay ring, no kept draws): gloo aborts on empty collectives
        "empty": fdist.gather_chains((trace[:0], torch.zeros(2, trace.shape[1], 0), torch.zeros(3, 0))),
        "summary": fdist.summary(trace, info),
        "table": str(fdist.summary_table(trace, info)),
        "rhat": fdist.rhat(trace),
    }
    tied = _tied_trace()[:, fdist.chain_slice(N_CHAINS)]
    names = ("rhat", "ess_bulk", "ess_tail", "ess", "mcse_mean", "mcse_sd")
    result["tied"] = {name: getattr(fdist, name)(tied) for name in names}
    result["tied_summary"] = fdist.summary(tied)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def _close(a, b, tol=1e-10):
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    assert torch.equal(a.isnan(), b.isnan()), (a, b)
    torch.testing.assert_close(a, b, rtol=tol, atol=0.0, equal_nan=True)


def test_two_ranks_equal_one_process(tmp_path):
    _spawn(_sampling_worker, tmp_path, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert (r0["local_chains"], r1["local_chains"]) == (5, 4)

    # one process, the same key and the same 9 chains, through the same engine as the ranks (aot_eager:
    # the traced ATen ops; eager draws come from fnebm.random's C code, equal to them only to an ulp)
    alg = fnebm.mala(_target(), 0.5)
    x0 = 3.0 * fr.normal(fr.split(fr.key(100), N_CHAINS), (2,), F64)
    state = torch.func.vmap(alg.init)(x0)
    _, trace, info = fnebm.sample_chain(
        alg.step, state, fr.key(7), N_STEPS, burn_in=BURN_IN, progress=False,
        cache=fnebm.chain.RunnerCache(backend="aot_eager")
    )
    for r in (r0, r1):
        assert torch.equal(r["trace"], trace)  # bit for bit
        assert [tuple(t.shape) for t in r["empty"]] == [(0, N_CHAINS, 2), (2, N_CHAINS, 0), (3, 0)]
        for k, v in info._asdict().items():
            assert torch.equal(r["info"][k], v), k

    want = fd.summary(trace, info)
    for r in (r0, r1):
        assert set(r["summary"]) == set(want)
        for k, v in want.items():
            if isinstance(v, int):
                assert r["summary"][k] == v
            else:
                _close(r["summary"][k], v)
        _close(r["rhat"], fd.rhat(trace))
        assert r["table"] == str(fd.summary_table(trace, info))

    tied = _tied_trace()
    for r in (r0, r1):
        for name, got in r["tied"].items():
            _close(got, getattr(fd, name)(tied))
        for k, v in fd.summary(tied).items():
            _close(r["tied_summary"][k], v)
    assert torch.isnan(r0["tied"]["rhat"][2]) and not torch.isnan(r0["tied"]["rhat"][:2]).any()
    assert r0["tied"]["rhat"][1] > 1.1  # the diagnostics see the disagreement between ranks' chains


def _failing_worker(rank):
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    fdist.rhat(fr.normal(fr.key(0), (20, 2), F64))  # rank 0 waits in a collective for rank 1


def test_a_failing_rank_fails_the_test_fast(tmp_path):
    # whichever rank is reported first: rank 1's error, or rank 0's collective seeing its peer gone (gloo says closed or reset)
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails on purpose|Connection (closed|reset) by peer"):
        _spawn(_failing_worker, tmp_path, deadline=120)
    # no timed assertion (a loaded machine stretches any figure): _spawn's deadline bounds the wait,
    # and the match above shows the failure itself was reported, not a timeout


def _abort_once(rank, marker):
    if rank == 0 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()  # SIGABRT, as the native-thread crash _spawn runs again for


def _abort_always(rank):
    if rank == 0:
        os.abort()


def test_a_rank_killed_by_sigabrt_is_run_again_once(tmp_path):
    marker = str(tmp_path / "aborted")
    with pytest.warns(UserWarning, match="SIGABRT"):
        _spawn(_abort_once, tmp_path, marker, deadline=60)
    assert os.path.exists(marker)
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):  # twice: the test fails
        with pytest.warns(UserWarning, match="SIGABRT"):
            _spawn(_abort_always, again, deadline=60)
