#!/usr/bin/env bash
# The wheel works outside the checkout: build it, install it into a fresh venv in a temporary
# folder, and check there that the C libraries the build compiled (setup.py's step) load with
# nothing built (a fresh FNEBM_CACHE_DIR stays empty); that with them passed over
# (FNEBM_PREBUILT=0) the C kernels (and the C++ trips) build from the files the wheel ships (a fresh FNEBM_CACHE_DIR,
# so nothing built from the checkout is reused), run, and agree with their twins; and that
# `fnebm demo` takes the C kernel. About 40 s on 2 cores.
#
# The venv sees the system site-packages (torch is not installed again: that alone takes ~45 s
# here), but not the checkout: PYTHONPATH is cleared, it runs from the temporary folder, and it
# asserts that `fnebm` is imported from the venv, not from an editable install.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/fnebm-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH
python=${PYTHON:-python}

# build from a copy: pip builds a local folder in place and would leave build/ and *.egg-info there
mkdir "$work/src"
tar -C "$root" --exclude=./.git --exclude=./build --exclude=./dist --exclude='*.egg-info' --exclude=__pycache__ \
    --exclude=./.venv --exclude=./fnebm/kernels/_prebuilt --exclude=.pytest_cache --exclude=.hypothesis -cf - . | tar -C "$work/src" -xf -
"$python" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation "$work/src" -w "$work/dist"
wheel=("$work"/dist/fnebm-*.whl)
echo "wheel_check: built ${wheel[0]##*/}"

"$python" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-index "${wheel[0]}"

cd "$work"
# the installation's own builds: loaded, nothing compiled, nothing written to the cache
FNEBM_CACHE_DIR="$work/cache-prebuilt" "$work/venv/bin/python" - <<'EOF'
import os, sys

import torch

import fnebm
from fnebm import _cbuild, _random_cpu, random as fr
from fnebm.kernels import cpu_chain, cpu_nuts, cpu_trips

where = os.path.realpath(fnebm.__file__)
assert where.startswith(os.path.realpath(sys.prefix) + os.sep), f"fnebm was imported from {where}, not the venv"
libraries = (_random_cpu.LIBRARY, cpu_chain.LIBRARY, cpu_nuts.LIBRARY, cpu_trips.LIBRARY)
assert sorted(lib.stem for lib in libraries) == sorted(_cbuild.LIBRARIES)
for lib in libraries:
    assert lib.load() is not None, f"{lib.stem} did not load: {lib.why}"
    assert lib.origin == "prebuilt" and lib.build_s == 0, (lib.stem, lib.origin, lib.passed_over)
x = fr.normal(fr.key(0), (4, 3))
assert torch.isfinite(x).all()
cache = os.environ["FNEBM_CACHE_DIR"]
built = [f for f in os.listdir(cache) if f.endswith(".so")] if os.path.isdir(cache) else []
assert not built, f"libraries were built although the installation has its own: {built}"
print(f"wheel_check: the wheel's prebuilt C libraries load, nothing built ({', '.join(_cbuild.LIBRARIES)})")
EOF

export FNEBM_CACHE_DIR="$work/cache" FNEBM_PREBUILT=0
"$work/venv/bin/python" - <<'EOF'
import os, sys

import torch

import fnebm
from fnebm import energies, random as fr
from fnebm.kernels import cpu_chain, cpu_nuts, cpu_trips

where = os.path.realpath(fnebm.__file__)
assert where.startswith(os.path.realpath(sys.prefix) + os.sep), f"fnebm was imported from {where}, not the venv"
for name, module in (("cpu_chain", cpu_chain), ("cpu_nuts", cpu_nuts)):
    why = module.available()
    assert why is None, f"{name} did not build from the installed wheel: {why}"
    assert module.build_seconds() > 0, f"{name} was not built now (FNEBM_CACHE_DIR is not fresh)"
# the NUTS kernel's trips in C++ (a .cpp source the wheel ships)
assert cpu_trips.available() is None, f"cpu_trips did not build from the installed wheel: {cpu_trips.available()}"
assert cpu_trips.LIBRARY.build_s > 0, "cpu_trips was not built now (FNEBM_CACHE_DIR is not fresh)"
# the eager draws' C library (fnebm.random falls back to NumPy without a word if it cannot build)
from fnebm import _random_cpu
assert _random_cpu.load() is not None, f"cpu_random did not build from the installed wheel: {_random_cpu.LIBRARY.why}"

# the chain kernel against the eager steps, the NUTS kernel against the torch kernel
alg = fnebm.mala(energies.harmonic(2.0), 0.2)
state = torch.func.vmap(alg.init)(fr.normal(fr.key(0), (40, 3)))
plans = []
_, got, _ = fnebm.sample_chain(alg.step, state, fr.key(1), 30, progress=False, on_plan=plans.append)
_, want, _ = fnebm.sample_chain(alg.step, state, fr.key(1), 30, backend="eager", progress=False)
assert plans[0].kernel, plans[0]
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
energy = energies.gaussian(torch.zeros(3), torch.tensor([[1.0, 0.5, 0.0], [0.5, 1.0, 0.2], [0.0, 0.2, 1.0]]))
state = torch.func.vmap(fnebm.nuts(energy, 0.5).init)(fr.normal(fr.key(0), (16, 3)))
got = fnebm.sample_chain(fnebm.nuts(energy, 0.5, backend="c").step, state, fr.key(1), 4, progress=False)[1]
want = fnebm.sample_chain(fnebm.nuts(energy, 0.5, backend="torch").step, state, fr.key(1), 4, progress=False,
                          compile=False)[1]
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
print(f"wheel_check: fnebm from {os.path.dirname(where)}; both C kernels built from the wheel "
      f"({cpu_chain.build_seconds():.1f} s, {cpu_nuts.build_seconds():.1f} s) and agree with their twins")
EOF

"$work/venv/bin/fnebm" demo --no-progress --plot "$work/demo.png" > "$work/demo.txt"
path_line="$(grep '^path ' "$work/demo.txt")"
echo "wheel_check: fnebm demo: $path_line"
case "$path_line" in
    *"C kernel (CPU), nothing compiled"*) ;;
    *) echo "wheel_check: the demo did not run the C kernel" >&2; cat "$work/demo.txt" >&2; exit 1 ;;
esac
echo "wheel_check: ok"
