"""The run's schedule as pure integer code: chunks, and which steps of a chunk are kept.

A run is ``burn_in + n_steps`` steps numbered from 0; draw ``j`` (``0 <= j < n_kept``,
``n_kept = n_steps // thin``) is the state after step ``burn_in + (j + 1) * thin - 1``.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["chunks", "Kept", "kept_in"]


def chunks(total: int, size: int) -> list[tuple[int, int]]:
    """``[a, b)`` ranges covering ``range(total)``, none of length 1 unless ``total == 1``.

    Dynamo specialises a length-1 scan into a graph of its own; a run never needs one, so a
    lone last step joins the chunk before it (and ``size`` 1 means 2).
    """
    size = max(size, 2)
    bounds = list(range(0, total, size)) + [total]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(zip(bounds[:-1], bounds[1:]))


class Kept(NamedTuple):
    """Steps ``lo, lo + thin, ... < hi`` of the chunk (offsets from its start) are draws ``j0 .. j1 - 1``."""

    lo: int
    hi: int
    j0: int
    j1: int


def kept_in(a: int, b: int, burn_in: int, thin: int, n_kept: int) -> Kept | None:
    """The kept steps in the chunk ``[a, b)``, or ``None`` if it keeps none."""
    first = burn_in + thin - 1  # the step whose resulting state is draw 0
    lo = first + max(0, -(-(a - first) // thin)) * thin
    hi = min(b, burn_in + n_kept * thin)
    if lo >= hi:
        return None
    j0, j1 = (lo - first) // thin, (hi - 1 - first) // thin + 1
    return Kept(lo - a, hi - a, j0, j1)
