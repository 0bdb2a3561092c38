"""Where a keyed loss loses time on a GPU: fnebm.random's eager draws against torch's, and one flow-matching
loss + backward with fnebm's keyed noise against the same loss fed torch.randn noise (bench/gpu_train_gen.py's MLP).

    python bench/gpu_rng_probe.py      # needs CUDA; prints JSON
"""

import json
import statistics
import sys
import time

import torch

from fnebm import random as fr

if not torch.cuda.is_available():
    print("bench/gpu_rng_probe.py: needs a CUDA device", file=sys.stderr)
    sys.exit(2)
dev = torch.device("cuda")


def timed(fn, n=50):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


k = fr.key(0, device=dev)
out = {"device": torch.cuda.get_device_name()}
for shape in ((4096, 2), (128, 3, 32, 32)):
    out[f"fnebm.normal{shape} ms"] = timed(lambda: fr.normal(k, shape))
    out[f"fnebm.uniform{shape} ms"] = timed(lambda: fr.uniform(k, shape))
    out[f"torch.randn{shape} ms"] = timed(lambda: torch.randn(shape, device=dev))
    out[f"fnebm.split ms"] = timed(lambda: fr.split(k, 3))
print(json.dumps(out, indent=1))
