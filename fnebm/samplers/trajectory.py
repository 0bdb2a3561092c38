"""NUTS's trajectory: tree doubling, subtree building and the choice of the proposal (BlackJAX's
``mcmc/trajectory.py`` and ``iterative_nuts_proposal``), for many chains in lockstep.

**The algorithm** (per chain). From the start point and its fresh momentum, expansion
``k = 0, 1, ...``: draw a direction, integrate a subtree of ``2^k`` steps from the trajectory's
edge on that side, sampling a subtree proposal *uniformly* in proportion to ``exp(-H)`` as it
goes (progressive multinomial sampling). A subtree that diverges (energy error above
``divergence_threshold``, or anything non-finite) or turns (:mod:`fnebm.samplers.termination`)
is dropped and the tree stops. Otherwise the subtree's proposal replaces the tree's with
probability ``min(1, W_subtree / W_tree)`` (the *biased* progressive sampling that favours
moving away), the subtree is merged, and the tree stops when the merged trajectory turns or
after ``max_tree_depth`` expansions.

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

One gradient per leapfrog step: the start point comes with its energy and gradient, and every
point of the trajectory carries its own.

The loop's carry is seven tensors (the iteration, and the per-chain integers, flags, scalars,
points, checkpoint vectors and checkpoint scalars each stacked into one): Inductor's compiled
loop allocates, checks and passes every carry entry on every iteration, in Python, and with 36
separate entries that overhead rivalled the arithmetic at tens of chains. The body unpacks them
into views and stacks its results back; the arithmetic, and so every draw, is unchanged.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from fnebm import random as fr
from fnebm._control import while_loop
from fnebm.integrators.symplectic import IntegratorState, integrate
from fnebm.samplers.base import all_finite
from fnebm.samplers.termination import is_tree_turning, iterative_turning, new_checkpoints

__all__ = ["Proposal", "iterative_nuts_proposal"]


class Proposal(NamedTuple):
    """What one NUTS trajectory returns, each field per chain: the proposal (``position``,
    ``energy``, ``grad``) and the fields of :class:`~fnebm.samplers.nuts.NUTSInfo`, in its order."""

    position: Tensor
    energy: Tensor
    grad: Tensor
    acceptance_rate: Tensor
    is_divergent: Tensor
    is_turning: Tensor
    energy_error: Tensor
    tree_depth: Tensor
    num_integration_steps: Tensor


def _dot(a: Tensor, b: Tensor) -> Tensor:
    return (a * b).sum(-1)


def iterative_nuts_proposal(
    integrator: tuple[float, ...], divergence_threshold: float, *, uturn_extra_checks: bool = True
) -> Callable[..., Proposal]:
    """``propose(start, velocity, h0, key, step_size, value_and_grad, velocity_fn, max_tree_depth,
    n_batch) -> Proposal``: the trajectory of one NUTS transition for every chain.

    start: an :class:`~fnebm.integrators.symplectic.IntegratorState` ``(position, momentum, energy,
    grad)`` with ``n_batch`` leading chain axes; velocity: ``M^{-1} momentum``; h0: the start's
    Hamiltonian (per chain); key: ``(*chains, 2)``, the trajectory's randomness; step_size:
    shaped to broadcast against positions; value_and_grad: the batched energy and gradient;
    velocity_fn: ``p -> M^{-1} p``; max_tree_depth: a Python int >= 1 (it sizes the
    checkpoints). ``integrator``: symplectic coefficients; ``uturn_extra_checks``: Stan's checks
    across the halves of every merge (:mod:`fnebm.samplers.termination`).
    """

    def propose(start: IntegratorState, velocity: Tensor, h0: Tensor, key: Tensor, step_size: Tensor,
                value_and_grad: Callable, velocity_fn: Callable[[Tensor], Tensor], max_tree_depth: int,
                n_batch: int) -> Proposal:
        x0, p0, energy0, grad0 = start
        v0 = velocity
        h, vg, depth = step_size, value_and_grad, int(max_tree_depth)
        batch = tuple(x0.shape[:n_batch])
        n_event = x0.ndim - n_batch
        dtype, device = x0.dtype, x0.device
        # checkpoint slots, leading the chain axes: (depth, *chains, 1...)
        slot = torch.arange(depth, device=device).reshape((depth,) + (1,) * n_batch)

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
        #   ck (4, depth, *chains, d), cks (3, depth, *chains): the U-turn checkpoints
        #     (fnebm.samplers.termination.new_checkpoints)
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
            draws = fr.uniform(fr.fold_in(key, i), (3,), dtype)
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
            nx, np_, nu, ng = integrate(IntegratorState(x, p, u, g), wide(sign) * h, vg, velocity_fn, integrator)
            nv = velocity_fn(np_)
            nh = nu + 0.5 * _dot(np_, nv)
            finite = all_finite(nh, ng, nx, n_batch=n_batch)
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
            # the subtree's first point and the one before it (the tree's edge), for Stan's checks
            at0 = wide(active & first)
            r0, v0 = torch.where(at0, np_, r0), torch.where(at0, nv, v0)
            q0, w0 = torch.where(at0, p, q0), torch.where(at0, v, w0)

            # the U-turns inside the subtree, from its checkpoints (a divergent point's momentum is not checked)
            ck, cks, sub_turning = iterative_turning(ck, cks, slot, n, active, p, v, np_, nv, sub_sum,
                                                     uturn_extra_checks)
            sub_turning = active & ~divergent & sub_turning

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
            tree_turning = merge & is_tree_turning(pf, vf, np_, nv, tree_sum, sub_sum, merged_sum, r0, v0, q0, w0,
                                                   uturn_extra_checks)
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
                    ck, cks)

        zero, one = torch.zeros(batch, dtype=dtype, device=device), torch.ones(batch, dtype=torch.bool, device=device)
        ints = torch.zeros((3,) + batch, dtype=torch.int64, device=device)
        flags = torch.stack((one, one, ~one, ~one))
        scalars = torch.stack((energy0, energy0, energy0, h0, zero, energy0, h0, zero, zero))
        points = torch.stack((x0, p0, grad0, v0, x0, p0, grad0, v0, x0, grad0, x0, grad0, p0,
                              torch.zeros_like(p0), p0, v0, p0, v0))
        ck, cks = new_checkpoints(depth, tuple(x0.shape), n_batch, dtype, device)
        out = while_loop(cond, body, (torch.zeros((), dtype=torch.int64, device=device), ints, flags, scalars,
                                      points, ck, cks))
        k, _, steps = out[1].unbind(0)
        _, _, diverged, turned = out[2].unbind(0)
        _, _, pu, ph, _, _, _, _, accept_sum = out[3].unbind(0)
        px, pg = out[4][8], out[4][9]
        return Proposal(px, pu, pg, accept_sum / steps.clamp_min(1).to(dtype), diverged, turned, ph - h0, k + 1, steps)

    return propose
