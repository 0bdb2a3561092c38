"""Running chains: :func:`sample_chain` (orchestration, progress, trace buffers) and :func:`run`
(a functional loop to use inside your own compiled code).

* :mod:`fnebm.chain.schedule` — chunks and kept steps, as pure integer code;
* :mod:`fnebm.chain.loop` — :func:`run`, the scan (or unrolled loop) over steps (from :mod:`fnebm._loop`);
* :mod:`fnebm.chain.runner` — the compiled runner and its explicit :class:`RunnerCache`;
* :mod:`fnebm.chain.sample` — :func:`sample_chain` and :class:`ChainState`;
* :mod:`fnebm.chain.warmup` — ``sample_chain`` installed as the runner of :mod:`fnebm.adaptation`'s warm-ups.

Randomness: step ``t`` of chain ``c`` uses ``fold_in(keys[c], t)``, where ``keys`` are the
per-chain keys (``split(key, n_chains)`` from one key) and ``t`` counts every step the chain
has taken, burn-in included — so the same key gives the same trajectory compiled or eager,
chunked or not, in one call or continued across calls.
"""

from fnebm.chain.loop import position_and_energy, run
from fnebm.chain.runner import CompileFallbackWarning, RunnerCache, RunPlan, default_cache
from fnebm.chain.sample import ChainState, init, sample_chain
from fnebm.chain import warmup as _warmup  # noqa: F401  (installs sample_chain as the warm-ups' runner)

__all__ = ["sample_chain", "run", "position_and_energy", "init", "ChainState", "RunnerCache", "RunPlan", "default_cache",
           "CompileFallbackWarning"]
