"""fnebm._inductor: the per-machine record of compile times that compile="auto" starts from, the
vector-ISA record that spares each process Inductor's probe, and the faster linker of fnebm's builds."""

import json

import pytest
import torch

from fnebm import _inductor
from fnebm.chain.runner import RunnerCache


@pytest.fixture
def record(tmp_path, monkeypatch):
    path = tmp_path / "compile-times.json"
    monkeypatch.setattr(_inductor, "_times", None)
    monkeypatch.setattr(_inductor, "_times_path", lambda: path)
    return path


def test_compile_times_are_recorded_per_kind_and_read_by_a_new_process(record, monkeypatch):
    assert _inductor.machine_compile_s("chain") is None
    for t in (9.0, 30.0, 11.0):
        _inductor.record_compile_s("chain", t)
    _inductor.record_compile_s("energy", 4.0)
    _inductor.record_compile_s("chain", float("nan"))  # not a time: not recorded
    assert _inductor.machine_compile_s("chain") == 11.0 and _inductor.machine_compile_s("energy") == 4.0
    monkeypatch.setattr(_inductor, "_times", None)  # what the next process reads from the file
    assert _inductor.machine_compile_s("chain") == 11.0
    assert json.loads(record.read_text())[-1] == ["energy", 4.0]
    for i in range(40):
        _inductor.record_compile_s("chain", 100.0 + i)
    kinds = [k for k, _ in json.loads(record.read_text())]
    # the last of each kind are kept: many of one kind do not push another's out
    assert kinds.count("chain") == _inductor._TIMES_KEPT and kinds.count("energy") == 1


def test_a_damaged_record_is_no_record(record):
    record.write_text("{not json")
    assert _inductor.machine_compile_s("chain") is None
    _inductor.record_compile_s("chain", 5.0)  # and it is replaced whole
    assert json.loads(record.read_text()) == [["chain", 5.0]]


def test_auto_takes_a_compile_to_cost_what_it_took_on_this_machine(record):
    cache = RunnerCache()
    assert cache._compile_cost("kind") == (20.0, False)  # nothing recorded: the assumed figure
    _inductor.record_compile_s("chain", 6.0)
    assert cache._compile_cost("kind") == (6.0, "machine")
    with pytest.warns(UserWarning, match="compiles took 6 s on this machine, the median recorded"):
        cache.plan("kind", "shapes", 10, "auto")  # no eager step timed: it compiles, and says why
    cache.compile_s["other"] = 45.0  # a longer compile in this process raises it
    assert cache._compile_cost("kind") == (45.0, "process")
    assert cache._compile_cost("other") == (45.0, "process")
    assert RunnerCache(compile_estimate_s=12)._compile_cost("kind") == (12.0, False)  # an explicit figure stays


def test_the_vector_isa_option_is_left_to_a_user_who_set_it(monkeypatch):
    from torch._inductor import config

    monkeypatch.setattr(_inductor, "_isa_known", None)
    with config.patch({"cpp.vec_isa_ok": False}):
        assert _inductor._isa_record() is None
        assert _inductor.compile_patches() == {}


def test_the_vector_isa_record_follows_torchs_probe(tmp_path, monkeypatch):
    from torch._inductor import cpu_vec_isa

    from fnebm import _cbuild

    monkeypatch.setattr(_cbuild, "cache_dirs", lambda: [tmp_path])
    record = _inductor._isa_record()
    if record is None:
        pytest.skip("fnebm records the probe on x86-64 Linux only")
    folders, name = record
    # torch's test build fails for a set the CPU reports (whatever this process cached before): no
    # record, and Inductor decides as it would alone. The first build asked fails: an AVX2-only CPU
    # reports one set, an AVX-512 one two
    built = []
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda self, code: built.append(str(self)) or len(built) > 1)
    monkeypatch.setattr(_inductor, "_isa_known", None)
    assert _inductor.compile_patches() == {} and not (tmp_path / name).exists()
    assert built, "the probe did not run"
    monkeypatch.undo()
    monkeypatch.setattr(_cbuild, "cache_dirs", lambda: [tmp_path])
    monkeypatch.setattr(_inductor, "_isa_known", None)
    passed = _inductor.compile_patches()
    if passed:  # every set the CPU reports built and loaded here: recorded, and read by a new process
        assert (tmp_path / name).is_file()
        monkeypatch.setattr(_inductor, "_isa_known", None)
        assert _inductor.compile_patches() == {"cpp.vec_isa_ok": True}


