"""fnebm.distributed, training: two gloo processes on CPU against one process with the combined batch.

One module-scoped run spawns 2 ranks (``tests/test_distributed.py``'s ``_spawn``: a 60 s timeout
on the group's collectives, a rank that raises fails at once, a deadline kills a hung run) and
trains, eagerly and in float64:

* persistent CD (MALA, a replay ring per chain) with ``torch.func.grad`` over a parameter dict,
  ``all_reduce_mean`` and a functional Adam, 5 examples split 3 + 2 (uneven: the weighted
  mean), a checkpoint half-way, then a resume from it on the same two ranks, and one from a
  checkpoint a single process saved (the chains re-sharded 5 -> 3 + 2);
* denoising score matching, the same way (no chains);
* CD with an ``nn.Module`` and ``torch.optim.Adam`` under ``DistributedDataParallel``, and
  under FSDP2's ``fully_shard``, 6 examples split 3 + 3.

The parent runs the same code with no process group (every helper the identity) on the
combined batch and compares. Cost: about 40 s in all on the loaded 2-core machine (load
average 8), nearly all of it the spawned run (two processes importing torch, then eager
training) and the one-process references; the other tests take well under a second each.

**Tolerance.** Not bit-exact: the ranks average their gradients (``sum_r n_r g_r / n``) where one
process takes one mean over all examples, and ``vmap`` over 3 examples runs other BLAS blocks
than over 5, so sums round in another order. Everything else — every example's key, noise,
chain and buffer entry — is the same. Measured after 4 steps: at most 1.1e-16 absolute on the
parameters (all of size ~0.1-1), 4.4e-16 on the gradients, 5.6e-17 on the chains; relative, at
most 3.4e-13, on elements near zero. The tests allow 1e-10 relative plus 1e-12 absolute: about
10,000 times that, and far below what a wrong key, a lost or doubled example or a wrong weight
changes (``test_a_wrong_layout_is_caught``: over 1e6 times the tolerance).
"""

import functools
import os

import pytest
import torch
from torch.utils import _pytree as pytree

import fnebm
from fnebm import datasets
from fnebm import distributed as fdist
from fnebm import energies as E
from fnebm import losses
from fnebm import random as fr

from test_distributed import _spawn

F64 = torch.float64
HIDDEN = 16
N_PCD, N_DDP = 5, 6          # examples per step: 3 + 2, and 3 + 3 (DDP averages ranks plainly)
N_STEPS, SAVE_AT = 4, 2
K_PARAMS, K_DATA, K_TRAIN, K_CHAINS = fr.split(fr.key(2024), 4)
RTOL, ATOL = 1e-10, 1e-12    # see the module docstring

PCD = functools.partial(losses.persistent_contrastive_divergence, sampler=lambda e: fnebm.mala(e, 0.1),
                        n_steps=3, reinit_prob=0.3)
DSM = functools.partial(losses.denoising_score_matching, sigma=torch.tensor([0.1, 0.3], dtype=F64))
CD = functools.partial(losses.contrastive_divergence, sampler=lambda e: fnebm.langevin(e, 0.05), n_steps=3,
                       init="noise")


# ----------------------------------------------------------------- the training code, shared


def mlp(params, x):
    return torch.nn.functional.silu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def init_params():
    k1, k2 = fr.split(K_PARAMS)
    return {"w1": 0.7 * fr.normal(k1, (2, HIDDEN), F64), "b1": torch.zeros(HIDDEN, dtype=F64),
            "w2": 0.25 * fr.normal(k2, (HIDDEN,), F64), "b2": torch.zeros((), dtype=F64)}


def adam_init(params):
    return {"m": {k: torch.zeros_like(v) for k, v in params.items()},
            "v": {k: torch.zeros_like(v) for k, v in params.items()}, "t": torch.zeros((), dtype=F64)}


def adam(params, grads, opt, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8):
    t = opt["t"] + 1
    m = {k: b1 * opt["m"][k] + (1 - b1) * grads[k] for k in params}
    v = {k: b2 * opt["v"][k] + (1 - b2) * grads[k] ** 2 for k in params}
    new = {k: params[k] - lr * (m[k] / (1 - b1 ** t)) / ((v[k] / (1 - b2 ** t)).sqrt() + eps) for k in params}
    return new, {"m": m, "v": v, "t": t}


def global_batch(step, n):
    return datasets.two_moons(fr.fold_in(K_DATA, step), n, dtype=F64)


