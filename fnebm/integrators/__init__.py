"""One-step maps that samplers are built from: ``diffusion`` (Euler–Maruyama), ``symplectic``
(velocity Verlet, McLachlan, Yoshida as coefficients) and ``metrics`` (mass matrices).

Integrators take tensors that already broadcast (a per-chain step size reshaped against the
positions by the sampler) and hold no state; they never draw random numbers themselves
(the noise is an argument), so the same map serves a kernel and its tests.
"""

from fnebm.integrators.diffusion import euler_maruyama
from fnebm.integrators.metrics import Dense, Diagonal, euclidean
from fnebm.integrators.symplectic import IntegratorState, integrate, mclachlan, velocity_verlet, yoshida

__all__ = ["euler_maruyama", "IntegratorState", "integrate", "velocity_verlet", "mclachlan", "yoshida", "euclidean",
           "Diagonal", "Dense"]
