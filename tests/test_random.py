import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fnebm import random as fr

# Random123 kat_vectors for philox4x32_10: (counter words, key words, expected output).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]

seeds = st.integers(min_value=-(2**63), max_value=2**64 - 1)


@pytest.mark.parametrize("numpy_path", [True, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("ctr,k,expected", KAT)
def test_philox_known_answers(ctr, k, expected, numpy_path, monkeypatch):
    # eager CPU calls take the NumPy path, everything else the torch ops: both must be Philox
    monkeypatch.setattr(fr, "_NUMPY_EAGER", numpy_path)
    words = [torch.tensor(c, dtype=torch.int64) for c in ctr + k]
    out = fr.philox4x32(*words)
    assert tuple(int(w) for w in out) == expected
    assert all(w.dtype == torch.int64 for w in out)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([(), (1,), (3,), (4, 1), (2, 3)]))
def test_numpy_and_torch_paths_agree_bit_for_bit(seed, shape):
    # broadcast words of mixed shapes, and every public function built on Philox
    g = torch.Generator().manual_seed(seed)  # the test's own generator; the library never uses one
    words = [torch.randint(0, 2**32, s, generator=g) for s in (shape, (), (3,) if shape else (), (1,), shape, ())]
    keys = fr.split(fr.key(seed), 5)
    calls = [lambda: fr.philox4x32(*words), lambda: fr.normal(fr.fold_in(keys, 7), (3,)),
             lambda: fr.uniform(keys, (2, 2), torch.float64), lambda: fr.split(keys, 3), lambda: fr.bits(keys, 5)]
    # the NumPy path itself (the C path, taken first where it builds, is tests/test_random_cpu.py's)
    try:
        fr._C_EAGER = False
        for call in calls:
            fr._NUMPY_EAGER = True
            a = call()
            fr._NUMPY_EAGER = False
            b = call()
            for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                assert x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
    finally:
        fr._NUMPY_EAGER = True
        fr._C_EAGER = True


def test_key_layout():
    assert fr.key(0).tolist() == [0, 0]
    assert fr.key(2**32 + 5).tolist() == [5, 1]
    assert fr.key(-1).tolist() == [2**32 - 1, 2**32 - 1]
    assert fr.key(3).dtype == torch.int64


@given(seeds)
@settings(max_examples=50, deadline=None)
def test_keys_are_32_bit_words_and_deterministic(seed):
    k = fr.key(seed)
    for derived in (k, fr.split(k, 3), fr.fold_in(k, 12345)):
        assert ((derived >= 0) & (derived < 2**32)).all()
    assert torch.equal(fr.split(k, 3), fr.split(fr.key(seed), 3))
    assert torch.equal(fr.normal(k, (5,)), fr.normal(fr.key(seed), (5,)))
    assert torch.equal(fr.fold_in(k, 7), fr.fold_in(fr.key(seed), 7))


@given(seeds, st.integers(min_value=2, max_value=64))
@settings(max_examples=50, deadline=None)
def test_split_and_fold_in_give_distinct_keys(seed, num):
    k = fr.key(seed)
    children = fr.split(k, num)
    folded = fr.fold_in(k, torch.arange(num))
    pool = torch.cat([k[None], children, folded])
    assert torch.unique(pool, dim=0).shape[0] == pool.shape[0]
    # split(k, n) is a prefix of split(k, n + 1): child i depends on i only
    assert torch.equal(fr.split(k, num + 1)[:num], children)


def test_derived_keys_do_not_reuse_the_parent_stream():
    k = fr.key(0)
    parent = fr.bits(k, (64,))
    for child in list(fr.split(k, 4)) + [fr.fold_in(k, 0), fr.fold_in(k, 1)]:
        assert not torch.equal(fr.bits(child, (64,)), parent)


def _same_normals(a, b):
    # an eager CPU normal draw runs in C where it builds, vmap runs torch's ops: the same Philox
    # words, Box–Muller's log, sin and cos within a few ulp (tests/test_random_cpu.py bounds them)
    eps = torch.finfo(a.dtype).eps
    torch.testing.assert_close(a, b, rtol=5 * eps, atol=1e-30)
    return True


def test_batched_calls_equal_vmap():
    keys = fr.split(fr.key(3), 6)
    vm = torch.func.vmap
    assert _same_normals(fr.normal(keys, (2, 5)), vm(lambda k: fr.normal(k, (2, 5)))(keys))
    assert torch.equal(fr.uniform(keys, (3,)), vm(lambda k: fr.uniform(k, (3,)))(keys))
    assert torch.equal(fr.split(keys, 3), vm(lambda k: fr.split(k, 3))(keys))
    assert torch.equal(fr.fold_in(keys, 9), vm(lambda k: fr.fold_in(k, 9))(keys))
    # each row of a batched draw is the draw of that row's key
    assert torch.equal(fr.normal(keys, (4,))[2], fr.normal(keys[2], (4,)))
    # two batch axes: the same as vmap twice
    grid = fr.split(fr.key(4), 12).reshape(3, 4, 2)
    assert _same_normals(fr.normal(grid, (5,)), vm(vm(lambda k: fr.normal(k, (5,))))(grid))
    assert torch.equal(fr.split(grid, 3), vm(vm(lambda k: fr.split(k, 3)))(grid))


def test_batched_keys_are_stored_word_major():
    # a word of one key index is contiguous across the batch, so kernels load it as a vector
    keys = fr.split(fr.key(0), 8)
    assert keys.stride() == (1, 8)
    assert fr.split(keys, 2)[..., 0, :].stride()[0] == 1
    assert fr.fold_in(keys, 3).stride() == (1, 8)


def _z(sample_mean, true_mean, true_var, n):
    return abs(sample_mean - true_mean) / math.sqrt(true_var / n)


def test_normal_moments_within_monte_carlo_error():
    n = 400_000
    x = fr.normal(fr.key(1), (n,), dtype=torch.float64)
    # mean, second and fourth moments of N(0,1) with their exact variances (1, 2, 96)
    assert _z(x.mean().item(), 0.0, 1.0, n) < 5
    assert _z((x**2).mean().item(), 1.0, 2.0, n) < 5
    assert _z((x**4).mean().item(), 3.0, 96.0, n) < 5
    # the two Box-Muller lanes of a pair are uncorrelated: E[x_i x_{i+m}] = 0, variance 1
    m = n // 4
    assert _z((x[:m] * x[m : 2 * m]).mean().item(), 0.0, 1.0, m) < 5


def test_uniform_moments_and_range():
    n = 400_000
    u = fr.uniform(fr.key(2), (n,))
    assert (u >= 0).all() and (u < 1).all()
    assert _z(u.double().mean().item(), 0.5, 1 / 12, n) < 5
    # each quarter of [0, 1) holds its share (binomial standard error)
    counts = torch.histc(u, bins=4, min=0, max=1)
    assert ((counts - n / 4).abs() < 5 * math.sqrt(n * 0.25 * 0.75)).all()
    v = fr.uniform(fr.key(2), (1000,), minval=-3.0, maxval=-1.0)
    assert (v >= -3).all() and (v < -1).all()


def test_bernoulli_rate():
    n = 200_000
    b = fr.bernoulli(fr.key(4), 0.3, (n,))
    assert b.dtype == torch.bool
    assert _z(b.double().mean().item(), 0.3, 0.21, n) < 5


def test_dtypes_follow_the_argument():
    k = fr.key(0)
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        assert fr.normal(k, (3,), dtype=dt).dtype == dt
        assert fr.uniform(k, (3,), dtype=dt).dtype == dt
    # float64 uses the same bits: it agrees with float32 to float32 precision
    torch.testing.assert_close(fr.normal(k, (100,), torch.float64).float(), fr.normal(k, (100,)), rtol=1e-5, atol=1e-5)
    assert fr.normal(k, ()).shape == ()
    assert fr.normal(k, 4).shape == (4,)


@pytest.mark.compile
def test_compiled_equals_eager():
    def draw(k):
        k1, k2 = fr.split(k)
        return fr.normal(k1, (3, 5)), fr.uniform(fr.fold_in(k2, 4), (7,)), fr.split(k2, 3)

    keys = fr.split(fr.key(5), 4)
    compiled = torch.compile(torch.func.vmap(draw), fullgraph=True)
    for got, want in zip(compiled(keys), torch.func.vmap(draw)(keys)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: fr.key(1.5), TypeError, "seed"),
        (lambda: fr.key(True), TypeError, "seed"),
        (lambda: fr.key(2**64), ValueError, "seed"),
        (lambda: fr.normal(torch.zeros(2), (3,)), TypeError, "key"),
        (lambda: fr.normal(torch.zeros(3, dtype=torch.int64), (3,)), ValueError, "key"),
        (lambda: fr.normal([0, 0], (3,)), TypeError, "key"),
        (lambda: fr.normal(fr.key(0), (-1,)), ValueError, "shape"),
        (lambda: fr.normal(fr.key(0), (3,), dtype=torch.int32), TypeError, "dtype"),
        (lambda: fr.split(fr.key(0), 0), ValueError, "num"),
        (lambda: fr.fold_in(fr.key(0), 1.5), TypeError, "data"),
        (lambda: fr.fold_in(fr.key(0), torch.tensor(1.5)), TypeError, "data"),
        (lambda: fr.fold_in(fr.key(0), 2**63), ValueError, "data"),
    ],
)
def test_bad_input_raises(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_eager_normal_and_uniform_are_the_torch_paths_bits(dtype):
    # The NumPy eager CPU path converts words in NumPy and runs both Box–Muller pairs as one set of
    # operations: the same bits as the torch path (every lane count, key batch and event shape).
    cases = [((), (5,)), ((3,), ()), ((3,), (1,)), ((3,), (2,)), ((3,), (3,)), ((4,), (7,)), ((2, 3), (2, 5)),
             ((16,), (784,)), ((2,), (1, 28, 28)), ((3,), (0,)), ((100,), (2,))]
    try:
        fr._C_EAGER = False  # the NumPy path (the C path: tests/test_random_cpu.py)
        for batch, shape in cases:
            k = fr.fold_in(fr.key(41), 5)
            keys = k if batch == () else fr.split(k, math.prod(batch)).reshape(batch + (2,))
            for draw in (fr.normal, fr.uniform):
                fr._NUMPY_EAGER = True
                a = draw(keys, shape, dtype)
                fr._NUMPY_EAGER = False
                b = draw(keys, shape, dtype)
                assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), (draw.__name__, batch, shape)
    finally:
        fr._NUMPY_EAGER = True
        fr._C_EAGER = True