def test_processes_recording_at_once_keep_each_others_times(record, monkeypatch):
    _inductor.record_compile_s("chain", 5.0)
    stale = list(_inductor._times)
    _inductor.record_compile_s("energy", 7.0)  # another process's entry, written meanwhile
    monkeypatch.setattr(_inductor, "_times", stale)  # this process read the file before it
    _inductor.record_compile_s("chain", 30.0)
    assert json.loads(record.read_text()) == [["chain", 5.0], ["energy", 7.0], ["chain", 30.0]]


def test_a_second_import_of_fnebm_keeps_the_operators():
    import subprocess
    import sys

    code = ("import sys, torch, fnebm\n"
            "k = fnebm.random.split(fnebm.random.key(1), 3)\n"
            "a = torch.func.vmap(lambda k: fnebm.random.normal(k, (2,)))(k)\n"
            "[sys.modules.pop(m) for m in list(sys.modules) if m.startswith('fnebm')]\n"
            "import fnebm\n"
            "assert torch.equal(torch.func.vmap(lambda k: fnebm.random.normal(k, (2,)))(k), a)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture
def linker_cache(tmp_path, monkeypatch):
    from fnebm import _cbuild

    monkeypatch.setattr(_cbuild, "cache_dirs", lambda: [tmp_path])
    monkeypatch.setattr(_inductor, "_linker", False)
    return tmp_path


def test_the_faster_linker_is_tried_once_and_recorded(linker_cache, monkeypatch):
    tried = []
    real = _inductor._test_link
    monkeypatch.setattr(_inductor, "_test_link", lambda cxx, name: tried.append(name) or real(cxx, name))
    flag = _inductor.fast_linker()
    if flag is None:
        assert not list(linker_cache.glob("inductor-linker-*.ok"))
        pytest.skip(f"no linker of {[p for _, p in _inductor._LINKERS]} links here (tried {tried})")
    assert flag == f"fuse-ld={tried[-1]}" and _inductor.fast_linker() == flag
    assert len(list(linker_cache.glob(f"inductor-linker-{tried[-1]}-*.ok"))) == 1
    assert len(list(linker_cache.glob("inductor-linker-*.no"))) == len(tried) - 1  # those that did not link
    # a new process reads the records and links nothing to find out
    monkeypatch.setattr(_inductor, "_linker", False)
    monkeypatch.setattr(_inductor, "_test_link", lambda cxx, name: pytest.fail(f"{name} tested again"))
    assert _inductor.fast_linker() == flag
    monkeypatch.setattr(_inductor, "FAST_LINKER", False)
    assert _inductor.fast_linker() is None


def test_a_linker_whose_test_link_fails_is_not_used_and_not_tried_again(linker_cache, monkeypatch):
    tried = []
    monkeypatch.setattr(_inductor, "_test_link", lambda cxx, name: tried.append(name) and False)
    assert _inductor.fast_linker() is None
    assert not list(linker_cache.glob("inductor-linker-*.ok"))
    assert len(list(linker_cache.glob("inductor-linker-*.no"))) == len(tried)
    monkeypatch.setattr(_inductor, "_linker", False)
    monkeypatch.setattr(_inductor, "_test_link", lambda cxx, name: pytest.fail(f"{name} tested again"))
    assert _inductor.fast_linker() is None
    with _inductor.linking_fast() as flag:  # nothing to pass: the builds as torch makes them
        assert flag is None and getattr(_inductor._scope, "linker", None) is None


def test_only_fnebms_builds_link_with_it_and_they_load(linker_cache):
    import threading

    from torch._inductor import config, cpp_builder
    from torch._inductor.codecache import CppCodeCache

    flag = _inductor.fast_linker()
    if flag is None:
        pytest.skip("no faster linker here")

    def command() -> str:
        return cpp_builder.CppBuilder(name="o", sources="i", BuildOption=cpp_builder.CppTorchOptions()).get_command_line()

    assert f"-{flag}" not in command()  # outside fnebm's compiles: torch's own flags
    others = []
    with _inductor.linking_fast() as on:
        mine = command()
        thread = threading.Thread(target=lambda: others.append(command()))  # a user's compile meanwhile
        thread.start()
        thread.join()
        with _inductor.linking_fast(False) as off:
            assert off is None and f"-{flag}" not in command()
        # a real build in the scope: a library linked against torch's, as Inductor's kernels are, that loads
        lib = CppCodeCache.load('extern "C" int fnebm_seven() { return 7; }')
    assert on == flag and f"-{flag}" in mine and f"-{flag}" not in others[0] and f"-{flag}" not in command()
    assert lib.fnebm_seven() == 7
    with open(lib._name, "rb") as f:  # the linker leaves its mark in the library
        assert {"fuse-ld=gold": b".note.gnu.gold-version", "fuse-ld=lld": b"Linker: LLD"}[flag] in f.read()
    with config.patch({"max_autotune": True}), _inductor.linking_fast() as autotuned:
        assert autotuned is None  # its templates build on threads of their own: left as torch makes them


def test_a_build_the_faster_linker_fails_is_compiled_again_without_it(monkeypatch):
    from torch._inductor import compile_fx as compile_fx_module
    from torch._inductor.exc import CppCompileError

    monkeypatch.setattr(_inductor, "_linker", "fuse-ld=gold")  # as if found on this machine
    monkeypatch.setattr(_inductor, "_hook_linker", lambda: True)
    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen.append(getattr(_inductor._scope, "linker", None))
        if len(seen) == 1:
            raise RuntimeError("the build") from CppCompileError(["g++", "-fuse-ld=gold"], "ld.gold: error")
        return "compiled"

    monkeypatch.setattr(compile_fx_module, "compile_fx", fake_compile_fx)
    gm = torch.fx.symbolic_trace(lambda x: x + 1.0)
    assert _inductor.inductor_backend(gm, [torch.zeros(2)]) == "compiled"
    assert seen == ["fuse-ld=gold", None] and _inductor.fast_linker() is None  # and from now on without it
    seen.clear()
    monkeypatch.setattr(_inductor, "_linker", "fuse-ld=gold")

    def other_failure(gm, example_inputs, config_patches=None):
        seen.append(1)
        raise ValueError("not a build")

    monkeypatch.setattr(compile_fx_module, "compile_fx", other_failure)
    with pytest.raises(ValueError, match="not a build"):
        _inductor.inductor_backend(gm, [torch.zeros(2)])
    assert seen == [1] and _inductor.fast_linker() == "fuse-ld=gold"  # any other error: raised as it was


def test_the_precompiled_header_is_named_without_the_linker(monkeypatch):
    # Inductor names its precompiled header by the kernel's command line; the linker flag must not
    # enter that name (the header's compile links nothing): else a second 150 MB header is built
    from torch._inductor import codecache

    monkeypatch.setattr(_inductor, "_linker", "fuse-ld=gold")
    if not _inductor._hook_linker() or _inductor._HEADER_ORIGINAL[0] is None:
        pytest.skip("this torch has no _precompile_header to name")
    names = []
    monkeypatch.setattr(_inductor, "_HEADER_ORIGINAL", [lambda header, cmd, **kw: names.append(cmd) or "h"])
    line = "g++ k.cpp -O3 -o k.so -fuse-ld=gold  -ltorch"
    with _inductor.linking_fast() as flag:
        assert flag == "fuse-ld=gold"
        codecache._precompile_header("cpp_prefix.h", line, device_type="cpu")
    codecache._precompile_header("cpp_prefix.h", "g++ k.cpp -O3 -o k.so  -ltorch", device_type="cpu")
    assert names == ["g++ k.cpp -O3 -o k.so  -ltorch"] * 2  # the same name in fnebm's compiles and torch's


def test_a_graph_compiled_before_is_known_while_inductors_cache_holds_it(record, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    key = "fabcdefghijklmnop"
    assert not _inductor.compiled_before("sig")  # nothing recorded
    _inductor.record_graph("sig", [key])
    assert not _inductor.compiled_before("sig")  # recorded, but Inductor's cache does not hold the graph
    entry = tmp_path / "inductor" / "fxgraph" / key[1:3] / key
    entry.mkdir(parents=True)
    (entry / "artifact").write_text("x")
    assert _inductor.compiled_before("sig") and not _inductor.compiled_before("other")
    assert not _inductor.compiled_before(None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "emptied"))  # a new (or wiped) cache
    assert not _inductor.compiled_before("sig")
    for i in range(_inductor._GRAPHS_KEPT + 5):  # the record keeps the most recent signatures
        _inductor.record_graph(f"s{i}", [key])
    kept = json.loads(_inductor._graphs_path().read_text())
    assert len(kept) == _inductor._GRAPHS_KEPT and "sig" not in kept and f"s{_inductor._GRAPHS_KEPT + 4}" in kept
    _inductor._graphs_path().write_text("[not a dict]")  # a damaged record is no record
    assert not _inductor.compiled_before("s300")


def test_auto_expects_a_runner_this_machine_compiled_before_to_cost_what_such_compiles_took(record, monkeypatch):
    from fnebm.chain import runner

    before = {"sig": True}
    monkeypatch.setattr(_inductor, "compiled_before", lambda sig: before.get(sig, False))
    _inductor.record_compile_s("chain", 18.0)
    cache = RunnerCache()
    assert cache._compile_cost("kind", "shapes") == (18.0, "machine")  # not described: a first compile's time
    cache.describe("kind", "shapes", "sig")
    assert cache.described("kind", "shapes") and not cache.described("kind", "other shapes")
    assert cache._compile_cost("kind", "shapes") == (runner.CACHED_COMPILE_S, "cached")
    assert cache._compile_cost("kind", "other shapes") == (18.0, "machine")  # another graph
    _inductor.record_compile_s("chain-cached", 4.5)
    assert cache._compile_cost("kind", "shapes") == (4.5, "cached")
    with pytest.warns(UserWarning, match="this machine compiled this sampler before"):
        cache.plan("kind", "shapes", 10, "auto")
    other = RunnerCache()
    other.describe("kind", "shapes", "unknown")
    assert other._compile_cost("kind", "shapes") == (18.0, "machine")


def test_a_runners_first_compiled_call_records_its_graphs_as_a_first_or_a_cached_compile(record, monkeypatch):
    recorded, counts = [], iter([(0, 0), (0, 1), (1, 1), (2, 1)])  # a miss, then a hit
    monkeypatch.setattr(_inductor, "record_graph", lambda sig, keys: recorded.append((sig, list(keys))))
    monkeypatch.setattr(_inductor, "cache_hits", lambda: next(counts))
    for key in ("a", "b"):
        cache = RunnerCache()
        cache.describe(key, "shapes", f"sig-{key}")
        cache.describe(key, "other shapes", "not this one")
        cache._graph_keys[key] = [f"graph-{key}"]
        cache._shapes[key] = "shapes"  # what plan() said it compiles for
        run = cache._timed(key, lambda x: x + 1)
        assert run(1) == 2 and run(2) == 3  # timed and recorded once
    assert recorded == [("sig-a", ["graph-a"]), ("sig-b", ["graph-b"])]
    assert [k for k, _ in json.loads(record.read_text())] == ["chain", "chain-cached"]


def test_sample_chain_describes_the_runner_it_may_compile():
    import fnebm
    from fnebm import random as fr

    cache = RunnerCache(compile_estimate_s=1e9)  # never compiles here
    alg = fnebm.langevin(lambda x: 0.5 * (x * x).sum(), 0.1)  # a function of the user's: the torch engine
    state = torch.func.vmap(alg.init)(torch.zeros(3, 2))
    fnebm.sample_chain(alg.step, state, fr.key(0), 5, cache=cache, progress=False)
    assert not any(led.described for led in cache._ledgers.values())  # an explicit estimate: nothing recorded
    measured = RunnerCache()  # nothing recorded (tests): 5 steps stay within the assumed 20 s
    fnebm.sample_chain(alg.step, state, fr.key(0), 5, cache=measured, progress=False)
    (sig,) = [led.signature for led in measured._ledgers.values()]
    assert isinstance(sig, str) and len(sig) == 32
    eager = RunnerCache()
    fnebm.sample_chain(alg.step, state, fr.key(0), 5, cache=eager, compile=False, progress=False)
    assert not any(led.described for led in eager._ledgers.values())  # compile=False: nothing will compile


def test_no_cache_folder_leaves_the_records_silent(monkeypatch):
    # a home directory that cannot be found (Path.home raising in a container run under an arbitrary uid):
    # nothing recorded, nothing known, and nothing raised into the user's run
    def nowhere():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(_inductor, "_times_path", nowhere)
    monkeypatch.setattr(_inductor, "_times", None)
    _inductor.record_graph("sig", ["fkey"])
    _inductor.record_compile_s("chain", 3.0)
    _inductor.record_gain("sig", 0.5)
    assert not _inductor.compiled_before("sig") and _inductor.machine_compile_s("chain") is None
    assert _inductor.recorded_gain("sig") is None


def test_what_compiling_bought_is_recorded_per_description(record):
    assert _inductor.recorded_gain("sig") is None and _inductor.recorded_gain(None) is None
    _inductor.record_gain("sig", 0.5)
    _inductor.record_gain("sig", 0.75)  # a later measurement replaces it
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        _inductor.record_gain("other", bad)  # not a ratio: not recorded
    _inductor.record_gain(None, 0.5)
    assert _inductor.recorded_gain("sig") == 0.75 and _inductor.recorded_gain("other") is None
    for i in range(_inductor._GAINS_KEPT + 3):  # the most recent descriptions are kept
        _inductor.record_gain(f"s{i}", 1.5)
    kept = json.loads(_inductor._gains_path().read_text())
    assert len(kept) == _inductor._GAINS_KEPT and "sig" not in kept
    _inductor._gains_path().write_text('{"s300": "fast", "s301": true}')  # damaged entries are no record
    assert _inductor.recorded_gain("s300") is None and _inductor.recorded_gain("s301") is None


def _timed_ledger(cache, key="kind", signature="sig"):
    cache.describe(key, "shapes", signature)
    ledger = cache.ledger(key, "shapes")
    ledger.record(1.0, 10)  # 0.1 s an eager step
    return ledger


def test_auto_weighs_a_compile_against_what_it_saves(record):
    # a compile costs 10 s here; 0.1 s an eager step, 1 s of them spent
    _inductor.record_compile_s("chain", 10.0)
    cache = RunnerCache()
    _timed_ledger(cache)
    assert cache.gain("kind", "shapes") == (None, "")
    with pytest.warns(UserWarning, match="compiles this sampler now"):
        plan = cache.plan("kind", "shapes", 100, "auto")  # 1 + 10 s > 10 s, what it buys unknown: the old rule
    assert plan.compiled and plan.gain is None
    # with the gain recorded by an earlier process, the rent is (1 + 0.1 x steps) x (1 - gain), against 10 s
    # (at least a tenth of it: a gain at or above 1 rents for ten times a compile's cost, then measures again)
    for gain, steps, compiles in ((0.95, 100, False), (0.5, 100, False), (0.5, 300, True), (0.1, 100, False), (0.1, 200, True),
                                  (1.2, 50, False), (1.2, 1000, True)):
        _inductor.record_gain("sig", gain)
        cache = RunnerCache()
        _timed_ledger(cache)
        assert cache.gain("kind", "shapes") == (gain, "recorded on this machine")
        if compiles:
            with pytest.warns(UserWarning, match=f"ran {gain:.3g}x the eager steps' time"):
                plan = cache.plan("kind", "shapes", steps, "auto")
        else:
            plan = cache.plan("kind", "shapes", steps, "auto")
            assert f"ran {gain:.3g}x the eager steps' time (recorded on this machine)" in plan.reason
        assert plan.compiled == compiles and plan.gain == gain, (gain, steps, plan)
        assert cache.plan("kind", "shapes", steps, True).compiled  # compile=True is obeyed whatever the gain
    other = RunnerCache()
    _timed_ledger(other, signature="another runner")
    assert other.gain("kind", "shapes") == (None, "")  # recorded for another description only


def test_a_compiled_runner_measured_no_faster_runs_eagerly_again(record):
    from fnebm.chain import runner

    cache = RunnerCache()
    ledger = _timed_ledger(cache, signature="sig2")
    ledger.compiled = True  # compiled earlier in this process
    for _ in range(runner.GAIN_CHUNKS - 1):
        ledger.record_compiled(1.5, 10)
    assert ledger.measured_gain() is None  # too few timed chunks
    assert cache.plan("kind", "shapes", 10, "auto").compiled
    ledger.record_compiled(1.2, 10)  # the best of them: 0.12 s a step against 0.1 eagerly
    assert ledger.measured_gain() == pytest.approx(1.2)
    plan = cache.plan("kind", "shapes", 10, "auto")
    assert not plan.compiled and "no faster" in plan.reason and plan.gain == pytest.approx(1.2)
    assert cache.plan("kind", "shapes", 10, True).compiled
    assert _inductor.recorded_gain("sig2") == pytest.approx(1.2)  # kept for later processes
    ledger.record_compiled(0.3, 10)  # a faster chunk moves it by more than 5 %: written again
    assert _inductor.recorded_gain("sig2") == pytest.approx(0.3)
    assert cache.plan("kind", "shapes", 10, "auto").compiled


def test_sample_chain_looks_up_what_compiling_bought_its_runner(monkeypatch):
    # end to end: the runner's own description finds the recorded gain, and the plan weighs the compile with it
    import fnebm
    from fnebm import random as fr
    from fnebm.chain import runner

    looked_up = []
    monkeypatch.setattr(_inductor, "recorded_gain", lambda sig: looked_up.append(sig) or 1.2)
    monkeypatch.setattr(runner._Ledger, "step_s", lambda self: 0.01)  # 10 ms an eager step, whatever the machine
    cache = RunnerCache()
    monkeypatch.setattr(cache, "_compile_cost", lambda key, shapes=None: (1.0, "machine"))
    alg = fnebm.langevin(lambda x: 0.5 * (x * x).sum(), 0.1)
    state = torch.func.vmap(alg.init)(torch.zeros(3, 2))
    plans = []
    # 200 steps x 10 ms = 2 s > the 1 s a compile costs: without the gain it would compile; with it the rent is
    # a tenth of that, 0.2 s
    fnebm.sample_chain(alg.step, state, fr.key(0), 200, cache=cache, progress=False, on_plan=plans.append)
    (sig,) = [led.signature for led in cache._ledgers.values()]
    assert looked_up == [sig] and plans[0].gain == 1.2 and not plans[0].compiled and len(cache) == 0
    assert "recorded on this machine" in plans[0].reason
