"""fnebm.kernels.families, the one table of analytic families, against the C and Triton sources
that switch on its ids, and the kernels' covers() that read it (parsing: no kernel runs); and a new
family added at the five sites it takes, run on every engine (one test, two C builds)."""

import ast
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from fnebm import energies as E
from fnebm.kernels import cpu_chain, cpu_nuts, families

KERNELS = Path(families.__file__).parent


def _examples():
    """One energy of each family (a family without an example fails test_every_family_has_an_example)."""
    d = 3
    return {
        "double_well": E.double_well(2.0, 1.0),
        "harmonic": E.harmonic(1.5),
        "gaussian": E.Gaussian(torch.zeros(d), torch.linspace(0.5, 2.0, d)),
        "rastrigin": E.rastrigin(3.0),
        "gaussian_full": E.gaussian(torch.zeros(d), torch.eye(d) + 0.5),
    }


def _c_families() -> tuple[dict[str, int], set[str]]:
    """``({NAME: id}, separable names)`` as _cpu_common.h declares them: the FNEBM_SEPARABLE list's
    X(NAME, id, ...) entries and the enum's further members."""
    header = (KERNELS / "_cpu_common.h").read_text()
    body = re.search(r"#define FNEBM_SEPARABLE\(X\)(.*?)\n\n", header, re.S)
    assert body, "FNEBM_SEPARABLE not found in _cpu_common.h"
    separable = {name: int(i) for name, i in re.findall(r"\bX\((\w+),\s*(\d+),", body.group(1))}
    enum = re.search(r"enum\s*\{\s*FNEBM_SEPARABLE\(FNEBM_ENUM\)(.*?)\};", header, re.S)
    assert enum, "the families' enum not found in _cpu_common.h"
    others = {name: int(i) for name, i in re.findall(r"(\w+)\s*=\s*(\d+)", enum.group(1))}
    return {**separable, **others}, set(separable)


def test_the_c_sources_number_the_families_as_the_table_does():
    ids, separable = _c_families()
    assert ids == families.ids(families.C_CHAIN) == families.ids(families.C_NUTS)
    # both kernels dispatch over the separable list, and name every other family they take
    chain = (KERNELS / "_cpu_chain.c").read_text()
    nuts = (KERNELS / "_cpu_nuts.c").read_text()
    assert "FNEBM_SEPARABLE(FNEBM_RUN)" in chain and "FNEBM_SEPARABLE(FNEBM_CASE)" in nuts
    assert "FNEBM_SEPARABLE(FNEBM_TERM)" in (KERNELS / "_cpu_common.h").read_text()
    for name in set(ids) - separable:
        assert re.search(rf"run_block\(a, c0, buf, {name},", chain), f"_cpu_chain.c does not run {name}"
        assert re.search(rf"energy_grad\({name},", nuts), f"_cpu_nuts.c does not compute {name}"
    # no family switched on by a bare number
    for source in (chain, nuts):
        assert not re.search(r"family\s*==\s*\d", source)


def _triton_tree():
    return ast.parse((KERNELS / "langevin_chain.py").read_text())


def test_the_triton_kernel_numbers_the_families_as_the_table_does():
    tree = _triton_tree()
    want = families.ids(families.TRITON)
    # the constexprs: _NAME = tl.constexpr(_IDS["NAME"]), _IDS = families.ids(families.TRITON)
    consts = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            arg = node.value.args[0] if node.value.args else None
            if isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name) and arg.value.id == "_IDS":
                consts[target.id] = arg.slice.value
    assert consts == {f"_{name}": name for name in want}
    assert "_IDS = families.ids(families.TRITON)" in (KERNELS / "langevin_chain.py").read_text()
    # every comparison with ENERGY names one of them; _terms and _energy have a branch for each
    compared = {}
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(fn):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "ENERGY":
                (right,) = node.comparators
                assert isinstance(right, ast.Name) and right.id in consts, (
                    f"{fn.name} compares ENERGY with {ast.unparse(right)}, not a family's constexpr")
                compared.setdefault(fn.name, set()).add(consts[right.id])
    assert compared["_terms"] == compared["_energy"] == set(want)


