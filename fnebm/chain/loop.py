"""``run``: K steps of a batched step as one functional loop, usable inside your own compiled code.

The loop lives in :mod:`fnebm._loop`, below :mod:`fnebm.adaptation` (whose warm-ups reach it
without importing this package); this module re-exports it under its public name.
"""

from fnebm._loop import (  # noqa: F401  (re-exported, private helpers included for callers here)
    _copy,
    _step_tensors,
    _steps,
    _tracks_grad,
    body,
    loop,
    needs_grad,
    position,
    position_and_energy,
    run,
    structure,
)

__all__ = ["run", "position", "position_and_energy"]
