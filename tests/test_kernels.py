"""fnebm.kernels under TRITON_INTERPRET=1 on CPU: each kernel against its pure-torch twin.

Same key, same noise: the fused Langevin kernel's in-kernel normals are fnebm.random.normal's
(to about 2 ulp: the Philox words agree bit for bit, log/cos/sin are the interpreter's NumPy
ones against torch's), and its positions equal the twin's to float32 tolerance.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import pytest
import torch

pytest.importorskip("triton")

from fnebm import random as fr  # noqa: E402
from fnebm.integrators import euler_maruyama  # noqa: E402
from fnebm.kernels import langevin_update, langevin_update_torch  # noqa: E402

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                       reason="needs TRITON_INTERPRET=1 or a GPU"),
]

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
# Normals: the interpreter's float32 log/cos/sin against torch's differ by an ulp or two.
TOL = dict(rtol=2e-6, atol=1e-6)


def _keys(chains):
    k = fr.key(17, device=DEVICE)
    return k if chains == () else fr.split(k, torch.Size(chains).numel()).reshape(*chains, 2)


# (chains, event): tails inside a tile (37 = 4 * 10 - 3), chains past a tile's rows, a single
# key drawing the whole tensor over two programs (1100 numbers = 275 blocks > 256 per tile).
SHAPES = [((3,), (37,)), ((2, 3), (5, 2)), ((), (1100,))]


@pytest.mark.parametrize("chains, event", SHAPES)
def test_noise_is_fnebm_random_normal(chains, event):
    keys = _keys(chains)
    zero = torch.zeros(chains + event, device=DEVICE)
    # h = 1/2, s = 1: x' = 0 - 0 + 1 * xi exactly, so x' is the kernel's noise
    noise = langevin_update(zero, zero, keys, 0.5, 1.0)
    torch.testing.assert_close(noise, fr.normal(keys, event), **TOL)


@pytest.mark.parametrize("per_chain", [False, True], ids=["0-dim", "per-chain"])
def test_update_matches_twin(per_chain):
    chains, event = (5,), (37,)
    x, g = fr.normal(fr.key(1, DEVICE), (2,) + chains + event)
    keys = _keys(chains)
    if per_chain:
        h = torch.linspace(0.01, 0.5, 5, device=DEVICE)
        s = torch.tensor(0.8, device=DEVICE)
    else:
        h = torch.tensor(0.1, device=DEVICE)
        s = torch.linspace(0.0, 1.0, 5, device=DEVICE)
    twin = langevin_update_torch(x, g, keys, h, s)
    torch.testing.assert_close(langevin_update(x, g, keys, h, s), twin, **TOL)
    # the twin is the Euler–Maruyama step with fnebm.random's noise
    hb, sb = (t.reshape(-1, 1) if t.ndim else t for t in (h, s))
    assert torch.equal(twin, euler_maruyama(x, g, hb, fr.normal(keys, event), sb))


def test_gradients_match_twin():
    keys = _keys((3,))
    w = torch.linspace(-1.0, 1.0, 3 * 37, device=DEVICE).reshape(3, 37)

    def grads(update):
        args = [*fr.normal(fr.key(2, DEVICE), (2, 3, 37)), torch.tensor([0.1, 0.2, 0.3], device=DEVICE),
                torch.tensor(0.7, device=DEVICE)]
        args = [a.requires_grad_() for a in args]
        (update(args[0], args[1], keys, *args[2:]) * w).sum().backward()
        return [a.grad for a in args]

    for a, b in zip(grads(langevin_update), grads(langevin_update_torch)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rejects_what_the_kernel_does_not_cover():
    keys = _keys((3,))
    x = torch.zeros(3, 4, device=DEVICE)
    with pytest.raises(TypeError, match="float32"):
        langevin_update(x.double(), x.double(), keys, 0.1)
    with pytest.raises(ValueError, match="step_size"):
        langevin_update(x, x, keys, torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match="key"):
        langevin_update(x, x, _keys((4,)), 0.1)


@pytest.mark.compile
def test_op_in_compiled_graph():
    """The registered op: its fake implementation and AOT dispatch (opcheck), and one
    fullgraph compile that a new step-size value does not recompile."""
    keys = _keys((3,))
    x, g = fr.normal(fr.key(3, DEVICE), (2, 3, 37))
    h = torch.tensor([0.1, 0.2, 0.3], device=DEVICE)
    s = torch.tensor(1.0, device=DEVICE)
    torch.library.opcheck(torch.ops.fnebm.langevin_update.default, (x.requires_grad_(), g, keys, h, s))
    x = x.detach()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(lambda x, g, k, h: langevin_update(x, g, k, h, s) * 2.0, fullgraph=True, backend="aot_eager")
    for h in (h, 2 * h):
        torch.testing.assert_close(step(x, g, keys, h), 2.0 * langevin_update_torch(x, g, keys, h, s), **TOL)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