def start_chains():
    """This rank's persistent chains: its rows of N(0, I) starts drawn from per-chain keys."""
    return fdist.per_example_pcd_init(fr.normal(fdist.local_keys(K_CHAINS, N_PCD), (2,), F64), buffer_size=2)


def functional_train(loss, params, opt, chains, start, stop, n, *, ckpt=None, save_at=None):
    """Steps ``start..stop-1``: this rank's shard, per-example keys, gradients averaged across
    ranks. Returns the parameters, the optimiser state, the chains and every step's gradient."""
    f = fdist.per_example(loss)

    def objective(params, batch, keys, *state):
        return f(E.bind(mlp, params), batch, keys, *state)

    grad = torch.func.grad(objective, has_aux=True)
    history = []
    for t in range(start, stop):
        if ckpt is not None and t == save_at:
            fdist.save_checkpoint(ckpt, {"params": params, "opt": opt, "step": t}, chains)
        batch = fdist.shard(global_batch(t, n))
        state = () if chains is None else (chains,)
        grads, aux = grad(params, batch, fdist.step_keys(K_TRAIN, t, n), *state)
        grads = fdist.all_reduce_mean(grads, weight=batch.shape[0])
        history.append(grads)
        params, opt = adam(params, grads, opt)
        if chains is not None:
            chains = aux.state
    return params, opt, chains, history


class LossModule(torch.nn.Module):
    """The whole loss as one module, so DDP/FSDP2 see one forward (and one backward) per step."""

    def __init__(self, net, loss):
        super().__init__()
        self.net, self.loss = net, fdist.per_example(loss)
        self.energy_fn, _ = E.from_module(net)

    def forward(self, batch, keys):
        return self.loss(E.bind(self.energy_fn, dict(self.net.named_parameters())), batch, keys)[0]


def make_net():
    params = init_params()
    net = torch.nn.Sequential(torch.nn.Linear(2, HIDDEN), torch.nn.SiLU(), torch.nn.Linear(HIDDEN, 1)).to(F64)
    with torch.no_grad():
        net[0].weight.copy_(params["w1"].T)
        net[0].bias.zero_()
        net[2].weight.copy_(params["w2"][None])
        net[2].bias.zero_()
    return net


def module_train(wrap=None):
    net = make_net()
    model = LossModule(net, CD)
    if wrap is not None:
        model = wrap(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for t in range(N_STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(fdist.shard(global_batch(t, N_DDP)), fdist.step_keys(K_TRAIN, t, N_DDP))
        loss.backward()
        opt.step()
    return model


def ddp(model):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model)


def module_params(model):
    """The network's full parameters as plain tensors (FSDP2 holds them as sharded DTensors)."""
    sd = model.state_dict()
    return {k.split("net.", 1)[-1]: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in sd.items()}


# ----------------------------------------------------------------------- the two ranks


def _worker(rank, out):
    res = {}
    ckpt = os.path.join(out, "ckpt")
    p0 = init_params()
    params, _, chains, grads = functional_train(PCD, p0, adam_init(p0), start_chains(), 0, N_STEPS, N_PCD,
                                                ckpt=ckpt, save_at=SAVE_AT)
    res["pcd"] = {"params": params, "grads": grads, "local_chains": chains.positions.shape[0],
                  "chains": fdist.gather_chains(chains, dim=0)}
    state, chains2 = fdist.load_checkpoint(ckpt)
    assert state["step"] == SAVE_AT
    params2, _, chains2, _ = functional_train(PCD, state["params"], state["opt"], chains2, SAVE_AT, N_STEPS, N_PCD)
    res["pcd_resumed"] = {"params": params2, "chains": fdist.gather_chains(chains2, dim=0)}
    state, chains3 = fdist.load_checkpoint(os.path.join(out, "ckpt1"))  # saved by one process: 5 -> 3 + 2
    res["from_one"] = {"local_chains": chains3.positions.shape[0]}
    params3, _, chains3, _ = functional_train(PCD, state["params"], state["opt"], chains3, SAVE_AT, N_STEPS, N_PCD)
    res["from_one"].update(params=params3, chains=fdist.gather_chains(chains3, dim=0))
    res["dsm"] = functional_train(DSM, p0, adam_init(p0), None, 0, N_STEPS, N_PCD)[::3]  # parameters, gradients
    res["ddp"] = module_params(module_train(ddp))
    res["fsdp2"] = module_params(module_train(fsdp2))
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("train2")
    p0 = init_params()  # a checkpoint from one process, for the ranks to re-shard
    functional_train(PCD, p0, adam_init(p0), start_chains(), 0, SAVE_AT + 1, N_PCD, ckpt=out / "ckpt1", save_at=SAVE_AT)
    _spawn(_worker, out, str(out))
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def one_process():
    """The same training in this process, no process group: the combined batch on one rank."""
    p0 = init_params()
    params, _, chains, grads = functional_train(PCD, p0, adam_init(p0), start_chains(), 0, N_STEPS, N_PCD)
    return {"pcd": {"params": params, "chains": chains, "grads": grads},
            "dsm": functional_train(DSM, p0, adam_init(p0), None, 0, N_STEPS, N_PCD)[::3],  # parameters, gradients
            "module": module_params(module_train())}


def close(a, b):
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b), strict=True):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL)


