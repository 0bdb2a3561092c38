"""Train an MLP energy on a 2-D toy set with data parallelism: one script for 1 process or many.

    python examples/train_ddp.py --steps 200
    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 200          # the same run, 2 ranks
    torchrun --nproc-per-node 2 examples/train_ddp.py --style ddp          # nn.Module + DDP
    torchrun --nproc-per-node 2 examples/train_ddp.py --style fsdp2        # nn.Module + fully_shard
    torchrun --nproc-per-node 2 examples/train_ddp.py --out ckpt --steps 100
    python examples/train_ddp.py --resume ckpt --steps 100                 # continue on 1 process

Every rank draws the step's global batch from the key and keeps its rows (a real data set would
load only them), takes its examples' keys with ``fnebm.distributed.step_keys`` and runs the
loss with one key per example (``per_example``), so the run is the single-process run with the
combined batch, up to float rounding, on any number of ranks. ``--style functional``:
``torch.func.grad`` over a parameter dict, ``all_reduce_mean`` and Adam written out;
``ddp``/``fsdp2``: the loss wrapped in one ``nn.Module`` (one forward per step) under
``DistributedDataParallel`` / ``fully_shard``, and ``torch.optim.Adam``.

Prints (rank 0) the world size, the first step's time, the median of the later steps' times and
the loss averaged across ranks; ``--json`` prints one JSON line instead.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import fnebm
from fnebm import datasets
from fnebm import distributed as fdist
from fnebm import energies as E
from fnebm import losses
from fnebm import random as fr


def make_net(key: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.nn.Module:
    """2 -> hidden -> hidden -> 1 with SiLU; weights ~ N(0, 1/fan_in) from ``key`` (the same on every rank)."""
    net = torch.nn.Sequential(torch.nn.Linear(2, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, hidden),
                              torch.nn.SiLU(), torch.nn.Linear(hidden, 1)).to(dtype)
    layers = [m for m in net if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for k, layer in zip(fr.split(key, len(layers)), layers):
            layer.weight.copy_(fr.normal(k, tuple(layer.weight.shape), dtype) / layer.in_features ** 0.5)
            layer.bias.zero_()
    return net


class LossModule(torch.nn.Module):
    """The whole loss as one module: DDP and FSDP2 hook one forward and one backward per step."""

    def __init__(self, net: torch.nn.Module, loss):
        super().__init__()
        self.net, self.loss = net, fdist.per_example(loss)
        self.energy_fn, _ = E.from_module(net)

    def forward(self, batch, keys, *state):
        energy = E.bind(self.energy_fn, dict(self.net.named_parameters()))
        return self.loss(energy, batch, keys, *state)


def adam(params, grads, opt, lr, b1=0.9, b2=0.999, eps=1e-8):
    t = opt["t"] + 1
    m = {k: b1 * opt["m"][k] + (1 - b1) * grads[k] for k in params}
    v = {k: b2 * opt["v"][k] + (1 - b2) * grads[k] ** 2 for k in params}
    new = {k: params[k] - lr * (m[k] / (1 - b1 ** t)) / ((v[k] / (1 - b2 ** t)).sqrt() + eps) for k in params}
    return new, {"m": m, "v": v, "t": t}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--style", choices=("functional", "ddp", "fsdp2"), default="functional")
    p.add_argument("--loss", choices=("pcd", "cd", "dsm"), default="pcd")
    p.add_argument("--dataset", default="eight_gaussians")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=1024, help="global batch (and persistent chains for pcd)")
    p.add_argument("--k", type=int, default=10, help="sampler steps per training step (pcd, cd)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--out", default=None, help="save a checkpoint (a directory) at the end")
    p.add_argument("--resume", default=None, help="continue from this checkpoint directory")
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: one GPU per local rank when there are enough, else the CPU")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    use_cuda = args.device == "cuda" or (args.device == "auto" and 0 < local_ranks <= gpus)
    if use_cuda and local_ranks > gpus:
        p.error(f"--device cuda needs a GPU per local rank: {local_ranks} ranks on this machine, {gpus} GPU(s)")
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():  # launched by torchrun
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=5))
        if use_cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu")
    if args.style != "functional" and not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(), "store")  # DDP and fully_shard need a group, even of one
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)

    k_params, k_chains, k_train, k_data = fr.split(fr.key(args.seed, device), 4)
    data = datasets.get(args.dataset)
    sampler = lambda e: fnebm.langevin(e, 0.01)  # noqa: E731
    loss = {"pcd": functools.partial(losses.persistent_contrastive_divergence, sampler=sampler, n_steps=args.k,
                                     reinit_prob=0.05),
            "cd": functools.partial(losses.contrastive_divergence, sampler=sampler, n_steps=args.k, init="data"),
            "dsm": functools.partial(losses.denoising_score_matching, sigma=0.1)}[args.loss]
    n = args.batch

    net = make_net(k_params, args.hidden, torch.float32).to(device)
    chains = None
    if args.loss == "pcd":  # this rank's chains: its rows of the N(0, 4 I) starts
        chains = fdist.per_example_pcd_init(2.0 * fr.normal(fdist.local_keys(k_chains, n), (2,)))
    start = 0
    if args.style == "functional":
        energy_fn, params = E.from_module(net)
        opt = {"m": {k: torch.zeros_like(v) for k, v in params.items()},
               "v": {k: torch.zeros_like(v) for k, v in params.items()}, "t": torch.zeros((), device=device)}
    else:
        model = LossModule(net, loss)
        if args.style == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            model = fully_shard(model)
        optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.resume is not None:
        state, loaded = fdist.load_checkpoint(args.resume, map_location=device)
        if state["style"] != args.style:
            raise SystemExit(f"--resume {args.resume}: saved with --style {state['style']}, not {args.style}")
        start, chains = state["step"], loaded
        if args.style == "functional":
            params, opt = state["params"], state["opt"]
        elif args.style == "ddp":
            net.load_state_dict(state["params"])
            optim.load_state_dict(state["opt"])
        else:
            raise SystemExit("--resume with --style fsdp2: use torch.distributed.checkpoint for sharded state")

    f = fdist.per_example(loss)

    def objective(params, batch, keys, *state):
        return f(E.bind(energy_fn, params), batch, keys, *state)

    grad = torch.func.grad_and_value(objective, has_aux=True)
    times, value = [], torch.zeros(())
    for t in range(start, start + args.steps):
        t0 = time.perf_counter()
        batch = fdist.shard(data(fr.fold_in(k_data, t), n))  # this rank's rows of the global batch
        keys = fdist.step_keys(k_train, t, n)                 # and their keys
        state = () if chains is None else (chains,)
        if args.style == "functional":
            grads, (value, aux) = grad(params, batch, keys, *state)
            grads = fdist.all_reduce_mean(grads, weight=batch.shape[0])   # the global batch's gradient
            params, opt = adam(params, grads, opt, args.lr)
        else:
            optim.zero_grad(set_to_none=True)
            value, aux = model(batch, keys, *state)
            value.backward()                                  # DDP / FSDP2 average the gradients here
            optim.step()
        if chains is not None:
            chains = aux.state
        value = fdist.all_reduce_mean(value.detach(), weight=batch.shape[0])
        times.append(time.perf_counter() - t0)

    if args.out is not None:
        if args.style == "functional":
            state = {"style": args.style, "step": start + args.steps, "params": params, "opt": opt}
        elif args.style == "ddp":
            state = {"style": args.style, "step": start + args.steps, "params": net.state_dict(),
                     "opt": optim.state_dict()}
        else:
            raise SystemExit("--out with --style fsdp2: use torch.distributed.checkpoint for sharded state")
        fdist.save_checkpoint(args.out, state, chains)
    if fdist.rank() == 0:
        later = times[1:] or times
        row = {"world_size": fdist.world_size(), "style": args.style, "loss": args.loss, "batch": n,
               "steps": args.steps, "first_step_s": times[0], "median_step_s": statistics.median(later),
               "total_s": sum(times), "final_loss": float(value)}
        print(json.dumps(row) if args.json else "\n".join(f"{k:<14} {v}" for k, v in row.items()))
    if dist.is_initialized():
        # A rank that tore its gloo group down while a peer still used it, or while DDP's reducer
        # still held it, aborted at exit ("terminate called without an active exception", 4 of 10
        # launches): release the model, wait for every rank, then destroy the group.
        model = optim = aux = None  # noqa: F841
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
