"""One-step maps that samplers are built from: ``diffusion`` (Euler–Maruyama), ``symplectic``
(velocity Verlet, McLachlan, Yoshida as coefficients), ``metrics`` (mass matrices), and the
solvers: ``ode`` (Runge–Kutta methods as Butcher tableaus, fixed grid or adaptive, one
``odeint``) and ``sde`` (Euler–Maruyama and stochastic Heun over a grid, keyed).

Integrators take tensors that already broadcast (a per-chain step size reshaped against the
positions by the sampler) and hold no state; the one-step maps never draw random numbers
themselves (the noise is an argument), so the same map serves a kernel and its tests. The SDE
driver ``sdeint`` draws each step's noise from a key it is given (``fold_in(key, step)``).
"""

from fnebm.integrators.diffusion import euler_maruyama
from fnebm.integrators.metrics import Dense, Diagonal, euclidean
from fnebm.integrators import ode, sde
from fnebm.integrators.ode import ODEInfo, Tableau, odeint
from fnebm.integrators.sde import sdeint
from fnebm.integrators.symplectic import IntegratorState, integrate, mclachlan, velocity_verlet, yoshida

__all__ = ["euler_maruyama", "IntegratorState", "integrate", "velocity_verlet", "mclachlan", "yoshida", "euclidean",
           "Diagonal", "Dense", "ode", "odeint", "Tableau", "ODEInfo", "sde", "sdeint"]
