"""Couplings: exact OT against brute force, Sinkhorn against exact OT, keyed and checked."""

import functools
import itertools

import pytest
import torch

from fnebm import couplings as C
from fnebm import random as fr

F64 = torch.float64


def brute_force(cost):
    n = cost.shape[0]
    return min(sum(float(cost[i, p[i]]) for i in range(n)) for p in itertools.permutations(range(n)))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_assignment_is_exact_against_every_permutation(n):
    for trial in range(20):
        cost = fr.uniform(fr.fold_in(fr.key(n), trial), (n, n), F64)
        if trial % 4 == 0:  # ties: integer costs
            cost = torch.floor(4 * cost)
        idx = C.assignment(cost)
        assert sorted(idx.tolist()) == list(range(n))
        assert float(cost[torch.arange(n), idx].sum()) == pytest.approx(brute_force(cost), abs=1e-12)


def test_exact_ot_pairs_minimise_the_total_squared_distance():
    x0 = fr.normal(fr.key(1), (6, 2), F64)
    x1 = fr.normal(fr.key(2), (6, 2), F64) + 2.0
    a, b = C.exact_ot(x0, x1, fr.key(0))
    assert torch.equal(a, x0)
    got = float(((a - b) ** 2).sum())
    best = min(float(((x0 - x1[list(p)]) ** 2).sum()) for p in itertools.permutations(range(6)))
    assert got == pytest.approx(best, rel=1e-12)
    assert sorted(map(tuple, b.tolist())) == sorted(map(tuple, x1.tolist()))  # a permutation of the data


def test_exact_ot_moderate_batch_beats_random_pairings_and_is_a_permutation():
    x0, x1 = fr.normal(fr.key(3), (128, 2)), fr.normal(fr.key(4), (128, 2)) + 1.0
    a, b = C.exact_ot(x0, x1)
    ot = ((a - b) ** 2).sum()
    for k in range(5):  # no transposition improves it (a necessary condition; cheap to check)
        _, s = C.independent(x0, x1, fr.key(k))
        assert ot <= ((x0 - s) ** 2).sum()
    i, j = torch.meshgrid(torch.arange(128), torch.arange(128), indexing="ij")
    swap = ((a[i] - b[j]) ** 2).sum(-1) + ((a[j] - b[i]) ** 2).sum(-1) - ((a[i] - b[i]) ** 2).sum(-1) \
        - ((a[j] - b[j]) ** 2).sum(-1)
    assert float(swap.min()) >= -1e-4


@pytest.mark.parametrize("eps, tol", [(0.01, 0.05), (0.002, 0.015)])
def test_sinkhorn_plan_cost_approaches_the_exact_cost(eps, tol):
    x0, x1 = fr.normal(fr.key(5), (32, 2), F64), fr.normal(fr.key(6), (32, 2), F64) + 2.0
    cost = C.squared_cost(x0, x1)
    exact = float(cost[torch.arange(32), C.assignment(cost)].sum()) / 32
    log_plan = C.sinkhorn(cost, eps, 2000)
    plan = log_plan.exp()
    torch.testing.assert_close(plan.sum(0), torch.full((32,), 1 / 32, dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(plan.sum(1), torch.full((32,), 1 / 32, dtype=F64), rtol=0, atol=1e-3 / 32)
    entropic = float((plan * cost).sum())
    assert exact - 1e-9 <= entropic <= exact + tol * exact


def test_sinkhorn_ot_small_epsilon_recovers_the_exact_pairs():
    # well-separated pairs: the OT plan is a permutation far from any tie
    x1 = torch.tensor([[0.0, 0.0], [5.0, 0.0], [0.0, 5.0], [5.0, 5.0], [10.0, 0.0]], dtype=F64)
    x0 = x1[[3, 0, 4, 1, 2]] + 0.1
    _, exact = C.exact_ot(x0, x1)
    for mode in ("argmax", "sample"):
        _, got = C.sinkhorn_ot(x0, x1, fr.key(7), epsilon=0.005, n_iters=300, mode=mode)
        assert torch.equal(got, exact)


def test_keyed_reproducible_and_key_dependent():
    x0, x1 = fr.normal(fr.key(8), (64, 3)), fr.normal(fr.key(9), (64, 3))
    f = functools.partial(C.sinkhorn_ot, epsilon=0.5, n_iters=20)
    assert torch.equal(f(x0, x1, fr.key(1))[1], f(x0, x1, fr.key(1))[1])
    assert not torch.equal(f(x0, x1, fr.key(1))[1], f(x0, x1, fr.key(2))[1])
    assert torch.equal(C.independent(x0, x1, fr.key(1))[1], C.independent(x0, x1, fr.key(1))[1])
    assert not torch.equal(C.independent(x0, x1, fr.key(1))[1], C.independent(x0, x1, fr.key(2))[1])
    assert C.independent(x0, x1)[1] is x1


def test_event_shapes_flatten():
    x0, x1 = fr.normal(fr.key(10), (5, 2, 3)), fr.normal(fr.key(11), (5, 2, 3))
    a, b = C.exact_ot(x0, x1)
    flat = C.exact_ot(x0.reshape(5, 6), x1.reshape(5, 6))[1]
    assert torch.equal(b.reshape(5, 6), flat)


def test_argument_checks():
    x = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="same shape"):
        C.exact_ot(x, torch.zeros(3, 2))
    with pytest.raises(TypeError, match="x0 must be a floating tensor"):
        C.exact_ot(torch.zeros(4, 2, dtype=torch.int64), x)
    with pytest.raises(ValueError, match="square"):
        C.assignment(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="finite"):
        C.assignment(torch.tensor([[0.0, float("nan")], [1.0, 0.0]]))
    with pytest.raises(ValueError, match="pass key"):
        C.sinkhorn_ot(x, x)
    with pytest.raises(ValueError, match="mode"):
        C.sinkhorn_ot(x, x, fr.key(0), mode="max")
    with pytest.raises(ValueError, match="epsilon"):
        C.sinkhorn_ot(x, x, fr.key(0), epsilon=0.0)
    with pytest.raises(ValueError, match="one key"):
        C.independent(x, x, fr.split(fr.key(0), 3))
