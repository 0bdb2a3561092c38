"""Import cost, and the batched form of energies: one forward and one backward for all chains.

* ``import fnebm`` loads nothing heavy (Dynamo, Inductor, sympy, triton) until it is used: a
  behavioural check in a fresh process, not a time.
* An energy that evaluates a whole batch in one call (``from_module``, ``bind(batch_fn=)``,
  ``batched``) gives the same values, gradients and draws as its one-sample form.
"""

import os
import subprocess
import sys

import torch

from fnebm.kernels import _assume_constant_result

HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "triton")


def test_import_fnebm_loads_no_compiler_stack():
    code = "import fnebm, sys; print(sorted(m for m in %r if m in sys.modules))" % (HEAVY,)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ), cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_constant_mark_is_the_one_dynamo_sets():
    import torch._dynamo

    def ours():
        return None

    def theirs():
        return None

    _assume_constant_result(ours)
    torch._dynamo.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) == {"_dynamo_marked_constant": True}
