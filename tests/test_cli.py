"""The ``fnebm`` command, driven as a user would: ``main([...])`` in-process, one subprocess.

Compiling costs 10-30 s per configuration on a 2-core CPU, so exactly one configuration is
compiled (``COMPILED``, shared through the ``compiled`` fixture and re-run once from the
build cache); everything else runs with ``--no-compile`` (or ``auto`` on runs so short that it
runs them eagerly) or only builds and validates.
"""

import contextlib
import io
import math
import os
import subprocess
import sys
import threading
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
    "compiled", "path", "ramp", "n_runaway", "runaway_chains", "n_runaway_stuck", "runaway_max_abs", "n_frozen",
    "frozen_chains", "rhat_max_unflagged", "mixing", "truth", "setup_s", "kernel_build_s",
}
# The one configuration that is compiled in this file.
COMPILED = [
    "sample", "--energy", "double_well", "--dim", "2", "--sampler", "mala", "--step-size", "0.05",
    "--chains", "64", "--steps", "20", "--burn-in", "4", "--seed", "0", "--device", "cpu", "--no-progress",
    "--compile",
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


def plain(value):
    """Plain Python data: what a summary may hold."""
    if isinstance(value, (list, tuple)):
        return all(plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    return value is None or type(value) in (int, float, str, bool)


@pytest.fixture(scope="module")
def compile_record(tmp_path_factory):
    """Compile times go to a file of this test session, not to the user's Inductor cache directory."""
    path = tmp_path_factory.mktemp("record") / "times.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli._common, "_compile_times_path", lambda: str(path))
        yield path


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, compile_record):
    """The compiled run, with --out and --plot, as on a terminal (so the compile notice shows):
    (exit code, stdout, stderr, out path, plot path)."""
    d = tmp_path_factory.mktemp("compiled")
    out, png = d / "samples.pt", d / "samples.png"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli.report, "_tty", lambda: True)
        code = cli.main([*COMPILED, "--out", str(out), "--plot", str(png)])
    return code, stdout.getvalue(), stderr.getvalue(), out, png


# ------------------------------------------------------------------------------ sample


