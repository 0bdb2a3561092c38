"""Chains across processes on ``torch.distributed``; every helper is the identity in one process.

One concern per module, every public name re-exported here:

* :mod:`fnebm.distributed.sharding` — the process group (:func:`is_distributed`,
  :func:`rank`, :func:`world_size`), the chain layout (:func:`chain_counts`,
  :func:`chain_slice`, :func:`local_keys`, :func:`shard`: rank ``r`` runs the contiguous block
  ``chain_slice(n_chains)`` of the chains with their keys, so the union of every rank's draws is
  the single-process run, bit for bit) and the collectives that move chains
  (:func:`gather_chains`). Sampling needs no communication.
* :mod:`fnebm.distributed.diagnostics` — :func:`rhat`, :func:`ess_bulk`, :func:`ess_tail`,
  :func:`ess`, :func:`mcse_mean`, :func:`mcse_sd`, :func:`summary`, :func:`summary_table`,
  :func:`acceptance_summary` of the trace every rank holds a block of: :mod:`fnebm.diagnostics`'s
  own statistics, given a context that reduces over chains across ranks.
* :mod:`fnebm.distributed.training` — data parallelism with draws independent of the number of
  ranks: :func:`step_keys`, :func:`per_example`, :func:`per_example_pcd_init`,
  :func:`all_reduce_mean`.
* :mod:`fnebm.distributed.checkpoint` — :func:`save_checkpoint`, :func:`load_checkpoint`
  (re-sharding the chains onto another number of ranks).

Without a process group (or with one process) each function is the one-process one, so one
script runs under ``python`` and under ``torchrun --nproc-per-node 2``. docs/distributed.md
has the whole story and the measurements.
"""

from fnebm.distributed.checkpoint import load_checkpoint, save_checkpoint
from fnebm.distributed.diagnostics import (
    acceptance_summary,
    ess,
    ess_bulk,
    ess_tail,
    mcse_mean,
    mcse_sd,
    rhat,
    summary,
    summary_table,
)
from fnebm.distributed.sharding import (
    chain_counts,
    chain_slice,
    gather_chains,
    is_distributed,
    local_keys,
    rank,
    shard,
    world_size,
)
from fnebm.distributed.training import all_reduce_mean, per_example, per_example_pcd_init, step_keys

__all__ = [
    "is_distributed",
    "rank",
    "world_size",
    "chain_counts",
    "chain_slice",
    "local_keys",
    "shard",
    "gather_chains",
    "rhat",
    "ess",
    "ess_bulk",
    "ess_tail",
    "mcse_mean",
    "mcse_sd",
    "acceptance_summary",
    "summary",
    "summary_table",
    "step_keys",
    "per_example",
    "per_example_pcd_init",
    "all_reduce_mean",
    "save_checkpoint",
    "load_checkpoint",
]
