"""Every Python block in README.md and docs/*.md runs, in order, one namespace per file.

Compiles inside the examples use the ``aot_eager`` backend (the same Dynamo graphs, no C++
code generation, which would cost minutes on two cores); the examples' results do not
depend on the backend.
"""

import pathlib
import re

import pytest
import torch

import fnebm
import fnebm.chain.sample

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(path):
    return BLOCK.findall(path.read_text())


@pytest.fixture
def light_compiles(monkeypatch):
    compile_ = torch.compile

    def compile_with_aot_eager(fn=None, **kw):
        kw.setdefault("backend", "aot_eager")
        return compile_(**kw) if fn is None else compile_(fn, **kw)

    monkeypatch.setattr(torch, "compile", compile_with_aot_eager)
    monkeypatch.setattr(fnebm.chain.sample, "default_cache", fnebm.chain.RunnerCache(backend="aot_eager", compile_estimate_s=20.0))


@pytest.mark.parametrize("path", [p for p in FILES if blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(path, light_compiles, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anything an example writes lands here
    namespace = {"__name__": f"docs_{path.stem}"}
    for i, code in enumerate(blocks(path)):
        try:
            exec(compile(code, f"{path.name}[block {i}]", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{path.name}, python block {i} failed: {type(e).__name__}: {e}\n{code}") from e


def test_every_doc_with_code_is_covered():
    # a file with python blocks must be picked up (guards the regex against a format change)
    assert {p.name for p in FILES if blocks(p)} >= {"README.md", "api.md", "getting-started.md", "energies.md"}
