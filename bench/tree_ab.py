"""fnebm's own sampling paths in two trees, fresh processes alternated A B A B: the C whole-chain kernel
(W1: Langevin, W3: MALA, bench/run.py's 10-D double well, 10,000 chains x 100 steps) and the eager
engine on many chains of a small state (Langevin on an energy written for a batch,
``energies.batched(lambda xs: 0.5 * (xs * xs).sum(-1))``, 10,000 chains of a 2-D position x 100 steps,
compile=False: what a user's energy pays beside its gradient: the draws, the update, the checks).

    python bench/tree_ab.py --before TREE [--after TREE] [--pairs 3] [--json PATH]

Each process times 7 calls of each case after one unmeasured call and reports their median; the
figure per case is the median over pairs of after / before. A tree is put first on PYTHONPATH (the
processes run outside any checkout, so an editable install does not shadow it); give each tree its
built C libraries (``python -c "import fnebm._cbuild as c; c.prebuild()"`` in it, or copy
fnebm/kernels/_prebuilt) or the first call builds them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, os, time
import torch, fnebm
from fnebm import energies, random as fr
out = {"tree": os.path.dirname(os.path.dirname(fnebm.__file__))}
well = energies.double_well(2.0, 1.0)
quadratic = energies.batched(lambda xs: 0.5 * (xs * xs).sum(-1))
cases = (("W1 Langevin, C chain kernel", lambda: fnebm.langevin(well, 0.01), 10, True),
         ("W3 MALA, C chain kernel", lambda: fnebm.mala(well, 0.01), 10, True),
         ("eager Langevin, batched energy, 10,000 x 2", lambda: fnebm.langevin(quadratic, 0.01, 0.05), 2, False))
for name, make, dim, compiled in cases:
    alg = make()
    state = torch.func.vmap(alg.init)(fr.normal(fr.key(0), (10000, dim)))
    f = lambda: fnebm.sample_chain(alg.step, state, fr.key(1), 100, compile=compiled, progress=False)
    f()
    ts = []
    for _ in range(7):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    out[name] = sorted(ts)[3]  # the median of 7
print(json.dumps(out))
"""


def _one(tree: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, OMP_WAIT_POLICY="PASSIVE")
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if r.returncode:
        raise SystemExit(f"{tree}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if os.path.realpath(got["tree"]) != os.path.realpath(tree):
        raise SystemExit(f"asked for {tree}, imported fnebm from {got['tree']}")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default=ROOT)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    load0 = os.getloadavg()
    runs = []
    for _ in range(a.pairs):
        runs.append((_one(a.before), _one(a.after)))
    cases = [k for k in runs[0][0] if k != "tree"]
    result = {"host": platform.processor() or platform.machine(), "load": [load0, os.getloadavg()],
              "before": a.before, "after": a.after, "cases": {}}
    print(f"{a.pairs} process pairs, load {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    for c in cases:
        b, f = [r[0][c] for r in runs], [r[1][c] for r in runs]
        ratio = statistics.median(x / y for x, y in zip(f, b))
        result["cases"][c] = {"before_s": b, "after_s": f, "ratio_median": ratio}
        print(f"  {c}: before {statistics.median(b) * 1e3:.1f} ms, after {statistics.median(f) * 1e3:.1f} ms, "
              f"after/before {ratio:.2f}x")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
