"""The standard 2-D toy data sets, each a pure function ``fn(key, n, dtype, device) -> (n, 2)``.

Same key, same points: every draw comes from :mod:`fnebm.random` (never the global RNG), so
a data set is reproducible on any device, eager or compiled. Each point is drawn
independently (its component — which Gaussian, moon, ring, spiral arm, wheel blade — is part
of the draw), so the points are i.i.d. and any subset of a sample is a sample too. The
shapes and scales follow the toy data of FFJORD (Grathwohl et al. 2019), which most EBM and
flow papers reuse; all sets lie roughly in ``[-4, 4]^2``.

==================== =====================================================================
``eight_gaussians``  eight N(c, 0.5²) blobs on a circle of radius 4, all divided by 1.414
``two_moons``        sklearn's moons, noise 0.1, scaled by 2 and shifted by (-1, -0.2)
``swiss_roll``       sklearn's swiss roll's (x, z) plane, noise 1, divided by 5
``circles``          two rings of radius 3 and 1.5, noise 0.08·3
``checkerboard``     uniform on the eight black squares of a 4×4 board on [-4, 4]²
``pinwheel``         five blades, radial std 0.3, tangential std 0.1, rate 0.25, times 2
``two_spirals``      two interleaved arms (540°), noise 0.1
==================== =====================================================================

``DATASETS`` maps each name to its function; :func:`get` looks one up with an error listing
the names.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import random as fr

__all__ = [
    "eight_gaussians",
    "two_moons",
    "swiss_roll",
    "circles",
    "checkerboard",
    "pinwheel",
    "two_spirals",
    "DATASETS",
    "get",
]


def _setup(key: Any, n: Any, dtype: Any, device: Any) -> tuple[Tensor, int, torch.dtype]:
    """Checked ``(key on device, n, working dtype)``: the boundary of every data set."""
    fr.check_key(key)
    if key.shape != (2,):
        raise ValueError(f"key must be one key of shape (2,), got shape {tuple(key.shape)}")
    n = _checks.check_int("n", n, minimum=0)
    _checks.check_float_dtype("dtype", dtype)
    if device is not None:
        try:
            device = torch.device(device)
        except (TypeError, RuntimeError):
            raise TypeError(f"device must be a torch.device, a device string or None, got {device!r}") from None
        key = key.to(device)
    # draw in float64 for float64 output, else float32 (bf16/fp16 are rounded at the end)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return key, n, work


def _uniform(key: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    return fr.uniform(key, (n,), dtype)


def _component(key: Tensor, n: int, k: int) -> Tensor:
    """``n`` draws uniform on ``{0, ..., k-1}`` (int64)."""
    return torch.floor(fr.uniform(key, (n,), torch.float32) * k).to(torch.int64).clamp_max(k - 1)


def eight_gaussians(key: Tensor, n: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None) -> Tensor:
    """Eight Gaussians ``N(c_i, 0.5² I)`` with ``c_i`` on a circle of radius 4, scaled by 1/1.414.

    key: one key ``(2,)``; n: number of points (``>= 0``). Returns ``(n, 2)`` of ``dtype`` on
    ``device`` (default: the key's device).
    """
    key, n, work = _setup(key, n, dtype, device)
    k_comp, k_noise = fr.split(key)
    angle = _component(k_comp, n, 8).to(work) * (2 * math.pi / 8)
    centers = 4.0 * torch.stack((torch.cos(angle), torch.sin(angle)), -1)
    return ((centers + 0.5 * fr.normal(k_noise, (n, 2), work)) / 1.414).to(dtype)


def two_moons(key: Tensor, n: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> Tensor:
    """Two interleaved half circles (sklearn's ``make_moons``, noise 0.1), ``* 2 + (-1, -0.2)``: ``(n, 2)``."""
    key, n, work = _setup(key, n, dtype, device)
    k_comp, k_angle, k_noise = fr.split(key, 3)
    inner = _component(k_comp, n, 2).to(torch.bool)
    t = math.pi * _uniform(k_angle, n, work)
    outer_pts = torch.stack((torch.cos(t), torch.sin(t)), -1)
    inner_pts = torch.stack((1.0 - torch.cos(t), 0.5 - torch.sin(t)), -1)
    x = torch.where(inner[:, None], inner_pts, outer_pts) + 0.1 * fr.normal(k_noise, (n, 2), work)
    return (2.0 * x + torch.tensor([-1.0, -0.2], dtype=work, device=x.device)).to(dtype)


def swiss_roll(key: Tensor, n: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> Tensor:
    """The swiss roll's ``(t cos t, t sin t)`` plane, ``t ~ U(1.5π, 4.5π)``, noise 1, divided by 5: ``(n, 2)``."""
    key, n, work = _setup(key, n, dtype, device)
    k_t, k_noise = fr.split(key)
    t = 1.5 * math.pi * (1.0 + 2.0 * _uniform(k_t, n, work))
    x = torch.stack((t * torch.cos(t), t * torch.sin(t)), -1) + fr.normal(k_noise, (n, 2), work)
    return (x / 5.0).to(dtype)


def circles(key: Tensor, n: int, dtype: torch.dtype = torch.float32,
            device: torch.device | str | None = None) -> Tensor:
    """Two concentric rings of radius 1 and 0.5 (sklearn's ``make_circles``, noise 0.08), times 3: ``(n, 2)``."""
    key, n, work = _setup(key, n, dtype, device)
    k_comp, k_angle, k_noise = fr.split(key, 3)
    radius = 1.0 - 0.5 * _component(k_comp, n, 2).to(work)
    t = 2 * math.pi * _uniform(k_angle, n, work)
    x = radius[:, None] * torch.stack((torch.cos(t), torch.sin(t)), -1) + 0.08 * fr.normal(k_noise, (n, 2), work)
    return (3.0 * x).to(dtype)


def checkerboard(key: Tensor, n: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> Tensor:
    """Uniform on the black squares of a 4×4 checkerboard covering ``[-4, 4]²``: ``(n, 2)``."""
    key, n, work = _setup(key, n, dtype, device)
    k_x1, k_x2, k_row = fr.split(key, 3)
    x1 = 4.0 * _uniform(k_x1, n, work) - 2.0
    row = 2.0 * _component(k_row, n, 2).to(work)
    x2 = _uniform(k_x2, n, work) - row + torch.remainder(torch.floor(x1), 2.0)
    return (2.0 * torch.stack((x1, x2), -1)).to(dtype)


def pinwheel(key: Tensor, n: int, dtype: torch.dtype = torch.float32,
             device: torch.device | str | None = None) -> Tensor:
    """Five blades: radial std 0.3, tangential std 0.1, twisted at rate 0.25, times 2: ``(n, 2)``."""
    key, n, work = _setup(key, n, dtype, device)
    k_comp, k_noise = fr.split(key)
    blade = _component(k_comp, n, 5).to(work)
    f = fr.normal(k_noise, (n, 2), work) * torch.tensor([0.3, 0.1], dtype=work, device=key.device)
    r, s = f[:, 0] + 1.0, f[:, 1]
    angle = blade * (2 * math.pi / 5) + 0.25 * torch.exp(r)
    c, sn = torch.cos(angle), torch.sin(angle)
    return (2.0 * torch.stack((r * c + s * sn, -r * sn + s * c), -1)).to(dtype)


def two_spirals(key: Tensor, n: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> Tensor:
    """Two interleaved spiral arms of 540°, point-symmetric about the origin, noise 0.1: ``(n, 2)``."""
    key, n, work = _setup(key, n, dtype, device)
    k_arm, k_t, k_jitter, k_noise = fr.split(key, 4)
    t = torch.sqrt(_uniform(k_t, n, work)) * (540 * 2 * math.pi / 360)
    jitter = 0.5 * fr.uniform(k_jitter, (n, 2), work)
    arm = torch.stack((-torch.cos(t) * t, torch.sin(t) * t), -1) + jitter
    sign = 1.0 - 2.0 * _component(k_arm, n, 2).to(work)
    return (sign[:, None] * arm / 3.0 + 0.1 * fr.normal(k_noise, (n, 2), work)).to(dtype)


DATASETS: dict[str, Callable[..., Tensor]] = {
    "eight_gaussians": eight_gaussians,
    "two_moons": two_moons,
    "swiss_roll": swiss_roll,
    "circles": circles,
    "checkerboard": checkerboard,
    "pinwheel": pinwheel,
    "two_spirals": two_spirals,
}


def get(name: str) -> Callable[..., Tensor]:
    """The data set called ``name`` (a key of :data:`DATASETS`); ``ValueError`` listing them otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"name must be one of {sorted(DATASETS)}, got {name!r}") from None
