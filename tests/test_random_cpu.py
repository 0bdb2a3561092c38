"""fnebm.random's eager CPU draws in compiled C (fnebm/_random_cpu.py, fnebm/kernels/_cpu_random.c):
the Philox words of the NumPy and torch paths, bit for bit (keys, uniform draws), normal draws within
a few ulp of the torch path, and the NumPy path where the library cannot be built.

The cases that build or fail to build run in a child process with its own FNEBM_CACHE_DIR.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import subprocess
import sys
import threading

import pytest
import torch

from fnebm import random as fr

if fr._c_library() is None:  # pragma: no cover - a machine without a working C compiler
    pytest.skip(f"the C draws do not build here: {__import__('fnebm._random_cpu').LIBRARY.why}",
                allow_module_level=True)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# (key batch, event shape): every lane count, one value and many per key, 0-size, several batch axes
CASES = [((), ()), ((), (1,)), ((), (5,)), ((), (64,)), ((), (1001,)), ((3,), ()), ((3,), (1,)), ((3,), (2,)),
         ((3,), (3,)), ((4,), (7,)), ((2, 3), (2, 5)), ((17,), (784,)), ((2,), (1, 28, 28)), ((3,), (0,)),
         ((0,), (4,)), ((100,), (2,)), ((33,), (63,)), ((40,), (65,))]


def _paths(call, path):
    """``call()`` on the C path (``"c"``), the NumPy path or the torch path."""
    saved = fr._C_EAGER, fr._NUMPY_EAGER
    try:
        fr._C_EAGER, fr._NUMPY_EAGER = path == "c", path in ("c", "numpy")
        return call()
    finally:
        fr._C_EAGER, fr._NUMPY_EAGER = saved


def _keys(batch, seed=41):
    k = fr.fold_in(fr.key(seed), 5)
    return k if batch == () else fr.split(k, max(math.prod(batch), 1))[: math.prod(batch)].reshape(batch + (2,))


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| in units of the larger one's spacing (eps relative)."""
    if a.numel() == 0:
        return 0.0
    x, y = a.double(), b.double()
    eps = torch.finfo(a.dtype).eps
    scale = torch.maximum(x.abs(), y.abs()).clamp_min(torch.finfo(a.dtype).tiny)
    return ((x - y).abs() / (scale * eps)).max().item()


