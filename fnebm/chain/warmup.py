"""``sample_chain`` as the runner of :mod:`fnebm.adaptation`'s warm-ups.

Adaptation sits below this package and never imports it: a warm-up runs through the runner of
:mod:`fnebm._loop` (``fnebm._loop.default_runner()``). Importing :mod:`fnebm.chain` installs
:func:`ensemble_runner`, so a warm-up gets what ``sample_chain`` gives a chain: the compiled
runner and its cache, ``compile="auto"``, ``on_plan``, progress, and the eager fallback (with
one :class:`~fnebm.chain.runner.CompileFallbackWarning`) when a compile fails.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor

from fnebm import _loop
from fnebm.chain.sample import sample_chain

__all__ = ["ensemble_runner"]


def ensemble_runner(step: Callable[[Any, Tensor], tuple[Any, Any]], state: Any, key: Tensor, n_steps: int, *,
                    collect: Callable[[Any], Any] | None = None, **options: Any) -> tuple[Any, Any, Any]:
    """``sample_chain`` over the whole ensemble as one chain (``chain_ndim=0``: ``state`` has no
    chain axes, ``key`` is one key ``(2,)``); returns ``(state, trace, info)``. ``options`` are
    ``sample_chain``'s (``compile``, ``cache``, ``progress``, ``on_plan``, ...)."""
    chain, trace, info = sample_chain(step, state, key, n_steps, chain_ndim=0, collect=collect, **options)
    return chain.state, trace, info


_loop.install_runner(ensemble_runner)
