#!/bin/bash
# Second GPU call of issue 26: the compiled rows after the uint8 -> bool fix, a profile of the eager
# step, and the NUTS logistic regression phase by phase. Wheels in .whl/ (torchebm, blackjax).
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 230 python3 bench/gpu_user.py --only mlp784,mlp2d --warm 5 --timeout 150 \
  --json "$OUT/results-gpu-user-compiled.json" 2>&1 | tee "$OUT/gpu_user.log" | grep -v "^  [a-z0-9]* \(first\|second\) "
timeout 60 python3 bench/gpu_profile_user.py --workload mlp784 --steps 20 2>&1 | tee "$OUT/profile.log" | cut -c1-200
timeout 110 python3 bench/gpu_nuts_check.py 2>&1 | tee "$OUT/nuts.log" | grep -v "^\s*$" | tail -40
echo done
