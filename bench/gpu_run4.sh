#!/bin/bash
# Fifth GPU call of issue 26: the CUDA tests, MALA on the logistic-regression posterior after the
# eager batched-gradient route for one-sample functions on CUDA (fnebm/gradients.py), the same with
# compile=True, the first-call profile of MALA, and the neural first call. Wheels in .whl/
# (torchebm, blackjax). PARTS (default "test mala first") picks; "compiled" and "profile" are extra.
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
PARTS=${PARTS:-test mala first}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; cat /proc/loadavg;
  python3 -c "import torch, triton, jax; print(torch.__version__, triton.__version__, jax.__version__)"; } 2>&1 | tee "$OUT/env.txt"
case " $PARTS " in *" test "*)
timeout 110 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda_graph_steps.py tests/test_diagnostics.py::test_follows_cuda_device \
  tests/test_batched.py -k "cuda or graph or function or route" 2>&1 | tail -8 | tee "$OUT/pytest.log";; esac
case " $PARTS " in *" mala "*)
timeout 150 python3 bench/posterior.py --only mala --device cuda --repeats 1 --rounds 3 --calls 2 --timeout 70 \
  --json "$OUT/results-posterior-mala-gpu.json" 2>&1 | tee "$OUT/posterior_mala.log" | tail -24;; esac
case " $PARTS " in *" profile "*)
timeout 70 python3 bench/gpu_mala_profile.py 2>&1 | tee "$OUT/mala_profile.log" | head -60;; esac
case " $PARTS " in *" first "*)
timeout 100 python3 bench/gpu_first_call.py --rounds 2 2>&1 | tee "$OUT/first_call.log" | tail -12;; esac
case " $PARTS " in *" compiled "*)
timeout 120 python3 bench/posterior.py --only mala --device cuda --repeats 1 --rounds 3 --calls 2 --timeout 100 \
  --fnebm-compile true --json "$OUT/results-posterior-mala-gpu-compiled.json" 2>&1 | tee "$OUT/posterior_mala_compiled.log" | tail -24;; esac
echo done
