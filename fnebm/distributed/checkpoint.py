"""Checkpoints of a run across ranks: the replicated state once, each rank's chains apart.

:func:`save_checkpoint` writes the replicated state once (rank 0) and each rank's chains;
:func:`load_checkpoint` reads them back on the same number of ranks, or re-shards the chains
onto another.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fnebm.distributed.sharding import _dist, _sizes, chain_slice, is_distributed, rank, world_size

__all__ = ["save_checkpoint", "load_checkpoint"]

_STATE_FILE = "state.pt"
_VERSION = 1


def _chain_file(directory: str, r: int) -> str:
    return os.path.join(directory, f"chains.rank{r}.pt")


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _chain_leaves(chains: Any) -> tuple[list[Any], Any, int]:
    """The leaves of a per-chain pytree, its spec and its number of chains (0-dim leaves are shared)."""
    leaves, spec = pytree.tree_flatten(chains)
    if not leaves or not all(isinstance(x, Tensor) for x in leaves):
        raise TypeError("chains must be a tensor or a pytree of tensors with a leading chain axis (or None)")
    sizes = {x.shape[0] for x in leaves if x.ndim >= 1}
    if len(sizes) != 1:
        raise ValueError("chains: every leaf with a chain axis must lead with the same number of chains, "
                         f"got leading sizes {sorted(sizes) or 'none'}")
    return leaves, spec, sizes.pop()


def save_checkpoint(directory: str | os.PathLike, state: Any, chains: Any = None, *, group: Any = None) -> None:
    """Write a training (or sampling) checkpoint that :func:`load_checkpoint` reads back.

    ``state``: what every rank holds alike — parameters, optimiser state, the key, the step
    (anything ``torch.load(weights_only=True)`` reads back: tensors, dicts, lists, numbers,
    fnebm's NamedTuples); rank 0 writes it to ``directory/state.pt``. ``chains``: this rank's
    block of the global per-chain pytree (every leaf ``(local_chains, ...)``; 0-dim leaves,
    such as a ``ChainState``'s ``steps_taken``, are shared), written by every rank to
    ``directory/chains.rank{r}.pt``. Every rank of the group must call it (it is a collective).

    Each file is written to a temporary name and renamed; ``state.pt`` is written last, after
    every rank's chains, and names the save (a random token every file carries), so a save cut
    short is never read as a whole one. ``directory`` must be one directory every rank sees (a
    shared filesystem across machines). Without a process group: one chains file, rank 0.
    """
    directory = os.fspath(directory)
    r, w = rank(group), world_size(group)
    if chains is not None:
        _, _, n_local = _chain_leaves(chains)
    else:
        n_local = 0
    token = [uuid.uuid4().hex if r == 0 else None]
    if is_distributed(group):
        dist = _dist()
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        counts = _sizes(n_local, _group_device(group), group)
    else:
        counts = [n_local]
    if any(c == 0 for c in counts) and any(counts):
        raise ValueError("save_checkpoint: every rank must pass its chains, or none may: got chain counts "
                         f"{counts} by rank")
    if r == 0:
        os.makedirs(directory, exist_ok=True)
    if is_distributed(group):
        _dist().barrier(group=group)
    if chains is not None:
        _atomic_save({"token": token[0], "rank": r, "world_size": w, "chains": chains}, _chain_file(directory, r))
    if is_distributed(group):
        _dist().barrier(group=group)
    if r == 0:
        meta = {"version": _VERSION, "token": token[0], "world_size": w,
                "chain_counts": counts if chains is not None else None, "state": state}
        _atomic_save(meta, os.path.join(directory, _STATE_FILE))
    if is_distributed(group):
        _dist().barrier(group=group)


def _group_device(group: Any) -> torch.device:
    dist = _dist()
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _load(path: str, map_location: Any) -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    return torch.load(path, map_location=map_location, weights_only=True)


def load_checkpoint(directory: str | os.PathLike, *, map_location: Any = None, group: Any = None) -> tuple[Any, Any]:
    """Read a checkpoint of :func:`save_checkpoint`: ``(state, chains)``, ``chains`` this rank's block.

    On the number of ranks it was saved from, each rank reads its own chains file. On another
    number, every rank reads every chains file, puts the chains back in global order and takes
    its block ``chain_slice(n_chains)`` (re-sharding; ``n_chains`` must be at least the new
    number of ranks). Runs whose keys come from :func:`step_keys` and :func:`local_keys` then
    continue as they would have on the old number of ranks. ``chains`` is ``None`` if none were
    saved. Every rank reads ``state.pt``. Raises ``ValueError`` for a checkpoint that is not
    whole (a chains file from another save, a missing rank) and ``FileNotFoundError`` for a
    missing file.
    """
    directory = os.fspath(directory)
    meta = _load(os.path.join(directory, _STATE_FILE), map_location)
    if not isinstance(meta, dict) or meta.get("version") != _VERSION or "token" not in meta:
        raise ValueError(f"{directory}: not an fnebm.distributed checkpoint (state.pt written by save_checkpoint)")
    counts = meta["chain_counts"]
    if counts is None:
        return meta["state"], None
    saved_w, w, r = meta["world_size"], world_size(group), rank(group)

    def read(i: int) -> Any:
        path = _chain_file(directory, i)
        rec = _load(path, map_location)
        if not isinstance(rec, dict) or rec.get("token") != meta["token"]:
            raise ValueError(f"{path} belongs to another save than {os.path.join(directory, _STATE_FILE)}: "
                             "the checkpoint is not whole")
        return rec["chains"]

    if saved_w == w:
        return meta["state"], read(r)
    n = sum(counts)
    if n < w:
        raise ValueError(f"the checkpoint holds {n} chains, fewer than the {w} ranks loading it: "
                         "every rank needs at least one chain")
    parts = [_chain_leaves(read(i)) for i in range(saved_w)]
    spec = parts[0][1]
    sl = chain_slice(n, group=group)
    out = []
    for j, leaf in enumerate(parts[0][0]):
        if leaf.ndim == 0:
            out.append(leaf)
        else:
            out.append(torch.cat([p[0][j] for p in parts])[sl])
    return meta["state"], pytree.tree_unflatten(out, spec)
