"""What the command line prints besides its results: no torch warnings from short or broken runs, and a
help text that says what the demo samples. Tiny eager runs only."""

import warnings

import torch

from fnebm import cli
from fnebm.cli import presets
from fnebm.cli.stats import mixing


def test_the_mixing_note_of_a_run_whose_chains_are_all_flagged_warns_nothing():
    """Every chain flagged (runaway or frozen) leaves no chain to measure: the note says "few chains"
    instead of asking torch for the std of nothing ("std(): degrees of freedom is <= 0")."""
    positions = torch.randn(40, 4, 2, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        verdict = mixing(positions, torch.tensor([1.5, 1.2]), torch.zeros(4, dtype=torch.bool))
    assert verdict["verdict"] == "few chains"


def test_a_short_run_whose_chains_all_stall_prints_no_warning(capsys):
    # Rosenbrock's curved valley at 40 steps: both chains flagged, R-hat high (the note ran std() on no chains)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        code = cli.main(["sample", "--energy", "rosenbrock", "--chains", "2", "--steps", "40", "--no-progress",
                         "--no-compile"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Warning" not in err and "R-hat" in out


def test_help_says_what_the_demo_samples(capsys):
    assert cli.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "MALA on a correlated 2-D Gaussian" in out and "mixture" not in out
    assert presets.DEMO["energy"] == "gaussian" and presets.DEMO["sampler"] == "mala" and presets.DEMO["dim"] == 2
