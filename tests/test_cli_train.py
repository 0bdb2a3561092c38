"""``fnebm train``, driven in-process with ``main([...])``: tiny eager runs only (batch 64, hidden 16,
a few steps, ``--no-compile``), so the file takes seconds; the compiled path is measured in
docs/cli.md, not here."""

from pathlib import Path

import pytest
import torch

from fnebm import cli, datasets

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
# persistent CD with a replay buffer: every part of the state a checkpoint must carry
BASE = ["train", "--batch", "64", "--hidden", "16", "--k", "2", "--sample-steps", "4",
        "--device", "cpu", "--no-progress", "--no-compile"]
TINY = [*BASE, "--buffer", "128"]
CHECKPOINT_KEYS = {"format", "version", "config", "step", "key", "params", "optimizer", "chains", "losses", "summary"}


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(err):
    assert err.startswith("fnebm: error: ")
    assert err.count("\n") == 1 and err.endswith("\n"), err


def assert_same_state(a, b):
    """Bit for bit: parameters, optimiser, chains and buffer, key, step, loss history."""
    assert a["step"] == b["step"] and a["config"] == b["config"]
    assert torch.equal(a["key"], b["key"]) and torch.equal(a["losses"], b["losses"])
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
        assert torch.equal(a["optimizer"]["m"][name], b["optimizer"]["m"][name]), name
        assert torch.equal(a["optimizer"]["v"][name], b["optimizer"]["v"][name]), name
    assert torch.equal(a["optimizer"]["t"], b["optimizer"]["t"])
    for field in ("positions", "buffer", "count", "pointer"):
        assert torch.equal(a["chains"][field], b["chains"][field]), field


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """6 steps in one go (with a plot), and 3 steps: {name: (exit code, stdout, path)}."""
    d = tmp_path_factory.mktemp("train")
    done = {}
    for name, steps, extra in (("six", 6, ["--plot", d / "six.png"]), ("three", 3, [])):
        path = d / f"{name}.pt"
        code = cli.main([str(a) for a in [*TINY, "--steps", steps, "--out", path, *extra]])
        done[name] = (code, path)
    return d, done


# ------------------------------------------------------------------------------ outputs


def test_train_prints_a_summary_and_writes_checkpoint_and_plot(runs, capsys):
    d, done = runs
    code, path = done["six"]
    assert code == 0
    ckpt = torch.load(path)  # weights_only=True: plain containers and tensors only
    assert set(ckpt) == CHECKPOINT_KEYS
    assert ckpt["format"] == "fnebm-train" and ckpt["version"] == 2 and ckpt["step"] == 6
    assert ckpt["config"] == {**cli.TRAIN_DEFAULTS, "batch": 64, "hidden": 16, "k": 2, "buffer": 128}
    assert ckpt["key"].shape == (2,) and ckpt["losses"].shape == (6,) and torch.isfinite(ckpt["losses"]).all()
    shapes = {"w0": (2, 16), "b0": (16,), "w1": (16, 16), "b1": (16,), "w2": (16, 1)}
    assert {n: tuple(p.shape) for n, p in ckpt["params"].items()} == shapes
    assert set(ckpt["optimizer"]) == {"m", "v", "t"} and float(ckpt["optimizer"]["t"]) == 6
    chains = ckpt["chains"]
    assert chains["positions"].shape == (64, 2) and chains["buffer"].shape == (128, 2)
    assert int(chains["count"]) == 128 and int(chains["pointer"]) == (6 * 64) % 128
    summary = ckpt["summary"]
    assert summary["step"] == 6 and summary["start"] == 0 and summary["kl"] >= 0 and summary["kl_floor"] >= 0
    png = (d / "six.png").read_bytes()
    assert png[:8] == PNG_SIGNATURE and len(png) > 10_000