def test_the_c_path_runs_eagerly(monkeypatch):
    calls = []
    real = fr._draw_c
    monkeypatch.setattr(fr, "_draw_c", lambda *a: calls.append(a[1]) or real(*a))
    fr.normal(fr.key(0), (3,))
    fr.uniform(fr.split(fr.key(0), 4), (2,))
    assert calls == ["normal", "uniform"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_uniform_is_the_numpy_and_torch_paths_bits(dtype):
    for batch, shape in CASES:
        keys = _keys(batch)
        got = _paths(lambda: fr.uniform(keys, shape, dtype), "c")
        for path in ("numpy", "torch"):
            want = _paths(lambda: fr.uniform(keys, shape, dtype), path)
            assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want), (batch, shape, path)
    # minval / maxval on top, as before
    keys = _keys((5,))
    got = _paths(lambda: fr.uniform(keys, (3,), dtype, -2.0, torch.tensor(3.0, dtype=dtype)), "c")
    assert torch.equal(got, _paths(lambda: fr.uniform(keys, (3,), dtype, -2.0, torch.tensor(3.0, dtype=dtype)), "numpy"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_normal_is_the_torch_paths_draw_up_to_rounding(dtype):
    # the same Philox words through the same float operations; only log, sin and cos are other code
    # (Cephes' polynomials in float32, the C library's in float64): measured at most 3.4 eps
    bound = 4.0 if dtype in (torch.float32, torch.float64) else 1.0  # half precision: one rounding apart
    for batch, shape in CASES:
        keys = _keys(batch)
        got = _paths(lambda: fr.normal(keys, shape, dtype), "c")
        want = _paths(lambda: fr.normal(keys, shape, dtype), "torch")
        assert got.shape == want.shape and got.dtype == want.dtype, (batch, shape)
        assert _ulps(got, want) <= bound, (batch, shape, _ulps(got, want))
    # and many values: 4096 chains x 784 (3.2 million draws)
    keys = _keys((4096,), seed=3)
    got = _paths(lambda: fr.normal(keys, (784,), dtype), "c")
    want = _paths(lambda: fr.normal(keys, (784,), dtype), "numpy")
    assert _ulps(got, want) <= bound


def test_keys_are_the_numpy_and_torch_paths_bits():
    for batch in [(), (1,), (3,), (17,), (2, 3), (100,), (0,)]:
        keys = _keys(batch)
        calls = [lambda: fr.split(keys), lambda: fr.split(keys, 3), lambda: fr.split(keys, 8),
                 lambda: fr.fold_in(keys, 7), lambda: fr.fold_in(keys, -(2**63)), lambda: fr.fold_in(keys, 2**40 + 3),
                 lambda: fr.fold_in(keys, torch.arange(5).reshape((5,) + (1,) * len(batch))),
                 lambda: fr.fold_in(keys, torch.tensor(9, dtype=torch.int32))]
        for call in calls:
            got = _paths(call, "c")
            for path in ("numpy", "torch"):
                want = _paths(call, path)
                assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want), (batch, path)
    # stored word-major, as the other paths store them
    keys = fr.split(fr.key(0), 8)
    assert keys.stride() == (1, 8) and fr.fold_in(keys, 3).stride() == (1, 8)
    assert fr.split(keys, 2)[..., 0, :].stride()[0] == 1


def test_keys_of_any_layout():
    # contiguous, word-major, sliced, transposed and broadcast keys (some read in place, some copied)
    base = fr.split(fr.key(9), 24)
    layouts = [base, base.contiguous(), base[::3], base.reshape(4, 6, 2).transpose(0, 1),
               base[:4].expand(3, 4, 2), fr.key(5).expand(7, 2), base.contiguous()[:, :].reshape(2, 12, 2)[1]]
    for keys in layouts:
        for call in (lambda: fr.normal(keys, (5,)), lambda: fr.uniform(keys, (3,)), lambda: fr.split(keys, 3),
                     lambda: fr.fold_in(keys, 4)):
            got = _paths(call, "c")
            want = _paths(call, "torch")
            if got.dtype == torch.float32:
                assert _ulps(got, want) <= 4.0
            else:
                assert torch.equal(got, want)


def test_bad_keys_still_raise_on_the_c_path():
    with pytest.raises(ValueError, match="key"):
        fr.normal(torch.tensor([0, 2**32], dtype=torch.int64), (3,))
    with pytest.raises(TypeError, match="key"):
        fr.uniform(torch.zeros(2), (3,))
    with pytest.raises(ValueError, match="key"):
        fr.split(torch.tensor([-1, 0]), 2)


def test_transformed_calls_take_the_operators_not_the_eager_c_path(monkeypatch):
    # vmap and grad see torch.ops.fnebm.* (tests/test_random_ops.py), never the eager C entry with
    # functorch tensors (which have no data pointer); the operators' implementation calls the C
    monkeypatch.setattr(fr, "_draw_c", lambda *a: pytest.fail("the eager C path ran under vmap"))
    monkeypatch.setattr(fr, "_c_library", lambda: None)  # the operators' own fallback: the NumPy path
    keys = fr.split(fr.key(1), 3)
    torch.func.vmap(lambda k: fr.normal(k, (4,)) + fr.uniform(k, (4,)))(keys)


def test_threads_give_the_same_draws(monkeypatch):
    # from four million values the blocks are shared among OpenMP threads: the same bits
    key = fr.key(2**40 + 1)
    n = 4 * 2**20 + 3
    one = fr.normal(key, (n,))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert torch.equal(fr.normal(key, (n,)), one)
    assert torch.equal(fr.uniform(key, (n,)), _paths(lambda: fr.uniform(key, (n,)), "numpy"))


def test_calls_from_many_threads_agree():
    keys = fr.split(fr.key(7), 64)
    want = [fr.normal(fr.fold_in(keys, i), (300,)) for i in range(16)]
    got = [None] * 16

    def work(i):
        got[i] = fr.normal(fr.fold_in(keys, i), (300,))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


# In a child process with its own cache: the first draws, from several threads at once, build the
# library once; what the library says, and whether the draws equal the NumPy path's
_CHILD = """
import json, sys, threading, torch
from fnebm import random as fr
keys = fr.split(fr.key(3), 16)
out = [None] * 4
def work(i):
    out[i] = (fr.normal(keys, (9,)), fr.uniform(keys, (9,)), fr.split(keys, 3))
threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
for t in threads: t.start()
for t in threads: t.join()
fr._C_EAGER = False
want = (fr.normal(keys, (9,)), fr.uniform(keys, (9,)), fr.split(keys, 3))
from fnebm import _random_cpu
lib = _random_cpu.LIBRARY
print(json.dumps(dict(
    loaded=lib.lib is not None, why=lib.why, build_s=lib.build_s, c_lib=bool(fr._c_lib),
    same_bits=all(torch.equal(a, b) for o in out for a, b in zip(o, want)),
    same_keys=all(torch.equal(o[2], want[2]) and torch.equal(o[1], want[1]) for o in out),
    close=all(torch.allclose(o[0], want[0], rtol=1e-6, atol=1e-6) for o in out),
    agree=all(torch.equal(o[0], out[0][0]) for o in out))))
"""


def _child(cache, **env):
    done = subprocess.run([sys.executable, "-c", _CHILD], env=dict(os.environ, FNEBM_CACHE_DIR=str(cache), **env),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.strip() == "", done.stderr  # silent, on either path
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_library_builds_once_from_concurrent_first_draws(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    first = _child(cache)
    assert first["loaded"] and first["c_lib"] and first["build_s"] > 0, first
    assert first["same_keys"] and first["close"] and first["agree"], first
    assert len(list(cache.glob("cpu_random-*.so"))) == 1
    second = _child(cache)  # a later process loads it without building
    assert second["loaded"] and second["build_s"] == 0, second


@pytest.mark.parametrize("how", ["no compiler", "failing compiler"])
def test_without_the_library_the_numpy_path_runs_silently(tmp_path, how):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    if how == "no compiler":
        cc = str(tmp_path / "no-such-cc")
    else:  # a compiler that runs but cannot build (as tests/test_kernel_cache.py simulates one)
        fake = tmp_path / "fake-cc"
        real = shutil.which(os.environ.get("CC") or "cc")
        fake.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then exec {real} --version; fi\n'
                        'echo "fake-cc: cannot build" >&2\nexit 1\n')
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
        cc = str(fake)
    result = _child(cache, CC=cc)
    assert not result["loaded"] and not result["c_lib"] and result["why"], result
    assert result["same_bits"], result  # the NumPy path: every draw and key bit for bit
    assert not list(cache.glob("cpu_random-*.so"))


def test_import_does_not_load_the_library():
    code = "import sys, fnebm; print('fnebm._random_cpu' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-1000:]


@pytest.mark.parametrize("bad", [[0, 2**32], [-1, 0], [5, 2**40]])
def test_words_out_of_range_raise_on_every_c_entry(bad):
    # the C code checks the words' range (instead of five torch operations): the same error
    keys = torch.tensor([[1, 2], bad, [3, 4]], dtype=torch.int64)
    for call in (lambda: fr.normal(keys, (3,)), lambda: fr.normal(keys, (3,), torch.float64),
                 lambda: fr.uniform(keys, (40,)), lambda: fr.uniform(keys, (), torch.float64),
                 lambda: fr.split(keys, 3), lambda: fr.fold_in(keys, 2), lambda: fr.fold_in(keys[1], torch.arange(3))):
        with pytest.raises(ValueError, match="outside"):
            call()


def test_shapes_that_do_not_broadcast_raise():
    with pytest.raises(RuntimeError, match="broadcast"):
        fr.fold_in(fr.split(fr.key(0), 3), torch.arange(4))


def test_a_first_eager_draw_imports_nothing_heavy():
    # torch.broadcast_shapes would import torch.fx's symbolic shapes and sympy (0.4 s) on first use
    code = ("import sys, torch, fnebm; from fnebm import random as fr; ks = fr.split(fr.key(0), 8); "
            "fr.normal(fr.fold_in(ks, torch.tensor(3)), (5,)); fr.uniform(fr.fold_in(ks, 2), ()); "
            "print('sympy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-1000:]
