"""Contrastive divergence (CD-k) and persistent CD with a replay buffer.

Both estimate the maximum-likelihood gradient of an EBM ``p(x) ∝ exp(-E(x))``,
``∇θ NLL = E_data[∇θ E(x)] - E_model[∇θ E(x)]``, by the loss ``mean E(x⁺) - mean E(x⁻)``:
positives ``x⁺`` are the data, negatives ``x⁻`` come from ``n_steps`` steps of an fnebm
sampler targeting the model. No gradient flows through the sampler unless asked
(``grad_through_sampler=True``): the sampler runs on a detached copy of the energy, so the
gradient is exactly that of the two energy means.

**Evaluations.** With ``init="data"`` the chains start at the positives, so the sampler's
``init`` (E and dE/dx at the start) runs under the live energy and its state is then detached:
the state's energy (an fnebm sampler's ``energy`` field) is the loss's ``E(x⁺)``, parameter
gradient included, and the positives' forward pass runs once. CD-k then costs the sampler's
evaluations of E and dE/dx (Langevin: ``k + 1``, at the start and at every proposal) and one
forward pass, ``E(x⁻)``; other starts add ``E(x⁺)``.

**Randomness.** ``key`` (one key ``(2,)``) is split as ``k_init, k_chain = split(key)``: the
starting points use ``k_init``, and chain ``c`` takes ``split(k_chain, n_chains)[c]`` (which
:func:`fnebm.chain.run` folds with the step index).

**Compiled.** Inside ``torch.compile`` the ``n_steps`` sampler steps are unrolled by default
(``unroll=None``): on torch 2.13, ``scan`` cannot run inside ``torch.func.grad`` under
Dynamo. Without ``torch.func`` (``loss.backward()``), ``unroll=False`` traces one scan body
for any ``n_steps``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fnebm import _checks
from fnebm import random as fr
from fnebm._loop import run
from fnebm.losses import _common
from fnebm.samplers.base import state_caches_energy
from fnebm.samplers.langevin import langevin

__all__ = [
    "CDAux",
    "contrastive_divergence",
    "PCDState",
    "PCDAux",
    "pcd_init",
    "persistent_contrastive_divergence",
    "default_sampler",
]


def default_sampler(energy: Callable[[Tensor], Tensor]):
    """The sampler used when none is given: unadjusted Langevin, step size 0.01, noise scale 1."""
    return langevin(energy, 0.01)


class CDAux(NamedTuple):
    """What a CD loss reports besides the loss (all detached).

    positive_energy: ``(n,)`` ``E(x⁺)``; negative_energy: ``(m,)`` ``E(x⁻)``; negatives:
    ``(m, *event)``; info: the sampler's info at every step, leaves ``(n_steps, m)``.
    """

    positive_energy: Tensor
    negative_energy: Tensor
    negatives: Tensor
    info: Any


class PCDState(NamedTuple):
    """Persistent chains and replay buffer, returned by every call and passed to the next.

    positions: ``(m, *event)``, where each chain stopped; buffer: ``(B, *event)`` replay
    buffer (``B = 0``: none); count: ``()`` int64, entries of the buffer filled so far;
    pointer: ``()`` int64, the slot the next negatives are written to (a ring).

    It holds positions only — no energy or gradient — so nothing in it goes stale when the
    parameters change: every call evaluates the chains' energies and gradients afresh.
    """

    positions: Tensor
    buffer: Tensor
    count: Tensor
    pointer: Tensor


class PCDAux(NamedTuple):
    """:class:`CDAux`'s fields and ``state``, the :class:`PCDState` to pass to the next call."""

    positive_energy: Tensor
    negative_energy: Tensor
    negatives: Tensor
    info: Any
    state: PCDState


torch.serialization.add_safe_globals([PCDState])



def _caches_energy(alg: Any, state: Any) -> bool:
    """Whether ``state`` (from ``alg.init``) holds ``energy = E(position)``, computed by the sampler's
    ``init`` through the energy it was given: its ``Step`` says so (``caches_energy``; fnebm's
    Langevin, MALA, HMC and NUTS do, through samplers.base.init_position_state), and inside a
    compiled region its kernel does (:func:`fnebm.samplers.base.state_caches_energy`). A sampler
    that does not say so has its positives' energies computed by the loss."""
    return state_caches_energy(alg.step, state)


