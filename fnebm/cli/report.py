"""What ``fnebm sample`` tells its user: the notices on stderr (a compile, a C kernel's first build,
the progress bar), what the run's ``sample_chain`` calls report (:class:`_Calls`), and the printed
summary (:func:`format_summary`) of :mod:`fnebm.cli.stats`' figures."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch

from fnebm import distributed as fdist
from fnebm.cli import plan as dispatch
from fnebm.cli._common import _fmt, compile_cache_dir, compile_times, format_rows
from fnebm.cli.options import Config, _local_chains
from fnebm.cli.presets import ENERGIES
from fnebm.cli.stats import MIXING_MIN_CHAINS, RHAT_OK

# ---------------------------------------------------------------------------- notices


def _tty() -> bool:
    return sys.stderr.isatty() and fdist.rank() == 0  # under torchrun, rank 0 speaks for every rank


def _graph_name(cfg: Config) -> str:
    return (f"{cfg.sampler} {cfg.energy} dim={cfg.dim} chains={_local_chains(cfg)} {cfg.dtype} "
            f"{torch.device(cfg.device).type}")


def compile_notice(cfg: Config, warmup: bool = False) -> str:
    """The line shown before a compile: what, about how long on this machine, and that it is cached.
    ``warmup``: the window adaptation's graph (all chains, on every rank), not the sampler's."""
    chains = (f"{cfg.chains} chains" if warmup or cfg.world_size == 1
              else f"{_local_chains(cfg)} chains on rank {cfg.rank} of {cfg.world_size}")
    what = (f"compiling {'the window adaptation of ' if warmup else ''}{cfg.sampler} on {cfg.energy} "
            f"(dim {cfg.dim}, {chains}, {cfg.dtype}, {torch.device(cfg.device).type}) with torch.compile")
    times = compile_times()
    kind = torch.device(cfg.device).type
    mine = None if warmup else times.get(_graph_name(cfg))  # warm-up compiles are not timed apart
    others = sorted(v["first"] for k, v in times.items() if k.endswith(f" {kind}"))
    where = compile_cache_dir() or "Inductor's cache directory"
    if mine is not None:
        return (f"{what}: about {mine['last']:.0f} s (it took {mine['last']:.0f} s here last time; "
                f"the code is served from the on-disk cache in {where})")
    if others:
        typical = others[len(others) // 2]  # the median first compile measured here
        return (f"{what}: about {typical:.0f} s the first time on this machine (the median of {len(others)} first "
                f"compiles measured here); then cached on disk in {where}, so a later run compiles faster")
    guess = "30-45 s on a 2-core CPU, less on more cores" if kind == "cpu" else "tens of seconds"
    return (f"{what}: the first time typically {guess}; then cached on disk in {where}, "
            "so a later run compiles faster")


def _warmup_notice(cfg: Config) -> Any:
    """``on_plan`` of the warm-up: the compile notice before its graph compiles, as for sampling."""
    def on_plan(plan: Any) -> None:
        if plan.compiles and _tty():
            print(f"fnebm: {compile_notice(cfg, warmup=True)}", file=sys.stderr, flush=True)
    return on_plan


def _kernel_build_notice(cfg: Config, target: Any) -> None:
    """On a terminal, one line before the C kernel is compiled for this run (its first use on this
    machine), as before a torch.compile."""
    if not _tty() or cfg.rank != 0:
        return
    which = dispatch.kernel_to_build(cfg, target)
    if which == "nuts":
        print("fnebm: building the NUTS C kernel with the system C compiler: a few seconds, once on this machine "
              "(cached on disk)", file=sys.stderr, flush=True)
    elif which == "chain":
        print("fnebm: building the whole-chain C kernel with the system C compiler: a few seconds, once on this "
              "machine (cached on disk)", file=sys.stderr, flush=True)


class _Calls:
    """What the ``sample_chain`` calls of one run report: their plans and their chunks' seconds.
    It prints the compile notice before a compile and drives the progress bar, which starts once
    the compile is done."""

    def __init__(self, cfg: Config, total: int):
        self.cfg, self.total = cfg, total
        self.plans: list[Any] = []
        self.chunks: list[tuple[int, int, float]] = []  # (call, steps, seconds)
        self.planned_at: list[float] = []  # when each call had planned (a compile's imports come next)
        self.first_done: dict[int, float] = {}  # when each call's first chunk ended
        self.done = 0
        self.bar = None
        self.announced = False
        self._seen = 0

    def on_plan(self, plan: Any) -> None:
        if getattr(plan, "revised", False) and self.plans:  # the same call: its compile failed, it runs eagerly
            self.plans[-1] = plan
            self._start_bar()
            return
        self.plans.append(plan)
        self.planned_at.append(time.perf_counter())
        self._seen = 0
        if plan.compiles and not self.announced:
            self.announced = True
            if self.bar is not None:  # the burn-in ramp ran eagerly: the bar starts again after the compile
                self.bar.leave = False
                self.bar.close()
                self.bar = None
            if _tty():
                self._say(f"fnebm: {compile_notice(self.cfg)}")
        elif not plan.compiles:
            self._start_bar()

    def on_chunk(self, done: int, total: int, seconds: float) -> None:
        steps, self._seen = done - self._seen, done
        self.chunks.append((len(self.plans) - 1, steps, seconds))
        self.first_done.setdefault(len(self.plans) - 1, time.perf_counter())
        self._start_bar()
        self.done += steps
        if self.bar is not None:
            self.bar.update(steps)

    def _start_bar(self) -> None:
        if self.bar is None and self.cfg.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=self.done, unit="step", desc="sampling", file=sys.stderr)

    def _say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _compiles(self) -> tuple[dict[int, tuple[int, float]], float]:
        """Each compiling call's first chunk ``{call: (steps, seconds)}``, and the seconds per step
        of the other compiled chunks."""
        compiling = {i for i, p in enumerate(self.plans) if p is not None and p.compiles}
        firsts, steps, seconds = {}, 0, 0.0
        for call, n, s in self.chunks:
            if call in compiling and call not in firsts:
                firsts[call] = (n, s)
            elif self.plans[call] is not None and self.plans[call].compiled:
                steps, seconds = steps + n, seconds + s
        return firsts, seconds / steps if steps else 0.0

    def compile_s(self) -> float | None:
        """Seconds the compiles took: from a compiling call's plan to the end of its first chunk
        (the compiler's imports, tracing, code generation and that chunk), less what the chunk's
        steps cost at the rate of the other compiled chunks (``None`` when nothing was compiled)."""
        firsts, rate = self._compiles()
        if not firsts:
            return None
        return sum(max(0.0, self.first_done[c] - self.planned_at[c] - n * rate) for c, (n, _) in firsts.items())

    def stepping_s(self) -> float:
        """Seconds the steps took: the synchronised chunk times, less the compiling in them."""
        firsts, rate = self._compiles()
        compiling = sum(max(0.0, s - n * rate) for n, s in firsts.values())
        return max(0.0, sum(s for _, _, s in self.chunks) - compiling)

    def path(self, main: int) -> tuple[bool | None, str]:
        """``(compiled, why)`` for the main call, and a word on the burn-in ramp's calls if they differ."""
        return dispatch.path(self.plans, main, self.cfg.compile)


# ---------------------------------------------------------------------------- summary


def _setup_words(s: dict[str, Any]) -> str:
    built = s.get("kernel_build_s")
    if built:
        return (f" (+{s['setup_s']:.2f} s setting up, {built:.2f} s of it building the C kernel: once on this "
                "machine, cached on disk)")
    return f" (+{s['setup_s']:.2f} s setting up: checks, the first eager step, tracing)"


def _chain_list(idx: list[int], n: int) -> str:
    shown = ", ".join(str(i) for i in idx[:5])
    return f"{shown}, ..." if n > 5 else shown


def format_summary(s: dict[str, Any]) -> list[str]:
    """The summary as aligned lines."""
    if s["acceptance"] is not None:
        acceptance = f"{s['acceptance']:.3f} (mean {s['sampler'].upper()} acceptance statistic)"
    else:
        acceptance = f"{1 - s['divergent_fraction']:.3f} (unadjusted: 1 - divergent fraction)"
    smaller = f"try a smaller --step-size (e.g. {s['step_size'] / 4:.3g})"
    if s.get("compiled") is None and s["compile_s"] is None:
        path = s.get("path") or "eager"
    else:
        path = f"{'compiled' if s.get('compiled') else 'eager'} ({s.get('path')})"
    rows = [
        ("sampler", f"{s['sampler']}, step size {s['step_size']:g}" + (" (before adaptation)" if s.get("adapted") else "")),
        ("energy", f"{s['energy']}, dim {s['dim']}, {s['dtype']} on {s['device']}"),
        ("run", f"{s['chains']} chains x {s['steps']} steps (burn-in {s['burn_in']}, thin {s['thin']})"
                f" -> {s['draws']} draws"),
        *([("processes", f"{s['processes']['world_size']} ({s['processes']['backend']}): "
                         f"{' + '.join(map(str, s['processes']['chain_counts']))} chains; the diagnostics "
                         "are computed across them")] if s.get("processes") else []),
        *([("adaptation", f"{s['adapt']} warm-up steps: step size {s['adapted']['step_size']:.3g}, diagonal "
                          f"inverse mass matrix in [{s['adapted']['inverse_mass_matrix_range'][0]:.3g}, "
                          f"{s['adapted']['inverse_mass_matrix_range'][1]:.3g}] ({s['adapt_s']:.2f} s"
                          + (f", {s['adapted']['kernel_build_s']:.2f} s of it building the C kernel: once on this "
                             "machine" if s['adapted'].get('kernel_build_s') else "") + ")")]
          if s.get("adapted") else []),
        ("acceptance", acceptance),
        *([("trajectory", f"mean tree depth {s['mean_tree_depth']:.2f}, mean {s['mean_integration_steps']:.1f} "
                          "leapfrog steps per draw")] if s.get("mean_tree_depth") is not None else
          [("trajectory", f"{s['mean_integration_steps']:.0f} leapfrog steps per draw")]
          if s.get("mean_integration_steps") is not None else []),
        ("divergences", f"{s['n_divergent']} ({100 * s['divergent_fraction']:.2f}% of kept steps)"),
    ]
    if s.get("n_runaway"):
        stuck = f", {s['n_runaway_stuck']} of them stuck there" if s.get("n_runaway_stuck") else ""
        rows.append(("runaway", f"{s['n_runaway']} of {s['chains']} chains (chain {_chain_list(s['runaway_chains'], s['n_runaway'])}) "
                                f"left the bulk: |x| up to {s['runaway_max_abs']:.3g}{stuck}; {smaller}"))
    if s.get("n_frozen"):
        rows.append(("frozen", f"{s['n_frozen']} of {s['chains']} chains (chain {_chain_list(s['frozen_chains'], s['n_frozen'])}) "
                               f"did not move over the {s['draws']} kept draws (every proposal rejected); {smaller}"))
    rhat = _fmt(s["rhat_max"], ".4f") + (" (needs >= 2 chains)" if s["chains"] == 1 else "")
    if s.get("rhat_max_unflagged") is not None:
        rhat += f" ({s['rhat_max_unflagged']:.4f} without the runaway and frozen chains)"
    rows += [
        ("ESS bulk", "n/a (needs >= 4 kept draws)" if s["ess_bulk_min"] is None
         else f"min {s['ess_bulk_min']:.0f}, median {s['ess_bulk_median']:.0f} (over dims)"),
        ("ESS/s", _fmt(s["ess_per_s"], ".1f") + ("" if s["ess_per_s"] is None else " (min bulk ESS per sampling s)")),
        ("R-hat max", rhat),
        ("path", path),
        ("compile", "none" if s["compile_s"] is None else f"{s['compile_s']:.2f} s (torch.compile; cached on disk "
                                                          "for the next run)"),
        ("sampling", f"{s['sampling_s']:.2f} s" + (_setup_words(s) if s.get("setup_s") else "")),
    ]
    lines = format_rows(rows)
    truth = s.get("truth")
    if truth is not None:
        lines.append(f"{'truth':<12} {truth['about']}: estimate ± MCSE from the kept draws")
        shown = truth["rows"]
        if len(shown) > 7:  # the largest deviations
            shown = sorted(shown, key=lambda r: -abs(r["z"]) if math.isfinite(r["z"]) else -math.inf)[:5]
        for r in shown:
            where = f"  {r['where']}" if r.get("where") else ""
            lines.append(f"  {r['name']:<10} {r['estimate']:+.4f} ± {r['mcse']:.4f}   truth {r['truth']:+.4f}"
                         f"   z {r['z']:+.2f}{where}")
        if len(shown) < len(truth["rows"]):
            lines.append(f"  ({len(shown)} of {len(truth['rows'])} estimates shown: the largest |z|)")
        level = f"an exact sampler exceeds {truth['z_crit']:.2f} 1% of the time"
        if s["rhat_max"] is not None and s["rhat_max"] > RHAT_OK:
            lines.append(f"{'check':<12} no verdict: R-hat > {RHAT_OK}, and an MCSE assumes chains that have "
                         f"converged (largest |z| {truth['z_max']:.3g})")
        elif truth["agrees"]:
            lines.append(f"{'check':<12} agrees with the truth: largest |z| {truth['z_max']:.2f} of "
                         f"{len(truth['rows'])} estimates ({level})")
        else:
            why = []
            if s["sampler"] == "langevin":
                why.append("unadjusted Langevin is biased by O(step size): use --sampler mala or a smaller --step-size")
            if s["rhat_max"] is not None and s["rhat_max"] > RHAT_OK:
                why.append("the chains have not converged (see the note)")
            if s.get("n_runaway") or s.get("n_frozen"):
                why.append("some chains ran away or froze")
            lines.append(f"{'check':<12} DISAGREES with the truth: |z| {truth['z_max']:.3g} for {truth['worst']} "
                         f"({level})" + (f"; {'; '.join(why)}" if why else ""))
    note = _note(s)
    if note:
        lines.append(f"{'note':<12} {note}")
    return lines


def _note(s: dict[str, Any]) -> str | None:
    if s["rhat_max"] is None or not s["rhat_max"] > RHAT_OK:
        return None
    m = s.get("mixing") or {}
    spec = ENERGIES.get(s["energy"])
    head = f"R-hat {s['rhat_max']:.3g} > {RHAT_OK}: the chains disagree."
    if m.get("verdict") == "separate modes":
        known = f" ({s['energy']} is multimodal, see docs/cli.md)" if spec is not None and spec.multimodal else ""
        return (f"{head} They sit in separate modes{known}: the chain means of x{m['coordinate']} fall into "
                f"groups {m['gap']:.0f} within-chain standard deviations apart, and no chain crosses between "
                "them. More steps will not fix this soon: the pooled draws weigh each mode by how many chains "
                "started near it, not by its mass.")
    known = f" {s['energy']}: {spec.mixing} (docs/cli.md)." if spec is not None and spec.mixing else ""
    if m.get("verdict") == "too short":
        return (f"{head} No separate modes show (the chain means of x{m['coordinate']} spread without a gap): "
                f"the run is too short. Try --steps {m['steps_needed']} (about 200 autocorrelation times, "
                "from the bulk ESS)." + known)
    return (f"{head} Too short, or chains in separate modes: with fewer than {MIXING_MIN_CHAINS} chains the "
            "two cannot be told apart." + known)
