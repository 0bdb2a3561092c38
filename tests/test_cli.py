"""The ``fnebm`` command, driven as a user would: ``main([...])`` in-process, one subprocess.

Compiling costs 10-30 s per configuration on a 2-core CPU, so exactly one configuration is
compiled (``COMPILED``, shared through the ``compiled`` fixture and re-run once from the
build cache); everything else runs with ``--no-compile`` or only builds and validates.
"""

import contextlib
import io
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fnebm import cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
SUMMARY_KEYS = {
    "sampler", "energy", "dim", "chains", "steps", "burn_in", "thin", "draws", "step_size", "dtype", "device",
    "seed", "acceptance", "n_divergent", "divergent_fraction", "ess_bulk_min", "ess_bulk_median", "ess_per_s",
    "rhat_max", "compile_s", "sampling_s", "mean_tree_depth", "mean_integration_steps", "adapt", "adapt_s", "adapted",
}
# The one configuration that is compiled in this file.
COMPILED = [
    "sample", "--energy", "double_well", "--dim", "2", "--sampler", "mala", "--step-size", "0.05",
    "--chains", "64", "--steps", "20", "--burn-in", "4", "--seed", "0", "--device", "cpu", "--no-progress",
]
# Small eager runs for everything else.
EAGER = ["--chains", "8", "--steps", "3", "--device", "cpu", "--no-progress", "--no-compile"]


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_png(path):
    data = Path(path).read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 10_000  # a real figure, not an empty canvas