# ------------------------------------------------------------------------------- checks


def _check_sampler(sampler: Any) -> Callable:
    if sampler is None:
        return default_sampler
    _checks.check_callable("sampler", sampler, "energy -> SamplingAlgorithm (e.g. lambda e: fnebm.mala(e, 0.1))")
    return sampler


def _check_noise(noise: Any) -> Callable:
    if noise is None:
        return fr.normal
    _checks.check_callable("noise", noise, "(key, shape, dtype) -> Tensor (e.g. fnebm.random.normal)")
    return noise


def _named_call(name: str, fn: Callable, args: tuple, what: str, hint: str = "") -> Any:
    """``fn(*args)``; a ``TypeError`` from a call ``fn``'s signature cannot take is named for the
    argument (:func:`fnebm._checks.check_signature`). The signature is read on that error only, so
    a good call pays nothing, and never under compile (no ``try`` in a traced graph)."""
    if torch.compiler.is_compiling():
        return fn(*args)
    try:
        return fn(*args)
    except TypeError:
        _checks.check_signature(name, fn, len(args), what=what, hint=hint)
        raise


def _noise(noise: Callable, key: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    return _named_call("noise", noise, (key, shape, dtype),
                       "noise(key, shape, dtype) -> Tensor (e.g. fnebm.random.normal)")


def _check_positions(name: str, x: Any, batch: Tensor) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor of shape (m, *event), got {type(x).__name__}")
    if x.ndim != batch.ndim or tuple(x.shape[1:]) != tuple(batch.shape[1:]) or x.shape[0] == 0:
        raise ValueError(
            f"{name} must have shape (m, *event) with m >= 1 and the batch's event shape "
            f"{tuple(batch.shape[1:])}, got {tuple(x.shape)}"
        )
    if x.dtype != batch.dtype or x.device != batch.device:
        raise TypeError(
            f"{name} must have the batch's dtype and device ({batch.dtype}, {batch.device}), "
            f"got ({x.dtype}, {x.device})"
        )
    return x


def _probability(name: str, p: Any) -> Tensor | float:
    p = _common.nonnegative(name, p)
    if isinstance(p, float) and p > 1:
        raise ValueError(f"{name} must be in [0, 1], got {p}")
    if isinstance(p, Tensor) and _checks.is_concrete(p) and not bool((p <= 1).all()):
        raise ValueError(f"{name} must be in [0, 1]")
    return p


def _default_unroll(unroll: bool | None) -> bool | None:
    # scan cannot run inside torch.func.grad under Dynamo (torch 2.13), and from inside a
    # compiled function there is no way to ask whether a torch.func transform is active
    if unroll is None and torch.compiler.is_compiling():
        return True
    return unroll


# ------------------------------------------------------------------------------ pieces


def _nothing(state: Any) -> tuple:
    return ()


def _algorithm(sampler: Callable, energy: Callable[[Tensor], Tensor]):
    alg = _named_call("sampler", sampler, (energy,), "sampler(energy) -> SamplingAlgorithm",
                      "bind the sampler's other arguments: lambda e: fnebm.mala(e, 0.1) or "
                      "functools.partial(fnebm.mala, step_size=0.1)")
    if not (callable(getattr(alg, "init", None)) and callable(getattr(alg, "step", None))):
        raise TypeError(f"sampler(energy) must return a SamplingAlgorithm(init, step), got {type(alg).__name__}")
    return alg


def init_chains(energy: Callable[[Tensor], Tensor], start: Tensor, sampler: Callable) -> Any:
    """The chains' first state at ``start: (m, *event)``: ``vmap`` of ``sampler(energy).init``."""
    return torch.func.vmap(_algorithm(sampler, energy).init)(start)


def sample_negatives(
    energy: Callable[[Tensor], Tensor], start: Any, key: Tensor, sampler: Callable, n_steps: int,
    unroll: bool | None,
) -> tuple[Tensor, Any]:
    """``n_steps`` of ``sampler(energy)``; chain ``c`` uses ``split(key, m)[c]``.

    ``start``: positions ``(m, *event)``, whose energies and gradients are then computed here
    under the given energy, or a sampler state from :func:`init_chains`. Returns the final
    positions ``(m, *event)`` and the info at every step.
    """
    alg = _algorithm(sampler, energy)
    state = torch.func.vmap(alg.init)(start) if isinstance(start, Tensor) else start
    m = pytree.tree_leaves(state)[0].shape[0]
    final, _, info = run(alg.step, state, fr.split(key, m), n_steps, collect=_nothing,
                         unroll=_default_unroll(unroll))
    return final.position, info


def _cd_value(energy: Callable[[Tensor], Tensor], batch: Tensor, negatives: Tensor,
              alpha: Tensor | float, e_pos: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The loss and ``E(x⁺)``, ``E(x⁻)``; ``e_pos``: ``E(x⁺)`` already evaluated (with its parameter
    gradient), else computed here."""
    if e_pos is None:
        e_pos = _common.batched(energy)(batch)
    e_neg = _common.batched(energy)(negatives)
    loss = e_pos.mean() - e_neg.mean()
    if not (isinstance(alpha, float) and alpha == 0.0):
        alpha = alpha.to(e_pos.dtype) if isinstance(alpha, Tensor) else alpha
        loss = loss + alpha * ((e_pos * e_pos).mean() + (e_neg * e_neg).mean())
    return loss, e_pos, e_neg


# ---------------------------------------------------------------------------------- CD


def contrastive_divergence(
    energy: Callable[[Tensor], Tensor],
    batch: Tensor,
    key: Tensor,
    *,
    sampler: Callable | None = None,
    n_steps: int = 10,
    init: str | Tensor = "data",
    noise: Callable | None = None,
    alpha: float | Tensor = 0.0,
    grad_through_sampler: bool = False,
    unroll: bool | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[Tensor, CDAux]:
    """CD-k: ``mean E(x⁺) - mean E(x⁻) + alpha (mean E(x⁺)² + mean E(x⁻)²)``.

    Args:
        energy: the model, and the parameters being learned: an fnebm energy (a pytree whose
            tensor leaves are its parameters), e.g. ``energies.bind(energy_fn, params)`` for a
            network. ``torch.func.grad`` of this loss returns gradients shaped like it.
        batch: data ``(n, *event)``.
        key: one key ``(2,)``.
        sampler: ``energy -> SamplingAlgorithm``; default :func:`default_sampler` (Langevin,
            step 0.01). Any fnebm sampler: ``lambda e: fnebm.mala(e, 0.1)``,
            ``functools.partial(fnebm.hmc, step_size=0.1, num_integration_steps=5)``.
        n_steps: sampler steps ``k`` (``>= 1``).
        init: where the chains start: ``"data"`` (the batch: classic CD-k), ``"noise"``
            (``noise(k_init, batch.shape, batch.dtype)``), or a tensor ``(m, *event)``.
        noise: ``(key, shape, dtype) -> Tensor``; default ``fnebm.random.normal``.
        alpha: weight of the energy-magnitude regulariser (Du & Mordatch 2019), ``>= 0``.
        grad_through_sampler: differentiate through the chain too (the negatives then depend
            on the parameters; the loop is unrolled, so keep ``n_steps`` small).
        unroll: passed to :func:`fnebm.chain.run`; ``None`` unrolls inside ``torch.compile``
            (needed under ``torch.func.grad``), see the module docstring.
        autocast: e.g. ``torch.bfloat16``: the energy's forward (in the loss and in the
            sampler) runs under ``torch.autocast``; positions, gradients with respect to them,
            the sampler's updates and the loss stay in the batch's dtype.

    Returns:
        ``(loss, CDAux)``; the loss is 0-dim in the batch's dtype.
    """
    _common.check_energy(energy)
    batch = _common.check_batch(batch)
    _common.check_fits(energy, batch)
    _common.check_loss_key(key)
    sampler = _check_sampler(sampler)
    n_steps = _checks.check_int("n_steps", n_steps, 1)
    noise = _check_noise(noise)
    alpha = _common.nonnegative("alpha", alpha)
    dtype = _common.check_autocast(autocast)
    if not isinstance(grad_through_sampler, bool):
        raise TypeError(f"grad_through_sampler must be a bool, got {type(grad_through_sampler).__name__}")
    k_init, k_chain = fr.split(key)
    from_data = isinstance(init, str) and init == "data"
    if isinstance(init, str):
        if init == "data":
            start = batch
        elif init == "noise":
            start = _noise(noise, k_init, tuple(batch.shape), batch.dtype)
        else:
            raise ValueError(f"init must be 'data', 'noise' or a tensor of starting points, got {init!r}")
    else:
        start = _check_positions("init", init, batch)

    model = _common.checked(energy, dtype)  # the loss's own evaluations check what the energy returns
    frozen = model if grad_through_sampler else _common.with_autocast(_common.stop_gradient(energy), dtype)
    e_pos = None
    if from_data and not grad_through_sampler:
        # The chains start at the positives, and an fnebm sampler's init evaluates E there (and
        # dE/dx): run under the live parameters, that E is the loss's E(x⁺), with its parameter
        # gradient, so the positives' forward pass runs once. Detached, the state is the one
        # `frozen` would give, to the bit.
        alg = _algorithm(sampler, model)
        start = torch.func.vmap(alg.init)(batch)  # init_chains, keeping alg
        if _caches_energy(alg, start):
            e_pos = start.energy
        start = _common.stop_gradient(start)
    else:
        e_pos = _common.batched(model)(batch)  # before the sampler: a bad energy is named by the loss
        if not grad_through_sampler:
            start = start.detach()
    negatives, info = sample_negatives(frozen, start, k_chain, sampler, n_steps, unroll)
    if not grad_through_sampler:
        negatives = negatives.detach()
    loss, e_pos, e_neg = _cd_value(model, batch, negatives, alpha, e_pos)
    return loss, CDAux(e_pos.detach(), e_neg.detach(), negatives.detach(), info)


# ---------------------------------------------------------------------------------- PCD


def pcd_init(positions: Tensor, buffer_size: int = 0) -> PCDState:
    """The first :class:`PCDState`: chains at ``positions: (m, *event)`` (e.g. noise) and an
    empty replay buffer of ``buffer_size`` entries (``0``: no buffer; else ``>= m``)."""
    if not isinstance(positions, Tensor) or not positions.is_floating_point():
        raise TypeError(f"positions must be a floating tensor (m, *event), got {type(positions).__name__}")
    if positions.ndim < 1 or positions.shape[0] == 0:
        raise ValueError(f"positions must have shape (m, *event) with m >= 1, got {tuple(positions.shape)}")
    if _checks.is_concrete(positions) and not bool(torch.isfinite(positions).all()):
        raise ValueError("positions must be finite (no NaN or inf)")
    buffer_size = _checks.check_int("buffer_size", buffer_size, 0)
    m = positions.shape[0]
    if 0 < buffer_size < m:
        raise ValueError(f"buffer_size must be 0 (no buffer) or >= the number of chains {m}, got {buffer_size}")
    zero = torch.zeros((), dtype=torch.int64, device=positions.device)
    buffer = positions.new_zeros((buffer_size, *positions.shape[1:]))
    return PCDState(positions.detach().clone(), buffer, zero, zero.clone())


def _check_state(state: Any, batch: Tensor) -> PCDState:
    if not isinstance(state, PCDState):
        raise TypeError(f"state must be a PCDState (from losses.pcd_init or the last call's aux.state), "
                        f"got {type(state).__name__}")
    _check_positions("state.positions", state.positions, batch)
    if tuple(state.buffer.shape[1:]) != tuple(batch.shape[1:]) or state.buffer.dtype != batch.dtype:
        raise ValueError(f"state.buffer must be (B, *event) like the batch, got {tuple(state.buffer.shape)}")
    return state


def _starts(state: PCDState, key: Tensor, reinit_prob: Tensor | float, noise: Callable) -> Tensor:
    """Where the chains start: noise with probability ``reinit_prob``; otherwise a uniformly drawn
    buffer entry (the chain's own position while the buffer is empty, or with no buffer)."""
    x = state.positions
    m, event = x.shape[0], tuple(x.shape[1:])
    k_reinit, k_pick, k_noise = fr.split(key, 3)
    mask = (1,) * len(event)
    if isinstance(reinit_prob, Tensor):
        reinit_prob = reinit_prob.to(x.dtype)
    reinit = (fr.uniform(k_reinit, (m,), x.dtype) < reinit_prob).reshape((m, *mask))
    carried = x
    size = state.buffer.shape[0]
    if size > 0:  # static shape: no branch on data
        count = state.count.to(x.dtype)
        idx = torch.floor(fr.uniform(k_pick, (m,), x.dtype) * count).to(torch.int64).clamp(0, size - 1)
        carried = torch.where((state.count > 0).reshape((1, *mask)), state.buffer[idx], x)
    return torch.where(reinit, _noise(noise, k_noise, (m, *event), x.dtype), carried)


def _advance(state: PCDState, negatives: Tensor) -> PCDState:
    negatives = negatives.detach()
    size, m = state.buffer.shape[0], negatives.shape[0]
    if size == 0:
        return PCDState(negatives, state.buffer, state.count, state.pointer)
    slots = torch.remainder(state.pointer + torch.arange(m, device=negatives.device), size)
    buffer = state.buffer.index_copy(0, slots, negatives)
    return PCDState(negatives, buffer, torch.clamp_max(state.count + m, size), torch.remainder(state.pointer + m, size))


def persistent_contrastive_divergence(
    energy: Callable[[Tensor], Tensor],
    batch: Tensor,
    key: Tensor,
    state: PCDState,
    *,
    sampler: Callable | None = None,
    n_steps: int = 10,
    reinit_prob: float | Tensor = 0.05,
    noise: Callable | None = None,
    alpha: float | Tensor = 0.0,
    unroll: bool | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[Tensor, PCDAux]:
    """Persistent CD: CD's loss, with negatives from chains that persist across calls.

    The chains start where ``state`` says (:func:`_starts`): with probability
    ``reinit_prob`` from ``noise``; otherwise, with a replay buffer (``pcd_init(...,
    buffer_size=B)``), from an entry drawn uniformly from the buffer — Du & Mordatch 2019 —
    and without one, from where the chain stopped last time (Tieleman 2008). After
    ``n_steps`` sampler steps the negatives are the new positions and are written into the
    buffer (a ring: the oldest entries go first). ``aux.state`` is the state for the next call.

    The state holds positions only: the sampler's state — energy and gradient at each chain —
    is built afresh from them under the current parameters on every call, so the first
    accept/reject after a parameter update compares energies of the current model.

    ``key`` is split as ``k_init, k_chain = split(key)``; ``k_reinit, k_pick, k_noise =
    split(k_init, 3)`` choose the restarts, the buffer entries and the noise. Other arguments
    as :func:`contrastive_divergence` (no gradient ever flows through persistent chains).
    Returns ``(loss, PCDAux)``.
    """
    _common.check_energy(energy)
    batch = _common.check_batch(batch)
    _common.check_loss_key(key)
    state = _check_state(state, batch)
    _common.check_fits(energy, batch)
    sampler = _check_sampler(sampler)
    n_steps = _checks.check_int("n_steps", n_steps, 1)
    noise = _check_noise(noise)
    reinit_prob = _probability("reinit_prob", reinit_prob)
    alpha = _common.nonnegative("alpha", alpha)
    dtype = _common.check_autocast(autocast)
    k_init, k_chain = fr.split(key)
    start = _starts(state, k_init, reinit_prob, noise)
    model = _common.checked(energy, dtype)
    e_pos = _common.batched(model)(batch)  # before the sampler: a bad energy is named by the loss
    frozen = _common.with_autocast(_common.stop_gradient(energy), dtype)
    negatives, info = sample_negatives(frozen, start.detach(), k_chain, sampler, n_steps, unroll)
    negatives = negatives.detach()
    loss, e_pos, e_neg = _cd_value(model, batch, negatives, alpha, e_pos)
    return loss, PCDAux(e_pos.detach(), e_neg.detach(), negatives, info, _advance(state, negatives))
