"""SDE solvers over a time grid, keyed: ``dX = b(t, X) dt + g(t, X) dW``.

A method is a step function ``step(drift, diffusion, t, x, h, noise) -> (x_new, n_evals)`` with
``noise ~ N(0, I)`` of ``x``'s shape (the Wiener increment is ``sqrt(h) noise``):

* :func:`euler_maruyama_step`: ``x + h b + g sqrt(h) xi`` — fnebm's Euler–Maruyama step
  (:func:`fnebm.integrators.diffusion.euler_maruyama`, the one Langevin and MALA take) with
  gradient ``-b`` and noise scale ``g / sqrt(2)``; strong order 1/2, weak order 1.
* :func:`heun_step`: the stochastic Heun predictor–corrector
  ``x~ = x + h b + g dW``, ``x' = x + h (b + b~) / 2 + (g + g~) dW / 2``; with additive noise
  (``g`` a function of ``t`` only, as the flow sampler's SDE) it converges to the Itô solution
  with strong order 1 (Stratonovich for state-dependent ``g``).

:func:`sdeint` runs one over a grid ``t``; step ``i`` draws its noise from
``fnebm.random.normal(fold_in(key, i), x.shape)``, so a run is a pure function of its key, the
same eager or compiled, and a run split at step ``i`` continues with ``start=i``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import random as fr
from fnebm.integrators.diffusion import euler_maruyama
from fnebm.integrators.ode import ODEInfo

__all__ = ["euler_maruyama_step", "heun_step", "sdeint"]

Drift = Callable[[Tensor, Tensor], Tensor]

_RSQRT2 = 1.0 / math.sqrt(2.0)


def euler_maruyama_step(drift: Drift, diffusion: Drift, t: Tensor, x: Tensor, h: Tensor, noise: Tensor) -> tuple[Tensor, int]:
    """``x + h b(t, x) + g(t, x) sqrt(h) noise``: one evaluation of the drift."""
    return euler_maruyama(x, -drift(t, x), h, noise, diffusion(t, x) * _RSQRT2), 1


def heun_step(drift: Drift, diffusion: Drift, t: Tensor, x: Tensor, h: Tensor, noise: Tensor) -> tuple[Tensor, int]:
    """Stochastic Heun: an Euler–Maruyama predictor, then the trapezoidal corrector with the same
    increment; two evaluations of the drift."""
    dw = h.sqrt() * noise
    b, g = drift(t, x), diffusion(t, x)
    pred = x + h * b + g * dw
    b2, g2 = drift(t + h, pred), diffusion(t + h, pred)
    return x + 0.5 * h * (b + b2) + 0.5 * (g + g2) * dw, 2


def _as_diffusion(diffusion) -> Drift:
    if callable(diffusion):
        return diffusion
    return lambda t, x: diffusion


def sdeint(
    drift: Drift,
    diffusion: Drift | float | Tensor,
    x0: Tensor,
    t: Tensor,
    key: Tensor,
    method: Callable = euler_maruyama_step,
    *,
    start: int | Tensor = 0,
    trajectory: bool = True,
    out: Tensor | None = None,
    unroll: bool | None = None,
) -> tuple[Tensor, ODEInfo]:
    """Integrate ``dX = drift(t, X) dt + diffusion(t, X) dW`` over the grid ``t``; ``(xs, info)``.

    Args:
        drift: ``drift(t, x) -> (batch, ...)``, ``t`` 0-dim.
        diffusion: ``diffusion(t, x)`` broadcasting against ``x`` (a scale per sample
            ``(batch, 1, ...)``, per coordinate, or 0-dim), or a constant number/tensor.
        x0: ``(batch, ...)`` floating tensor.
        t: ``(n + 1,)`` strictly increasing times.
        key: one ``fnebm.random`` key ``(2,)``; step ``i`` uses ``fold_in(key, start + i)``.
        method: :func:`euler_maruyama_step` or :func:`heun_step` (or your own with that signature).
        start: index of the first step in the key's stream.
        trajectory / out / unroll: as :func:`fnebm.integrators.ode.odeint` (a scan under
            compile unless ``unroll``).
    """
    _checks.check_callable("drift", drift, "drift(t, x) -> dx/dt")
    if not callable(diffusion) and not isinstance(diffusion, Tensor):
        _checks.check_real("diffusion", diffusion)
    _checks.check_callable("method", method, "step(drift, diffusion, t, x, h, noise) -> (x, n_evals)")
    if not isinstance(x0, Tensor) or not x0.is_floating_point():
        raise TypeError(f"x0 must be a floating tensor (batch, ...), got {type(x0).__name__ if not isinstance(x0, Tensor) else x0.dtype}")
    if not isinstance(t, Tensor) or t.ndim != 1 or t.shape[0] < 2:
        raise ValueError(f"t must be a 1-D tensor of at least 2 times, got {t if not isinstance(t, Tensor) else tuple(t.shape)}")
    _checks.check_key(key)
    if key.ndim != 1:
        raise ValueError(f"key must be one key of shape (2,), got shape {tuple(key.shape)}")
    t = t.to(dtype=x0.dtype, device=x0.device)
    if _checks.is_concrete(t) and not bool((t[1:] > t[:-1]).all()):
        raise ValueError("t must be strictly increasing")
    n_steps = t.shape[0] - 1
    shape = ((n_steps + 1,) if trajectory else ()) + tuple(x0.shape)
    if out is not None and (not isinstance(out, Tensor) or tuple(out.shape) != shape or out.dtype != x0.dtype):
        raise ValueError(f"out must be a tensor of shape {shape} and dtype {x0.dtype}")
    g = _as_diffusion(diffusion)
    steps = torch.arange(n_steps, device=x0.device)
    steps = steps + (start.to(device=x0.device, dtype=torch.int64) if isinstance(start, Tensor) else _checks.check_int("start", start, 0))

    def one(x, i, t0, t1):
        noise = fr.normal(fr.fold_in(key, i), tuple(x.shape), dtype=x.dtype)
        return method(drift, g, t0, x, t1 - t0, noise)

    evals = 0
    if not torch.compiler.is_compiling() or unroll:
        x = x0
        if trajectory:
            buf = torch.empty(shape, dtype=x0.dtype, device=x0.device) if out is None else out
            buf[0] = x0
        for i in range(n_steps):
            x, n = one(x, steps[i], t[i], t[i + 1])
            evals += n
            if trajectory:
                buf[i + 1] = x
        result = buf if trajectory else (out.copy_(x) if out is not None else x)
    else:
        from torch._higher_order_ops.scan import scan

        evals = n_steps * one(x0, steps[0], t[0], t[1])[1]  # traced once for the count; unused, dropped

        def body(x, xs):
            i, t0, t1 = xs
            new = one(x, i, t0, t1)[0]
            return new.clone(), new.clone()

        last, xs = scan(body, x0, (steps, t[:-1], t[1:]))
        if trajectory:
            full = torch.cat((x0.unsqueeze(0), xs), dim=0)
            result = out.copy_(full) if out is not None else full
        else:
            result = out.copy_(last) if out is not None else last
    n = torch.tensor(n_steps, dtype=torch.int64, device=x0.device)
    return result, ODEInfo(torch.tensor(evals, dtype=torch.int64, device=x0.device), n, torch.zeros_like(n),
                           torch.ones((), dtype=torch.bool, device=x0.device))
