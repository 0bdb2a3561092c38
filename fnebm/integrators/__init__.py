"""One-step maps that samplers are built from: ``fnebm.integrators.diffusion`` (Euler–Maruyama).

Integrators take tensors that already broadcast (a per-chain step size reshaped against the
positions by the sampler) and hold no state; they never draw random numbers themselves
(the noise is an argument), so the same map serves a kernel and its tests.
"""

from fnebm.integrators.diffusion import euler_maruyama

__all__ = ["euler_maruyama"]
