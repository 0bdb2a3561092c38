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
        def energy(x):
            return net(x).sum() + 0.5 * (x @ (P @ x))
    """)
    (tmp_path / "user_energy.py").write_text(src)
    code = "import sys; sys.path.insert(0, sys.argv[1]); import user_energy; from fnebm._signature import signature; " \
           "print(signature(user_energy.energy, (4, 2)))"
    outs = [subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout.strip() for seed in (1, 2)]
    assert outs[0] == outs[1] and len(outs[0]) == 32
