"""W4's quality check: the model fnebm's CD step and TorchEBM's reach after the same training.

    python bench/w4_quality.py [--steps 2000] [--batch 1024] [--k 10] [--threads N] [--json bench/results-w4.json]
                               [--save PATH | --load PATH]

Both train W4's model (bench/run.py: fnebm train's MLP 2-128-128-1, SiLU, + 0.01 |x|^2 / 2)
from the same initial weights on the same eight-Gaussians batches (batch t from
``fold_in(key(1), t)``), CD-k with chains from the data, Langevin step 0.01 and noise scale 0.1,
Adam 1e-3: fnebm with W4's compiled step (bench/run.py ``w4_fnebm_step``), TorchEBM with its
``ContrastiveDivergence`` + ``LangevinDynamics`` + ``torch.optim.Adam``. The two are
interleaved step by step (A B A B), so every step also gives a timing pair.

Then each model is measured the same way, as ``fnebm train --loss cd --noise-scale 0.1``
measures its own (``fnebm.cli.train.evaluate``, the TorchEBM model's weights copied into the
same parameter dict):

- ``kl``: KL(data || exp(-E)) on a 100 x 100 grid over the data's box (nats), with
  ``kl_floor`` the same between two data sets (what a perfect model would score);
- ``kl_tempered``: the same KL for exp(-E / 0.1^2), the density that Langevin with noise
  scale 0.1 samples (the training sampler targets it, so CD-k fits it, not exp(-E));
- ``mmd2``: unbiased squared MMD (Gaussian kernels 0.1, 0.3, 1) between 2,000 model samples
  (500 steps of fnebm's Langevin, step 0.01, noise 0.1, from N(0, 4 I)) and 2,000 data points;
  ``mmd2_own_sampler``: the same with TorchEBM's model sampled by TorchEBM's LangevinDynamics
  (same starting points, its own noise);
- ``mode_weights``: the fraction of model samples nearest to each of the eight centres, and
  ``off_mode``: the fraction farther than 3 standard deviations (1.06) from every centre.

Results are printed and stored under ``"quality"`` in the JSON file (other keys kept).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run as w4  # noqa: E402  (bench/run.py: W4's model, data, steps)

from fnebm import datasets, energies  # noqa: E402
from fnebm import random as fr  # noqa: E402
from fnebm.cli.train_model import mlp_energy  # noqa: E402
from fnebm.cli.train_options import TRAIN_DEFAULTS, TrainConfig  # noqa: E402
from fnebm.cli.train_report import evaluate, mmd2  # noqa: E402

CENTRES = torch.tensor([[4.0 * math.cos(i * math.pi / 4), 4.0 * math.sin(i * math.pi / 4)] for i in range(8)],
                       dtype=torch.float64) / 1.414
MODE_RADIUS = 3 * 0.5 / 1.414  # 3 standard deviations of a component


def _config(batch: int, k: int, steps: int) -> TrainConfig:
    """What ``fnebm train --loss cd --step-size 0.01 --noise-scale 0.1 --batch B --k K --steps N --lr 1e-3``
    would run with (options this script does not set take fnebm train's defaults)."""
    given = dict(dataset="eight_gaussians", loss="cd", sampler="langevin", batch=batch, lr=w4.W4_LR, k=k,
                 step_size=w4.W4_ETA, noise_scale=w4.W4_NOISE, hidden=w4.W4_HIDDEN, seed=0, dtype="float32",
                 steps=steps, sample_steps=500, device="cpu", out=None, plot=None, resume=None, progress=False,
                 compile=True)
    return TrainConfig(**{f: given[f] if f in given else TRAIN_DEFAULTS[f] for f in TrainConfig._fields})


def _kl_tempered(ev: dict, temperature: float) -> tuple[float, float]:
    """KL(data || q^(1/T)) on evaluate's grid, and (a check) the same at T = 1, which must equal ``ev["kl"]``.

    The data's density is evaluate's: a histogram of its 10,000 points on the grid smoothed by a
    Gaussian of 2 cells (fnebm.cli.train's method, rebuilt here from its outputs).
    """
    data, lo, hi = ev["data"], ev["lo"], ev["hi"]
    n = ev["log_density"].shape[0]
    cell = ((data - lo) / (hi - lo) * n).floor().long()
    inside = ((cell >= 0) & (cell < n)).all(1)
    cell = cell[inside]
    hist = torch.zeros(n * n, dtype=torch.float64)
    hist.index_add_(0, cell[:, 1] * n + cell[:, 0], torch.ones(cell.shape[0], dtype=torch.float64))
    width = 2.0
    radius = int(math.ceil(4 * width))
    w = torch.exp(-0.5 * (torch.arange(-radius, radius + 1, dtype=torch.float64) / width) ** 2)
    w = w / w.sum()
    img = hist.reshape(1, 1, n, n)
    img = torch.nn.functional.conv2d(img, w.reshape(1, 1, 1, -1), padding=(0, radius))
    img = torch.nn.functional.conv2d(img, w.reshape(1, 1, -1, 1), padding=(radius, 0))
    p = img.reshape(n, n).clamp_min(0)
    p = p / p.sum()
    mask = p > 0

    def kl(log_q):
        log_q = log_q - torch.logsumexp(log_q.reshape(-1), 0)
        return float((p[mask] * (p[mask].log() - log_q[mask])).sum())

    return kl(ev["log_density"] / temperature), kl(ev["log_density"])


def _modes(samples: torch.Tensor) -> tuple[list[float], float]:
    d = torch.cdist(samples.double(), CENTRES)
    nearest = d.argmin(1)
    weights = [float((nearest == i).double().mean()) for i in range(8)]
    return weights, float((d.min(1).values > MODE_RADIUS).double().mean())


def _torchebm_samples(model, n: int, sample_steps: int, key) -> torch.Tensor:
    """TorchEBM's LangevinDynamics on its model from evaluate's starting distribution N(0, 4 I) (fnebm's draw)."""
    from torchebm.samplers import LangevinDynamics

    start = 2.0 * fr.normal(key, (n, 2))
    sampler = LangevinDynamics(model, step_size=w4.W4_ETA, noise_scale=w4.W4_NOISE)
    return sampler.sample(x=start, n_steps=sample_steps).detach()


def _train(args) -> dict:
    """Both trained side by side, step by step; returns their parameters, step times and losses."""
    params = w4.w4_params()
    step = w4.w4_fnebm_step(args.k)
    energy = energies.bind(mlp_energy, params)
    opt_state = w4.w4_adam_init(energy)
    model = w4.w4_torchebm_model(params)
    te_step = w4.w4_torchebm_trainer(model, args.k)
    torch.manual_seed(args.seed)  # TorchEBM's noise: the global generator
    k_data, k_train = fr.key(1), fr.key(2 + args.seed)  # the batches stay; the chains' noise changes with --seed
    times = {"fnebm": [], "torchebm": []}
    losses = {"fnebm": [], "torchebm": []}
    for t in range(args.steps):
        batch = datasets.eight_gaussians(fr.fold_in(k_data, t), args.batch)
        key = fr.fold_in(k_train, t)
        t0 = time.perf_counter()
        energy, opt_state, loss = step(energy, opt_state, batch, key)
        t1 = time.perf_counter()
        loss_te = te_step(batch)
        t2 = time.perf_counter()
        times["fnebm"].append(t1 - t0)
        times["torchebm"].append(t2 - t1)
        losses["fnebm"].append(float(loss))
        losses["torchebm"].append(float(loss_te))
        if (t + 1) % max(1, args.steps // 10) == 0:
            print(f"  step {t + 1}: loss fnebm {statistics.fmean(losses['fnebm'][-100:]):+.2e}, TorchEBM "
                  f"{statistics.fmean(losses['torchebm'][-100:]):+.2e}; ms/step {1e3 * times['fnebm'][-1]:.1f} / "
                  f"{1e3 * times['torchebm'][-1]:.1f}; load {os.getloadavg()[0]:.2f}", flush=True)
    return dict(fnebm={n: t.detach() for n, t in energy.params.items()}, torchebm=w4.w4_torchebm_params(model),
                times=times, losses=losses)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="W4's quality: fnebm's and TorchEBM's CD after the same training")
    parser.add_argument("--steps", type=int, default=2000, help="training steps of each (default 2000)")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--k", type=int, default=10, help="Langevin steps per training step (default 10)")
    parser.add_argument("--json", default="bench/results-w4.json", help="file to store the result under 'quality'")
    parser.add_argument("--save", default=None, metavar="PATH",
                        help="torch.save both trained parameter dicts here (to evaluate them again later)")
    parser.add_argument("--load", default=None, metavar="PATH",
                        help="skip training: evaluate the parameters a --save run wrote")
    parser.add_argument("--seed", type=int, default=0,
                        help="the samplers' noise: fnebm's key(2 + seed), TorchEBM's torch.manual_seed(seed) (the "
                             "batches, initial weights and evaluation stay the same) (default 0)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's). 1 keeps a loaded machine from stalling OpenMP "
                             "barriers, which slows both sides by 10-100x; the figures do not depend on it")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    for name in ("steps", "batch", "k"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    load_before = [round(x, 2) for x in os.getloadavg()]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {load_before}; "
          f"{args.steps} steps, batch {args.batch}, k={args.k}", flush=True)
    if args.load:
        record = torch.load(args.load, weights_only=True)
    else:
        record = _train(args)
        if args.save:
            torch.save(record, args.save)
    times, losses = record["times"], record["losses"]

    cfg = _config(args.batch, args.k, args.steps)
    initial = w4.w4_params()
    rows = {}
    for name, p in (("initial", initial), ("fnebm", record["fnebm"]), ("torchebm", record["torchebm"])):
        ev = evaluate(cfg, p)
        kl_t, kl_check = _kl_tempered(ev, w4.W4_NOISE ** 2)
        assert abs(kl_check - ev["kl"]) < 1e-9, (kl_check, ev["kl"])  # the rebuilt data density is evaluate's
        ok = torch.isfinite(ev["samples"]).all(1)
        weights, off = _modes(ev["samples"][ok])
        moved = math.sqrt(sum(float((p[n] - initial[n]).square().sum()) for n in initial) /
                          sum(float(initial[n].square().sum()) for n in initial))
        rows[name] = dict(kl=ev["kl"], kl_floor=ev["kl_floor"], kl_tempered=kl_t, mmd2=ev["mmd2"],
                          nonfinite_samples=ev["nonfinite_samples"], mode_weights=weights, off_mode=off,
                          relative_change=moved)
        if name != "initial":
            warm = times[name][1:]
            rows[name].update(final_loss=statistics.fmean(losses[name][-max(1, args.steps // 10):]),
                              first_step_s=times[name][0], step_ms_median=1e3 * statistics.median(warm),
                              train_s=sum(times[name]))
    # TorchEBM's model sampled by TorchEBM's own sampler, from the same starts as evaluate's
    k_data, _, k_samples = fr.split(fr.split(fr.key(cfg.seed), 4)[3], 3)
    own = _torchebm_samples(w4.w4_torchebm_model(record["torchebm"]), 2000, cfg.sample_steps,
                            fr.split(k_samples)[0]).double()
    data = datasets.eight_gaussians(k_data, 10_000, torch.float64)
    rows["torchebm"]["mmd2_own_sampler"] = mmd2(own[torch.isfinite(own).all(1)], data[:2000])
    pairs = [b / a for a, b in zip(times["fnebm"][1:], times["torchebm"][1:])]
    summary = dict(
        steps=args.steps, batch=args.batch, k=args.k, seed=args.seed, load_before=load_before,
        load_after=[round(x, 2) for x in os.getloadavg()], threads=torch.get_num_threads(),
        ratio_per_step_median=statistics.median(pairs),
        method=("both trained on the same batches, interleaved step by step; ratio: median over steps 2.. of "
                "(TorchEBM step time / fnebm step time); figures: fnebm.cli.train.evaluate on each model"),
        rows=rows,
    )

    print(f"\n{'':<10} {'KL':>8} {'KL T=0.01':>10} {'MMD^2':>10} {'off-mode':>9} {'min/max mode':>13} "
          f"{'moved':>7} {'final loss':>11} {'ms/step':>8}")
    for name, r in rows.items():
        print(f"{name:<10} {r['kl']:>8.4f} {r['kl_tempered']:>10.4f} {r['mmd2']:>10.2e} {r['off_mode']:>9.3f} "
              f"{min(r['mode_weights']):>6.3f}/{max(r['mode_weights']):.3f} {r['relative_change']:>7.3f} "
              f"{r.get('final_loss', math.nan):>+11.2e} {r.get('step_ms_median', math.nan):>8.1f}")
    print("moved: |params - initial| / |initial| (all weights as one vector)")
    print(f"KL floor (two data sets): {rows['fnebm']['kl_floor']:.4f}; TorchEBM's model sampled by TorchEBM's "
          f"LangevinDynamics: MMD^2 {rows['torchebm']['mmd2_own_sampler']:.2e}")
    print(f"per-step time ratio TorchEBM / fnebm (median over steps 2..{args.steps}): "
          f"{summary['ratio_per_step_median']:.2f}x; fnebm's first step (compile) "
          f"{rows['fnebm']['first_step_s']:.1f} s; "
          f"load after {summary['load_after']}")

    if args.json:
        doc = {}
        if os.path.exists(args.json):
            with open(args.json) as f:
                doc = json.load(f)
        doc["quality"] = summary
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.json)
        print(f"wrote {args.json} (key 'quality')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
