#!/bin/bash
# Third GPU call of issue 26: eager steps replayed from a CUDA graph (engines._graphed), checked and
# timed against one-by-one eager steps, the plain loop and TorchEBM. Wheels in .whl/ (torchebm, blackjax).
# PARTS (default "test check user profile") picks what runs; "first" (bench/gpu_first_call.py, and the
# graph check with torch draws) and "mala" (bench/posterior.py --only mala --device cuda) are extra.
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
PARTS=${PARTS:-test check user profile}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; cat /proc/loadavg; } 2>&1 | tee "$OUT/env.txt"
case " $PARTS " in *" test "*)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph_steps.py 2>&1 | tail -15 | tee "$OUT/pytest.log";; esac
case " $PARTS " in *" check "*)
timeout 150 python3 bench/gpu_graph_check.py 2>&1 | tee "$OUT/graph_check.log" | tail -30;; esac
case " $PARTS " in *" user "*)
timeout 260 python3 bench/gpu_user.py --only mlp784,mlp2d,conv28,mlp784x4096 --rows "fnebm,fnebm one-by-one,TorchEBM" \
  --warm 5 --timeout 62 --json "$OUT/results-gpu-user-graphs.json" 2>&1 | tee "$OUT/gpu_user.log" | grep -v "^  [a-z0-9]* \(first\|second\) ";; esac
case " $PARTS " in *" profile "*)
timeout 60 python3 bench/gpu_profile_user.py --workload mlp784 --steps 20 2>&1 | tee "$OUT/profile.log" | grep -E "==|most called";; esac
case " $PARTS " in *" first "*)
timeout 150 python3 bench/gpu_first_call.py --rounds 3 2>&1 | tee "$OUT/first_call.log"
timeout 60 python3 bench/gpu_graph_check.py --torch-draws 2>&1 | tee "$OUT/graph_check_torch_draws.log" | tail -22;; esac
case " $PARTS " in *" mala "*)
timeout 150 python3 bench/posterior.py --only mala --device cuda --repeats 1 --rounds 3 --calls 2 --timeout 70 \
  --json "$OUT/results-posterior-mala-gpu.json" 2>&1 | tee "$OUT/posterior_mala.log" | tail -30;; esac
echo done
