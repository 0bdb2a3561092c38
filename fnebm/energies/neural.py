"""Neural energies: a module as a pure ``energy_fn(params, x)``, and ``bind`` to fix ``params``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fnebm import _checks
from fnebm.energies.base import _check_dim_arg, _check_dtype

__all__ = ["from_module", "BoundEnergy", "bind"]


def from_module(module: nn.Module) -> tuple[Callable[[dict[str, Tensor], Tensor], Tensor], dict[str, Tensor]]:
    """A batch-style module as a pure ``energy_fn(params, x)`` and its ``params``.

    ``module`` maps ``(B, *event) -> (B,)`` or ``(B, 1)``; ``energy_fn(params, x)`` takes one
    sample ``x: event`` and returns a 0-dim energy. ``params`` holds the module's parameters
    and buffers, detached, so ``torch.func.grad(energy_fn)(params, x)`` differentiates them.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    params = {k: v.detach() for k, v in (*module.named_parameters(), *module.named_buffers())}

    def energy_fn(params: dict[str, Tensor], x: Tensor) -> Tensor:
        out = torch.func.functional_call(module, params, (x[None],))
        if out.numel() != 1:  # shapes are static: no sync, no graph break
            raise ValueError(
                f"module must return one energy per sample, shape (B,) or (B, 1); got {tuple(out.shape)} for B=1"
            )
        return out.reshape(())

    return energy_fn, params


@dataclass(frozen=True, eq=False)
class BoundEnergy:
    """``energy_fn`` with ``params`` fixed: ``e(x) = energy_fn(params, x)``, ``x: (dim,)`` -> 0-dim.

    A pytree: its leaves are those of ``params``; ``energy_fn`` is the context.
    ``dtype``/``device`` are those of the first floating tensor in ``params`` (``None`` if none).
    """

    energy_fn: Callable[[Any, Tensor], Tensor]
    params: Any

    def __call__(self, x: Tensor) -> Tensor:
        return self.energy_fn(self.params, x)

    def _first_float(self) -> Tensor | None:
        return next(
            (t for t in pytree.tree_leaves(self.params) if isinstance(t, Tensor) and t.is_floating_point()), None
        )

    @property
    def dtype(self) -> torch.dtype | None:
        t = self._first_float()
        return None if t is None else t.dtype

    @property
    def device(self) -> torch.device | None:
        t = self._first_float()
        return None if t is None else t.device

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> BoundEnergy:
        """A copy with floating tensors in ``params`` on ``device`` / in ``dtype``."""
        dtype = _check_dtype(dtype)

        def convert(v: Any) -> Any:
            if isinstance(v, Tensor):
                return v.to(device=device, dtype=dtype if v.is_floating_point() else None)
            return v

        return BoundEnergy(self.energy_fn, pytree.tree_map(convert, self.params))

    @property
    def dim(self) -> None:
        return None

    def check_dim(self, d: int) -> None:
        _check_dim_arg(d)


pytree.register_pytree_node(
    BoundEnergy,
    lambda e: ([e.params], e.energy_fn),
    lambda children, energy_fn: BoundEnergy(energy_fn, children[0]),
    flatten_with_keys_fn=lambda e: ([(pytree.GetAttrKey("params"), e.params)], e.energy_fn),
)


def bind(energy_fn: Callable[[Any, Tensor], Tensor], params: Any) -> BoundEnergy:
    """Fix ``params`` of ``energy_fn(params, x)``, giving a one-argument energy ``x -> E``."""
    _checks.check_callable("energy_fn", energy_fn, "(params, x) -> E")
    return BoundEnergy(energy_fn, params)
