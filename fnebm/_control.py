"""Data-dependent loops that trace: ``while_loop`` for kernels whose trip count is data (NUTS trees,
trajectory lengths drawn per iteration).

Under ``torch.compile`` this is ``torch._higher_order_ops.while_loop`` (one traced body, any trip
count, nestable inside the ``scan`` of :func:`fnebm.chain.run`); in eager mode a Python loop.
Under ``torch.func.vmap`` (eager) each lane
runs until its own condition fails. The condition reads one boolean per iteration, so on a GPU each iteration syncs with the host
once, in eager and compiled code alike: keep the body large (a whole batch of chains).

Rules the compiled form imposes (torch 2.13), checked by ``tests/test_control.py``:

* ``carry`` is a flat tuple of tensors, and ``body`` returns one of the same shapes and dtypes
  (strides and aliasing are taken care of here);
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

        def same_layout(*old):  # the carry keeps its strides, and never aliases an input
            return tuple(torch.empty_like(o).copy_(n) for o, n in zip(old, body(*old)))

        # a copy, not .contiguous(): two carry entries that are views of one buffer (an eager
        # NUTS step's state) make the while_loop's aliasing check fail after the whole trace
        return tuple(hop(cond, same_layout, tuple(c.clone(memory_format=torch.contiguous_format) for c in carry)))
    while True:
        go = cond(*carry)
        if not _is_wrapped(go):
            if not bool(go):
                return carry
            carry = tuple(body(*carry))
            continue
        # under torch.func.vmap each lane has its own condition: step until every lane is done,
        # a finished lane keeping its carry
        if not bool(_unwrapped(go).any()):
            return carry
        carry = tuple(torch.where(go, new, old) for new, old in zip(body(*carry), carry))


def _is_wrapped(t: Tensor) -> bool:
    return torch._C._functorch.is_batchedtensor(t)


def _unwrapped(t: Tensor) -> Tensor:
    while torch._C._functorch.is_batchedtensor(t) or torch._C._functorch.is_gradtrackingtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t
