"""The ``fnebm`` command: ``fnebm sample`` runs a sampler on a named energy, ``fnebm demo`` a preset,
``fnebm train`` fits an MLP energy to a 2-D toy data set.

The top layer: it builds an energy from :mod:`fnebm.energies` and a sampler from
:mod:`fnebm.samplers` by name, runs :func:`fnebm.sample_chain`, prints a diagnostics summary
(:mod:`fnebm.diagnostics`) and optionally saves the draws and a plot. Every argument is
checked before sampling starts; a bad one gives one ``fnebm: error: ...`` line and exit
status 2. ``main(argv) -> int`` is the entry point of the console script and of
``python -m fnebm``. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile  # noqa: F401  (tests patch cli.tempfile.mkstemp)

import fnebm
from fnebm.cli._common import (PROG, RunError, UsageError, _one_line, _Parser, is_out_of_memory, launched,
                               launched_rank, write_atomic)
from fnebm.cli.presets import DEMO, DEMO_PLOT, DTYPES, ENERGIES, SAMPLERS, EnergySpec, demo_command
from fnebm.cli.options import _add_run_options
from fnebm.cli.plotting import plot
from fnebm.cli.report import format_summary
from fnebm.cli.run import _chunk_size
from fnebm.cli.sample import _sample
from fnebm.cli.train import _train
from fnebm.cli.train_model import mlp_energy, mlp_init
from fnebm.cli.train_options import TRAIN_DEFAULTS, TRAIN_LOSSES, TRAIN_SAMPLERS, _add_train_options


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Sample energy-based models with fnebm.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"fnebm {fnebm.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{sample,demo,train}", required=True, parser_class=_Parser)
    sample = sub.add_parser("sample", help="run a sampler on a named energy", allow_abbrev=False,
                            description="Run a sampler on a named energy and summarise the draws.")
    _add_run_options(sample, demo=False)
    demo = sub.add_parser("demo", help="MALA on a correlated 2-D Gaussian, with a plot", allow_abbrev=False,
                          description=f"The first thing to run. Equivalent to: {demo_command()}")
    _add_run_options(demo, demo=True)
    train = sub.add_parser("train", help="train an MLP energy on a 2-D toy data set", allow_abbrev=False,
                           description="Train a small MLP energy on a 2-D toy data set (CD, persistent CD or "
                                       "score matching), checkpoint it, plot it and measure its fit.")
    _add_train_options(train)
    return parser



def main(argv: list[str] | None = None) -> int:
    """Run the ``fnebm`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        if args.command == "train":
            return _train(args)
        return _sample(args)  # `demo` is `sample` with the preset's defaults
    except UsageError as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except (RuntimeError, MemoryError) as e:  # the CPU allocator raises RuntimeError, CUDA's OutOfMemoryError
        if not is_out_of_memory(e):
            raise
        where = f"rank {launched_rank()}: " if launched() else ""  # under torchrun any rank may run out
        print(f"{PROG}: error: {where}out of memory ({_one_line(e)[:200]}); use a smaller run: fewer --chains or "
              "--steps (fnebm sample: or a larger --thin)", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        if launched_rank() == 0:  # torchrun passes Ctrl-C to every rank: one line, from rank 0
            print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
