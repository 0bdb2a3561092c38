"""The flow sampler: draws from a learned velocity, score or noise prediction, and the exact
log-likelihood of a flow model.

Time runs from noise to data (:mod:`fnebm.interpolants`): ``x0 ~ N(0, I)`` at ``t = 0`` and data
at ``t = 1``. ``model(x, t)`` takes ``x: (batch, ...)`` and ``t: (batch,)`` and predicts

* ``"velocity"``: the probability-flow velocity ``v(x, t)`` (flow matching);
* ``"score"``: ``grad log p_t(x)``, turned into ``v`` by :func:`fnebm.interpolants.velocity_from_score`;
* ``"noise"``: ``E[x0 | x_t = x]``, turned into ``v`` by :func:`fnebm.interpolants.velocity_from_noise`.

:func:`flow_sample` integrates ``dx/dt = v(x, t)`` with :func:`fnebm.integrators.ode.odeint`
(adaptive DOPRI5 by default, or any tableau on a fixed grid), or the SDE with the same
marginals ``dx = [v + w(t) score] dt + sqrt(2 w(t)) dW`` with
:func:`fnebm.integrators.sde.sdeint` (``sde=True``). The diffusion level ``w(t)`` is yours:
the default ``w(t) = sigma(t)`` (TorchEBM's ``"sigma"`` form) injects noise where the path is
noisy and vanishes at the data end; any ``w(t) >= 0`` keeps the marginals ``p_t``.

:func:`log_likelihood` integrates ``(x, l)`` backward from the data at ``t = 1`` to ``t = 0``
with ``dl/dt = div v`` (the instantaneous change of variables), so that
``log p_1(x1) = log N(x(0); 0, I) + l(0)``; the divergence exactly (one forward-mode product
per dimension, batched by ``vmap``) or by Hutchinson's estimator with keyed Rademacher or
Gaussian probes, unbiased for any dimension. :func:`sample_and_log_prob` integrates the same
pair forward from the base draw: draws and their log-density in one solve (what an
independence Metropolis–Hastings step needs of a flow proposal).

Everything is a pure function of its arguments and key; ``model`` is any callable (for an
``nn.Module``: ``lambda x, t: net(x, t)``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import interpolants as itp
from fnebm import random as fr
from fnebm.integrators import ode, sde as sde_mod

__all__ = ["flow_sample", "log_likelihood", "sample_and_log_prob", "velocity_field", "score_field", "sigma_diffusion",
           "PREDICTIONS"]

PREDICTIONS = ("velocity", "score", "noise")
_EPS = 1e-3  # where a path starts or ends when alpha(0) = 0 or sigma(1) = 0 makes a conversion singular


def _check_prediction(prediction: str) -> None:
    if prediction not in PREDICTIONS:
        raise ValueError(f"prediction must be one of {PREDICTIONS}, got {prediction!r}")


def _times(t: Tensor, x: Tensor) -> Tensor:
    return t.expand(x.shape[0]) if t.ndim == 0 else t


def velocity_field(model: Callable, interpolant: itp.Interpolant, prediction: str = "velocity") -> Callable[[Tensor, Tensor], Tensor]:
    """``f(t, x) -> v(x, t)`` (the ODE solvers' convention) from a model's prediction; ``t`` 0-dim or ``(batch,)``."""
    _check_prediction(prediction)

    def f(t: Tensor, x: Tensor) -> Tensor:
        tb = _times(t, x)
        out = model(x, tb)
        if prediction == "velocity":
            return out
        if prediction == "score":
            return itp.velocity_from_score(interpolant, out, x, tb)
        return itp.velocity_from_noise(interpolant, out, x, tb)

    return f


def score_field(model: Callable, interpolant: itp.Interpolant, prediction: str = "velocity") -> Callable[[Tensor, Tensor], Tensor]:
    """``(t, x) -> (v, score)`` from one model call: what the SDE's drift needs."""
    _check_prediction(prediction)

    def f(t: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        tb = _times(t, x)
        out = model(x, tb)
        if prediction == "velocity":
            return out, itp.score_from_velocity(interpolant, out, x, tb)
        if prediction == "score":
            return itp.velocity_from_score(interpolant, out, x, tb), out
        sigma = interpolant.coefficients(itp.expand_time(tb, x))[2]
        return itp.velocity_from_noise(interpolant, out, x, tb), -out / sigma

    return f


def sigma_diffusion(interpolant: itp.Interpolant, scale: float | Tensor = 1.0) -> Callable[[Tensor], Tensor]:
    """``w(t) = scale * sigma(t)``: the default diffusion level of the flow SDE."""
    return lambda t: scale * interpolant.coefficients(t)[2]


def _grid(t0: float, t1: float, steps: int, like: Tensor) -> Tensor:
    return torch.linspace(t0, t1, steps + 1, dtype=like.dtype, device=like.device)


def flow_sample(
    model: Callable[[Tensor, Tensor], Tensor],
    key: Tensor,
    shape: int | tuple[int, ...],
    *,
    method: ode.Tableau | Callable | None = None,
    steps: int | None = None,
    rtol: float | Tensor = 1e-5,
    atol: float | Tensor = 1e-5,
    sde: bool = False,
    diffusion: Callable[[Tensor], Tensor] | float | None = None,
    interpolant: itp.Interpolant | None = None,
    prediction: str = "velocity",
    t0: float | None = None,
    t1: float | None = None,
    trajectory: bool = False,
    out: Tensor | None = None,
    x0: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    per_sample: bool = False,
    compile: bool | str = False,
) -> tuple[Tensor, ode.ODEInfo]:
    """Draw ``shape[0]`` samples by integrating from ``N(0, I)`` at ``t0`` to ``t1``; ``(x, info)``.

    Args:
        model: ``model(x, t) -> prediction``, ``x: (batch, ...)``, ``t: (batch,)``.
        key: an ``fnebm.random`` key ``(2,)``: the base draw, and the SDE's noise.
        shape: ``(batch, ...)`` of the samples.
        method: ODE: a :class:`~fnebm.integrators.ode.Tableau` (default :data:`~fnebm.integrators.ode.dopri5`);
            SDE: a step of :mod:`fnebm.integrators.sde` (default :func:`~fnebm.integrators.sde.euler_maruyama_step`).
        steps: the number of steps of a fixed grid. ``None``: adaptive (ODE with an embedded
            pair only, controlled by ``rtol``/``atol``); the SDE needs it.
        sde: integrate ``dx = [v + w(t) score] dt + sqrt(2 w(t)) dW`` instead of the ODE.
        diffusion: the SDE's ``w(t)``: a function of a time tensor, or a constant
            (default :func:`sigma_diffusion`, ``w = sigma(t)``).
        interpolant: the path the model was trained on (default :func:`fnebm.interpolants.linear`);
            used to convert score/noise predictions and for the SDE.
        prediction: ``"velocity"``, ``"score"`` or ``"noise"``.
        t0, t1: the time span; defaults ``0`` and ``1``, moved ``1e-3`` inside where a
            conversion is singular (score or noise prediction at ``t = 0``; the SDE at both ends).
        trajectory: keep the solution at every grid time (adaptive: at ``t0`` and ``t1``):
            ``(steps + 1, *shape)``; else only the end ``shape``.
        out: a preallocated buffer of that shape, written and returned.
        x0: a start other than the keyed ``N(0, I)`` draw (e.g. fixed noise).
        dtype: of the draw (when ``x0`` is not given).
        per_sample, compile: adaptive ODE only, see :func:`fnebm.integrators.ode.odeint`.
    """
    _checks.check_callable("model", model, "model(x, t) -> velocity, score or noise")
    _checks.check_key(key)
    if key.ndim != 1:
        raise ValueError(f"key must be one key of shape (2,), got shape {tuple(key.shape)}")
    shape = _checks.check_shape("shape", shape)
    if len(shape) < 1:
        raise ValueError("shape must have a leading batch axis (batch, ...)")
    _check_prediction(prediction)
    interpolant = itp.linear() if interpolant is None else interpolant
    if not isinstance(interpolant, itp.Interpolant):
        raise TypeError(f"interpolant must be an fnebm.interpolants.Interpolant, got {type(interpolant).__name__}")
    if steps is not None:
        steps = _checks.check_int("steps", steps, 1)
    k_base, k_noise = fr.split(key)
    if x0 is None:
        _checks.check_float_dtype("dtype", dtype)
        x0 = fr.normal(k_base, shape, dtype=dtype)
    elif not isinstance(x0, Tensor) or tuple(x0.shape) != shape or not x0.is_floating_point():
        raise ValueError(f"x0 must be a floating tensor of shape {shape}")
    start = t0 if t0 is not None else (_EPS if sde or prediction != "velocity" else 0.0)
    end = t1 if t1 is not None else (1.0 - _EPS if sde else 1.0)
    start, end = _checks.check_real("t0", start), _checks.check_real("t1", end)
    if not start < end:
        raise ValueError(f"need t0 < t1, got t0={start}, t1={end}")

    if not sde:
        method = ode.dopri5 if method is None else method
        if not isinstance(method, ode.Tableau):
            raise TypeError(f"method must be a Tableau for the ODE (fnebm.integrators.ode.dopri5, rk4, ...), got {type(method).__name__}")
        f = velocity_field(model, interpolant, prediction)
        if steps is None:
            if method.b_err is None:
                raise ValueError(f"steps must be given for {method.name}, which has no error estimate for adaptive control")
            grid = torch.tensor([start, end], dtype=x0.dtype, device=x0.device)
            return ode.odeint(f, x0, grid, method, rtol=rtol, atol=atol, trajectory=trajectory, out=out,
                              per_sample=per_sample, compile=compile)
        return ode.odeint(f, x0, _grid(start, end, steps, x0), method, trajectory=trajectory, out=out)

    method = sde_mod.euler_maruyama_step if method is None else method
    if isinstance(method, ode.Tableau) or not callable(method):
        raise TypeError("method must be an SDE step for sde=True (fnebm.integrators.sde.euler_maruyama_step or heun_step), "
                        f"got {type(method).__name__}")
    if steps is None:
        raise ValueError("steps must be given for sde=True (the SDE runs on a fixed grid)")
    if diffusion is None:
        w = sigma_diffusion(interpolant)
    elif callable(diffusion):
        w = diffusion
    else:
        level = _checks.check_real("diffusion", diffusion)
        if level < 0:
            raise ValueError(f"diffusion must be >= 0, got {level}")
        w = lambda t: torch.full_like(t, level)  # noqa: E731
    fields = score_field(model, interpolant, prediction)

    def drift(t: Tensor, x: Tensor) -> Tensor:
        v, s = fields(t, x)
        return v + w(t) * s

    def noise_scale(t: Tensor, x: Tensor) -> Tensor:
        return (2.0 * w(t)).sqrt()

    return sde_mod.sdeint(drift, noise_scale, x0, _grid(start, end, steps, x0), k_noise, method,
                          trajectory=trajectory, out=out)


def _exact_divergence(f: Callable, t: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """``(v, div v)``: the Jacobian's diagonal by one forward-mode product per dimension (vmapped)."""
    flat = x.flatten(1)
    d = flat.shape[1]

    def g(y: Tensor) -> Tensor:
        return f(t, y.view_as(x)).flatten(1)

    basis = torch.eye(d, dtype=x.dtype, device=x.device).unsqueeze(1).expand(d, x.shape[0], d)
    v, cols = torch.func.vmap(lambda e: torch.func.jvp(g, (flat,), (e,)), out_dims=(None, 0))(basis)
    div = torch.diagonal(cols, dim1=0, dim2=2).sum(-1)  # cols: (d, batch, d) -> sum_i J_ii
    return v.view_as(x), div


def _hutchinson_divergence(f: Callable, t: Tensor, x: Tensor, probe: Tensor) -> tuple[Tensor, Tensor]:
    """``(v, probe . J probe)``: one forward-mode product, unbiased for ``E[probe probe^T] = I``."""
    v, jp = torch.func.jvp(lambda y: f(t, y), (x,), (probe,))
    return v, (probe * jp).flatten(1).sum(1)


def _probe(key: Tensor, like: Tensor, probe: str) -> Tensor:
    if probe == "rademacher":
        return fr.bernoulli(key, 0.5, tuple(like.shape)).to(like.dtype) * 2.0 - 1.0
    return fr.normal(key, tuple(like.shape), dtype=like.dtype)


def _transport(f: Callable, x: Tensor, t_from: float, t_to: float, method: ode.Tableau, steps: int | None,
               rtol, atol, divergence: str, p: Tensor | None) -> tuple[Tensor, Tensor, ode.ODEInfo]:
    """``x`` at ``t_from`` carried to ``t_to`` with ``int_{t_from}^{t_to} div v dt``: ``(x, integral, info)``."""
    batch, event = x.shape[0], x.shape[1:]

    def aug(t: Tensor, z: Tensor) -> Tensor:
        y = z[:, :-1].reshape(batch, *event)
        v, div = _exact_divergence(f, t, y) if divergence == "exact" else _hutchinson_divergence(f, t, y, p)
        return torch.cat((v.flatten(1), div.unsqueeze(1)), dim=1)

    z = torch.cat((x.flatten(1), x.new_zeros(batch, 1)), dim=1)
    if steps is None:
        grid = torch.tensor([t_from, t_to], dtype=x.dtype, device=x.device)
        z, info = ode.odeint(aug, z, grid, method, rtol=rtol, atol=atol, trajectory=False)
    else:
        z, info = ode.odeint(aug, z, _grid(t_from, t_to, steps, x), method, trajectory=False)
    return z[:, :-1].reshape(batch, *event), z[:, -1], info


def _log_normal(x: Tensor) -> Tensor:
    flat = x.flatten(1)
    return -0.5 * flat.square().sum(1) - 0.5 * flat.shape[1] * math.log(2 * math.pi)


def _check_density_args(model, prediction: str, divergence: str, probe: str, method, steps) -> int | None:
    _checks.check_callable("model", model, "model(x, t) -> velocity, score or noise")
    _check_prediction(prediction)
    if divergence not in ("exact", "hutchinson"):
        raise ValueError(f"divergence must be 'exact' or 'hutchinson', got {divergence!r}")
    if probe not in ("rademacher", "gaussian"):
        raise ValueError(f"probe must be 'rademacher' or 'gaussian', got {probe!r}")
    if not isinstance(method, ode.Tableau):
        raise TypeError(f"method must be a Tableau (fnebm.integrators.ode.dopri5, rk4, ...), got {type(method).__name__}")
    if steps is None:
        if method.b_err is None:
            raise ValueError(f"steps must be given for {method.name}, which has no error estimate for adaptive control")
        return None
    return _checks.check_int("steps", steps, 1)


def _span(t0: float | None, t1: float, prediction: str) -> tuple[float, float]:
    start = t0 if t0 is not None else (0.0 if prediction == "velocity" else _EPS)
    start, t1 = _checks.check_real("t0", start), _checks.check_real("t1", t1)
    if not start < t1:
        raise ValueError(f"need t0 < t1, got t0={start}, t1={t1}")
    return start, t1


def log_likelihood(
    model: Callable[[Tensor, Tensor], Tensor],
    x1: Tensor,
    *,
    method: ode.Tableau = ode.dopri5,
    steps: int | None = None,
    rtol: float | Tensor = 1e-5,
    atol: float | Tensor = 1e-5,
    interpolant: itp.Interpolant | None = None,
    prediction: str = "velocity",
    divergence: str = "exact",
    key: Tensor | None = None,
    probe: str = "rademacher",
    t0: float | None = None,
    t1: float = 1.0,
) -> tuple[Tensor, ode.ODEInfo]:
    """``log p(x1)`` under the flow of ``model`` from ``N(0, I)``: ``(log_p: (batch,), info)``.

    Integrates ``d/dt (x, l) = (v, div v)`` from ``t1`` back to ``t0`` (adaptive by default, or
    ``steps`` of a fixed grid) and returns ``log N(x(t0); 0, I) + l(t0)``.

    Args:
        divergence: ``"exact"`` (``d`` forward-mode products per evaluation: small ``d``) or
            ``"hutchinson"`` (one product, with a probe drawn once from ``key`` and held over
            the solve: unbiased, the error is Monte Carlo; average over keys to reduce it).
        probe: ``"rademacher"`` (entries ``+-1``, the lower variance) or ``"gaussian"``.
        t0: default ``0`` for a velocity model, ``1e-3`` for score/noise (singular at ``t = 0``):
            the base density is then taken as ``N(0, I)`` at ``t0``.
    """
    steps = _check_density_args(model, prediction, divergence, probe, method, steps)
    if not isinstance(x1, Tensor) or not x1.is_floating_point() or x1.ndim < 2:
        raise TypeError("x1 must be a floating tensor (batch, ...) with at least one event axis")
    start, t1 = _span(t0, t1, prediction)
    p = None
    if divergence == "hutchinson":
        if key is None:
            raise ValueError("key must be given for divergence='hutchinson' (the probe is drawn from it)")
        _checks.check_key(key)
        p = _probe(key, x1, probe)
    f = velocity_field(model, itp.linear() if interpolant is None else interpolant, prediction)
    x0, integral, info = _transport(f, x1, t1, start, method, steps, rtol, atol, divergence, p)
    return _log_normal(x0) + integral, info  # integral = int_1^0 div v dt = -int_0^1 div v dt


def sample_and_log_prob(
    model: Callable[[Tensor, Tensor], Tensor],
    key: Tensor,
    shape: int | tuple[int, ...],
    *,
    method: ode.Tableau = ode.dopri5,
    steps: int | None = None,
    rtol: float | Tensor = 1e-5,
    atol: float | Tensor = 1e-5,
    interpolant: itp.Interpolant | None = None,
    prediction: str = "velocity",
    divergence: str = "exact",
    probe: str = "rademacher",
    t0: float | None = None,
    t1: float = 1.0,
    x0: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, ode.ODEInfo]:
    """Draws and their log-density under the flow, in one forward solve: ``(x, log_q: (batch,), info)``.

    ``log q(x(t1)) = log N(x0; 0, I) - int_{t0}^{t1} div v dt`` along each draw's path, the
    density an independence Metropolis–Hastings step needs of a flow proposal. The base draw is
    :func:`flow_sample`'s (the same ``key`` gives the same ``x0``); a Hutchinson probe comes from
    the key too. Other arguments as :func:`log_likelihood`.
    """
    steps = _check_density_args(model, prediction, divergence, probe, method, steps)
    _checks.check_key(key)
    if key.ndim != 1:
        raise ValueError(f"key must be one key of shape (2,), got shape {tuple(key.shape)}")
    shape = _checks.check_shape("shape", shape)
    if len(shape) < 2:
        raise ValueError(f"shape must be (batch, ...) with at least one event axis, got {shape}")
    start, t1 = _span(t0, t1, prediction)
    k_base, k_probe = fr.split(key)
    if x0 is None:
        _checks.check_float_dtype("dtype", dtype)
        x0 = fr.normal(k_base, shape, dtype=dtype)
    elif not isinstance(x0, Tensor) or tuple(x0.shape) != shape or not x0.is_floating_point():
        raise ValueError(f"x0 must be a floating tensor of shape {shape}")
    p = _probe(k_probe, x0, probe) if divergence == "hutchinson" else None
    f = velocity_field(model, itp.linear() if interpolant is None else interpolant, prediction)
    x, integral, info = _transport(f, x0, start, t1, method, steps, rtol, atol, divergence, p)
    return x, _log_normal(x0) - integral, info
