"""The No-U-Turn sampler: iterative NUTS with multinomial sampling and the generalised U-turn
criterion (as BlackJAX's ``mcmc/nuts.py`` and Stan), written for many chains in lockstep.

Three layers, as every sampler: :func:`init` (one chain), :func:`build_kernel` (the pure
kernel over any chain axes, with the integrator as data) and :func:`nuts` (the constructor).

**The algorithm** (per chain; BlackJAX's ``iterative_nuts_proposal``). Draw ``p ~ N(0, M)``.
Expansion ``k = 0, 1, ...``: draw a direction, integrate a subtree of ``2^k`` steps from the
trajectory's edge on that side, sampling a subtree proposal *uniformly* in proportion to
``exp(-H)`` as it goes (progressive multinomial sampling). A subtree that diverges (energy error
above ``divergence_threshold``, or anything non-finite) or turns is dropped and the tree stops.
Otherwise the subtree's proposal replaces the tree's with probability
``min(1, W_subtree / W_tree)`` (the *biased* progressive sampling that favours moving away),
the subtree is merged, and the tree stops when the merged trajectory turns or after
``max_tree_depth`` expansions.

The U-turn criterion is the generalised one (Betancourt 2013): a span with end momenta
``p-, p+``, velocities ``v = M^{-1} p`` and momentum sum ``rho`` turns when
``v- . r <= 0`` or ``v+ . r <= 0`` with ``r = rho - (p- + p+) / 2`` (NumPyro's and BlackJAX's
form). Every balanced sub-subtree is checked when it completes, through checkpoints of momentum
and momentum sum indexed by bit tricks on the step number (NumPyro's ``iterative_uturn``): a
subtree of ``2^j`` steps ending at step ``n`` of its subtree starts at checkpoint
``popcount(n >> 1) - j + 1``. With ``uturn_extra_checks`` (default, Stan's since 2.21) each
merge of two halves ``A | B`` also checks ``A + first(B)`` and ``last(A) + B``, inside subtrees
(the second half's start checkpoint sits at the next index) and at the top level; it stops the
trajectories that turn *between* the halves, which the plain criterion misses on
near-periodic targets.

**The loop: one flat ``while_loop`` over leapfrog steps.** Every chain advances one integrator
step per iteration, with per-chain counters (expansion ``k``, step ``n`` in the subtree,
direction); the bookkeeping of a subtree's end (merge, biased sampling, the top-level U-turn
check, the next direction) happens in the same iteration, masked with ``torch.where``. A chain
that is done freezes (its step size set to 0, its carry kept) until the last chain is done.
Why flat rather than BlackJAX's two nested loops: with chains in lockstep, a nested loop would
make every chain wait at each expansion for the slowest one, and its body (holding the
gradient) would appear once per nesting level in the graph; the flat loop has one body, one
gradient per iteration, and costs ``max over chains of the number of leapfrog steps``
iterations. The randomness of iteration ``t`` of a chain is ``uniform(fold_in(key, t), 3)``
(within-subtree choice, merge choice, direction), so a chain's draws depend on its own key and
step count only: a batch of chains equals each chain run alone.

Checkpoints live in ``(max_tree_depth, *chains, d)`` tensors, stored in the form the checks
read: the checkpoint's velocity ``v`` and ``e = S - r/2`` (``r`` its momentum, ``S`` the
subtree's running momentum sum there), so the U-turn of the span from a checkpoint to the current
point is ``dot(v, y) - dot(v, e)`` and ``dot(nv, y) - dot(nv, e)`` with ``y = S_now - p_now/2``
(``dot(v, e)`` kept as a scalar per slot). A check is then two batched dot products over the slot
arrays, never a matrix product, and reads each array once whatever the depth (Stan's extra checks
add one more pair of arrays; the first-of-B check depends on two checkpoints only and is decided
when the second is written). Measured by ``bench/nuts_trip.py`` (64 chains x 50 dimensions,
depth 10, 2 cores, the same draws): 211 us per loop trip for the five-array form it replaced,
187 us for this one.

One gradient per leapfrog step: the state caches the energy and gradient at the position, and so
does every point of the trajectory.

**On the CPU, a C kernel.** For float32 chains on an energy the C kernels compute in closed form,
:func:`nuts` (``backend="auto"``) runs each transition in :mod:`fnebm.kernels.cpu_nuts` instead:
the same algorithm and the same draws, one chain after another per thread, each building its own
tree, so no chain waits for the longest one. The kernel below is its twin, and serves every other
run (another dtype or device, any other energy function, a gradient through the step).

The loop's carry is seven tensors (the iteration, and the per-chain integers, flags, scalars,
points, checkpoint vectors and checkpoint scalars each stacked into one): Inductor's compiled loop allocates, checks and
passes every carry entry on every iteration, in Python, and with 36 separate entries that
overhead rivalled the arithmetic at tens of chains. The body unpacks them into views and
stacks its results back; the arithmetic, and so every draw, is unchanged.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import _checks
from fnebm import random as fr
from fnebm._control import while_loop
from fnebm.gradients import value_and_grad
from fnebm.integrators.metrics import InverseMassMatrix, check_inverse_mass_matrix, euclidean, resolve
from fnebm.kernels import cpu_nuts
from fnebm.integrators.symplectic import IntegratorState, integrate, velocity_verlet
from fnebm.samplers.base import (
    Step,
    KernelCache,
    SamplingAlgorithm,
    chain_axes,
    check_energy,
    all_finite,
    init_position_state,
    per_chain,
)

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
    return init_position_state(NUTSState, position, energy_fn)


def _dot(a: Tensor, b: Tensor) -> Tensor:
    return (a * b).sum(-1)


def _turning(p_left: Tensor, v_left: Tensor, p_right: Tensor, v_right: Tensor, p_sum: Tensor) -> Tensor:
    """The generalised U-turn criterion of a span with end momenta ``p_left, p_right`` (velocities
    ``v = M^{-1} p``) and momentum sum ``p_sum`` (ends included). Symmetric in the two ends."""
    rho = p_sum - 0.5 * (p_left + p_right)
    return (_dot(v_left, rho) <= 0) | (_dot(v_right, rho) <= 0)


def _popcount(n: Tensor) -> Tensor:
    """Set bits of ``n`` (int64, ``0 <= n < 2**32``): the SWAR count, a dozen ops for any depth."""
    n = n - ((n >> 1) & 0x55555555)
    n = (n & 0x33333333) + ((n >> 2) & 0x33333333)
    n = (n + (n >> 4)) & 0x0F0F0F0F
    return ((n * 0x01010101) & 0xFFFFFFFF) >> 24


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
    """

    def kernel(state: NUTSState, key: Tensor, energy_fn: Callable[[Tensor], Tensor], step_size: Tensor,
               inverse_mass_matrix, max_tree_depth: int = 10):
        batch = chain_axes(state.energy, key)
        x0 = state.position
        depth = int(max_tree_depth)
        h = per_chain("step_size", step_size, batch, x0)
        metric = euclidean(inverse_mass_matrix, x0, len(batch))
        keys = fr.split(key, 2)
        p0 = metric.sample_momentum(keys[..., 0, :], x0)
        k_traj = keys[..., 1, :]
        v0 = metric.velocity(p0)
        h0 = state.energy + 0.5 * _dot(p0, v0)
        vg = value_and_grad(energy_fn, len(batch))
        n_event = x0.ndim - len(batch)
        dtype, device = x0.dtype, x0.device
        # checkpoint slots, leading the chain axes: (depth, *chains, 1...)
        slot = torch.arange(depth, device=device).reshape((depth,) + (1,) * len(batch))

        def wide(mask: Tensor) -> Tensor:  # a per-chain mask against (*chains, d)
            return mask.reshape(mask.shape + (1,) * n_event)

        # The loop's carry is packed into seven tensors (fewer buffers for the compiled loop to
        # allocate and copy per iteration); the body unpacks them into views and restacks them:
        #   ints (3, *chains): k (expansion), n (step in the subtree), steps (gradients so far)
        #   flags (4, *chains): active, fwd (direction), diverged, turned
        #   scalars (9, *chains): u, uf, pu, ph, pw, su, sh, sw (potential energies, H and log
        #     weights below) and accept_sum
        #   points (18, *chains, d): x, p, g, v, xf, pf, gf, vf, px, pg, sx, sg, tree_sum, sub_sum,
        #     and the subtree's first point and the one before it: r0, v0, q0, w0
        #   ck (4, depth, *chains, d): per checkpoint slot, the velocity v and e = S - r / 2 (r its
        #     momentum, S the subtree's running momentum sum there); for Stan's checks the
        #     velocity w of the point before it (momentum q) and f = r - S + q / 2
        #   cks (3, depth, *chains): dot(v, e), dot(w, f), and 1.0 where the pair of halves that
        #     ends at the slot turns (Stan's first-of-B check, final once the slot is written)
        # The U-turn of a span from slot j to the current point (momentum p, velocity nv, running
        # sum S) is rho = S - S_j + r_j - (r_j + p) / 2 = y - e_j with y = S - p / 2, so its two dot
        # products are dot(v_j, y) - dot(v_j, e_j) and dot(nv, y) - dot(nv, e_j): each check
        # reads two slot arrays once, whatever the depth.
        def cond(i, ints, flags, scalars, points, ck, cks):
            return flags[0].any()

        def body(i, ints, flags, scalars, points, ck, cks):
            k, n, steps = ints.unbind(0)
            active, fwd, diverged, turned = flags.unbind(0)
            u, uf, pu, ph, pw, su, sh, sw, accept_sum = scalars.unbind(0)
            # x, p, g, v: the point integration continues from (its velocity v = M^{-1} p);
            # xf, pf, gf, vf: the trajectory's other edge; px, pg (pu, ph, pw): the tree's proposal,
            # its H and the tree's log weight; sx, sg (su, sh, sw): the subtree's; tree_sum,
            # sub_sum: momentum sums of the merged tree and of the subtree
            x, p, g, v, xf, pf, gf, vf, px, pg, sx, sg, tree_sum, sub_sum, r0, v0, q0, w0 = points.unbind(0)
            v_ck, e_ck, w_ck, f_ck = ck.unbind(0)
            a_ck, c_ck, pair_ck = cks.unbind(0)
            draws = fr.uniform(fr.fold_in(k_traj, i), (3,), dtype)
            u_sub, u_merge, u_dir = draws[..., 0], draws[..., 1], draws[..., 2]

            # a new subtree: draw its direction, and start from the edge on that side
            first = n == 0
            new_fwd = torch.where(active & first, u_dir < 0.5, fwd)
            swap = new_fwd != fwd
            ws = wide(swap)
            x, xf = torch.where(ws, xf, x), torch.where(ws, x, xf)
            p, pf = torch.where(ws, pf, p), torch.where(ws, p, pf)
            u, uf = torch.where(swap, uf, u), torch.where(swap, u, uf)
            g, gf = torch.where(ws, gf, g), torch.where(ws, g, gf)
            v, vf = torch.where(ws, vf, v), torch.where(ws, v, vf)

            # one integrator step (step size 0 for a finished chain: it stays where it is)
            sign = torch.where(new_fwd & active, 1.0, torch.where(active, -1.0, 0.0)).to(dtype)
            nx, np_, nu, ng = integrate(IntegratorState(x, p, u, g), wide(sign) * h, vg, metric.velocity, integrator)
            nv = metric.velocity(np_)
            nh = nu + 0.5 * _dot(np_, nv)
            finite = all_finite(nh, ng, nx, n_batch=len(batch))
            delta = torch.where(finite, h0 - nh, torch.full_like(nh, -math.inf))  # log weight exp(-(H - H0))
            divergent = active & ~(finite & (-delta <= divergence_threshold))
            accept_sum = accept_sum + torch.where(active, torch.exp(torch.clamp_max(delta, 0.0)), 0.0)
            steps = steps + active.to(steps.dtype)

            # progressive uniform sampling inside the subtree (its first point is taken outright)
            take = active & (first | (u_sub < torch.sigmoid(delta - sw)))
            wt = wide(take)
            sx, sg = torch.where(wt, nx, sx), torch.where(wt, ng, sg)
            su, sh = torch.where(take, nu, su), torch.where(take, nh, sh)
            sw = torch.where(active, torch.where(first, delta, torch.logaddexp(sw, delta)), sw)
            sub_sum = torch.where(wide(active), torch.where(wide(first), np_, sub_sum + np_), sub_sum)
            y = sub_sum - 0.5 * np_

            # checkpoints at even steps, in slot popcount(n); slot 0 (n = 0) is also kept whole
            bits_n, bits_next = _popcount(n), _popcount(n + 1)
            write_cks = active & (n % 2 == 0) & (slot == bits_n)
            write = wide(write_cks)
            v_ck = torch.where(write, nv, v_ck)
            e_ck = torch.where(write, y, e_ck)  # at the checkpoint itself, y is its e = S - r / 2
            a_ck = torch.where(write_cks, _dot(nv, y), a_ck)
            at0 = wide(active & first)
            r0, v0 = torch.where(at0, np_, r0), torch.where(at0, nv, v0)
            q0, w0 = torch.where(at0, p, q0), torch.where(at0, v, w0)

            # U-turns of the balanced subtrees completed at step n (n odd, t trailing ones: sizes 2..2^t)
            # start at slots popcount(n + 1) - 1 (the largest) .. popcount(n) - 1 (the pair)
            hi, lo = bits_n - 1, bits_next - 1
            span = (slot >= lo) & (slot <= hi)  # empty for even n
            vy, nvy = _dot(v_ck, y), _dot(nv, y)
            sub_turning = (span & ((vy - a_ck <= 0) | (nvy - _dot(nv, e_ck) <= 0))).any(0)
            if uturn_extra_checks and depth > 1:
                # halves A | B of the subtree starting at slot j: B starts at slot j + 1. When slot
                # b = j + 1 is written, slot j holds A's start: A + first(B) is checked then, and
                # last(A) + B (rho = y + f_b) at every step after, from w and f of slot b
                prev = (bits_n - 1).clamp_min(0).reshape((1,) + tuple(batch) + (1,) * n_event)
                prev = prev.expand((1,) + tuple(x0.shape))
                v_a, e_a = v_ck.gather(0, prev)[0], e_ck.gather(0, prev)[0]
                rho_ab = y - e_a
                pair = ((_dot(v_a, rho_ab) <= 0) | (_dot(nv, rho_ab) <= 0)).to(dtype)
                new_f = np_ - sub_sum + 0.5 * p  # r - S + q / 2
                w_ck = torch.where(write, v, w_ck)
                f_ck = torch.where(write, new_f, f_ck)
                c_ck = torch.where(write_cks, _dot(v, new_f), c_ck)
                pair_ck = torch.where(write_cks, pair, pair_ck)
                second = (slot > lo) & (slot <= hi)
                last_a_b = (_dot(w_ck, y) + c_ck <= 0) | (nvy + _dot(nv, f_ck) <= 0)
                sub_turning = sub_turning | (second & ((pair_ck > 0) | last_a_b)).any(0)
            sub_turning = active & ~divergent & sub_turning  # a divergent point's momentum is not checked

            # the subtree's end: merge it, or stop
            end = active & (n + 1 == torch.bitwise_left_shift(torch.ones_like(k), k))
            stop = divergent | sub_turning
            merge = end & ~stop
            take = merge & (u_merge < torch.exp(torch.clamp_max(sw - pw, 0.0)))  # biased sampling
            wt = wide(take)
            px, pg = torch.where(wt, sx, px), torch.where(wt, sg, pg)
            pu, ph = torch.where(take, su, pu), torch.where(take, sh, ph)
            pw = torch.where(merge, torch.logaddexp(pw, sw), pw)
            merged_sum = tree_sum + sub_sum
            tree_turning = _turning(pf, vf, np_, nv, merged_sum)
            if uturn_extra_checks:
                # tree + the subtree's first point; the tree's edge it grew from + the subtree
                tree_turning = (tree_turning | _turning(pf, vf, r0, v0, tree_sum + r0)
                                | _turning(q0, w0, np_, nv, sub_sum + q0))
            tree_turning = merge & tree_turning
            tree_sum = torch.where(wide(merge), merged_sum, tree_sum)
            done = stop | tree_turning | (merge & (k + 1 >= depth))
            k = torch.where(merge & ~done, k + 1, k)
            n = torch.where(active, torch.where(end, 0, n + 1), n)

            # integration continues from the new point (a non-finite one ends the chain's tree anyway)
            keep = active & finite
            wk = wide(keep)
            x, p, g, v = torch.where(wk, nx, x), torch.where(wk, np_, p), torch.where(wk, ng, g), torch.where(wk, nv, v)
            u = torch.where(keep, nu, u)
            diverged = diverged | divergent
            turned = turned | sub_turning | tree_turning
            return (i + 1, torch.stack((k, n, steps)), torch.stack((active & ~done, new_fwd, diverged, turned)),
                    torch.stack((u, uf, pu, ph, pw, su, sh, sw, accept_sum)),
                    torch.stack((x, p, g, v, xf, pf, gf, vf, px, pg, sx, sg, tree_sum, sub_sum, r0, v0, q0, w0)),
                    torch.stack((v_ck, e_ck, w_ck, f_ck)), torch.stack((a_ck, c_ck, pair_ck)))

        zero, one = torch.zeros(batch, dtype=dtype, device=device), torch.ones(batch, dtype=torch.bool, device=device)
        ints = torch.zeros((3,) + tuple(batch), dtype=torch.int64, device=device)
        flags = torch.stack((one, one, ~one, ~one))
        scalars = torch.stack((state.energy, state.energy, state.energy, h0, zero, state.energy, h0, zero, zero))
        points = torch.stack((x0, p0, state.grad, v0, x0, p0, state.grad, v0, x0, state.grad, x0, state.grad, p0,
                              torch.zeros_like(p0), p0, v0, p0, v0))
        ck = torch.zeros((4, depth) + tuple(x0.shape), dtype=dtype, device=device)
        cks = torch.zeros((3, depth) + tuple(batch), dtype=dtype, device=device)
        out = while_loop(cond, body, (torch.zeros((), dtype=torch.int64, device=device), ints, flags, scalars,
                                      points, ck, cks))
        k, _, steps = out[1].unbind(0)
        _, _, diverged, turned = out[2].unbind(0)
        _, _, pu, ph, _, _, _, _, accept_sum = out[3].unbind(0)
        px, pg = out[4][8], out[4][9]
        info = NUTSInfo(accept_sum / steps.clamp_min(1).to(dtype), diverged, turned, ph - h0, k + 1, steps)
        return NUTSState(px, pu, pg), info

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
) -> SamplingAlgorithm:
    """NUTS targeting ``p(x) ∝ exp(-E(x))``: trajectories that double until they turn.

    ``step_size``: a number or a tensor, 0-dim or one per chain. ``inverse_mass_matrix``:
    diagonal ``(d,)`` / ``(*chains, d)`` or dense ``(d, d)`` / ``(*chains, d, d)`` (``None``: the
    identity, for any d); see :mod:`fnebm.integrators.metrics`. ``max_tree_depth``: a Python int
    >= 1, at most ``2^max_tree_depth - 1`` integrator steps per transition. A subtree whose
    energy error exceeds ``divergence_threshold`` or turns non-finite is dropped, the tree stops
    and the transition is flagged ``is_divergent``.

    ``backend``: which code runs a transition. ``"auto"`` (default) takes the C kernel of
    :mod:`fnebm.kernels.cpu_nuts` where it applies — CPU float32 tensors, an energy the C kernels
    compute in closed form (:class:`~fnebm.energies.Gaussian`, :class:`~fnebm.energies.DoubleWell`,
    :class:`~fnebm.energies.Harmonic`, :class:`~fnebm.energies.Rastrigin`), no ``torch.func``
    transform and no gradient through the step — where each chain builds its own tree instead of
    waiting in lockstep for the longest one; elsewhere the torch kernel (:func:`build_kernel`).
    ``"c"`` insists on the C kernel (``ValueError`` naming what prevents it); ``"torch"`` always runs
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
    step = Step.of("nuts", _step, kernel, state_type=NUTSState, info_type=NUTSInfo,
                   tunables=("step_size", "inverse_mass_matrix"), energy_fn=energy_fn, step_size=step_size,
                   inverse_mass_matrix=inverse_mass_matrix, max_tree_depth=max_tree_depth,
                   integrator=coefficients, divergence_threshold=threshold, backend=backend)
    return SamplingAlgorithm(functools.partial(init, energy_fn=energy_fn), step)


BACKENDS = ("auto", "c", "torch")


def _step(kernel, state: NUTSState, key: Tensor, energy_fn, step_size: Tensor, inverse_mass_matrix,
          max_tree_depth: int, integrator: tuple[float, ...], divergence_threshold: float,
          backend: str) -> tuple[NUTSState, NUTSInfo]:
    """The step of :func:`nuts`: the C kernel where ``backend`` and the arguments allow, else ``kernel``."""
    x = state.position
    if inverse_mass_matrix is None:  # the identity, for any d
        inverse_mass_matrix = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    if backend != "torch":
        fr.check_key(key)  # the C kernel reads the words as they are (the torch kernel checks them in split)
        reason, dense, imm = _why_not_c(state, key, energy_fn, step_size, inverse_mass_matrix, integrator)
        if reason is None:
            out = cpu_nuts.nuts_step(energy_fn, x, state.energy, state.grad, key, step_size, imm, dense,
                                     max_tree_depth=max_tree_depth, coefficients=integrator,
                                     divergence_threshold=divergence_threshold)
            return NUTSState(*out[:3]), NUTSInfo(*out[3:])
        if backend == "c":
            raise ValueError(f'backend="c" cannot run this NUTS transition: {reason}. backend="auto" runs it with '
                             "the torch kernel instead")
    return kernel(state, key, energy_fn, step_size, inverse_mass_matrix, max_tree_depth)


def _kernel_reason(step: Any, state: NUTSState, key: Tensor) -> str | None:
    """``None`` when the C kernel runs a transition of ``step`` (a :func:`nuts` step) from ``state``, else
    why not: :func:`_step`'s own check, which ``fnebm.kernels.dispatch`` asks on the chain's behalf."""
    kw = step.keywords
    x = state.position
    imm = kw["inverse_mass_matrix"]
    if imm is None:
        imm = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return _why_not_c(state, key, kw["energy_fn"], kw["step_size"], imm, kw["integrator"])[0]


_step.kernel_reason = _kernel_reason  # the step's transition kernel check, read by fnebm.kernels.dispatch


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
    return cpu_nuts.why_not(energy_fn, x, state.energy, state.grad, key, step_size, imm, dense, integrator), dense, imm
