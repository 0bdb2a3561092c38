"""fnebm.kernels.cpu_trips: a C kernel's trips with a compiled energy, run in C++. The path itself (a
real C++-wrapper graph called from C++, the draws bit for bit those of the Python loop) is tested
with the one real compile of tests/test_evaluation.py; here, what happens when a trip fails."""

import ctypes

import pytest
import torch

from fnebm import random as fr
from fnebm.kernels import cpu_nuts, cpu_trips
from fnebm.samplers import evaluation

pytestmark = pytest.mark.skipif(cpu_trips.available() is not None or cpu_nuts.available() is not None,
                                reason=f"the C++ trips or the C NUTS kernel are unavailable here: "
                                       f"{cpu_trips.available() or cpu_nuts.available()}")

P = torch.tensor([[2.0, 0.6], [0.6, 1.0]])


def energy(x):
    return 0.5 * (x @ (P @ x))


def _failing_entry() -> int:
    """An entry that takes its (one) input and fails as a graph can (an allocation refused)."""
    lib = cpu_trips.LIBRARY.load()
    lib.fnebm_trips_test_set_delete.argtypes = [ctypes.c_void_p]
    lib.fnebm_trips_test_set_delete(cpu_trips._shim_functions()[1])
    return ctypes.cast(lib.fnebm_trips_test_failing_entry, ctypes.c_void_p).value


def test_a_failed_trip_is_not_made_and_says_so():
    pending = torch.zeros(4, 2)
    made = cpu_trips.made
    resume = cpu_nuts.LIBRARY.load().fnebm_nuts_resume  # never reached: the entry fails first
    assert cpu_trips.run(_failing_entry(), [pending], resume, 0, 7, pending, 100) == (7, 0, True)
    assert cpu_trips.made == made


def test_a_loop_whose_trip_fails_in_cpp_makes_it_and_the_rest_in_python():
    calls = {"native": 0, "python": 0}
    plain = evaluation.evaluator(energy, 1, False)

    class Failing:  # an evaluation that offers a C++ entry that fails
        def __call__(self, x):
            calls["python"] += 1
            e, g = plain(x)
            return e.contiguous(), g.contiguous()  # as a compiled graph's: what the kernel reads as it is

        def native(self, x):
            calls["native"] += 1
            return _failing_entry(), [x]

    x0 = fr.normal(fr.key(13), (4, 2))
    e0, g0 = plain(x0)
    keys = fr.split(fr.key(14), 5 * 4).reshape(5, 4, 2)
    kw = dict(max_tree_depth=6, coefficients=(0.5, 1.0, 0.5), divergence_threshold=1000.0)
    got = cpu_nuts.nuts_transitions(Failing(), x0, e0, g0, keys, torch.tensor(0.2), torch.ones(2), False, **kw)
    want = cpu_nuts.nuts_transitions(plain, x0, e0, g0, keys, torch.tensor(0.2), torch.ones(2), False, **kw)
    # offered once (after the first trip, from Python), failed, and not offered again in this loop
    assert calls["native"] == 1 and calls["python"] > 10
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(cpu_trips, "NATIVE", False)
    assert cpu_trips.available() == "fnebm.kernels.cpu_trips.NATIVE is off"