def assert_one_error_line(err):
    assert err.startswith("fnebm: error: ")
    assert err.count("\n") == 1 and err.endswith("\n"), err


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The compiled run, with --out and --plot: (exit code, stdout, stderr, out path, plot path)."""
    d = tmp_path_factory.mktemp("compiled")
    out, png = d / "samples.pt", d / "samples.png"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main([*COMPILED, "--out", str(out), "--plot", str(png)])
    return code, stdout.getvalue(), stderr.getvalue(), out, png


# ------------------------------------------------------------------------------ sample


def test_sample_writes_draws_summary_and_plot(compiled):
    code, out, err, pt, png = compiled
    assert code == 0 and err == ""
    record = torch.load(pt)
    assert set(record) == {"trace", "energy", "summary", "args"}
    assert record["trace"].shape == (20, 64, 2) and record["trace"].device.type == "cpu"
    assert record["trace"].dtype == torch.float32 and torch.isfinite(record["trace"]).all()
    assert record["energy"].shape == (20, 64)
    summary = record["summary"]
    assert set(summary) == SUMMARY_KEYS
    assert all(v is None or type(v) in (int, float, str, bool) for v in summary.values())
    assert summary["draws"] == 20 and summary["burn_in"] == 4 and summary["n_divergent"] == 0
    assert 0 < summary["acceptance"] <= 1 and summary["compile_s"] > 0
    assert 1 <= summary["ess_bulk_min"] <= summary["ess_bulk_median"] and math.isfinite(summary["rhat_max"])
    assert record["args"]["energy"] == "double_well" and record["args"]["compile"] is True
    assert_png(png)
    for label in ("sampler", "energy", "acceptance", "divergences", "ESS bulk", "ESS/s", "R-hat max",
                  "compile", "sampling", "saved", "plot"):
        assert any(line.startswith(label) for line in out.splitlines()), label
    assert "mala" in out and "double_well" in out and "64 chains x 20 steps" in out


def test_rerun_replaces_outputs_atomically_with_same_draws(compiled, tmp_path, capsys):
    # the second compiled run: a rebuilt sampler of the same kind and shapes reuses the graph
    _, _, _, first_pt, _ = compiled
    out, png = tmp_path / "samples.pt", tmp_path / "samples.png"
    out.write_bytes(b"old")
    png.write_bytes(b"old")
    code, _, err = run(capsys, *COMPILED, "--out", out, "--plot", png)
    assert code == 0 and err == ""
    torch.testing.assert_close(torch.load(out)["trace"], torch.load(first_pt)["trace"], rtol=0, atol=0)
    assert_png(png)
    assert sorted(os.listdir(tmp_path)) == ["samples.png", "samples.pt"]  # no temporary files left
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


def test_no_compile_gives_the_same_draws(compiled, tmp_path, capsys):
    _, _, _, first_pt, _ = compiled
    out = tmp_path / "eager.pt"
    code, stdout, _ = run(capsys, *COMPILED, "--no-compile", "--out", out)
    assert code == 0 and "skipped (--no-compile)" in stdout
    torch.testing.assert_close(torch.load(out)["trace"], torch.load(first_pt)["trace"], rtol=1e-5, atol=1e-5)


def test_seed_decides_the_draws(tmp_path, capsys):
    def trace(seed, name):
        assert run(capsys, "sample", *EAGER, "--seed", seed, "--out", tmp_path / name)[0] == 0
        return torch.load(tmp_path / name)["trace"]

    a, b, c = trace(3, "a.pt"), trace(3, "b.pt"), trace(4, "c.pt")
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("energy", list(cli.ENERGIES))
def test_every_energy_runs(energy, tmp_path, capsys):
    sampler = "langevin" if list(cli.ENERGIES).index(energy) % 2 else "mala"
    code, out, err = run(capsys, "sample", "--energy", energy, "--sampler", sampler, "--dim", 2, *EAGER,
                         "--out", tmp_path / "x.pt")
    assert (code, err) == (0, "")
    assert f"{energy}, dim 2" in out and "n/a (needs >= 4 kept draws)" in out  # 3 draws: no ESS
    record = torch.load(tmp_path / "x.pt")
    assert record["trace"].shape == (3, 8, 2) and record["summary"]["ess_bulk_min"] is None
    assert record["summary"]["step_size"] == cli.ENERGIES[energy].step_size  # the energy's default


@pytest.mark.parametrize("name,spec", list(cli.ENERGIES.items()))
def test_energy_defaults_build_for_any_dim(name, spec):
    for dim in (1, 2, 5):
        if name == "rosenbrock" and dim == 1:
            continue
        e = spec.build(dim, torch.float64, torch.device("cpu"))
        e.check_dim(dim)
        assert e.dtype == torch.float64
        assert torch.isfinite(torch.func.vmap(e)(torch.randn(3, dim, dtype=torch.float64))).all()


def test_langevin_summary_and_marginal_plot(tmp_path, capsys):
    png = tmp_path / "h.png"
    code, out, err = run(capsys, "sample", "--energy", "harmonic", "--dim", 5, "--sampler", "langevin",
                         "--chains", 16, "--steps", 8, "--thin", 2, "--no-compile", "--no-progress",
                         "--dtype", "float64", "--out", tmp_path / "h.pt", "--plot", png)
    assert (code, err) == (0, "")
    assert "unadjusted" in out and "float64" in out
    summary = torch.load(tmp_path / "h.pt")["summary"]
    assert summary["acceptance"] is None and summary["draws"] == 4 and summary["burn_in"] == 2
    assert summary["ess_bulk_min"] > 0 and summary["compile_s"] is None
    assert_png(png)


@pytest.mark.parametrize("sampler", ["hmc", "nuts"])
def test_hmc_and_nuts_adapt_then_sample(sampler, tmp_path, capsys):
    code, out, err = run(capsys, "sample", "--energy", "gaussian", "--dim", 3, "--sampler", sampler,
                         "--chains", 8, "--steps", 6, "--adapt", 30, "--no-compile", "--no-progress",
                         "--dtype", "float64", "--out", tmp_path / "x.pt")
    assert (code, err) == (0, "")
    summary = torch.load(tmp_path / "x.pt")["summary"]
    assert summary["adapt"] == 30 and summary["burn_in"] == 0  # the warm-up replaces burn-in
    assert summary["step_size"] == pytest.approx(3 ** -0.25)  # the rule of thumb, where adaptation starts
    assert summary["adapted"]["step_size"] > 0 and summary["adapted"]["step_size"] != summary["step_size"]
    assert "adaptation   30 warm-up steps: step size" in out and "leapfrog steps per draw" in out
    if sampler == "nuts":
        assert summary["mean_tree_depth"] >= 1 and "mean tree depth" in out
    else:  # ceil(sqrt(3)) leapfrog steps
        assert summary["mean_integration_steps"] == 2 and summary["mean_tree_depth"] is None


def test_hmc_without_adaptation_uses_the_energys_step_size(capsys, tmp_path):
    code, out, err = run(capsys, "sample", "--energy", "harmonic", "--sampler", "hmc", "--adapt", 0, *EAGER,
                         "--out", tmp_path / "x.pt")
    assert (code, err) == (0, "")
    summary = torch.load(tmp_path / "x.pt")["summary"]
    assert summary["adapted"] is None and summary["step_size"] == cli.ENERGIES["harmonic"].step_size
    assert summary["burn_in"] == 0  # steps // 4 with --steps 3


def test_chunks_are_never_one_step():
    # a one-step chunk compiles a second graph in the middle of the run
    for total in range(1, 700):
        for progress in (False, True):
            size = cli._chunk_size(total, max(1, total - 5), progress)
            assert 1 <= size <= total
            assert total == 1 or (size >= 2 and total % size != 1), (total, progress, size)


# ------------------------------------------------------------------------------ errors

BAD = {
    "no command": [],
    "unknown command": ["frobnicate"],
    "unknown option": ["sample", "--bogus"],
    "unknown energy": ["sample", "--energy", "banana"],
    "unknown sampler": ["sample", "--sampler", "gibbs"],
    "negative adapt": ["sample", "--sampler", "nuts", "--adapt", "-1"],
    "adapt without a mass matrix": ["sample", "--sampler", "mala", "--adapt", "10"],
    "unknown dtype": ["sample", "--dtype", "float16"],
    "unknown device": ["sample", "--device", "tpu"],
    "zero steps": ["sample", "--steps", "0"],
    "negative steps": ["sample", "--steps", "-5"],
    "zero chains": ["sample", "--chains", "0"],
    "zero dim": ["sample", "--dim", "0"],
    "negative dim": ["sample", "--dim", "-2"],
    "non-int steps": ["sample", "--steps", "2.5"],
    "zero step size": ["sample", "--step-size", "0"],
    "negative step size": ["sample", "--step-size", "-0.1"],
    "nan step size": ["sample", "--step-size", "nan"],
    "inf step size": ["sample", "--step-size", "inf"],
    "thin > steps": ["sample", "--steps", "20", "--thin", "30"],
    "zero thin": ["sample", "--thin", "0"],
    "negative burn-in": ["sample", "--burn-in", "-1"],
    "dim the energy does not take": ["sample", "--energy", "rosenbrock", "--dim", "1"],
    "seed out of range": ["sample", "--seed", str(2**70)],
    "out dir missing": ["sample", "--out", "{tmp}/missing/x.pt"],
    "plot dir missing": ["sample", "--plot", "{tmp}/missing/x.png"],
    "out under a file": ["sample", "--out", "{tmp}/file.txt/x.pt"],
    "out is a directory": ["sample", "--out", "{tmp}"],
    "out and plot the same": ["sample", "--out", "{tmp}/x", "--plot", "{tmp}/x"],
    "demo: zero chains": ["demo", "--chains", "0"],
    "demo: plot dir missing": ["demo", "--plot", "{tmp}/missing/demo.png"],
}


@pytest.mark.parametrize("argv", BAD.values(), ids=BAD.keys())
def test_bad_arguments_one_line_exit_2_no_output(argv, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("not a directory")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if argv and "--out" not in argv:
        argv += ["--out", str(tmp_path / "out.pt")]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert_one_error_line(err)
    assert sorted(os.listdir(tmp_path)) == ["file.txt"]  # nothing written, no temporary files


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(tmp_path, capsys):
    code, _, err = run(capsys, "sample", "--device", "cuda", "--out", tmp_path / "x.pt")
    assert code == 2 and "CUDA is not available" in err
    assert_one_error_line(err)


def test_unwritable_directory_is_refused_before_sampling(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cli.sample, "_run", lambda cfg: pytest.fail("sampled despite an unwritable directory"))
    monkeypatch.setattr(cli.tempfile, "mkstemp", refuse)
    code, _, err = run(capsys, "sample", "--plot", tmp_path / "x.png")
    assert code == 2 and "is not writable" in err
    assert_one_error_line(err)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes to read-only directories")
def test_read_only_directory(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    code, _, err = run(capsys, "sample", "--out", ro / "x.pt")
    assert code == 2 and "is not writable" in err


def test_library_errors_become_usage_errors(monkeypatch, tmp_path, capsys):
    def broken(dim, dtype, device):
        raise ValueError("barrier_height must be a finite number > 0,\n got -1.0")

    monkeypatch.setitem(cli.ENERGIES, "broken", cli.EnergySpec(broken, 0.1, "raises"))
    code, out, err = run(capsys, "sample", "--energy", "broken", *EAGER, "--out", tmp_path / "x.pt")
    assert code == 2 and out == "" and "barrier_height must be a finite number > 0, got -1.0" in err
    assert_one_error_line(err)
    assert os.listdir(tmp_path) == []


def test_bad_arguments_keep_an_existing_output(tmp_path, capsys):
    out = tmp_path / "x.pt"
    out.write_bytes(b"precious")
    code, _, _ = run(capsys, "sample", "--steps", "0", "--out", out)
    assert code == 2 and out.read_bytes() == b"precious"


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), RuntimeError("plotting broke")])
def test_failed_write_leaves_old_files_and_no_temporaries(error, monkeypatch, tmp_path, capsys):
    out, png = tmp_path / "x.pt", tmp_path / "x.png"
    out.write_bytes(b"old draws")
    png.write_bytes(b"old plot")

    def fail(f, *args):
        f.write(b"partial")
        raise error

    monkeypatch.setattr(cli.sample, "plot", fail)
    argv = ["sample", *EAGER, "--out", out, "--plot", png]
    if isinstance(error, OSError):  # an I/O failure: one line, exit 1
        code, _, err = run(capsys, *argv)
        assert code == 1 and "No space left on device" in err
        assert_one_error_line(err)
    else:  # a bug: its traceback is worth more than a line, but the files are still safe
        with pytest.raises(RuntimeError, match="plotting broke"):
            cli.main([str(a) for a in argv])
    assert out.read_bytes() == b"old draws" and png.read_bytes() == b"old plot"
    assert sorted(os.listdir(tmp_path)) == ["x.png", "x.pt"]


# -------------------------------------------------------------------------------- demo


@pytest.fixture
def small_demo(monkeypatch):
    monkeypatch.setitem(cli.DEMO, "chains", 32)
    monkeypatch.setitem(cli.DEMO, "steps", 8)
    monkeypatch.setitem(cli.DEMO, "burn_in", 2)


def test_demo_writes_its_plot_in_the_working_directory(small_demo, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "demo", "--no-compile", "--no-progress")
    assert (code, err) == (0, "")
    assert "gaussian_mixture, dim 2" in out and "mala" in out and "32 chains x 8 steps" in out
    assert out.splitlines()[-1].split() == ["plot", "fnebm-demo.png"]
    assert_png(tmp_path / "fnebm-demo.png")


def test_demo_plot_and_out_options(small_demo, tmp_path, capsys):
    png, pt = tmp_path / "d.png", tmp_path / "d.pt"
    code, out, _ = run(capsys, "demo", "--no-compile", "--no-progress", "--plot", png, "--out", pt)
    assert code == 0 and str(png) in out.splitlines()[-1]
    assert_png(png)
    assert torch.load(pt)["trace"].shape == (8, 32, 2)


def test_demo_preset_is_the_documented_one():
    assert cli.DEMO["energy"] == "gaussian_mixture" and cli.DEMO["dim"] == 2 and cli.DEMO["sampler"] == "mala"
    assert cli.demo_command() in DOCS.read_text()


def test_help_and_version(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "sample" in out and "demo" in out
    code, out, _ = run(capsys, "sample", "--help")
    for option in ("--energy", "--dim", "--sampler", "--chains", "--steps", "--burn-in", "--thin", "--step-size",
                   "--seed", "--out", "--plot", "--device", "--dtype", "--no-progress", "--no-compile"):
        assert option in out
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("fnebm ")


def test_docs_name_every_energy_and_sampler():
    text = DOCS.read_text()
    for name in (*cli.ENERGIES, *cli.SAMPLERS):
        assert f"`{name}`" in text, name


# -------------------------------------------------------------------------- end to end


def test_python_dash_m_fnebm(tmp_path):
    out = tmp_path / "x.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "fnebm", "sample", "--energy", "gaussian", "--dim", "3", "--sampler", "langevin",
         "--chains", "16", "--steps", "6", "--no-compile", "--no-progress", "--device", "cpu", "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "R-hat max" in proc.stdout and "saved" in proc.stdout
    assert torch.load(out)["trace"].shape == (6, 16, 3)
