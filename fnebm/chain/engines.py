"""The engines :func:`fnebm.sample_chain` drives: each runs "this chunk of steps, keeping these
draws in these buffers", so the one run loop in :mod:`fnebm.chain.sample` owns chunking,
thinning, progress, ``out=`` and continuation for all of them.

* :class:`TorchEngine` — the sampler's own step, through the compiled runner or eagerly (the
  compile decision, its fallback and ``auto``'s ledger live here);
* :class:`KernelEngine` — a hand-written whole-chain kernel (``run_into`` of the module a
  :class:`fnebm.kernels.dispatch.FastPath` names: Triton on CUDA, C on the CPU).

Which engine runs is decided by :func:`fnebm.kernels.dispatch.choose`, from one table.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fnebm import _checks, _loop
from fnebm import random as fr
from fnebm.chain.runner import GAIN_TIMED, RunPlan, describe_failure
from fnebm.chain.schedule import Kept
from fnebm.energies.neural import batch_form
from fnebm.kernels import dispatch
from fnebm.samplers.base import step_fields

__all__ = ["TorchEngine", "KernelEngine", "sync"]


def sync(device: torch.device) -> None:
    # only around chunks and the probe, never inside a step: clocks read real time
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


# While a compile runs in the background, eager chunks last about this long (the switch waits for a chunk's end)
_BACKGROUND_CHUNK_S = 0.5

# With out=, a compiled call's own output stays under this size (glibc reuses freed blocks
# below its adaptive mmap threshold, 32 MiB at most, instead of mapping fresh pages).
_SCRATCH_BYTES = 8 * 2**20

# Events up to this many elements are stored chain-innermost while a one-axis batch runs.
_CHAINS_LAST_MAX_EVENT = 64


def _whole_batch_energy(step: Any) -> bool:
    """Whether ``step`` is a sampler's step whose energy is evaluated for all chains at once (a module's,
    :func:`fnebm.energies.from_module`; :func:`fnebm.energies.batched`): its small state then keeps the
    chain axis outermost in eager steps. Such an energy's matrix products give its gradient chain-outermost,
    and a state laid out the other way met it in mixed layouts at every step (the update's elementwise
    passes, which then cannot take the one-pass C helper): ``bench/eager_gap.py``, the 2-D MLP's eager step,
    1.005x the plain loop chain-outermost against 1.161x chain-innermost."""
    fields = step_fields(step)
    energy = None if fields is None else fields.keywords.get("energy_fn")
    return energy is not None and batch_form(energy) is not None


def _graphs_compiled() -> int:
    """Graphs Dynamo compiled so far in this process (its counter; Dynamo is loaded where a runner is compiled)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _chains_last(state: Any) -> Any:
    """The same tensors with the chain axis innermost in memory (strides only; shapes unchanged).

    With small events (a 10-D position) every per-step kernel then vectorises over chains,
    and the random draws of a batch of keys, computed chain-innermost, need no transpose.
    """
    leaves, spec = pytree.tree_flatten(state)
    if any(math.prod(x.shape[1:]) > _CHAINS_LAST_MAX_EVENT for x in leaves):
        return state
    return pytree.tree_unflatten(
        [x.movedim(0, -1).contiguous().movedim(-1, 0) if x.ndim >= 2 else x for x in leaves], spec
    )


# On a CUDA device, a chunk of at least this many eager steps runs as replays of one step captured as
# a CUDA graph (TorchEngine._graphed): the capture costs about two eager steps' host time.
_GRAPH_MIN_STEPS = 8
_CUDA_GRAPHS = True  # False: eager steps on a GPU run one by one (A/B, tests)
# in a plan's reason
GRAPH_NOTE = f"on CUDA, eager chunks of {_GRAPH_MIN_STEPS} or more steps replay one step captured as a CUDA graph"


def graphable(device: torch.device, steps: int) -> bool:
    """Whether a chunk of ``steps`` eager steps on ``device`` replays a CUDA graph (TorchEngine._graphed)."""
    return _CUDA_GRAPHS and device.type == "cuda" and steps >= _GRAPH_MIN_STEPS


class _GraphFailed(NamedTuple):
    """Why an eager step was not captured (one line), the warm-up step's ``(state, info)``, and whether
    the reason holds for every call of this kind of step and shapes (``lasting``: the capture itself
    failed) or only for this one (a gradient asked for through this call's chain)."""

    reason: str
    ran: Any
    lasting: bool = True