def test_pcd_two_ranks_equal_one_process(two_ranks, one_process):
    _, (r0, r1) = two_ranks
    assert (r0["pcd"]["local_chains"], r1["pcd"]["local_chains"]) == (3, 2)
    for k in r0["pcd"]["params"]:  # replicated: the same all-reduced bits on both ranks
        assert torch.equal(r0["pcd"]["params"][k], r1["pcd"]["params"][k])
    ref = one_process["pcd"]
    close(r0["pcd"]["grads"], ref["grads"])  # every step's all-reduced gradient
    close(r0["pcd"]["params"], ref["params"])
    close(r0["pcd"]["chains"], ref["chains"])  # every chain, its replay ring, its counters
    assert int(ref["chains"].count.min()) == 2  # the rings filled: restarts from them were exercised
    moved = max((ref["params"][k] - v).abs().max() for k, v in init_params().items())
    assert moved > 1e-3  # training moved the parameters far beyond the tolerance


def test_score_matching_two_ranks_equal_one_process(two_ranks, one_process):
    _, (r0, r1) = two_ranks
    close(r0["dsm"], one_process["dsm"])
    close(r1["dsm"], one_process["dsm"])


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_module_two_ranks_equal_one_process(two_ranks, one_process, wrapper):
    _, (r0, r1) = two_ranks
    close(r0[wrapper], one_process["module"])
    close(r1[wrapper], one_process["module"])
    moved = (one_process["module"]["0.weight"] - init_params()["w1"].T).abs().max()
    assert moved > 1e-3


def test_resume_on_the_same_ranks_is_bit_exact(two_ranks):
    _, (r0, r1) = two_ranks
    for r in (r0, r1):
        for k, v in r["pcd"]["params"].items():
            assert torch.equal(r["pcd_resumed"]["params"][k], v)
        for a, b in zip(r["pcd_resumed"]["chains"], r["pcd"]["chains"]):
            assert torch.equal(a, b)


def test_resume_on_one_process_reshards_the_chains(two_ranks, one_process):
    out, _ = two_ranks
    assert sorted(os.listdir(out / "ckpt")) == ["chains.rank0.pt", "chains.rank1.pt", "state.pt"]
    state, chains = fdist.load_checkpoint(out / "ckpt")  # saved by 2 ranks, read by 1: 3 + 2 chains -> 5
    assert chains.positions.shape == (N_PCD, 1, 2) and state["step"] == SAVE_AT
    params, _, chains, _ = functional_train(PCD, state["params"], state["opt"], chains, SAVE_AT, N_STEPS, N_PCD)
    close(params, one_process["pcd"]["params"])
    close(chains, one_process["pcd"]["chains"])


def test_resume_on_two_ranks_from_one_process(two_ranks, one_process):
    _, (r0, r1) = two_ranks
    assert (r0["from_one"]["local_chains"], r1["from_one"]["local_chains"]) == (3, 2)
    close(r0["from_one"]["params"], one_process["pcd"]["params"])
    close(r0["from_one"]["chains"], one_process["pcd"]["chains"])


