"""The No-U-Turn sampler: iterative NUTS with multinomial sampling and the generalised U-turn
criterion (as BlackJAX's ``mcmc/nuts.py`` and Stan), written for many chains in lockstep.

Three layers, as every sampler: :func:`init` (one chain), :func:`build_kernel` (the pure
kernel over any chain axes, with the integrator as data) and :func:`nuts` (the constructor).
The kernel draws a momentum ``p ~ N(0, M)`` and hands the rest to two modules, as BlackJAX
splits ``nuts.py``, ``trajectory.py`` and ``termination.py``:

* :mod:`fnebm.samplers.trajectory` — tree doubling, subtree building and the choice of the
  proposal (progressive uniform sampling inside a subtree, biased sampling at a merge), as one
  flat ``while_loop`` over leapfrog steps for all chains;
* :mod:`fnebm.samplers.termination` — the generalised U-turn criterion, checked iteratively
  from checkpoints inside each subtree, with Stan's extra checks across merged halves.

**On the CPU, a C kernel.** For float32 chains, :func:`nuts` (``backend="auto"``) runs each
transition in :mod:`fnebm.kernels.cpu_nuts` instead, with the same algorithm and the same draws:
on an energy the C kernels compute in closed form, one chain after another per thread, each
building its own tree, so no chain waits for the longest one; on any other energy eagerly, in
lockstep, the energy and gradient of every chain evaluated in torch between the kernel's steps
(:mod:`fnebm.samplers.evaluation`). The kernel below is its twin, and serves every other run
(another dtype or device, a gradient through the step, a ``torch.func`` transform, and inside
``torch.compile`` an energy outside the families).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import random as fr
from fnebm.gradients import value_and_grad
from fnebm.integrators.metrics import InverseMassMatrix, check_inverse_mass_matrix, euclidean, resolve
from fnebm.kernels import cpu_nuts, families
from fnebm.kernels.dispatch import BackendUnavailable
from fnebm.integrators.symplectic import IntegratorState, velocity_verlet
from fnebm.samplers.base import (
    caches_energy_of,
    Step,
    KernelCache,
    SamplingAlgorithm,
    chain_axes,
    check_energy,
    init_position_state,
    per_chain,
)
from fnebm.samplers.evaluation import check_compile, evaluator
from fnebm.samplers.trajectory import iterative_nuts_proposal

__all__ = ["NUTSState", "NUTSInfo", "init", "build_kernel", "nuts"]


class NUTSState(NamedTuple):
    """``energy`` and ``grad`` at ``position`` are cached: a trajectory starts from them.

    position: ``(*chains, d)``; energy: ``chains``; grad: like position.
    """

    position: Tensor
    energy: Tensor
    grad: Tensor


class NUTSInfo(NamedTuple):
    """One NUTS transition, each field ``chains``.

    acceptance_rate: Stan's acceptance statistic, the mean over every integrated state of
    ``min(1, exp(H0 - H))`` (what dual averaging targets); is_divergent: the last subtree hit an
    energy error above ``divergence_threshold`` or a non-finite value (that subtree was dropped);
    is_turning: the tree stopped on a U-turn (inside the last subtree or of the merged tree);
    energy_error: ``H(proposal) - H0`` (0 when the chain stays; never NaN); tree_depth: the
    number of expansions tried, the last included (int64; ``2^(depth-1) <= num_integration_steps
    <= 2^depth - 1``, BlackJAX's ``num_trajectory_expansions``); num_integration_steps:
    integrator steps taken, i.e. gradients (int64).
    """

    acceptance_rate: Tensor
    is_divergent: Tensor
    is_turning: Tensor
    energy_error: Tensor
    tree_depth: Tensor
    num_integration_steps: Tensor


torch.serialization.add_safe_globals([NUTSState, NUTSInfo])


def init(position: Tensor, energy_fn: Callable[[Tensor], Tensor]) -> NUTSState:
    """One chain's state at ``position: (d,)``; ``torch.func.vmap`` it for many chains."""
    if position.device.type == "cpu" and position.dtype == torch.float32:
        cpu_nuts.prefetch()  # where the C transition will run: its library, if not built yet, builds now
    return init_position_state(NUTSState, position, energy_fn)


def _dot(a: Tensor, b: Tensor) -> Tensor:
    return (a * b).sum(-1)


def build_kernel(
    integrator: tuple[float, ...] = velocity_verlet,
    divergence_threshold: float = 1000.0,
    *,
    uturn_extra_checks: bool = True,
) -> Callable[..., tuple[NUTSState, NUTSInfo]]:
    """The pure kernel ``kernel(state, key, energy_fn, step_size, inverse_mass_matrix,
    max_tree_depth=10)``.

    key: ``(*chains, 2)``; step_size: a tensor, 0-dim or per chain; inverse_mass_matrix: see
    :mod:`fnebm.integrators.metrics` (shared or per chain, diagonal or dense); max_tree_depth: a
    Python int >= 1 (static: it sizes the checkpoints; at most ``2^max_tree_depth - 1``
    integrator steps per transition). ``integrator``: coefficients from
    :mod:`fnebm.integrators.symplectic`. ``uturn_extra_checks``: Stan's checks across the two
    halves of every merge (on by default; off, the criterion is BlackJAX's and NumPyro's).

    The kernel draws the momentum and hands the trajectory to
    :func:`fnebm.samplers.trajectory.iterative_nuts_proposal`.
    """
    propose = iterative_nuts_proposal(integrator, divergence_threshold, uturn_extra_checks=uturn_extra_checks)

    def kernel(state: NUTSState, key: Tensor, energy_fn: Callable[[Tensor], Tensor], step_size: Tensor,
               inverse_mass_matrix, max_tree_depth: int = 10):
        batch = chain_axes(state.energy, key)
        x0 = state.position
        h = per_chain("step_size", step_size, batch, x0)
        metric = euclidean(inverse_mass_matrix, x0, len(batch))
        keys = fr.split(key, 2)
        p0 = metric.sample_momentum(keys[..., 0, :], x0)
        v0 = metric.velocity(p0)
        h0 = state.energy + 0.5 * _dot(p0, v0)
        vg = value_and_grad(energy_fn, len(batch))
        tree = propose(IntegratorState(x0, p0, state.energy, state.grad), v0, h0, keys[..., 1, :], h, vg,
                       metric.velocity, int(max_tree_depth), len(batch))
        return NUTSState(*tree[:3]), NUTSInfo(*tree[3:])

    return kernel


# one kernel object per (integrator, threshold), built once (equal configurations share a graph)
_kernel_for = KernelCache(build_kernel)


def nuts(
    energy_fn: Callable[[Tensor], Tensor],
    step_size: float | Tensor,
    inverse_mass_matrix: InverseMassMatrix | None = None,
    max_tree_depth: int = 10,
    *,
    integrator: tuple[float, ...] = velocity_verlet,
    divergence_threshold: float = 1000.0,
    backend: str = "auto",
    compile_energy: bool | str = "auto",
) -> SamplingAlgorithm:
    """NUTS targeting ``p(x) ∝ exp(-E(x))``: trajectories that double until they turn.

    ``step_size``: a number or a tensor, 0-dim or one per chain. ``inverse_mass_matrix``:
    diagonal ``(d,)`` / ``(*chains, d)`` or dense ``(d, d)`` / ``(*chains, d, d)`` (``None``: the
    identity, for any d); see :mod:`fnebm.integrators.metrics`. ``max_tree_depth``: a Python int
    >= 1, at most ``2^max_tree_depth - 1`` integrator steps per transition. A subtree whose
    energy error exceeds ``divergence_threshold`` or turns non-finite is dropped, the tree stops
    and the transition is flagged ``is_divergent``.

    ``backend``: which code runs a transition. ``"auto"`` (default) takes the C kernel of
    :mod:`fnebm.kernels.cpu_nuts` where it applies — CPU float32 tensors, no ``torch.func``
    transform and no gradient through the step. On an energy the C kernels compute in closed
    form (the table :data:`fnebm.kernels.families.FAMILIES`) each chain builds its own tree
    instead of waiting in lockstep for the longest one, inside compiled code too; on any other
    energy the kernel builds the trees in lockstep and torch evaluates the energy and gradient
    of every chain at once between its steps, eagerly (under ``torch.compile`` the torch kernel
    runs instead). Elsewhere the torch kernel (:func:`build_kernel`).
    ``compile_energy``: for that evaluation, ``False`` eager, ``True`` compiled from the first
    call, ``"auto"`` (default) traced after 0.5 s of evaluations and compiled once they took
    what a compile is expected to (:mod:`fnebm.samplers.evaluation`); ``sample_chain(compile=)``
    and ``window_adaptation.run(compile=)`` set it for their run when given ``True`` or ``False``.
    ``"c"`` insists on the C kernel (:class:`~fnebm.kernels.dispatch.BackendUnavailable`, a
    ``ValueError``, naming what prevents it); ``"torch"`` always runs
    the torch kernel. Both compute the same transition from the same keys, to float tolerance.
    Returns ``SamplingAlgorithm(init, step)``: ``init(position: (d,)) -> NUTSState`` for one
    chain, ``step(state, keys: (*chains, 2)) -> (NUTSState, NUTSInfo)``.
    """
    check_energy(energy_fn)
    step_size = _checks.tunable("step_size", step_size)
    max_tree_depth = _checks.check_int("max_tree_depth", max_tree_depth, 1)
    if max_tree_depth > 30:
        raise ValueError(f"max_tree_depth must be <= 30 (2^depth integrator steps), got {max_tree_depth}")
    threshold = _checks.check_real("divergence_threshold", divergence_threshold)
    if not threshold > 0:
        raise ValueError(f"divergence_threshold must be > 0, got {threshold}")
    coefficients = tuple(_checks.check_real("integrator coefficient", c) for c in integrator)
    if len(coefficients) % 2 == 0 or coefficients != coefficients[::-1]:
        raise ValueError(f"integrator must be a palindrome of odd length (e.g. fnebm.integrators.velocity_verlet), "
                         f"got {integrator}")
    if inverse_mass_matrix is not None:
        inverse_mass_matrix = check_inverse_mass_matrix(inverse_mass_matrix)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    kernel = _kernel_for(coefficients, threshold)
    step = Step.of("nuts", _step, kernel, caches_energy=True, state_type=NUTSState, info_type=NUTSInfo,
                   tunables=("step_size", "inverse_mass_matrix"), energy_fn=energy_fn, step_size=step_size,
                   inverse_mass_matrix=inverse_mass_matrix, max_tree_depth=max_tree_depth,
                   integrator=coefficients, divergence_threshold=threshold, backend=backend,
                   compile_energy=check_compile(compile_energy))
    return SamplingAlgorithm(functools.partial(init, energy_fn=energy_fn), step)


BACKENDS = ("auto", "c", "torch")


@caches_energy_of(NUTSState)
def _step(kernel, state: NUTSState, key: Tensor, energy_fn, step_size: Tensor, inverse_mass_matrix,
          max_tree_depth: int, integrator: tuple[float, ...], divergence_threshold: float,
          backend: str, compile_energy: bool | str = "auto") -> tuple[NUTSState, NUTSInfo]:
    """The step of :func:`nuts`: the C kernel where ``backend`` and the arguments allow, else ``kernel``."""
    x = state.position
    if inverse_mass_matrix is None:  # the identity, for any d
        inverse_mass_matrix = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    if backend != "torch":
        fr.check_key(key)  # the C kernel reads the words as they are (the torch kernel checks them in split)
        reason, dense, imm = _why_not_c(state, key, energy_fn, step_size, inverse_mass_matrix, integrator)
        if reason is None:
            closed = families.covers(energy_fn, families.C_NUTS) is None  # else evaluated in torch, eagerly
            evaluate = None if closed else evaluator(energy_fn, key.ndim - 1, compile_energy)
            with contextlib.nullcontext() if closed else evaluate.scope():
                out = cpu_nuts.nuts_step(energy_fn, x, state.energy, state.grad, key, step_size, imm, dense,
                                         max_tree_depth=max_tree_depth, coefficients=integrator,
                                         divergence_threshold=divergence_threshold, evaluate=evaluate)
            return NUTSState(*out[:3]), NUTSInfo(*out[3:])
        if backend == "c":
            raise BackendUnavailable("c", reason, "this NUTS transition", "the torch kernel instead")
    return kernel(state, key, energy_fn, step_size, inverse_mass_matrix, max_tree_depth)


def _kernel_reason(step: Any, state: NUTSState, key: Tensor) -> str | None:
    """``None`` when the C kernel runs a transition of ``step`` (a :func:`nuts` step) from ``state``, else
    why not: :func:`_step`'s own check, which ``fnebm.kernels.dispatch`` asks on the chain's behalf."""
    kw = step.keywords
    if kw["backend"] == "torch":  # the step's own choice, which a chain's backend="auto" leaves alone
        return 'the step was built with backend="torch"'
    x = state.position
    imm = kw["inverse_mass_matrix"]
    if imm is None:
        imm = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return _why_not_c(state, key, kw["energy_fn"], kw["step_size"], imm, kw["integrator"])[0]


def _kernel_traces(step: Any) -> bool:
    """Whether the C transition of ``step`` traces under ``torch.compile`` (one op for the energies the
    kernel computes itself); for any other energy it returns to Python for every evaluation, so
    it runs eagerly, with its evaluations compiled as ``compile_energy`` says."""
    return families.covers(step.keywords["energy_fn"], families.C_NUTS) is None


def _run_evaluated(step: Any, state: NUTSState, keys: Tensor, kernel: Callable[..., Any], **extra: Any) -> Any:
    """``kernel`` (:func:`fnebm.kernels.cpu_nuts.nuts_transitions` or ``nuts_warmup``) on ``keys: (T,
    *chains, 2)`` from ``state`` with ``step``'s parameters and an evaluator of its energy, when the C
    kernel runs ``step``'s transition on an energy it evaluates in torch; else ``None``."""
    kw = step.keywords
    energy_fn = kw["energy_fn"]
    if (kw["backend"] == "torch" or families.covers(energy_fn, families.C_NUTS) is None
            or not isinstance(keys, Tensor) or keys.ndim < 2):
        return None
    fr.check_key(keys)
    x = state.position
    imm = kw["inverse_mass_matrix"]
    if imm is None:
        imm = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    reason, dense, imm = _why_not_c(state, keys[0], energy_fn, kw["step_size"], imm, kw["integrator"])
    if reason is not None:
        return None
    evaluate = evaluator(energy_fn, keys.ndim - 2, kw["compile_energy"])
    with evaluate.scope():
        return kernel(evaluate, x, state.energy, state.grad, keys, kw["step_size"], imm, dense,
                      max_tree_depth=kw["max_tree_depth"], coefficients=kw["integrator"],
                      divergence_threshold=kw["divergence_threshold"], **extra)


def _kernel_many(step: Any, state: NUTSState, keys: Tensor) -> tuple[NUTSState, NUTSInfo] | None:
    """``keys: (T, *chains, 2)``: the ``T`` transitions of ``step`` from ``state``, stacked, when the C
    kernel runs them on an energy it evaluates in torch (:func:`fnebm.kernels.cpu_nuts.nuts_transitions`:
    each chain goes on to its next transition without waiting for the others' trees; the same
    transitions as ``T`` calls of the step, bit for bit); ``None`` when the step would not take
    that kernel (then call it ``T`` times). Eager runs of ``sample_chain`` use it."""
    out = _run_evaluated(step, state, keys, cpu_nuts.nuts_transitions)
    return None if out is None else (NUTSState(*out[:3]), NUTSInfo(*out[3:]))


def _kernel_warmup(step: Any, state: NUTSState, keys: Tensor, **adaptation: Any) -> tuple[NUTSState, Any] | None:
    """``keys: (T, *chains, 2)``: ``T`` iterations of window adaptation around ``step``'s transition, in
    C (:func:`fnebm.kernels.cpu_nuts.nuts_warmup`, ``adaptation`` its keywords), when the kernel runs
    the transition on an energy it evaluates in torch: ``(the states stacked, the Warmup)``, else
    ``None``. :mod:`fnebm.adaptation.window`'s eager iterations use it."""
    out = _run_evaluated(step, state, keys, cpu_nuts.nuts_warmup, **adaptation)
    return None if out is None else (NUTSState(out.position, out.energy, out.grad), out)


_step.kernel_reason = _kernel_reason  # the step's transition kernel check, read by fnebm.kernels.dispatch
_step.kernel_traces = _kernel_traces
_step.kernel_many = _kernel_many  # several transitions at once, read by fnebm.chain's eager loop
_step.kernel_warmup = _kernel_warmup  # window adaptation's iterations at once, read by fnebm.adaptation.window


def _why_not_c(state: NUTSState, key: Tensor, energy_fn, step_size: Tensor, inverse_mass_matrix,
               integrator: tuple[float, ...]) -> tuple[str | None, bool, Tensor | None]:
    """``(reason, dense, inverse_mass_matrix tensor)``: ``reason`` is ``None`` when the C kernel runs this
    transition, else why not (metadata only; a shape the torch kernel refuses is left for it to name)."""
    x = state.position
    if not isinstance(x, Tensor) or not isinstance(key, Tensor) or x.device.type != "cpu":
        return "the chains are not on the CPU (the C kernel runs on the CPU)", False, None
    if not isinstance(state, NUTSState):
        return f"the state is a {type(state).__name__}, not a NUTSState", False, None
    try:
        dense, imm = resolve(inverse_mass_matrix, tuple(key.shape[:-1]), x.shape[-1])
    except ValueError as exc:
        return str(exc), False, None
    return (cpu_nuts.why_not(energy_fn, x, state.energy, state.grad, key, step_size, imm, dense, integrator,
                             evaluated=True), dense, imm)