def _capture(fn: Callable[[], None], stream: Any) -> Any:
    """``fn``'s CUDA work captured on ``stream`` as a ``torch.cuda.CUDAGraph`` (raises what ``fn`` or
    the capture raised). ``torch.cuda.graph`` would also empty the allocator's cache at every capture.
    "thread_local": a background compile's thread may allocate meanwhile. A capture that fails is
    taken apart (:func:`_leave_pool`), so that the allocator goes on as if it had not begun."""
    graph = torch.cuda.CUDAGraph()
    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            fn()
        except BaseException:
            try:
                graph.capture_end()  # a capture that an operation did not invalidate ends here
            except BaseException:  # noqa: BLE001 - invalidated: keep fn's error
                _leave_pool(stream.device, pool)
            raise
        try:
            graph.capture_end()
        except BaseException:
            _leave_pool(stream.device, pool)
            raise
    return graph


def _leave_pool(device: torch.device, pool: Any) -> None:
    """After a capture whose end failed: torch's ``capture_end`` raises before it tells the allocator
    that allocations no longer go to the graph's pool, which would leave the allocator "capturing"
    for good (``empty_cache`` refused, no freeing of cached blocks before an out-of-memory error).
    Says so for it, and releases the pool (the graph, never captured, will not)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    for leave in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        with contextlib.suppress(Exception):  # already done by a capture_end that got that far
            getattr(torch._C, leave)(index, pool)


_SIDE_STREAMS: dict = {}  # device -> the stream captures run on (one per device: each stream has its BLAS workspace)


@contextlib.contextmanager
def _side_stream(device: torch.device):
    """The side stream of ``device``, current inside (after the current stream's work), waited for after."""
    main = torch.cuda.current_stream(device)
    stream = _SIDE_STREAMS.get(main.device)
    if stream is None:
        stream = _SIDE_STREAMS[main.device] = torch.cuda.Stream(main.device)
    stream.wait_stream(main)
    try:
        with torch.cuda.stream(stream):
            yield stream
    finally:
        main.wait_stream(stream)


def _tunables_on(step: Callable, device: torch.device) -> Callable:
    """``step`` with its tensor tunables held on ``device`` (a sampler's :class:`Step`; any other step
    as it is): a kernel that copies a CPU step size to the device at every step would wait for the
    host inside the captured step, which a capture refuses. A kernel's host scalars stay (see
    :meth:`fnebm.samplers.base.Step.of`): a capture takes them as the constants they are."""
    fields = step_fields(step)
    if fields is None:
        return step
    moved = {k: v.to(device) for k, v in fields.tunables.items() if isinstance(v, Tensor) and v.device != device
             and not (fields.host_scalars and v.ndim == 0 and v.device.type == "cpu")}  # those stay host scalars
    return fields.replace(**moved) if moved else step


class _Graphed:
    """One eager step captured as a CUDA graph that advances its own buffers: ``state`` and ``info``
    (the last step's), and ``t``, the index of the step the next replay takes (its key is
    ``fold_in(keys, t)``, as :meth:`TorchEngine._one_by_one`'s)."""

    def __init__(self, step: Callable, keys: Tensor, state: Any, info: Any, t: Tensor):
        self.step, self.keys, self.state, self.info, self.t = step, keys, state, info, t
        self._leaves = pytree.tree_leaves((state, info))
        self.graph = None

    def _advance(self) -> None:
        new, info = self.step(self.state, fr.fold_in(self.keys, self.t))
        srcs = pytree.tree_leaves((new, info))
        if len(srcs) != len(self._leaves):
            raise ValueError("the step's output changed structure between two steps")
        # an output that is (or views) one of the state's own buffers in another place (info = the energy
        # before the move, say) is read before the copies below overwrite it
        held = {d.untyped_storage().data_ptr() for d in self._leaves}
        srcs = [src.clone() if src.untyped_storage().data_ptr() in held and src is not dst else src
                for dst, src in zip(self._leaves, srcs)]
        for dst, src in zip(self._leaves, srcs):
            dst.copy_(src)
        self.t.add_(1)

    def replay(self) -> None:
        self.graph.replay()

    def load(self, state: Any, t: Tensor) -> None:
        """The next replay takes step ``t`` from ``state`` (a chunk after another engine's, or a revised plan's)."""
        if state is not self.state:
            for dst, src in zip(pytree.tree_leaves(self.state), pytree.tree_leaves(state), strict=True):
                dst.copy_(src)
        self.t.copy_(t)

    @classmethod
    def make(cls, step: Callable, keys: Tensor, state: Any, t: Tensor) -> tuple[_Graphed | None, _GraphFailed | None]:
        """Step ``t`` run eagerly on a side stream (the warm-up a capture needs: the draws' kernels
        built, the BLAS workspace of that stream allocated), then the next step captured there.
        ``(graphed, None)`` with the warm-up step's result in its buffers, or ``(None, why)``."""
        step = _tunables_on(step, keys.device)
        with _side_stream(keys.device) as stream:
            ran = step(state, fr.fold_in(keys, t))
        leaves = pytree.tree_leaves(ran)
        if not all(isinstance(x, Tensor) and x.device == keys.device for x in leaves):
            return None, _GraphFailed("a step's output is not all tensors on the chain's device", ran)
        if keys.device.type == "cuda":
            main = torch.cuda.current_stream(keys.device)
            for x in leaves:  # made on the side stream, used and freed on this one
                x.record_stream(main)
        if any(x.requires_grad for x in leaves) or not _checks.is_concrete(*leaves):
            return None, _GraphFailed("a step's output is tracked by autograd or a torch.func transform", ran,
                                      lasting=False)
        # the graph's buffers: made on this stream, which replays the graph
        g = cls(step, keys, *pytree.tree_map(torch.clone, ran), t.to(torch.int64) + 1)
        try:
            with _side_stream(keys.device) as stream:
                g.graph = _capture(g._advance, stream)
        except Exception as exc:  # noqa: BLE001 - the step read a value on the host, say: eager steps
            return None, _GraphFailed(describe_failure(exc), ran)
        return g, None


class TorchEngine:
    """The sampler's step, compiled (``run``, the compiled runner) or eager (:meth:`_eager`) as
    ``plan`` says; kept draws copied into the buffers.

    ``expected``: the ``(trace, info)`` tree of meta tensors ``(n_kept, ...)``; ``bufs``: the
    caller's ``out`` leaves, or ``None`` (allocated at the first kept draw, or the output of a
    call that covers the whole trace taken as it is).
    """

    name = "torch"
    exact_sizes = False  # a lone last step joins the chunk before it (one graph for every length)

    def __init__(self, step, collect, chain, n_chain_axes: int, plan: RunPlan, run: Callable, ledger: Any,
                 expected: Any, bufs: list[Tensor] | None, n_kept: int, thin: int, record: bool,
                 on_plan: Callable | None, fall_back: Callable, compiled: Callable | None = None,
                 background_failed: Callable | None = None, between_chunks: bool = False):
        self.step, self.collect, self.keys, self.start = step, collect, chain.keys, chain.steps_taken
        self.plan, self.run, self.ledger, self.record = plan, run, ledger, record
        # while a compile runs in the background: the compiled runner once it is ready, and what
        # to do should it fail
        self.compiled, self.background_failed = compiled, background_failed
        self.expected, self.bufs, self.n_kept, self.thin = expected, bufs, n_kept, thin
        self.on_plan, self.fall_back = on_plan, fall_back
        # eager steps of a whole-batch energy keep its small state chain-outermost; the compiled runner's loop
        # carries it chain-innermost (its body gives the state back in that layout: a scan needs the same), and
        # so does a call whose compile runs in the background (it compiles for this state, and takes over)
        outermost = n_chain_axes == 1 and not plan.compiled and not plan.background and _whole_batch_energy(step)
        self.state = _chains_last(chain.state) if n_chain_axes == 1 and not outermost else chain.state
        self.device = chain.keys.device
        self.first = None  # (state, info) of the run's first step when it was computed already (the probe's)
        self.graph: _Graphed | None = None  # the eager step captured as a CUDA graph (see _graphed)
        self.between_chunks = between_chunks  # the caller's code runs between chunks (on_chunk): capture anew
        self.graph_failed: _GraphFailed | None = None  # why it could not be, in this call
        self.known = None  # the structure of the step's outputs (_loop.structure), when a step ran before

    def first_size(self, chunk_size: int) -> int:
        per = self.ledger.step_s()
        if self.plan.background and per:
            return max(2, min(chunk_size, int(_BACKGROUND_CHUNK_S / per)))
        return max(chunk_size, 2)

    def next_size(self, steps: int, seconds: float, chunk_size: int) -> int:
        if self.plan.background and seconds > 0:
            # eager chunks of about _BACKGROUND_CHUNK_S while the compile runs: it is looked for between chunks
            return max(2, min(chunk_size, int(_BACKGROUND_CHUNK_S * steps / seconds)))
        return max(chunk_size, 2)

    def _look_for_the_compile(self, a: int) -> None:
        """Between chunks, while a compile runs in the background: switch to it once it is ready."""
        if self.ledger.compiled:
            self.plan = self.plan._replace(compiled=True, background=False, revised=True, engine="compiled",
                                           reason=f"compiled from step {a} of this call on: the compile that ran "
                                                  "in the background is ready")
            self.run = self.compiled
        elif self.ledger.failed is not None:
            self.plan = self.background_failed(self.plan, self.ledger, a)
        else:
            return
        if self.on_plan is not None:
            self.on_plan(self.plan)

    def chunk(self, a: int, b: int, kept: Kept | None) -> None:
        if self.plan.background and self.ledger.pending is None:
            self._look_for_the_compile(a)
        t0 = time.perf_counter()
        ts = self.start + torch.arange(a, b, device=self.device)
        thinned = False  # the outputs hold only the kept steps (the eager runner keeps no others)
        reused = int(self.first is not None and not self.plan.compiled)  # a step the probe ran: not timed here
        # a compiled call of a runner compiled before is timed (its first few chunks: GAIN_TIMED), unless Dynamo
        # compiled a graph during it after all (a recompile): what compiling buys (RunnerCache.gain)
        timed = (self.plan.compiled and self.ledger.compiled and self.record
                 and self.ledger.compiled_chunks < GAIN_TIMED and b > a)
        graphs = _graphs_compiled() if timed else None
        if self.plan.compiled:
            if b - a >= 2:  # one graph for every chunk length (0 and 1 are specialised)
                torch._dynamo.mark_dynamic(ts, 0)
            failed = None
            try:
                ran = self.run(self.step, self.collect, self.keys, self.state, ts, self.known)
            except Exception as exc:  # noqa: BLE001 - a failed compile, or an error the eager steps raise too
                failed = describe_failure(exc)
            if failed is None:
                self.ledger.compiled = True
            else:
                # the same chunk from the same inputs (the compiled call is pure: nothing moved),
                # eagerly; an error of the step itself is raised here, as eager code raises it
                ran, thinned = self._eager(ts, kept), True
                self.plan, self.run = self.fall_back(self.plan, self.ledger, failed, a, self.on_plan), None
        else:
            ran, thinned = self._eager(ts, kept), True
        self.state, out, info = ran
        if not self.plan.compiled and self.record and b - a > reused:
            sync(self.device)
            self.ledger.record(time.perf_counter() - t0, b - a - reused)
        elif timed and _graphs_compiled() == graphs:
            sync(self.device)
            self.ledger.record_compiled(time.perf_counter() - t0, b - a)
        if kept is None or out is _WRITTEN:  # (the eager steps wrote their draws into the buffers)
            return
        outs = pytree.tree_leaves((out, info))
        lo, hi, step = (0, kept.j1 - kept.j0, 1) if thinned else (kept.lo, kept.hi, self.thin)
        if self.bufs is None and (kept.j0, kept.j1) == (0, self.n_kept) and (thinned or (
                (kept.lo, kept.hi, self.thin) == (0, b - a, 1))):
            self.bufs = [x.contiguous() for x in outs]  # one call covers the trace: its output is the trace
            return
        self._allocate()
        for buf, x in zip(self.bufs, outs):
            buf[kept.j0 : kept.j1].copy_(x[lo:hi:step])

    def _eager(self, ts: Tensor, kept: Kept | None) -> tuple[Any, Any, Any]:
        """The chunk's steps eagerly, keeping only the kept ones: ``(state, kept, info)`` with
        leaves ``(n, ...)`` for the ``n`` steps kept in this chunk (``None`` when none).

        The same steps as the compiled runner's (same keys, same draws), without what a compiled
        scan needs and eager code does not: no copy of the state at every step (nothing mutates
        it), and no stack of every step's draws when a chunk keeps a few of them."""
        many = getattr(getattr(self.step, "func", None), "kernel_many", None)
        if many is not None and ts.shape[0] > 1:
            ran = self._eager_many(many, ts, kept)
            if ran is not None:
                self.first = None  # step 0 ran again in the block (the probe's copy is not needed)
                return ran
        first, self.first = self.first, None
        if (graphable(self.device, ts.shape[0] - (first is not None)) and self.graph_failed is None
                and self.ledger.graph_failed is None):
            return self._graphed(ts, kept, first)
        return self._one_by_one(self.state, ts, 0, kept, [], first, write=True)

    def _graphed(self, ts: Tensor, kept: Kept | None, first: Any) -> tuple[Any, Any, Any]:
        """The chunk's steps on a CUDA device, one step captured as a CUDA graph and replayed: the same
        kernels as :meth:`_one_by_one`'s steps in the same order (the same draws), one launch a step.

        An eager step is host-bound on a GPU (a 784-D MLP's Langevin step: ~48 launches and 2.5 ms of
        host time for 0.1 ms of device time). The graph is captured once per engine (per call; per
        chunk when the caller's code runs between chunks) after a step run eagerly on the capture
        stream, and kept across chunks. It is not used, and the steps run as :meth:`_one_by_one` runs
        them, where a step's output is tracked by autograd (a gradient through the chain) or the
        capture fails (the energy reads a value on the host, say): the reason is kept in
        ``graph_failed``, and a failed capture in the ledger too (later calls of this kind of step and
        shapes do not try again); a revised plan says it."""
        state, outs, a, n = self.state, [], 0, ts.shape[0]
        if first is not None:  # step 0 ran in the probe
            state, info = first
            if self._keeps(kept, 0):
                outs.append((pytree.tree_map(torch.clone, self.collect(state)), info))
            a = 1
        with _checks.eager_block():
            g = self.graph
            if g is None:
                g, failed = _Graphed.make(self.step, self.keys, state, ts[a])
                if g is None:  # the warm-up step ran (and is kept) but the capture was not made
                    self.graph_failed = failed
                    if failed.lasting:  # not tried again for this kind of step and shapes
                        self.ledger.graph_failed = failed.reason
                    if self.on_plan is not None and not self.plan.compiled:
                        self.plan = self.plan._replace(revised=True, reason=(
                            f"{self.plan.reason.replace('; ' + GRAPH_NOTE, '')}; the eager steps run one by "
                            f"one from step {a} on: no CUDA graph of a step ({failed.reason})"))
                        self.on_plan(self.plan)
                    return self._one_by_one(state, ts, a, kept, outs, failed.ran)
                self.graph = g
                if self._keeps(kept, a):
                    outs.append((pytree.tree_map(torch.clone, self.collect(g.state)), pytree.tree_map(torch.clone, g.info)))
                a += 1
            else:
                g.load(state, ts[a])
            for i in range(a, n):
                g.replay()
                if self._keeps(kept, i):
                    outs.append((pytree.tree_map(torch.clone, self.collect(g.state)), pytree.tree_map(torch.clone, g.info)))
        if self.between_chunks:
            # the caller's code runs between chunks (on_chunk): what it changes is seen by a new capture,
            # as by the steps one by one, rather than frozen in this graph
            self.graph = None
        # the engine's state is the graph's own buffers between chunks (the next chunk replays on them);
        # the call's final state is copied out of them (finish)
        return _stacked(g.state, outs)

    def _one_by_one(self, state: Any, ts: Tensor, a: int, kept: Kept | None, outs: list,
                    first: Any = None, write: bool = False) -> tuple[Any, Any, Any]:
        """Steps ``a`` on of the chunk, one at a time, after the kept ``outs`` so far; ``first``:
        step ``a``'s ``(state, info)`` when it ran already (the probe's). ``write``: the kept draws may
        go straight into the trace's buffers (the result's kept part is then ``_WRITTEN``)."""
        # on the CPU the step indices as Python ints: fold_in then makes no tensor for each (the same keys)
        n = ts.shape[0]
        steps = range(int(ts[0]), int(ts[0]) + n) if ts.device.type == "cpu" and n else ts
        # each kept draw is copied into the trace's buffers (decided once, at the chunk's first kept step),
        # rather than a clone a step stacked at the end: one copy, not two, and no per-step tensors pinning
        # the heap between the energy's temporaries (bench/eager_trace.py, MALA keeping 1,000 steps of
        # 1,024 x 25: the process's peak RSS 1.6-1.8 GB before, 0.52-0.53 GB after, for a 98 MB trace)
        direct = None if write and not outs and kept is not None else False  # None: not decided yet
        with _checks.eager_block():  # no user code runs between two steps: the energy's checks once
            for i in range(a, n):
                if i == a and first is not None:
                    state, info = first  # the same step on the same state and key, run by the probe
                else:
                    state, info = self.step(state, fr.fold_in(self.keys, steps[i]))
                if self._keeps(kept, i):
                    got = (self.collect(state), info)
                    if direct is None:
                        direct = self._writable(got)
                    if direct:
                        row = kept.j0 + (i - kept.lo) // self.thin
                        for buf, x in zip(self.bufs, pytree.tree_leaves(got)):
                            buf[row].copy_(x)
                    else:
                        outs.append((pytree.tree_map(torch.clone, got[0]), info))
        return (state, _WRITTEN, None) if direct else _stacked(state, outs)

    def _writable(self, got: Any) -> bool:
        """Whether a kept ``(collected, info)`` may be copied straight into the trace's buffers (allocated
        here, once): plain eager tensors laid out as the buffers expect, none tracked by autograd (a
        gradient through the chain keeps its draws as autograd's stacked outputs)."""
        leaves = pytree.tree_leaves(got)
        want = pytree.tree_leaves(self.expected)
        if (len(leaves) != len(want) or not all(isinstance(x, Tensor) for x in leaves)
                or not _checks.is_concrete(*leaves) or any(x.requires_grad for x in leaves)
                or any(x.shape != w.shape[1:] or x.dtype != w.dtype for x, w in zip(leaves, want))):
            return False
        self._allocate()
        return all(buf.device == x.device for buf, x in zip(self.bufs, leaves))

    def _allocate(self) -> None:
        """The trace's buffers, allocated once (unless given as ``out=`` or taken from a whole-trace call)."""
        if self.bufs is None:  # torch.empty, not empty_like: the meta tensors' layout rules load sympy (0.5 s)
            self.bufs = [torch.empty(w.shape, dtype=w.dtype, device=self.device)
                         for w in pytree.tree_leaves(self.expected)]

    def _keeps(self, kept: Kept | None, i: int) -> bool:
        return kept is not None and kept.lo <= i < kept.hi and (i - kept.lo) % self.thin == 0

    def _eager_many(self, many: Callable, ts: Tensor, kept: Kept | None) -> tuple[Any, Any, Any] | None:
        """The chunk's steps by the step's own ``kernel_many`` (several transitions per call: a NUTS
        step on an energy its C kernel evaluates in torch, where each chain goes on without waiting
        for the others' trees), in blocks of at most ``_MANY_FLOATS`` floats of positions; the same
        steps, keys and results as :meth:`_eager`. ``None`` when the step does not take it."""
        state, outs, n = self.state, [], ts.shape[0]
        x = getattr(state, "position", None)
        if not isinstance(x, Tensor):
            return None
        block = max(1, _MANY_FLOATS // max(1, x.numel()))
        lead = (1,) * (self.keys.ndim - 1)
        # a collect that picks fields keeps a block's steps by one slice of each stacked field (a row at
        # a time cost about 30 us a transition: eight schools' 1,000 draws and 1,000 warm-up iterations)
        sliced = _loop.is_fieldwise(self.collect)
        blocks = []  # sliced: (collected, info) of each block's kept steps, stacked
        a = 0
        while a < n:
            b = min(n, a + block)
            ran = many(self.step, state, fr.fold_in(self.keys, ts[a:b].reshape((-1,) + lead)))
            if ran is None:  # the kernel stopped applying: the rest one step at a time
                if a == 0:
                    return None
                if blocks:  # (outs is empty: the kept rows so far are in blocks)
                    rest, out, info = self._one_by_one(state, ts, a, kept, [])
                    return rest, *_joined(blocks + ([(out, info)] if out is not None else []))
                return self._one_by_one(state, ts, a, kept, outs)
            states, infos = ran  # every leaf stacked; the kernel may have run only the first of the steps
            b = a + pytree.tree_leaves(infos)[0].shape[0]
            rows = [i - a for i in range(a, b) if self._keeps(kept, i)]
            if sliced:
                if rows:  # every thin-th step of a range: one slice (views of outputs nothing writes again)
                    s = slice(rows[0], rows[-1] + 1, self.thin)
                    blocks.append(pytree.tree_map(lambda leaf: leaf[s], (self.collect(states), infos)))
            else:
                state_at, info_at = _rows(states), _rows(infos)
                # views of the block's outputs, which nothing writes again: stacked (copied) at the end
                outs += [(self.collect(state_at(i)), info_at(i)) for i in rows]
            state = pytree.tree_map(lambda leaf: leaf[b - a - 1], states)
            a = b
        if sliced:
            return (state, *_joined(blocks)) if blocks else (state, None, None)
        return _stacked(state, outs)

    def finish(self) -> tuple[Any, Any, Any]:
        graphed = self.graph is not None and self.state is self.graph.state
        final = pytree.tree_map(torch.clone if graphed else (lambda x: x.contiguous()), self.state)
        trace, info = pytree.tree_unflatten(self.bufs, pytree.tree_structure(self.expected))
        return final, trace, info


# The C kernel's launches are also cut by time (_SLICE_S each): Python raises a Ctrl-C's
# KeyboardInterrupt only once a ctypes call returns, so a launch's length bounds the wait.
# Any cut gives the same draws (step t's key is fold_in(key, t) wherever a launch starts).
_SLICE_S = 0.25  # the longest a launch of the C kernel should take (then Ctrl-C is seen)
# The first launch's work, before a rate is measured: steps x chains x elements (x d for a full
# Gaussian, d multiply-adds an element). 2**24 is about 50 ms at W1's rate on 2 quiet cores of this
# project's CPU host (29 ms for 10**7), 0.4 s at load average 6 there; W1 and W3 (10,000 chains x
# 10 x 100 steps) stay one launch (two launches cost them 1.10x and 1.16x at that load).
_FIRST_SLICE_WORK = 1 << 24
_GROWTH = 8  # a launch is at most this many times the one before
_MANY_FLOATS = 1 << 22  # the positions one call of a step's kernel_many writes at most (16 MB of float32)


def _rows(tree: Any) -> Callable[[int], Any]:
    """``i -> tree`` with row ``i`` of every leaf (leaves stacked on a leading axis), built once for
    many rows: a ``NamedTuple`` is rebuilt field by field (a state's or an info's row is a few
    microseconds, where a ``tree_map`` over a warm-up's nested state took about 45)."""
    if isinstance(tree, Tensor):
        return tree.__getitem__
    if isinstance(tree, tuple) and hasattr(type(tree), "_fields"):
        cls = type(tree)
        if all(isinstance(f, Tensor) for f in tree):
            return lambda i: cls(*[f[i] for f in tree])
        parts = [_rows(f) for f in tree]
        return lambda i: cls(*[g(i) for g in parts])
    leaves, spec = pytree.tree_flatten(tree)
    return lambda i: pytree.tree_unflatten([f[i] for f in leaves], spec)


_WRITTEN = object()  # an eager chunk's kept draws went straight into the trace's buffers (_one_by_one)


def _stacked(state: Any, outs: list) -> tuple[Any, Any, Any]:
    """``(state, kept, info)``: the kept ``(collected, info)`` pairs stacked on a new leading axis
    (``None`` when none was kept)."""
    if not outs:
        return state, None, None
    out, info = pytree.tree_map(lambda *xs: torch.stack(xs), *outs)
    return state, out, info


def _joined(blocks: list) -> tuple[Any, Any]:
    """``(kept, info)`` of blocks already stacked on a leading axis, joined along it: new memory (a
    block's slices are views of the kernel's outputs, which the final state may share)."""
    if len(blocks) == 1:
        return pytree.tree_map(torch.clone, blocks[0])
    return pytree.tree_map(lambda *xs: torch.cat(xs), *blocks)


def _first_slice(x: Tensor, energy: Any = None) -> int:
    """The first launch's steps, before a rate is measured: tens of milliseconds' work."""
    work = x.numel() * (x.shape[-1] if getattr(energy, "is_diagonal", True) is False else 1)
    return max(1, _FIRST_SLICE_WORK // max(1, work))


def _next_slice(steps: int, seconds: float, limit: int) -> int:
    """The next launch's steps: about ``_SLICE_S`` at the rate just measured, at most ``_GROWTH``
    times the last (one fast launch on a noisy machine does not make the next one long) and at
    most ``limit``."""
    fit = int(_SLICE_S * steps / seconds) if seconds > 0 else _GROWTH * steps
    return max(1, min(limit, _GROWTH * steps, fit))


def _per_chain(value: Tensor, x: Tensor, chains: tuple[int, ...]) -> Tensor:
    # the sampler's tunable in the position's dtype and device: 0-dim, or one value per chain
    value = value.to(dtype=x.dtype, device=x.device)
    if value.ndim == 0:
        return value
    return value.reshape(value.shape + (1,) * (len(chains) - value.ndim)).expand(chains).contiguous()


class KernelEngine:
    """A whole-chain kernel: ``module.run_into`` writes the kept draws straight into the buffers
    (the caller's ``out`` when contiguous, else fresh ones copied into it at the end)."""

    def __init__(self, path: dispatch.FastPath, step: Any, chain: Any, n_kept: int, burn_in: int, thin: int,
                 with_energy: bool, out: Any):
        self.name, self.path, self.step = path.engine, path, step
        self.module = dispatch.module(path)
        self.exact_sizes = path.engine == "c"  # timed launches: any cut gives the same draws
        state, keys = chain.state, chain.keys
        x = state.position
        chains = tuple(keys.shape[:-1])
        tun = step.tunables
        self.h = _per_chain(tun["step_size"], x, chains)
        self.s = _per_chain(tun.get("noise_scale", torch.ones(())), x, chains)
        self.x, self.e, self.g = x, state.energy, state.grad
        self.keys, self.start, self.thin, self.with_energy = keys, chain.steps_taken, thin, with_energy
        self.state_type, self.device = type(state), x.device
        self.trace, self.info, self.copy_to = self._buffers(out, x, chains, n_kept)
        self.outputs = (self.trace[0] if with_energy else self.trace, *self.info)
        self.more = {"energy_trace": self.trace[1]} if with_energy else {}

    def _buffers(self, out: Any, x: Tensor, chains: tuple[int, ...], n_kept: int) -> tuple[Any, Any, Any]:
        """``(trace, info, copy_to)``: the buffers the kernel writes — the caller's ``out`` when its
        tensors are contiguous, else fresh ones then copied into ``copy_to`` (``out``, or ``None``)."""
        trace = torch.empty((n_kept,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        if self.with_energy:
            trace = (trace, torch.empty((n_kept,) + chains, dtype=x.dtype, device=x.device))
        info = dispatch.info_buffers(self.path, self.step.sampler, self.step.info_type, n_kept, chains, x.dtype,
                                     x.device)
        if out is None:
            return trace, info, None
        want = pytree.tree_leaves((trace, info))
        pair = isinstance(out, tuple) and len(out) == 2
        if not pair or pytree.tree_structure(out) != pytree.tree_structure((trace, info)):
            raise ValueError(f"out must be a (trace, info) pair as this run returns: a tensor and a {type(info).__name__}")
        for got, w in zip(pytree.tree_leaves(out), want):
            if not isinstance(got, Tensor) or got.shape != w.shape or got.dtype != w.dtype or got.device != w.device:
                shapes = [(tuple(t.shape), t.dtype) for t in want]
                raise ValueError(f"out's buffers must have the shapes and dtypes {shapes} on {x.device}")
        if all(t.is_contiguous() for t in pytree.tree_leaves(out)):
            return out[0], out[1], None  # the kernel writes the caller's buffers directly
        return trace, info, out

    def first_size(self, chunk_size: int) -> int:
        if self.exact_sizes:
            return min(chunk_size, _first_slice(self.x, self.step.energy_fn))
        return max(chunk_size, 2)

    def next_size(self, steps: int, seconds: float, chunk_size: int) -> int:
        return _next_slice(steps, seconds, chunk_size) if self.exact_sizes else max(chunk_size, 2)

    def chunk(self, a: int, b: int, kept: Kept | None) -> None:
        first, n_keep, j0 = (kept.lo, kept.j1 - kept.j0, kept.j0) if kept is not None else (b - a, 0, 0)
        self.x, self.e, self.g = self.module.run_into(
            self.step.energy_fn, self.x, self.e, self.g, self.keys, self.start + a, self.h, self.s, self.outputs,
            mala=self.step.sampler == "mala", n_total=b - a, first=first, thin=self.thin, n_keep=n_keep, j0=j0,
            **self.more)

    def finish(self) -> tuple[Any, Any, Any]:
        trace, info = self.trace, self.info
        if self.copy_to is not None:  # out= with non-contiguous buffers
            for buf, new in zip(pytree.tree_leaves(self.copy_to), pytree.tree_leaves((trace, info))):
                buf.copy_(new)
            trace, info = self.copy_to
        return self.state_type(self.x, self.e, self.g), trace, info
