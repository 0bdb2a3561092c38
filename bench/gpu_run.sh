#!/bin/bash
# The GPU half of issue 26 in one device call (bench/gpu_user.py, then bench/posterior.py --device cuda).
# Expects the peers' wheels in .whl/ (torchebm, blackjax), results under $OUT (or ./gpu-out).
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; cat /proc/loadavg
  python3 -c "import torch, jax, blackjax, torchebm; print('torch', torch.__version__, 'jax', jax.__version__, jax.devices())"; } 2>&1 | tee "$OUT/env.txt"
timeout 330 python3 bench/gpu_user.py --only mlp784,mlp2d,conv28 --warm 5 --timeout 170 \
  --json "$OUT/results-gpu-user.json" 2>&1 | tee "$OUT/gpu_user.log" | grep -v "^  [a-z0-9]* \(first\|second\) "
timeout 170 python3 bench/posterior.py --only logreg --device cuda --quick --repeats 1 --rounds 2 --calls 2 --timeout 75 \
  --json "$OUT/results-posterior-gpu.json" 2>&1 | tee "$OUT/posterior.log"
timeout 60 python3 bench/gpu_user.py --only mlp784x4096 --warm 5 --timeout 58 \
  --json "$OUT/results-gpu-user-4096.json" 2>&1 | tee "$OUT/gpu_user_4096.log" | grep -v "^  [a-z0-9]* \(first\|second\) "
echo done
