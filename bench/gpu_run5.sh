#!/bin/bash
# Sixth GPU call of issue 26: MALA's fused step (fnebm.kernels.mala_step) on a GPU: its tests and
# the graph-replay tests there, its time and trace against the torch operations it replaces
# (bench/gpu_mala_step.py), and bench/posterior.py's MALA workload against BlackJAX. Wheels in
# .whl/ (torchebm, blackjax).
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; cat /proc/loadavg; } 2>&1 | tee "$OUT/env.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_mala_step.py tests/test_cuda_graph_steps.py 2>&1 | tail -15 | tee "$OUT/pytest.log"
timeout 110 python3 bench/gpu_mala_step.py 2>&1 | tee "$OUT/mala_step.log"
timeout 150 python3 bench/posterior.py --only mala --device cuda --repeats 1 --rounds 3 --calls 2 --timeout 70 \
  --json "$OUT/results-posterior-mala-gpu-fused.json" 2>&1 | tee "$OUT/posterior_mala.log" | tail -14
echo done