def test_a_wrong_layout_is_caught(one_process):
    """What the tolerance must reject: two ranks that split the step key over their own examples
    (``split(fold_in(key, t), n_local)``, the naive layout) instead of slicing the global split.
    Simulated in one process: the first step's gradient differs by far more than the tolerance.
    (Gradients, not parameters: Adam's first update is ``lr * g / |g|``, almost blind to ``g``.)"""
    p0, t = init_params(), 0
    f = fdist.per_example(PCD)
    chains, batch = start_chains(), global_batch(t, N_PCD)
    grads = []
    for r in (0, 1):
        sl = fdist.chain_slice(N_PCD, rank_=r, world_size_=2)
        keys = fr.split(fr.fold_in(K_TRAIN, t), sl.stop - sl.start)
        rows = pytree.tree_map(lambda x: x[sl], chains)
        g, _ = torch.func.grad(lambda p: f(E.bind(mlp, p), batch[sl], keys, rows), has_aux=True)(p0)
        grads.append(pytree.tree_map(lambda x: x * (sl.stop - sl.start) / N_PCD, g))
    wrong = pytree.tree_map(torch.add, *grads)
    ref = one_process["pcd"]["grads"][0]
    diff = max(((wrong[k] - ref[k]).abs() / (ATOL + RTOL * ref[k].abs())).max() for k in p0)
    assert diff > 1e6


# ----------------------------------------------------------------- one process, no group


def test_helpers_are_the_identity_without_a_process_group(tmp_path):
    key = fr.key(5)
    assert torch.equal(fdist.step_keys(key, 7, 6), fr.split(fr.fold_in(key, 7), 6))
    assert torch.equal(fdist.step_keys(key, torch.tensor(7), 6), fdist.step_keys(key, 7, 6))
    grads = {"a": torch.ones(3, dtype=F64), "b": None}
    assert fdist.all_reduce_mean(grads, weight=3) is grads
    chains = start_chains()
    fdist.save_checkpoint(tmp_path, {"step": 3}, chains)
    state, back = fdist.load_checkpoint(tmp_path)
    assert state == {"step": 3} and all(torch.equal(a, b) for a, b in zip(back, chains))
    fdist.save_checkpoint(tmp_path / "nochains", {"step": 1})
    assert fdist.load_checkpoint(tmp_path / "nochains") == ({"step": 1}, None)


def test_per_example_is_the_mean_of_batches_of_one():
    energy = E.bind(mlp, init_params())
    batch, keys = global_batch(0, 4), fr.split(fr.key(1), 4)
    chains = fdist.per_example_pcd_init(fr.normal(fr.key(2), (4, 2), F64), buffer_size=2)
    value, aux = fdist.per_example(PCD)(energy, batch, keys, chains)
    one = [PCD(energy, batch[i:i + 1], keys[i], pytree.tree_map(lambda x: x[i], chains)) for i in range(4)]
    torch.testing.assert_close(value, sum(v for v, _ in one) / 4, rtol=1e-14, atol=0)
    for i, (_, a) in enumerate(one):
        for x, y in zip(a.state, aux.state):
            torch.testing.assert_close(y[i], x, rtol=1e-14, atol=0)
    assert chains.positions.shape == (4, 1, 2) and chains.buffer.shape == (4, 2, 2)


def test_bad_arguments(tmp_path):
    f = fdist.per_example(DSM)
    energy, batch = E.bind(mlp, init_params()), global_batch(0, 4)
    with pytest.raises(ValueError, match="keys must be one key per example"):
        f(energy, batch, fr.split(fr.key(0), 3))
    with pytest.raises(ValueError, match="state leaf"):
        fdist.per_example(PCD)(energy, batch, fr.split(fr.key(0), 4), start_chains())  # 5 chains, 4 examples
    with pytest.raises(TypeError, match="batch"):
        f(energy, batch.tolist(), fr.split(fr.key(0), 4))
    with pytest.raises(TypeError, match="loss"):
        fdist.per_example("dsm")
    with pytest.raises(ValueError, match="key must be one key"):
        fdist.step_keys(fr.split(fr.key(0), 2), 0, 4)
    with pytest.raises(ValueError, match="weight"):
        fdist.all_reduce_mean({"a": torch.ones(2)}, weight=-1)
    with pytest.raises(TypeError, match="floating"):
        fdist.all_reduce_mean({"a": torch.ones(2, dtype=torch.int64)})
    with pytest.raises(TypeError, match="positions"):
        fdist.per_example_pcd_init(torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(FileNotFoundError, match="state.pt"):
        fdist.load_checkpoint(tmp_path / "missing")
    fdist.save_checkpoint(tmp_path / "a", {"step": 1}, start_chains())
    fdist.save_checkpoint(tmp_path / "b", {"step": 1}, start_chains())
    os.replace(tmp_path / "b" / "chains.rank0.pt", tmp_path / "a" / "chains.rank0.pt")
    with pytest.raises(ValueError, match="another save"):
        fdist.load_checkpoint(tmp_path / "a")
