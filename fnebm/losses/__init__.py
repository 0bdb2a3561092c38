"""Training losses for energy-based models, each a pure ``loss(energy, batch, key, ...) -> (loss, aux)``.

``energy`` is both the model and its parameters: an fnebm energy is a pytree whose tensor
leaves are its parameters (an analytic family, or a network as
``energies.bind(energy_fn, params)``), so ``torch.func.grad(loss, has_aux=True)(energy,
batch, key)`` returns gradients shaped like the energy, ready for a functional optimiser
(``tree_map(lambda p, g: p - lr * g, energy, grads)``). With ``torch.optim``, bind the
module's own parameters (``dict(net.named_parameters())``) and call ``loss.backward()``.

* sampler-based (:mod:`~fnebm.losses.contrastive`): :func:`contrastive_divergence` (CD-k),
  :func:`persistent_contrastive_divergence` with :func:`pcd_init` / :class:`PCDState`;
* score matching (:mod:`~fnebm.losses.score_matching`): :func:`exact_score_matching`,
  :func:`denoising_score_matching`, :func:`sliced_score_matching`;
* simulation-free (:mod:`~fnebm.losses.flow_matching`, :mod:`~fnebm.losses.equilibrium_matching`,
  :mod:`~fnebm.losses.energy_matching`): :func:`flow_matching` (a velocity field
  ``model(x, t)``, made by :func:`bind_field`), :func:`equilibrium_matching` (a time-invariant
  field, or an energy's gradient), :func:`energy_matching` (an energy); time samplers
  :func:`uniform_time`, :func:`logit_normal_time`; and :func:`ema_update` for an average of
  parameters.

Every loss takes ``autocast=torch.bfloat16`` (or another dtype) to run the energy's forward
under ``torch.autocast``; the rest stays in the batch's dtype. Nothing touches the global RNG:
``key`` is one key ``(2,)`` from :mod:`fnebm.random`.
"""

from fnebm.losses.contrastive import (
    CDAux,
    PCDAux,
    PCDState,
    contrastive_divergence,
    default_sampler,
    pcd_init,
    persistent_contrastive_divergence,
)
from fnebm.losses.score_matching import (
    DenoisingAux,
    ScoreMatchingAux,
    denoising_score_matching,
    exact_score_matching,
    sliced_score_matching,
)
from fnebm.losses._generative import BoundField, bind_field, logit_normal_time, uniform_time
from fnebm.losses.ema import ema_update
from fnebm.losses.energy_matching import EnergyMatchingAux, energy_matching
from fnebm.losses.equilibrium_matching import EqMAux, eqm_decay, equilibrium_matching
from fnebm.losses.flow_matching import FlowMatchingAux, flow_matching

__all__ = [
    "contrastive_divergence",
    "persistent_contrastive_divergence",
    "pcd_init",
    "PCDState",
    "CDAux",
    "PCDAux",
    "default_sampler",
    "exact_score_matching",
    "denoising_score_matching",
    "sliced_score_matching",
    "ScoreMatchingAux",
    "DenoisingAux",
    "flow_matching",
    "FlowMatchingAux",
    "equilibrium_matching",
    "EqMAux",
    "eqm_decay",
    "energy_matching",
    "EnergyMatchingAux",
    "bind_field",
    "BoundField",
    "uniform_time",
    "logit_normal_time",
    "ema_update",
]
