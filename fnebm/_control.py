"""Data-dependent loops that trace: ``while_loop`` for kernels whose trip count is data (NUTS trees,
trajectory lengths drawn per iteration).

Under ``torch.compile`` this is ``torch._higher_order_ops.while_loop`` (one traced body, any trip
count, nestable inside the ``scan`` of :func:`fnebm.chain.run`); in eager mode a Python loop.
The condition reads one boolean per iteration, so on a GPU each iteration syncs with the host
once, in eager and compiled code alike: keep the body large (a whole batch of chains).

Rules the compiled form imposes (torch 2.13), checked by ``tests/test_control.py``:

* ``carry`` is a flat tuple of tensors, and ``body`` returns one of the same shapes, dtypes and
  strides; an output must not alias an input (return ``t.clone()`` for a field passed through);
* a tensor used by both ``cond`` and ``body`` travels in ``carry``, not in a closure (a tensor
  captured by both breaks Dynamo's graph codegen: "duplicate argument");
* no gradient flows through the loop (torch 2.13 has no backward for ``while_loop``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["while_loop"]


def while_loop(
    cond: Callable[..., Tensor], body: Callable[..., tuple[Tensor, ...]], carry: tuple[Tensor, ...]
) -> tuple[Tensor, ...]:
    """``while cond(*carry): carry = body(*carry)``; ``cond`` returns a 0-dim boolean tensor."""
    carry = tuple(carry)
    if torch.compiler.is_compiling():
        from torch._higher_order_ops.while_loop import while_loop as hop

        return tuple(hop(cond, body, carry))
    while bool(cond(*carry)):
        carry = tuple(body(*carry))
    return carry
