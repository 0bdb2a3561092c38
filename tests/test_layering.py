"""The layers of docs (DESIGN.md's table) hold in the code: no module imports a layer it does not
depend on (module-level and function-level imports, ``importlib.import_module`` of a constant
name included), and no import cycle among fnebm's modules.

Read from the source with ``ast`` (nothing is imported), so the test is instant and names the
file and line of every offending import.
"""

from __future__ import annotations

import ast
import pathlib
from typing import NamedTuple

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fnebm"

# Every unit of fnebm (a top-level module or subpackage) and the units it may import directly:
# DESIGN.md's "depends on" column, and what its text adds (marked). A unit may import what its
# dependencies may import (transitively), itself, and the bottom helpers BASE. A new dependency
# is a decision: write it here (and in DESIGN.md) rather than around the test.
# argument checks, while_loop, large elementwise updates on one thread, descriptions of callables: torch
# only, usable everywhere
BASE = {"_checks", "_control", "_one_thread", "_signature"}
ALL = "everything"
LAYERS: dict[str, set[str] | str] = {
    "_checks": set(),
    "_control": set(),
    "_one_thread": set(),
    "_signature": set(),  # a description of a callable the same in every process (the compile records)
    "_philox_triton": set(),
    "_cbuild": set(),  # building and loading the C sources (torch and the standard library)
    "_random_cpu": {"_cbuild"},  # random's eager CPU draws in C
    "_random_ops": set(),  # random's draws as torch operators (random binds itself into it)
    "random": {"_philox_triton", "_random_cpu", "_random_ops"},
    "_inductor": {"_cbuild"},  # fnebm's Inductor backend, options and per-machine compile records
    "energies": set(),
    "gradients": {"energies"},
    "integrators": {"gradients", "random"},  # + random: momenta (metrics), SDE noise
    "interpolants": {"random"},
    "couplings": {"random"},
    "datasets": {"random"},
    "diagnostics": set(),
    "memory": set(),
    # kernels: random and energies; below the samplers and chain, which dispatch to them
    "kernels": {"random", "energies"},
    # the functional loop over steps (fnebm.chain.run) and the warm-ups' runner slot
    "_loop": {"random"},
    # + kernels: nuts(backend=...) runs the C transition; + interpolants: the flow sampler
    "samplers": {"integrators", "random", "kernels", "interpolants", "_inductor"},  # + _inductor: the evaluations' compile
    # + _loop: a warm-up runs through its runner, never through fnebm.chain (above it)
    "adaptation": {"samplers", "_loop"},
    # + kernels: the engines sample_chain dispatches to; + adaptation: below chain in the table
    "chain": {"samplers", "adaptation", "kernels", "_loop"},
    # + interpolants, couplings (the generative losses), _loop (the chains of the CD losses)
    "losses": {"samplers", "integrators", "energies", "interpolants", "couplings", "_loop"},
    "correction": {"chain", "samplers"},  # MCMC correction of a generator's draws: runs chains
    "profiling": {"chain", "gradients", "samplers"},  # times sample_chain's pieces
    "distributed": {"chain", "losses", "diagnostics"},  # + diagnostics: the collective statistics
    "cli": ALL,
    "__main__": {"cli"},
    "fnebm": ALL,  # the package's __init__: the public names
}


class Import(NamedTuple):
    importer: str  # module, e.g. fnebm.chain.sample
    imported: str  # module (or package) imported
    line: int
    top: bool  # executed when the importer is imported (not inside a function)


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(mods: dict[str, pathlib.Path]) -> list[Import]:
    found = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, top: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                for name in _targets(child, mod, is_package, mods):
                    found.append(Import(mod, name, child.lineno, top))
                visit(child, inner)

        visit(tree, True)
    return found


def _targets(node: ast.AST, mod: str, is_package: bool, mods: dict[str, pathlib.Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "fnebm"]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = mod.split(".") if is_package else mod.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.split(".")[0] != "fnebm":
            return []
        # `from fnebm.x import y`: the submodule y if there is one, else the module x
        return [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names]
    if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
            and node.args[0].value.split(".")[0] == "fnebm"):
        return [node.args[0].value]
    return []


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fnebm"