def test_sample_writes_draws_summary_and_plot(compiled):
    code, out, err, pt, png = compiled
    # on a terminal, one line before the compile says what, how long, and that it is cached
    assert code == 0 and err.count("\n") == 1
    assert err.startswith("fnebm: compiling mala on double_well (dim 2, 64 chains, float32, cpu) with torch.compile")
    assert "cached on disk" in err
    record = torch.load(pt)
    assert set(record) == {"trace", "energy", "summary", "args"}
    assert record["trace"].shape == (20, 64, 2) and record["trace"].device.type == "cpu"
    assert record["trace"].dtype == torch.float32 and torch.isfinite(record["trace"]).all()
    assert record["energy"].shape == (20, 64)
    summary = record["summary"]
    assert set(summary) == SUMMARY_KEYS
    assert plain(summary)
    assert summary["draws"] == 20 and summary["burn_in"] == 4 and summary["n_divergent"] == 0
    assert 0 < summary["acceptance"] <= 1 and summary["compile_s"] > 0
    assert summary["compiled"] is True and summary["path"] == "--compile" and summary["ramp"] == []
    assert 1 <= summary["ess_bulk_min"] <= summary["ess_bulk_median"] and math.isfinite(summary["rhat_max"])
    assert record["args"]["energy"] == "double_well" and record["args"]["compile"] is True
    assert_png(png)
    for label in ("sampler", "energy", "acceptance", "divergences", "ESS bulk", "ESS/s", "R-hat max", "path",
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
    argv = [a for a in COMPILED if a != "--compile"]
    code, stdout, _ = run(capsys, *argv, "--backend", "torch", "--no-compile", "--out", out)
    assert code == 0 and "path         eager (--no-compile)" in stdout and "compile      none" in stdout
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
    spec = cli.ENERGIES[energy]  # the energy's default for the sampler (dim 2: unscaled)
    base = spec.step_size if sampler == "mala" else spec.langevin_step_size
    assert record["summary"]["step_size"] == pytest.approx(base, rel=1e-3)


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
        size = cli._chunk_size(total)
        assert 1 <= size <= total
        assert total == 1 or (size >= 2 and total % size != 1), (total, size)
        assert total < 40 or -(-total // size) >= 5  # enough chunks to time a compile and move a bar


def test_compile_times_are_remembered_for_the_notice(compiled, compile_record):
    # the compiled run recorded its compile time; the next notice for it quotes that time
    import json

    times = json.loads(compile_record.read_text())
    assert times["mala double_well dim=2 chains=64 float32 cpu"]["first"] > 0
    argv = build_args(COMPILED)
    notice = cli.report.compile_notice(cli.options._config(argv))
    assert "here last time" in notice and "on-disk cache" in notice
    other = cli.report.compile_notice(cli.options._config(build_args([*COMPILED[:-1], "--dim", "3", "--compile"])))
    assert "the first time on this machine (the median of 1 first compiles" in other  # measured here


def test_compile_notice_without_records(monkeypatch, tmp_path):
    monkeypatch.setattr(cli._common, "_compile_times_path", lambda: str(tmp_path / "none.json"))
    notice = cli.report.compile_notice(cli.options._config(build_args(COMPILED)))
    assert notice.startswith("compiling mala on double_well") and "cached on disk" in notice
    assert "30-45 s on a 2-core CPU" in notice


def build_args(argv):
    return cli.build_parser().parse_args([str(a) for a in argv])


def test_auto_runs_a_short_run_eagerly_and_says_so(tmp_path, capsys):
    # auto (the default): 8 chains x 3 steps cost far less eagerly than a compile (~0.5 s);
    # Rosenbrock, which no hand-written CPU kernel covers
    argv = [a for a in EAGER if a != "--no-compile"]
    code, out, err = run(capsys, "sample", "--energy", "rosenbrock", *argv, "--out", tmp_path / "x.pt")
    assert (code, err) == (0, "")
    summary = torch.load(tmp_path / "x.pt")["summary"]
    assert summary["compiled"] is False and summary["compile_s"] is None
    assert summary["path"].startswith("auto: ") and "path         eager (auto: " in out


def test_auto_runs_a_covered_run_in_the_c_kernel_and_says_so(tmp_path, capsys):
    from fnebm.kernels import cpu_chain

    if cpu_chain.available() is not None:
        pytest.skip(f"the C kernel is unavailable here: {cpu_chain.available()}")
    argv = [a for a in EAGER if a != "--no-compile"]
    code, out, err = run(capsys, "sample", "--energy", "harmonic", *argv, "--out", tmp_path / "x.pt")
    assert (code, err) == (0, "")
    record = torch.load(tmp_path / "x.pt")
    summary = record["summary"]
    assert summary["compiled"] is None and summary["compile_s"] is None
    assert "path         the whole-chain C kernel (CPU), nothing compiled" in out
    # the kernel writes the energies the command keeps: they are the draws' energies
    target = cli.ENERGIES["harmonic"].build(record["trace"].shape[-1], torch.float32, "cpu")
    torch.testing.assert_close(record["energy"], torch.func.vmap(torch.func.vmap(target))(record["trace"]),
                               rtol=1e-5, atol=1e-6)


def _never_built(module, tmp_path, monkeypatch):
    """A machine that never built the C kernel of ``module``: an empty cache folder, nothing loaded
    in this process, and a terminal for the notice."""
    if module.available() is not None:
        pytest.skip(f"the C kernel is unavailable here: {module.available()}")
    monkeypatch.setenv("FNEBM_CACHE_DIR", str(tmp_path / "cache"))
    for name, value in (("lib", None), ("why", None), ("build_s", 0.0)):
        monkeypatch.setattr(module.LIBRARY, name, value)
    monkeypatch.setattr(cli.report, "_tty", lambda: True)


def test_a_first_build_of_the_c_kernel_is_announced_and_counted(tmp_path, monkeypatch, capsys):
    from fnebm.kernels import cpu_chain

    _never_built(cpu_chain, tmp_path, monkeypatch)
    argv = [a for a in EAGER if a != "--no-compile"]
    code, out, err = run(capsys, "sample", "--energy", "harmonic", *argv, "--out", tmp_path / "x.pt")
    assert code == 0 and err.startswith("fnebm: building the whole-chain C kernel") and err.count("\n") == 1
    assert "of it building the C kernel" in out
    assert torch.load(tmp_path / "x.pt")["summary"]["kernel_build_s"] > 0
    code, out, err = run(capsys, "sample", "--energy", "harmonic", *argv)  # built: nothing to announce
    assert (code, err) == (0, "") and "building" not in out


def test_a_first_build_of_the_nuts_kernel_is_announced_and_counted_in_the_warm_up(tmp_path, monkeypatch, capsys):
    from fnebm.kernels import cpu_nuts

    _never_built(cpu_nuts, tmp_path, monkeypatch)
    argv = ["--energy", "harmonic", "--sampler", "nuts", "--adapt", "20", *EAGER]
    code, out, err = run(capsys, "sample", *argv, "--out", tmp_path / "x.pt")
    assert code == 0 and err.startswith("fnebm: building the NUTS C kernel") and err.count("\n") == 1
    assert "of it building the C kernel" in out  # in the adaptation's line: its first step built it
    summary = torch.load(tmp_path / "x.pt")["summary"]
    assert summary["adapted"]["kernel_build_s"] > 0 and not summary["kernel_build_s"]
    code, out, err = run(capsys, "sample", *argv)  # built: nothing to announce
    assert (code, err) == (0, "") and "building" not in out


def test_compile_flag_runs_nuts_in_the_torch_kernel(monkeypatch):
    from fnebm.cli import presets

    target = cli.ENERGIES["harmonic"].build(3, torch.float32, torch.device("cpu"))
    alg = presets._algorithm(target, "nuts", 0.1, 3, compiled=True)
    assert alg.step.keywords["backend"] == "torch"
    assert presets._algorithm(target, "nuts", 0.1, 3).step.keywords["backend"] == "auto"


def test_defaults_scale_with_dim_and_sampler():
    from fnebm.cli import presets

    for name, spec in cli.ENERGIES.items():
        assert presets.default_step_size(name, "mala", 2) == pytest.approx(spec.step_size, rel=1e-3)
        assert presets.default_step_size(name, "mala", 1) == presets.default_step_size(name, "mala", 2)
        # MALA's optimal scaling, dim^(-1/3)
        assert presets.default_step_size(name, "mala", 16) == pytest.approx(spec.step_size / 2, rel=1e-2)
        assert presets.default_step_size(name, "langevin", 2) < spec.step_size
        assert presets.default_steps(name, 2) == spec.steps[0] and presets.default_steps(name, 10) == spec.steps[1]
        assert presets.default_steps(name, 2, "langevin") == 4 * spec.steps[0]
    args = build_args(["sample", "--energy", "gaussian", "--dim", "10"])
    cfg = cli.options._config(args)
    assert (cfg.steps, cfg.burn_in, cfg.thin) == (3000, 750, 3)  # about 1000 draws kept


def test_burn_in_ramp():
    assert cli.run._ramp(100, False) == [(1 / 64, 12), (1 / 16, 12), (1 / 4, 12)]
    assert cli.run._ramp(15, False) == [] and cli.run._ramp(100, True) == []
    assert cli.run._ramp(10_000, False) == [(1 / 64, 64), (1 / 16, 64), (1 / 4, 64)]
    assert cli.run._ramp(100, False, "rosenbrock") != [] and cli.run._ramp(100, False, "gaussian") == []


def test_runaway_chains_are_named_and_the_plot_stays_readable(tmp_path, capsys):
    # Langevin on Rosenbrock at 4x the old default step, no burn-in ramp: chains started out on the
    # walls overshoot to |x| ~ 1e7 (eager, 64 chains x 20 steps: ~1 s with the plot)
    png = tmp_path / "r.png"
    code, out, err = run(capsys, "sample", "--energy", "rosenbrock", "--sampler", "langevin", "--step-size", 0.004,
                         "--burn-in", 0, "--steps", 20, "--chains", 64, "--device", "cpu", "--no-progress",
                         "--no-compile", "--out", tmp_path / "r.pt", "--plot", png)
    assert (code, err) == (0, "")
    record = torch.load(tmp_path / "r.pt")
    summary, trace = record["summary"], record["trace"]
    assert summary["n_runaway"] > 0 and len(summary["runaway_chains"]) == summary["n_runaway"]
    far = trace.abs().amax(dim=(0, 2)) > 1e3
    assert set(summary["runaway_chains"]) == set(far.nonzero().flatten().tolist())
    line = next(x for x in out.splitlines() if x.startswith("runaway"))
    assert f"{summary['n_runaway']} of 64 chains" in line and "smaller --step-size" in line
    assert f"chain {summary['runaway_chains'][0]}" in line
    assert "without the runaway and frozen chains" in out
    assert_png(png)


def test_frozen_chains_are_named(tmp_path, capsys):
    # MALA on the double well at step 0.5: a chain out on a quartic wall overshoots by far on
    # every proposal and rejects them all (eager, 64 chains x 12 steps: < 1 s)
    code, out, _ = run(capsys, "sample", "--energy", "double_well", "--step-size", 0.5, "--burn-in", 0,
                       "--steps", 12, "--chains", 64, "--device", "cpu", "--no-progress", "--no-compile",
                       "--out", tmp_path / "f.pt")
    assert code == 0
    record = torch.load(tmp_path / "f.pt")
    summary, trace = record["summary"], record["trace"]
    still = (trace == trace[:1]).all(0).all(-1)
    assert summary["n_frozen"] == int(still.sum()) > 0
    assert summary["frozen_chains"] == still.nonzero().flatten().tolist()
    assert any(x.startswith("frozen") and "did not move over the 12 kept draws" in x for x in out.splitlines())


def test_default_step_and_ramp_keep_rosenbrock_langevin_in_the_bulk(tmp_path, capsys):
    # the case (1,024 chains from N(0, I)) at the new default step with the burn-in ramp,
    # shortened to 64 burn-in + 16 kept steps (eager, ~2-5 s): no chain runs away or freezes
    code, out, _ = run(capsys, "sample", "--energy", "rosenbrock", "--sampler", "langevin", "--steps", 16,
                       "--burn-in", 64, "--device", "cpu", "--no-progress", "--no-compile", "--out", tmp_path / "r.pt")
    assert code == 0
    summary = torch.load(tmp_path / "r.pt")["summary"]
    assert summary["chains"] == 1024 and summary["ramp"] == [[1 / 64, 8], [1 / 16, 8], [1 / 4, 8]]
    assert summary["n_runaway"] == 0 and summary["n_frozen"] == 0 and summary["n_divergent"] == 0
    assert "runaway" not in out and "frozen" not in out


def test_note_tells_separate_modes_from_a_short_run(tmp_path, capsys):
    # eager, 64 chains x 40 steps each (< 1 s): mixture chains stay in the mode they start in;
    # Gaussian chains at a tiny step still sit near their starting points, spread without a gap
    code, out, _ = run(capsys, "sample", "--energy", "gaussian_mixture", "--steps", 40, "--chains", 64,
                       "--device", "cpu", "--no-progress", "--no-compile", "--out", tmp_path / "m.pt")
    assert code == 0
    mixing = torch.load(tmp_path / "m.pt")["summary"]["mixing"]
    assert mixing["verdict"] == "separate modes" and mixing["gap"] > 4
    note = next(x for x in out.splitlines() if x.startswith("note"))
    assert "separate modes (gaussian_mixture is multimodal" in note and "will not fix this soon" in note
    assert "no verdict" in out  # the truth check does not trust an MCSE of chains that disagree

    code, out, _ = run(capsys, "sample", "--energy", "gaussian", "--step-size", 0.0005, "--steps", 40,
                       "--chains", 64, "--device", "cpu", "--no-progress", "--no-compile", "--out", tmp_path / "g.pt")
    mixing = torch.load(tmp_path / "g.pt")["summary"]["mixing"]
    assert mixing["verdict"] == "too short" and mixing["steps_needed"] >= 80
    note = next(x for x in out.splitlines() if x.startswith("note"))
    assert "too short. Try --steps" in note


def test_mixing_verdicts_on_made_up_traces():
    g = torch.Generator().manual_seed(0)
    draws, chains = 200, 64
    noise = 0.1 * torch.randn(draws, chains, 1, generator=g)
    modes = torch.where(torch.arange(chains) % 3 == 0, 3.0, -3.0)[None, :, None]
    rhat = torch.tensor([2.0])
    assert cli.stats.mixing(noise + modes, rhat)["verdict"] == "separate modes"
    many = 0.1 * torch.randn(draws, 512, 1, generator=g) + torch.where(torch.arange(512) % 2 == 0, 3.0, -3.0)[None, :, None]
    many[:, :4] = torch.linspace(-3, 3, draws)[:, None, None]  # 4 of 512 chains cross between the modes
    assert cli.stats.mixing(many, rhat)["verdict"] == "separate modes"
    walk = torch.randn(draws, chains, 1, generator=g).cumsum(0)  # one slow random walk per chain
    assert cli.stats.mixing(walk, rhat)["verdict"] == "too short"
    assert cli.stats.mixing(walk[:, :8], rhat)["verdict"] == "few chains"


def test_flag_chains_on_a_made_up_trace():
    x = torch.randn(20, 32, 2, generator=torch.Generator().manual_seed(1))
    x[5:, 3] = 1e9          # ran away and stuck there
    x[:, 7] = x[0, 7]       # frozen
    x[10, 9, 1] = math.inf  # not finite
    flags = cli.stats.flag_chains(x)
    assert flags["runaway"].nonzero().flatten().tolist() == [3, 9]
    assert flags["frozen"].nonzero().flatten().tolist() == [7]
    assert flags["stuck"].nonzero().flatten().tolist() == []  # chain 3 moved before it stuck
    assert cli.stats.flag_chains(x[:9])["frozen"].sum() == 0  # too few draws to call a chain frozen


def test_truth_check_catches_langevin_bias(tmp_path, capsys):
    # unadjusted Langevin at step 0.8 on N(0, I): x' = 0.2 x + sqrt(1.6) xi, stationary variance
    # 1.6 / (1 - 0.04) = 5/3; it mixes in ~2 steps (R-hat ~1.005 over 300 draws), and 128 chains x
    # 300 draws give an MCSE of ~0.01 on the variance, so |z| ~ 60 (eager, ~1-3 s)
    code, out, _ = run(capsys, "sample", "--energy", "harmonic", "--sampler", "langevin", "--step-size", 0.8,
                       "--chains", 128, "--steps", 300, "--burn-in", 10, "--device", "cpu", "--no-progress",
                       "--no-compile", "--out", tmp_path / "h.pt")
    assert code == 0
    summary = torch.load(tmp_path / "h.pt")["summary"]
    truth = summary["truth"]
    assert summary["rhat_max"] <= 1.01
    assert not truth["agrees"] and truth["z_max"] > 10 and truth["worst"].startswith("var")
    var = [r for r in truth["rows"] if r["name"] == "var x0"][0]
    assert var["estimate"] == pytest.approx(5 / 3, abs=0.1)
    assert "DISAGREES with the truth" in out and "unadjusted Langevin is biased" in out


def test_demo_converges_and_agrees_with_the_truth(tmp_path, capsys):
    """The demo's claim, at its real size: R-hat <= 1.01 and every estimate within Monte Carlo error
    of the known mean and covariance. Eager, 1,024 chains x 600 steps: ~3-10 s on a 2-core CPU.

    The tolerance is the MCSE's: each |z| = |estimate - truth| / MCSE must stay under the level an
    exact sampler exceeds 1% of the time over the 5 estimates (Bonferroni, z = 3.09); the seed is
    fixed, so the test is deterministic, and a change that biases the sampler fails it."""
    png = tmp_path / "demo.png"
    code, out, err = run(capsys, "demo", "--no-compile", "--no-progress", "--plot", png, "--out", tmp_path / "d.pt")
    assert (code, err) == (0, "")
    summary = torch.load(tmp_path / "d.pt")["summary"]
    assert summary["rhat_max"] <= 1.01 and summary["n_runaway"] == summary["n_frozen"] == 0
    truth = summary["truth"]
    assert truth["agrees"] and len(truth["rows"]) == 5
    assert all(abs(r["z"]) <= truth["z_crit"] for r in truth["rows"])
    assert truth["z_crit"] == pytest.approx(3.09, abs=0.01)
    assert "check        agrees with the truth" in out and "note" not in out
    assert_png(png)


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
    "compile and no-compile": ["sample", "--compile", "--no-compile"],
    "more memory than the machine has": ["sample", "--energy", "harmonic", "--chains", "10000000000000",
                                         "--no-compile"],
    "a huge dim": ["sample", "--dim", "100000000", "--chains", "1"],
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


def test_memory_is_checked_before_sampling(monkeypatch, tmp_path, capsys):
    # the command: refused with the estimate and what is available, before any allocation
    monkeypatch.setattr(cli.sample, "_run", lambda cfg: pytest.fail("sampled a run that cannot fit"))
    code, out, err = run(capsys, "sample", "--energy", "harmonic", "--chains", 10**13, "--no-compile")
    assert code == 2 and out == ""
    assert_one_error_line(err)
    assert "needs about" in err and "PiB of memory on cpu" in err and "is available" in err and "--chains" in err


def test_memory_estimate_covers_the_trace():
    cfg = cli.options._config(build_args(["sample", "--energy", "gaussian", "--dim", "10", "--chains", "1000",
                                         "--steps", "500"]))
    need, host, _ = cli.options.memory_estimate(cfg)
    trace = 1000 * 500 * 11 * 4
    assert trace < need < 20 * trace and host == 0


@pytest.mark.parametrize("error", [RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                                                "not enough memory: you tried to allocate 80000000000000 bytes."),
                                   torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")])
def test_out_of_memory_during_the_run_is_one_line(error, monkeypatch, capsys):
    def fail(cfg):
        raise error

    monkeypatch.setattr(cli.sample, "_run", fail)
    code, out, err = run(capsys, "sample", *EAGER)
    assert code == 2 and out == ""
    assert_one_error_line(err)
    assert "out of memory" in err and "fewer --chains" in err


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
    assert "gaussian, dim 2" in out and "mala" in out and "32 chains x 8 steps" in out
    assert out.splitlines()[-1].split() == ["plot", "fnebm-demo.png"]
    assert_png(tmp_path / "fnebm-demo.png")


def test_matplotlib_is_imported_after_every_decision_that_times_steps(small_demo, tmp_path, monkeypatch, capsys):
    """The plotting import runs on a thread, and never while compile="auto" times eager steps:
    beside it the demo's steps looked 15-25x slower and the demo compiled for 37 s instead of
    sampling eagerly for 2 s. Beside eager chains it is not started either (they hold the GIL)."""
    from types import SimpleNamespace

    from fnebm.cli import plotting, report

    plans, imports = [], []
    monkeypatch.setattr(plotting, "_import_plotting", lambda: imports.append(len(plans)))
    real_on_plan = report._Calls.on_plan
    monkeypatch.setattr(report._Calls, "on_plan", lambda self, plan: (plans.append(plan), real_on_plan(self, plan))[1])
    monkeypatch.chdir(tmp_path)
    # the eager path's ordering: with the C kernel unavailable (the demo's target is one it covers)
    from fnebm.kernels import cpu_chain

    monkeypatch.setattr(cpu_chain.LIBRARY, "lib", None)
    monkeypatch.setattr(cpu_chain.LIBRARY, "why", "made unavailable by the test")
    code, out, err = run(capsys, "demo", "--no-progress")  # compile="auto": a short run, eager
    assert (code, err) == (0, "") and "path         eager (auto:" in out
    for thread in threading.enumerate():
        if thread.name == "fnebm-import-matplotlib":
            thread.join()
    assert len(plans) >= 1 and not any(p.compiled for p in plans)
    assert imports == [len(plans)]  # once, after the last plan (and after the eager sampling)

    # the switch itself: beside compiled (or Triton) chains at the last plan; else when start() is
    # called; once; never with --profile (it times steps later) or on ranks other than 0
    def imported(**cfg):
        imports.clear()
        io = plotting._PlottingImport(SimpleNamespace(**{"plot": "x.png", "rank": 0, "profile": False, **cfg}))
        seen = []
        on_plan = io.after(seen.append)
        on_plan(SimpleNamespace(compiled=False, kernel=False))
        eager = list(imports) if io.thread is None else None
        on_plan(SimpleNamespace(compiled=True, kernel=False))
        io.start()
        if io.thread is not None:
            io.thread.join()
        return eager, len(imports), len(seen)

    assert imported() == ([], 1, 2)
    assert imported(profile=True) == ([], 0, 2)
    assert imported(rank=1) == ([], 0, 2)
    assert imported(plot=None) == ([], 0, 2)


def test_demo_plot_and_out_options(small_demo, tmp_path, capsys):
    png, pt = tmp_path / "d.png", tmp_path / "d.pt"
    code, out, _ = run(capsys, "demo", "--no-compile", "--no-progress", "--plot", png, "--out", pt)
    assert code == 0 and str(png) in out.splitlines()[-1]
    assert_png(png)
    assert torch.load(pt)["trace"].shape == (8, 32, 2)


def test_demo_preset_is_the_documented_one():
    assert cli.DEMO["energy"] == "gaussian" and cli.DEMO["dim"] == 2 and cli.DEMO["sampler"] == "mala"
    assert cli.demo_command() in DOCS.read_text()


def test_help_and_version(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "sample" in out and "demo" in out
    code, out, _ = run(capsys, "sample", "--help")
    for option in ("--energy", "--dim", "--sampler", "--chains", "--steps", "--burn-in", "--thin", "--step-size",
                   "--seed", "--out", "--plot", "--device", "--dtype", "--no-progress", "--compile", "--no-compile"):
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


def test_backend_is_sample_chains_word_and_a_forced_kernel_that_cannot_run_is_one_line(tmp_path, capsys):
    # --backend c on a run the C kernel covers: the path line says so
    code, stdout, _ = run(capsys, "sample", "--energy", "double_well", "--sampler", "mala", "--dim", 2, *EAGER,
                          "--backend", "c")
    assert code == 0 and "path         the whole-chain C kernel (CPU), nothing compiled" in stdout
    # --backend torch --no-compile: the sampler's own steps, eagerly
    code, stdout, _ = run(capsys, "sample", "--energy", "double_well", "--sampler", "mala", "--dim", 2, *EAGER,
                          "--backend", "torch")
    assert code == 0 and "path         eager (--no-compile)" in stdout
    # a kernel that cannot run this energy: one line on stderr naming why, exit 2, nothing written
    out = tmp_path / "x.pt"
    code, stdout, stderr = run(capsys, "sample", "--energy", "rosenbrock", "--sampler", "mala", "--dim", 2, *EAGER,
                               "--backend", "c", "--out", out)
    assert code == 2 and stdout == "" and not out.exists()
    (line,) = stderr.strip().splitlines()
    assert line.startswith("fnebm: error: --backend c: the energy Rosenbrock is not one the C kernel"), line
