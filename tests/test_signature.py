"""fnebm._signature: a description of an energy that is the same in every process, by which
compile="auto" knows a graph this machine compiled before (fnebm._inductor.compiled_before)."""

import functools
import subprocess
import sys
import textwrap

import torch
from torch import nn

from fnebm._signature import signature


def _energy(scale):
    P = torch.eye(3) * scale

    def energy(x):
        return 0.5 * (x @ (P @ x))

    return energy


def test_the_same_code_over_tensors_of_the_same_layout_is_one_signature():
    # values are a compiled graph's inputs: new values, the same graph
    assert signature(_energy(1.0)) == signature(_energy(2.0)) is not None
    assert signature(_energy(1.0), (4, 3), torch.float32) != signature(_energy(1.0), (5, 3), torch.float32)


def test_code_constants_closures_and_modules_enter_it():
    def a(x):
        return (x * 2.0).sum()

    def b(x):
        return (x * 3.0).sum()  # another constant: Dynamo specialises on it

    assert signature(a) != signature(b)
    P = torch.eye(3)

    def c(x):
        return x @ P

    first = signature(c)
    P = torch.eye(4)  # the closure's tensor takes another shape
    assert signature(c) != first
    assert signature(functools.partial(torch.add, alpha=2)) != signature(functools.partial(torch.add, alpha=3))
    narrow, wide = nn.Linear(3, 4), nn.Linear(3, 5)
    assert signature(narrow) != signature(wide)
    assert signature(narrow) == signature(nn.Linear(3, 4))
    assert signature(narrow.eval()) != signature(nn.Linear(3, 4))  # the mode enters a module's trace


def test_a_value_whose_repr_holds_an_address_has_no_signature():
    # an object with no fields to describe and no repr of its own: in another process it could be anything
    assert signature(lambda x: x, object()) is None

    class Stateless:
        __slots__ = ()

    assert signature(Stateless()) == signature(Stateless()) is not None  # its type says all there is


def test_it_is_the_same_in_another_process(tmp_path):
    src = textwrap.dedent("""
        import torch
        from torch import nn
        net = nn.Sequential(nn.Linear(2, 8), nn.SiLU(), nn.Linear(8, 1))
        P = torch.eye(2)
        def energy(x, kinds=frozenset({"alpha", "beta", "gamma", "delta"})):
            return net(x).sum() + 0.5 * (x @ (P @ x)) if "beta" in kinds else x.sum()
    """)
    (tmp_path / "user_energy.py").write_text(src)
    code = "import sys; sys.path.insert(0, sys.argv[1]); import user_energy; from fnebm._signature import signature; " \
           "print(signature(user_energy.energy, (4, 2)))"
    outs = [subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout.strip() for seed in (1, 2, 3)]
    # a set's order follows string hashing (PYTHONHASHSEED): described in an order of its own
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 32


def test_objects_are_told_apart_by_their_fields_however_many_there_are():
    import dataclasses

    @dataclasses.dataclass(slots=True)
    class Term:
        weight: float
        power: float

    def make(powers):
        terms = [Term(1.0, p) for p in powers]

        def energy(x):
            return sum(t.weight * (x ** t.power).sum() for t in terms)

        return energy

    # every object by its own fields (no temporary's reused address may stand for a later object's)
    assert signature(make([2.0] * 6)) != signature(make([2.0] * 5 + [4.0]))
    assert signature(make([2.0] * 6)) == signature(make([2.0] * 6))

    class Prior:
        def __init__(self, power):
            self.power = power

    class Model:
        def __init__(self, power):
            self.prior = Prior(power)

    def nested(power):
        model = Model(power)
        return functools.partial(lambda x, m: (x ** m.prior.power).sum(), m=model)

    assert signature(nested(2.0)) != signature(nested(4.0))  # a number deep inside counts by its value


def test_a_modules_code_attributes_and_submodules_modes_enter_it():
    class Net(nn.Module):
        def __init__(self, temperature, act):
            super().__init__()
            self.temperature, self.act = temperature, act
            self.body = nn.Sequential(nn.Linear(2, 4), nn.Dropout(0.1), nn.Linear(4, 1))

        def forward(self, x):
            return self.body(x) / self.temperature

    class Edited(Net):
        def forward(self, x):
            return self.body(x) * self.temperature

    assert signature(Net(1.0, "tanh")) == signature(Net(1.0, "tanh"))
    assert len({signature(Net(1.0, "tanh")), signature(Net(10.0, "tanh")), signature(Net(1.0, "relu")),
                signature(Edited(1.0, "tanh"))}) == 4
    partly = Net(1.0, "tanh")
    partly.body[1].eval()
    assert signature(partly) != signature(Net(1.0, "tanh"))


def test_large_or_opaque_values_give_no_signature_and_cost_little():
    import array

    import numpy as np

    big = "x" * 10_000_000
    numbers = array.array("d", range(1_000_000))
    # given up at once (no repr of the whole value)
    assert signature(lambda x: x, big) is None and signature(lambda x: x, numbers) is None
    assert signature(list(range(100_000))) is None  # past the item limit
    # a numpy array is its shape and dtype, like a tensor
    assert signature(np.zeros((3, 4))) == signature(np.ones((3, 4))) != signature(np.zeros((3, 5)))
    assert signature({1.0, 2.0}) == signature({2.0, 1.0})