def _allowed(unit: str) -> set[str] | str:
    deps = LAYERS.get(unit, set())  # a unit missing from LAYERS: test_every_unit_has_a_layer says so
    if deps == ALL:
        return ALL
    seen, todo = set(), list(deps)
    while todo:
        u = todo.pop()
        if u not in seen:
            seen.add(u)
            more = LAYERS.get(u, set())
            todo.extend(() if more == ALL else more)
    return seen | BASE | {unit}


MODULES = _modules()
IMPORTS = _imports(MODULES)


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in MODULES}
    assert units <= set(LAYERS), f"place these in LAYERS (and DESIGN.md's table): {sorted(units - set(LAYERS))}"
    assert all(deps == ALL or deps <= set(LAYERS) for deps in LAYERS.values())
    for unit in BASE:  # the bottom imports nothing of fnebm
        assert LAYERS[unit] == set()


def test_the_walk_sees_imports_of_every_kind():
    """The parser finds module-level, function-level and relative imports and import_module calls
    (a check of the test: it must be able to fail)."""
    source = ("from fnebm import random as fr\nimport fnebm.chain.loop\nfrom . import schedule\n"
              "def f():\n    from fnebm.chain.sample import sample_chain\n"
              "    importlib.import_module('fnebm.samplers.nuts')\n")
    tree = ast.parse(source)
    mod = "fnebm.chain.backend"
    got = []
    for node in ast.walk(tree):
        got += _targets(node, mod, False, MODULES)
    assert got == ["fnebm.random", "fnebm.chain.loop", "fnebm.chain.schedule", "fnebm.chain.sample",
                   "fnebm.samplers.nuts"]
    assert any(not i.top for i in IMPORTS) and any(i.top for i in IMPORTS)


def test_no_module_imports_a_layer_it_does_not_depend_on():
    bad = []
    for imp in IMPORTS:
        a, b = _unit(imp.importer), _unit(imp.imported)
        allowed = _allowed(a)
        if allowed == ALL or b in allowed:
            continue
        upward = _allowed(b) == ALL or a in _allowed(b)
        where = "module level" if imp.top else "inside a function"
        bad.append(f"{MODULES[imp.importer].relative_to(PACKAGE.parent)}:{imp.line} ({where}) imports "
                   f"{imp.imported}: {'upward, ' if upward else ''}{a} does not depend on {b}")
    assert not bad, "imports against the layers (DESIGN.md's table, LAYERS here):\n" + "\n".join(bad)


# Known cycles, through function-level imports: the modules of each (none left; an entry that no
# longer matches fails below).
KNOWN_CYCLES: set[frozenset[str]] = set()


def _cycles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for imp in edges:
        if imp.importer != imp.imported:
            graph.setdefault(imp.importer, set()).add(imp.imported)
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_no_import_cycle_at_module_level():
    assert _cycles([i for i in IMPORTS if i.top]) == []


def test_no_import_cycle_but_the_known_one():
    cycles = {frozenset(c) for c in _cycles(IMPORTS)}
    assert cycles <= KNOWN_CYCLES, f"import cycles (function-level imports included): {[sorted(c) for c in cycles - KNOWN_CYCLES]}"
    stale = KNOWN_CYCLES - cycles
    assert not stale, f"these cycles are gone: remove them from KNOWN_CYCLES: {[sorted(c) for c in stale]}"


def test_the_cycle_finder_finds_cycles():
    edges = [Import("a", "b", 1, True), Import("b", "c", 1, True), Import("c", "a", 1, False), Import("c", "d", 1, True)]
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles([e for e in edges if e.top]) == []


@pytest.mark.parametrize("module", ["fnebm.adaptation.window", "fnebm.adaptation.chees"])
def test_adaptation_does_not_import_chain(module):
    """Issue 24: a warm-up reaches chains through the runner of fnebm._loop, not fnebm.chain."""
    assert not [i for i in IMPORTS if i.importer == module and _unit(i.imported) == "chain"]