def test_summary_lines(tmp_path, capsys):
    code, out, err = run(capsys, *BASE, "--steps", 2, "--loss", "dsm", "--out", tmp_path / "m.pt")
    assert code == 0 and err == ""
    labels = [line.split()[0] for line in out.splitlines()]
    assert labels == ["dataset", "model", "loss", "steps", "final", "compile", "training", "KL", "MMD^2",
                      "evaluation", "saved"]
    assert "KL(data || model) on a 100x100 grid" in out and "skipped (--no-compile)" in out


@pytest.mark.parametrize("loss", ["cd", "ssm", "sm"])
def test_every_loss_trains(loss, tmp_path, capsys):
    extra = [] if loss != "cd" else ["--sampler", "mala"]
    argv = ["train", "--batch", "32", "--hidden", "8", "--k", "2", "--sample-steps", "2", "--steps", "2",
            "--device", "cpu", "--no-progress", "--no-compile", "--loss", loss, *extra, "--out", tmp_path / "m.pt"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    ckpt = torch.load(tmp_path / "m.pt")
    assert ckpt["chains"] is None and ckpt["config"]["loss"] == loss
    assert all(torch.isfinite(p).all() for p in ckpt["params"].values())


def test_same_seed_same_model_other_seed_other_model(runs, tmp_path, capsys):
    _, done = runs
    assert run(capsys, *TINY, "--steps", 3, "--out", tmp_path / "again.pt")[0] == 0
    assert run(capsys, *TINY, "--steps", 3, "--seed", 1, "--out", tmp_path / "seed1.pt")[0] == 0
    three, again, seed1 = (torch.load(p) for p in (done["three"][1], tmp_path / "again.pt", tmp_path / "seed1.pt"))
    assert_same_state(three, again)
    assert not torch.equal(three["params"]["w0"], seed1["params"]["w0"])


# ------------------------------------------------------------------------------- resume


def test_resume_is_bit_exact(runs, tmp_path, capsys):
    # 3 + 3 steps == 6 steps, bit for bit; options left out are taken from the checkpoint
    _, done = runs
    out = tmp_path / "resumed.pt"
    code, stdout, err = run(capsys, "train", "--resume", done["three"][1], "--steps", 3, "--sample-steps", 4,
                            "--device", "cpu", "--no-progress", "--no-compile", "--out", out)
    assert code == 0, err
    assert "3 -> 6" in stdout
    assert_same_state(torch.load(out), torch.load(done["six"][1]))


def test_learning_rate_falls_linearly_to_the_floor_then_stays():
    cfg = cli.train.TrainConfig(**{**cli.TRAIN_DEFAULTS, "lr": 1e-2, "lr_decay": 100}, steps=1, sample_steps=1,
                                device="cpu", out=None, plot=None, resume=None, progress=False, compile=False)
    floor = cli.train.LR_FLOOR * 1e-2
    rates = [cli.train.learning_rate(cfg, t) for t in (0, 50, 100, 101, 10_000)]
    assert rates[0] == 1e-2 and rates[1] == pytest.approx((1e-2 + floor) / 2, rel=1e-12)
    assert rates[2:] == pytest.approx([floor] * 3, rel=1e-12)
    assert cli.train.learning_rate(cfg._replace(lr_decay=0), 10_000) == 1e-2  # 0: constant


def test_a_version_1_checkpoint_resumes_at_a_constant_rate(runs, tmp_path, capsys):
    # version 1 had no lr_decay or reinit and trained at a constant rate with restarts 0.05: it continues
    # so, and is written as version 2
    _, done = runs
    old = torch.load(done["three"][1])
    old["version"] = 1
    del old["config"]["lr_decay"], old["config"]["reinit"]
    torch.save(old, tmp_path / "v1.pt")
    code, stdout, err = run(capsys, "train", "--resume", tmp_path / "v1.pt", "--steps", 1, "--sample-steps", 2,
                            "--device", "cpu", "--no-progress", "--no-compile", "--out", tmp_path / "v2.pt")
    assert code == 0, err
    assert "lr 0.002, seed 0" in stdout and "restarts 0.05" in stdout  # no decay in the summary
    new = torch.load(tmp_path / "v2.pt")
    assert new["version"] == 2 and new["step"] == 4
    assert new["config"]["lr_decay"] == 0 and new["config"]["reinit"] == 0.05


def test_resume_onto_its_own_file_with_matching_options(runs, tmp_path, capsys):
    _, done = runs
    path = tmp_path / "model.pt"
    path.write_bytes(done["three"][1].read_bytes())
    # restating the checkpoint's options is fine; --out may be the file resumed from
    code, _, err = run(capsys, *TINY, "--steps", 3, "--resume", path, "--out", path)
    assert code == 0, err
    assert_same_state(torch.load(path), torch.load(done["six"][1]))


# ------------------------------------------------------------------------------- errors


def bad_cases(d, checkpoint):
    not_torch = d / "notes.txt"
    not_torch.write_text("hello\n")
    foreign = d / "foreign.pt"
    torch.save({"trace": torch.zeros(2)}, foreign)
    return [
        (["--dataset", "mnist"], "unknown dataset 'mnist'"),
        (["--loss", "nce"], "unknown loss 'nce'"),
        (["--sampler", "hmc"], "unknown sampler 'hmc'"),
        (["--dtype", "float16"], "unknown dtype"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--steps", "-3"], "--steps must be >= 1"),
        (["--batch", "0"], "--batch must be >= 1"),
        (["--hidden", "0"], "--hidden must be >= 1"),
        (["--k", "0"], "--k must be >= 1"),
        (["--lr", "0"], "--lr must be a finite number > 0"),
        (["--lr=-1e-3"], "--lr must be a finite number > 0"),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--lr-decay", "-1"], "--lr-decay must be >= 0"),
        (["--resume", str(checkpoint), "--lr-decay", "0"], "--lr-decay 0 differs from the checkpoint's 2000"),
        (["--step-size", "inf"], "--step-size must be a finite number > 0"),
        (["--sigma", "0"], "--sigma must be a finite number > 0"),
        (["--noise-scale", "-1"], "--noise-scale must be a finite number >= 0"),
        (["--sampler", "mala", "--noise-scale", "0.5"], "--noise-scale is Langevin's"),
        (["--buffer", "10"], "--buffer must be 0 (none) or >= --batch"),
        (["--loss", "dsm", "--buffer", "128"], "--buffer is persistent CD's"),
        (["--reinit", "1.5"], "--reinit must be a probability in [0, 1]"),
        (["--reinit", "nan"], "--reinit must be a probability in [0, 1]"),
        (["--loss", "cd", "--reinit", "0.1"], "--reinit is persistent CD's"),
        (["--steps", "two"], "invalid int value"),
        (["--frobnicate"], "unrecognized arguments"),
        (["--device", "tpu"], "unknown device"),
        (["--plot", str(d / "missing" / "m.png")], "does not exist"),
        (["--resume", str(d / "nowhere.pt")], "no such file"),
        (["--resume", str(not_torch)], "not an fnebm train checkpoint"),
        (["--resume", str(foreign)], "not an fnebm train checkpoint"),
        (["--resume", str(checkpoint), "--hidden", "32"], "--hidden 32 differs from the checkpoint's 16"),
        (["--resume", str(checkpoint), "--loss", "cd"], "--loss cd differs from the checkpoint's pcd"),
    ]


def test_bad_arguments_one_line_status_2_nothing_written(runs, tmp_path, capsys):
    _, done = runs
    out = tmp_path / "model.pt"
    for extra, message in bad_cases(tmp_path, done["three"][1]):
        code, stdout, err = run(capsys, *TINY, "--steps", 2, *extra, "--out", out)
        assert code == 2, (extra, err)
        assert_one_error_line(err)
        assert message in err, (extra, err)
        assert stdout == ""
        assert not out.exists(), extra
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign.pt", "notes.txt"]  # no temporary files


def test_a_failure_while_writing_leaves_the_old_files(tmp_path, capsys, monkeypatch):
    out, png = tmp_path / "model.pt", tmp_path / "model.png"
    out.write_bytes(b"old checkpoint")

    def broken(f, *args):
        f.write(b"half a png")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli.train, "plot_training", broken)
    code, _, err = run(capsys, *TINY, "--steps", 1, "--out", out, "--plot", png)
    assert code == 1 and "No space left on device" in err
    assert out.read_bytes() == b"old checkpoint" and not png.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


# --------------------------------------------------------------------------- help, docs


def test_help_lists_the_options(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "train" in out
    code, out, _ = run(capsys, "train", "--help")
    assert code == 0
    for option in OPTIONS:
        assert option in out, option


OPTIONS = ("--dataset", "--loss", "--sampler", "--steps", "--batch", "--lr", "--lr-decay", "--k", "--step-size",
           "--noise-scale", "--sigma", "--buffer", "--reinit", "--hidden", "--seed", "--dtype", "--sample-steps",
           "--out", "--plot", "--resume", "--device", "--no-progress", "--no-compile")


def test_docs_cover_the_command():
    text = DOCS.read_text()
    section = text[text.index("## `fnebm train`"):]
    for option in OPTIONS:
        assert f"`{option}" in section, option
    for name in (*cli.TRAIN_LOSSES, *cli.TRAIN_SAMPLERS, *datasets.DATASETS):
        assert f"`{name}`" in section, name


# ----------------------------------------------------------------- flow and EqM objectives


@pytest.mark.parametrize("objective", ["flow", "eqm"])
def test_generative_objectives_train_checkpoint_plot_and_resume_bit_exact(objective, tmp_path, capsys):
    gen = ["train", "--objective", objective, "--batch", "64", "--hidden", "16", "--sample-steps", "4",
           "--device", "cpu", "--no-progress", "--no-compile"]
    code, out, err = run(capsys, *gen, "--steps", 4, "--out", tmp_path / "four.pt", "--plot", tmp_path / "four.png")
    assert code == 0, err
    assert "KL           n/a" in out and "MMD^2" in out
    ckpt = torch.load(tmp_path / "four.pt")
    assert ckpt["config"]["loss"] == objective and ckpt["chains"] is None and ckpt["step"] == 4
    din = 3 if objective == "flow" else 2
    assert {n: tuple(p.shape) for n, p in ckpt["params"].items()} == {
        "w0": (din, 16), "b0": (16,), "w1": (16, 16), "b1": (16,), "w2": (16, 2), "b2": (2,)}
    assert (tmp_path / "four.png").read_bytes()[:8] == PNG_SIGNATURE
    assert run(capsys, *gen, "--steps", 2, "--out", tmp_path / "two.pt")[0] == 0
    code, out, err = run(capsys, "train", "--resume", tmp_path / "two.pt", "--steps", 2, "--sample-steps", 4,
                         "--device", "cpu", "--no-progress", "--no-compile", "--out", tmp_path / "resumed.pt")
    assert code == 0, err
    a, b = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "four.pt")
    assert a["step"] == b["step"] == 4 and torch.equal(a["losses"], b["losses"])
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
        assert torch.equal(a["optimizer"]["m"][name], b["optimizer"]["m"][name]), name


def test_objective_is_loss_and_generative_refusals(tmp_path, capsys):
    code, out, _ = run(capsys, "train", "--help")
    assert "--objective" in out
    code, _, err = run(capsys, "train", "--objective", "score", "--steps", 1, "--device", "cpu")
    assert code == 2 and "unknown loss 'score'" in err
    assert_one_error_line(err)
    code, _, err = run(capsys, "train", "--objective", "flow", "--layout", "per-example", "--steps", 1,
                       "--device", "cpu", "--no-progress")
    assert code == 2 and "--layout batch" in err
    assert "`--objective" in DOCS.read_text()