def test_every_family_has_an_example_and_the_table_is_consistent():
    examples = _examples()
    assert [f.name for f in families.FAMILIES] == list(examples)
    assert len({f.id for f in families.FAMILIES}) == len(families.FAMILIES)
    for f in families.FAMILIES:
        energy = examples[f.name]
        assert families.find(energy) is f and f.engines <= set(families.ENGINES)
        family_id, scalars, vectors = families.pack(energy, 3)
        assert family_id == f.id and scalars.shape == (2,) and scalars.dtype == vectors.dtype == torch.float32
    assert families.find(E.rosenbrock()) is None
    # exact types: a subclass may override __call__ or grad
    sub = type("MyHarmonic", (E.Harmonic,), {})(torch.tensor(1.0))
    assert families.find(sub) is None


def test_covers_reads_the_table(monkeypatch):
    examples = _examples()
    lc = importlib.import_module("fnebm.kernels.langevin_chain")
    checks = {families.C_CHAIN: cpu_chain.covers, families.TRITON: lc.covers,
              families.C_NUTS: lambda e: cpu_nuts.why_not(e, *_nuts_args())}
    for f in families.FAMILIES:
        for engine, covers in checks.items():
            reason = covers(examples[f.name])
            assert (reason is None) == (engine in f.engines) or (engine == families.C_NUTS and reason is not None
                                                                and "C compiler" in reason), (f.name, engine, reason)
    # take double_well from every engine: each covers() says so, naming the family
    dw = families.FAMILIES[0]
    monkeypatch.setattr(families, "FAMILIES", (families.Family(dw.id, dw.name, dw.energy_type, dw.pack,
                                                               frozenset(), dw.label),) + families.FAMILIES[1:])
    for covers in checks.values():
        assert "double well" in covers(examples["double_well"])
    assert "Rosenbrock" in cpu_chain.covers(E.rosenbrock())


def _nuts_args():
    x = torch.zeros(2, 3)
    return (x, torch.zeros(2), x, torch.zeros(2, 2, dtype=torch.int64), torch.tensor(0.1), torch.ones(3), False,
            (0.5, 1.0, 0.5))


@pytest.mark.parametrize("name", ["double_well", "gaussian", "gaussian_full"])
def test_packing_is_what_the_kernels_read(name):
    energy = _examples()[name]
    family_id, scalars, vectors = cpu_chain._params(energy, 3)
    if name == "double_well":
        assert torch.equal(scalars, torch.stack([energy.barrier_height, energy.b]))
    elif name == "gaussian":  # mean, precision, sqrt(precision), one row each
        assert torch.equal(vectors, torch.stack([energy.mean, energy.precision, energy.precision_tril]))
    else:  # mean, then the factor row-major
        assert torch.equal(vectors, torch.cat([energy.mean, energy.precision_tril.reshape(-1)]))
    assert family_id == families.find(energy).id and scalars.is_contiguous() and vectors.is_contiguous()


# --------------------------------------------------------------- a new family, on every engine

