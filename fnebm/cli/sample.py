"""``fnebm sample`` and ``fnebm demo``: the entry point. The options and their checks are in
:mod:`fnebm.cli.options`, the run in :mod:`fnebm.cli.run`, its statistics in :mod:`fnebm.cli.stats`,
what is printed in :mod:`fnebm.cli.report`, the plot in :mod:`fnebm.cli.plotting`, and what the
command reads of a call's plan in :mod:`fnebm.cli.plan`."""

from __future__ import annotations

import argparse

import torch

from fnebm.cli._common import Launch, UsageError, agree, run_launched, write_outputs
from fnebm.cli.options import _config
from fnebm.cli.plotting import plot
from fnebm.cli.report import format_summary
from fnebm.cli.run import _gather_on_rank0, _run
from fnebm.kernels.dispatch import BackendUnavailable


def _sample(args: argparse.Namespace) -> int:
    return run_launched(args.device, lambda where: _sample_on(args, where))


def _sample_on(args: argparse.Namespace, where: Launch) -> int:
    cfg = agree(where, lambda: _config(args, where))
    try:
        summary, positions, energies, target = _run(cfg)
    except BackendUnavailable as e:  # --backend c or triton where that kernel cannot run
        raise UsageError(f"--backend {e.backend}: {e.reason}") from None
    if cfg.rank == 0:  # rank 0 prints (and writes) for every rank
        print("\n".join(format_summary(summary)), flush=True)
        if "profile" in summary:
            print(summary["profile"], flush=True)
    if cfg.world_size > 1 and (args.out is not None or args.plot is not None):  # every rank takes part
        positions, energies = _gather_on_rank0(positions, cfg.chains), _gather_on_rank0(energies, cfg.chains)
    if cfg.rank != 0:
        return 0

    files = []
    if cfg.out is not None:
        record = {
            "trace": positions.detach().cpu(),
            "energy": energies.detach().cpu(),
            "summary": summary,
            "args": {k: v for k, v in cfg._asdict().items()
                     if k not in ("out", "plot", "progress", "world_size", "rank")},
        }
        files.append(("saved", args.out, cfg.out, lambda f: torch.save(record, f)))
    if cfg.plot is not None:
        files.append(("plot", args.plot, cfg.plot, lambda f: plot(f, target, positions, energies, summary)))
    write_outputs(files)
    return 0