# What adding a separable family to every fast path takes (issue 24): E = c sum x^4. The energy
# itself goes into fnebm.energies (not a fast-path site); then five sites in three files.
_QUARTIC_ENERGY = ("energies/analytic.py", "\n# ----------------------------------------------------------------------------- Rastrigin\n", '''

@dataclass(frozen=True, eq=False)
class Quartic(Energy):
    c: Tensor

    def __call__(self, x: Tensor) -> Tensor:
        return self.c * (x * x * x * x).sum(-1)

    def grad(self, x: Tensor) -> Tensor:
        return 4 * self.c * x * x * x

# ----------------------------------------------------------------------------- Rastrigin
''')
_QUARTIC_SITES = [
    ("kernels/families.py", '''           lambda e: not e.is_diagonal),
)''', '''           lambda e: not e.is_diagonal),
    Family(5, "quartic", analytic.Quartic, lambda e, d: _scalar(e.c), _ALL, "a quartic energy"),
)'''),
    ("kernels/_cpu_common.h", '''    }, pa * (float)d + acc)
''', '''    }, pa * (float)d + acc)                                                                                 \\
    X(QUARTIC, 5, {                                                                                         \\
        float p2 = p * p;                                                                                   \\
        *q = p2 * p2;                                                                                       \\
        *n = 4.0f * va * p2 * p;                                                                            \\
    }, pa * acc)
'''),
    ("kernels/langevin_chain.py", '''    _RASTRIGIN: tl.constexpr = tl.constexpr(_IDS["RASTRIGIN"])
''', '''    _RASTRIGIN: tl.constexpr = tl.constexpr(_IDS["RASTRIGIN"])
    _QUARTIC: tl.constexpr = tl.constexpr(_IDS["QUARTIC"])
'''),
    ("kernels/langevin_chain.py", '''            g = 2.0 * x + _TWO_PI * pa * tl.sin(w)
''', '''            g = 2.0 * x + _TWO_PI * pa * tl.sin(w)
        elif ENERGY == _QUARTIC:
            x2 = x * x
            e = x2 * x2
            g = 4.0 * pa * x2 * x
'''),
    ("kernels/langevin_chain.py", '''            out = tl.load(s_ptr) * d + total
''', '''            out = tl.load(s_ptr) * d + total
        elif ENERGY == _QUARTIC:
            out = tl.load(s_ptr) * total
'''),
]

_QUARTIC_RUN = '''
import torch, fnebm
from fnebm import random as fr
from fnebm.energies.analytic import Quartic
from fnebm.kernels import cpu_chain, dispatch, families

dispatch._INTERPRETER_ON_CPU = True  # the Triton kernel on CPU tensors, under the interpreter
energy = Quartic(torch.tensor(0.5))
assert families.find(energy).name == "quartic" and cpu_chain.covers(energy) is None, cpu_chain.covers(energy)
for make in (fnebm.langevin, fnebm.mala):
    alg = make(energy, 0.05)
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(1), (6, 5)))
    want = fnebm.sample_chain(alg.step, state, fr.key(2), 6, burn_in=2, thin=2, backend="eager", progress=False)
    for backend in ("c", "triton"):
        got = fnebm.sample_chain(alg.step, state, fr.key(2), 6, burn_in=2, thin=2, backend=backend, progress=False)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        for a, b in zip(got[2], want[2]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
keys = fr.split(fr.key(3), 6)
runs = []
for backend in ("c", "torch"):
    alg = fnebm.nuts(energy, 0.2, backend=backend)
    runs.append(fnebm.chain.run(alg.step, torch.func.vmap(alg.init)(fr.normal(fr.key(1), (6, 5))), keys, 4))
torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-4, atol=1e-4)
assert torch.equal(runs[0][2].num_integration_steps, runs[1][2].num_integration_steps)
print("quartic ok")
'''


@pytest.mark.skipif(cpu_chain.available() is not None, reason="no C compiler builds the kernels here")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter)")
def test_a_new_family_is_five_sites_in_three_files(tmp_path):
    """Adds E = c sum x^4 to a copy of the package at the five sites docs/kernels.md lists, builds
    both C kernels from the copy and runs Langevin and MALA in C and in Triton (interpreter) and
    NUTS in C against the samplers' own eager steps. ~15 s (two C builds)."""
    import os
    import shutil
    import subprocess
    import sys

    import fnebm

    copy = tmp_path / "src" / "fnebm"
    shutil.copytree(Path(fnebm.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert len(_QUARTIC_SITES) == 5 and len({path for path, _, _ in _QUARTIC_SITES}) == 3
    for path, old, new in [_QUARTIC_ENERGY, *_QUARTIC_SITES]:
        text = (copy / path).read_text()
        assert text.count(old) == 1, f"{path}: the site moved ({old[:40]!r})"
        (copy / path).write_text(text.replace(old, new))
    env = dict(os.environ, PYTHONPATH=str(copy.parent), FNEBM_CACHE_DIR=str(tmp_path / "cache"),
               TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _QUARTIC_RUN], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "quartic ok", done.stderr[-3000:]
