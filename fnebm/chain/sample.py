"""``sample_chain``: orchestration only — check the arguments, lay out the chains, call the compiled
runner chunk by chunk, copy the kept draws into the trace, report progress.

Nothing here writes onto the caller's objects or mutates its arguments: the compiled graphs
live in a :class:`~fnebm.chain.runner.RunnerCache`, and timing goes to a callback.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from typing import Any, Callable, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fnebm import _checks, _signature
from fnebm import random as fr
from fnebm.chain import engines
from fnebm.chain.engines import _SCRATCH_BYTES, KernelEngine, TorchEngine, sync
from fnebm.chain.loop import needs_grad, position, position_and_energy, structure
from fnebm.chain.runner import CompileFallbackWarning, RunnerCache, RunPlan, code_key, default_cache
from fnebm.chain.schedule import kept_in
from fnebm.kernels import dispatch, mala_step
from fnebm.samplers.base import per_chain, step_fields

__all__ = ["ChainState", "init", "sample_chain"]


class ChainState(NamedTuple):
    """Where a run stands: the sampler ``state``, each chain's key ``keys: (*chains, 2)``, and
    ``steps_taken`` (0-dim int64), the index of the next step in every chain's random stream.

    ``sample_chain`` returns one and accepts one to continue: 100 + 100 steps equal 200 steps
    bit for bit. ``torch.save`` / ``torch.load`` (default ``weights_only=True``) round-trip it.
    """

    state: Any
    keys: Tensor
    steps_taken: Tensor


torch.serialization.add_safe_globals([ChainState])


def _leaves_with_names(state: Any) -> list[tuple[str, Any]]:
    flat, _ = pytree.tree_flatten_with_path(state)
    return [(pytree.keystr(path), leaf) for path, leaf in flat]  # "" for a bare tensor: "state" + name


def _chain_shape(state: Any, n: int) -> tuple[int, ...]:
    named = _leaves_with_names(state)
    if not named or not all(isinstance(x, Tensor) for _, x in named):
        raise TypeError("state must be a pytree (e.g. NamedTuple) of tensors, as returned by a sampler's init")
    first = named[0][1]
    if first.ndim < n:
        raise ValueError(
            f"state{named[0][0]} has shape {tuple(first.shape)}, fewer than the {n} chain axes expected; "
            "for one chain pass chain_ndim=0"
        )
    chains = tuple(first.shape[:n])
    for name, x in named:
        if x.ndim < n or tuple(x.shape[:n]) != chains:
            raise ValueError(
                f"every state field must lead with the chain axes {chains}, but state{name} has shape "
                f"{tuple(x.shape)}; for one chain pass chain_ndim=0 (a state from vmap(alg.init) has one chain axis)"
            )
    if math.prod(chains) == 0:
        raise ValueError(f"state has 0 chains: state{named[0][0]} has shape {tuple(first.shape)}, whose chain axes "
                         f"{chains} hold none; start from positions (n_chains, dim) with n_chains >= 1")
    return chains


def _check_sampler_state(step: Any, state: Any) -> None:
    """fnebm's own sampler steps (``fnebm.mala(...).step``, ...) get their own state type: a plain
    tensor of positions there is the common slip of passing positions instead of ``vmap(alg.init)``."""
    fields = step_fields(step)
    if fields is None:
        return
    expected = fields.state_type
    if isinstance(state, expected):
        return
    got = (f"a tensor of shape {tuple(state.shape)}" if isinstance(state, Tensor) else
           f"a {type(state).__name__}")
    fix = (" (positions?): make the state from positions (n_chains, dim) with torch.func.vmap(alg.init)(positions)"
           if isinstance(state, Tensor) else ": make it with torch.func.vmap(alg.init)(positions)")
    raise TypeError(f"state must be the sampler's {expected.__name__} (fields {', '.join(expected._fields)}), "
                    f"got {got}{fix}")


def init(state: Any, key: Tensor, *, chain_ndim: int | None = None) -> ChainState:
    """A fresh :class:`ChainState` at step 0.

    ``key``: one key ``(2,)`` — each chain gets ``split(key, n_chains)[c]`` (reshaped to the
    chain axes) — or per-chain keys ``(*chains, 2)`` used as they are. ``chain_ndim``: the
    number of leading chain axes of ``state``; default 1 with one key, ``key.ndim - 1`` with
    per-chain keys; 0 means one chain (its key is ``key`` itself).
    """
    _checks.check_key(key)
    if chain_ndim is not None:
        chain_ndim = _checks.check_int("chain_ndim", chain_ndim, 0)
    if key.ndim == 1:
        n = 1 if chain_ndim is None else chain_ndim
        chains = _chain_shape(state, n)
        keys = key if n == 0 else fr.split(key, math.prod(chains)).reshape(*chains, 2)
    else:
        chains = tuple(key.shape[:-1])
        if chain_ndim is not None and chain_ndim != len(chains):
            raise ValueError(f"key has {len(chains)} chain axes {chains} but chain_ndim={chain_ndim}")
        got = _chain_shape(state, len(chains))
        if got != chains:
            raise ValueError(f"key has chain shape {chains} but the state's chains are {got}: pass one key per chain")
        keys = key
    return ChainState(state, keys, torch.zeros((), dtype=torch.int64, device=key.device))


_CHECK_EACH_ON = ("cpu",)  # devices where a check costs no sync: each runs on its own


def _check_values(keys: Tensor, state: Any) -> None:
    """The keys' word range and the state's finiteness. Off the CPU each check is a device
    sync, so there the flags are gathered into one tensor and read once (measured on an H100:
    four syncs were a third of a whole-chain kernel call's host time); a failing flag then
    raises through the check that names it."""
    floats = [x for x in pytree.tree_leaves(state) if x.is_floating_point()]
    if keys.device.type in _CHECK_EACH_ON or not keys.numel() or not _checks.is_concrete(keys, *floats):
        _checks.check_key_values(keys, "key")
        _check_finite(state)
        return
    flags = torch.stack([((keys >= 0) & (keys <= 0xFFFFFFFF)).all()]
                        + [torch.isfinite(x).all() for x in floats]).tolist()
    if not flags[0]:
        _checks.check_key_values(keys, "key")
    if not all(flags[1:]):
        _check_finite(state)


def _finite(x: Tensor) -> bool:
    """Whether every value of ``x`` (concrete) is finite: by NumPy on plain CPU tensors (one vectorised
    pass on this thread, where torch's isfinite runs four parallel operations), else by torch."""
    if type(x) is Tensor and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64, torch.float16):
        try:
            import numpy as np

            return bool(np.isfinite(x.detach().numpy()).all())
        except (ImportError, RuntimeError):  # no NumPy, or a tensor it cannot view
            pass
    return bool(torch.isfinite(x).all())


def _check_finite(state: Any) -> None:
    for name, x in _leaves_with_names(state):
        if x.is_floating_point() and _checks.is_concrete(x) and not _finite(x):
            raise ValueError(
                f"state{name} has non-finite values (NaN or inf): a chain started there never recovers; "
                "start from finite positions"
            )


def _probe(step, collect, chain: ChainState, n: int, ledger=None, budget: float = math.inf,
           keep: list | None = None) -> tuple[Any, Any]:
    """One eager step of every chain: the kept and info trees (as meta tensors).

    It surfaces an error in ``step`` with a plain traceback before any compiling, and catches
    a one-chain step given a batch (its outputs do not keep the state's shapes). With a
    ``ledger`` (``compile="auto"``) the step is timed: when it took at most ``budget`` seconds
    (a step time that keeps this call's eager steps within what ``auto`` spends before it
    compiles, so that the call runs eagerly whatever the next steps take; the first step pays
    one-time costs and is the slowest), it is the first measure of what an eager step costs;
    else two more eager steps are timed and the faster is. ``keep`` (a list) receives the
    step's ``(state, info)``: the run's first step, which an eager run need not compute again.
    """
    t0 = time.perf_counter()
    try:
        new, info = step(chain.state, fr.fold_in(chain.keys, chain.steps_taken))
    except AttributeError as e:  # a step that reads fields, given positions: vmap(alg.init) was forgotten
        if isinstance(chain.state, Tensor) and "'Tensor' object has no attribute" in str(e):
            raise TypeError(f"step failed on state, a plain tensor of shape {tuple(chain.state.shape)} ({e}): "
                            "pass the sampler's state, e.g. torch.func.vmap(alg.init)(positions)") from e
        raise
    if ledger is not None:
        sync(chain.keys.device)
        first = time.perf_counter() - t0
        if first <= budget:  # eager whatever the next steps take: no more steps just to time them
            ledger.record(first, 1)
        else:
            for _ in range(2):  # the faster of two: one slow step on a busy machine would force a compile
                t0 = time.perf_counter()
                step(chain.state, fr.fold_in(chain.keys, chain.steps_taken))
                sync(chain.keys.device)
                ledger.record(time.perf_counter() - t0, 1)
    hint = ("sample_chain calls step(state, keys) with the chain axes leading the state and keys (*chains, 2); "
            "wrap a one-chain step with fnebm.vmap_chains(step)")
    if pytree.tree_structure(new) != pytree.tree_structure(chain.state):
        raise ValueError(f"step returned a state of another structure than it was given; {hint}")
    for (name, a), b in zip(_leaves_with_names(chain.state), pytree.tree_leaves(new)):
        if not isinstance(b, Tensor) or b.shape != a.shape or b.dtype != a.dtype:
            if isinstance(b, Tensor) and b.shape == a.shape:  # the dtype changed: mixed dtypes in the state?
                raise ValueError(f"step turned state{name} of dtype {a.dtype} into {b.dtype}: give every field of "
                                 "the state (and the energy's parameters) one floating dtype")
            got = tuple(b.shape) if isinstance(b, Tensor) else type(b).__name__
            raise ValueError(f"step turned state{name} of shape {tuple(a.shape)} into {got}; {hint}")
    chains = tuple(chain.keys.shape[:-1])
    for leaf in pytree.tree_leaves(info):
        if not isinstance(leaf, Tensor) or tuple(leaf.shape[:n]) != chains:
            raise ValueError(f"step's info must be a pytree of tensors leading with the chain axes {chains}; {hint}")
    try:
        kept = collect(new)
    except AttributeError as e:
        raise TypeError(f"collect failed on the state ({e}); pass collect=lambda state: ... for this state") from None
    if not pytree.tree_leaves(kept) or not all(isinstance(x, Tensor) for x in pytree.tree_leaves(kept)):
        raise TypeError("collect must return a tensor or a pytree of tensors")
    return pytree.tree_map(lambda x: torch.empty_like(x, device="meta"), (kept, info))


def _expected(tree: Any, n_kept: int) -> Any:
    return pytree.tree_map(lambda x: torch.empty((n_kept, *x.shape), dtype=x.dtype, device="meta"), tree)


def _check_out(out: Any, expected: Any) -> list[Tensor]:
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError("out must be a (trace, info) pair of buffers, as a previous sample_chain call returned")
    if pytree.tree_structure(out) != pytree.tree_structure(expected):
        raise ValueError("out must have the structure of (trace, info) that this run returns")
    bufs = pytree.tree_leaves(out)
    for (name, buf), want in zip(_leaves_with_names(out), pytree.tree_leaves(expected)):
        if not isinstance(buf, Tensor) or buf.shape != want.shape or buf.dtype != want.dtype:
            got = (tuple(buf.shape), buf.dtype) if isinstance(buf, Tensor) else type(buf).__name__
            raise ValueError(f"out{name} must be a tensor of shape {tuple(want.shape)} and dtype {want.dtype}, got {got}")
    return bufs


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _outside_fnebm() -> int:
    """The ``stacklevel`` of the first frame outside fnebm (a warning names the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _fall_back(plan: RunPlan, ledger: Any, reason: str, start: int, on_plan: Callable | None) -> RunPlan:
    """A compile failed and the eager steps ran: remember it, say so once, and tell ``on_plan``."""
    ledger.failed, ledger.failure_said = reason, True
    warnings.warn(f"fnebm: the compile of this run's step failed ({reason}); the steps from step {start} of this "
                  "call on ran eagerly instead, with the same keys and draws. Later calls with this kind of step "
                  "and shapes run eagerly without compiling again (RunnerCache.clear() forgets this).",
                  CompileFallbackWarning, stacklevel=_outside_fnebm())
    plan = plan._replace(compiled=False, compiles=False, fallback=reason, revised=True, engine="eager",
                         reason=f"eager from step {start}: the compile failed ({reason})")
    if on_plan is not None:
        on_plan(plan)
    return plan


def _takes_fused_mala(fields, chain: ChainState) -> bool:
    """Whether MALA's eager steps from ``chain`` take the fused GPU step (fnebm.kernels.mala_step)."""
    if fields is None or fields.sampler != "mala" or not mala_step.runs_on(chain.keys.device):
        return False
    try:
        x, energy, grad = chain.state.position, chain.state.energy, chain.state.grad
        h = per_chain("step_size", fields.keywords["step_size"], tuple(chain.keys.shape[:-1]), x, host_scalar=True)
    except Exception:  # not a MALA state, or a step size the step itself will refuse
        return False
    return mala_step.eligible(x, energy, grad, chain.keys, h)


def sample_chain(
    step: Callable[[Any, Tensor], tuple[Any, Any]],
    state: Any,
    key: Tensor | None,
    n_steps: int,
    *,
    burn_in: int = 0,
    thin: int = 1,
    collect: Callable[[Any], Any] | None = None,
    chunk_size: int | None = None,
    compile: bool | str = "auto",
    backend: str = "auto",
    progress: bool | None = None,
    chain_ndim: int | None = None,
    out: tuple[Any, Any] | None = None,
    on_chunk: Callable[[int, int, float], None] | None = None,
    on_plan: Callable[[RunPlan], None] | None = None,
    cache: RunnerCache | None = None,
) -> tuple[ChainState, Any, Any]:
    """Run ``burn_in + n_steps`` steps and return ``(chain, trace, info)``.

    Args:
        step: a batched ``step(state, keys: (*chains, 2)) -> (state, info)`` — a sampler's
            ``alg.step``, anything wrapping one, or a one-chain step wrapped in
            :func:`fnebm.vmap_chains`.
        state: a sampler state whose fields lead with the chain axes (from
            ``torch.func.vmap(alg.init)(positions)``), or a :class:`ChainState` from an
            earlier call to continue it (then ``key`` is ``None``).
        key: one key ``(2,)`` (chain ``c`` gets ``split(key, n_chains)[c]``) or per-chain keys
            ``(*chains, 2)``.
        n_steps: steps after burn-in; every ``thin``-th is kept, ``n_kept = n_steps // thin``.
        burn_in: steps run first and not kept.
        collect: ``state -> pytree of tensors`` kept at each kept step (default: the position).
        chunk_size: steps per compiled call (default: ``max(n_kept, 256)``, or 1/20 of the run
            when a progress bar shows). Every chunk length shares one graph.
        compile: ``True`` runs the steps in the compiled runner (compiling it first if this
            kind of step and shapes has not been compiled in this process); ``False`` runs the
            same steps eagerly (same keys, same draws up to float rounding); ``"auto"`` (the
            default) runs eagerly while that costs less than a compile would, and compiles once
            it does not: after one timed eager step, a call whose eager steps (plus the eager
            time already spent on this kind of step and shapes) would take longer than the
            cache's ``compile_estimate_s`` (20 s for Inductor) compiles; shorter calls run
            eagerly. So a short first run returns in seconds and a long one compiles at once;
            a graph compiled once is used from then on. ``on_plan`` says which ran and why.
            A compile that fails (Dynamo cannot trace the step, the backend raises) never loses
            the run: the chunk that was compiling runs again eagerly from the same inputs (the
            same keys, so the same draws as ``compile=False``), and so does the rest of the run,
            with one :class:`~fnebm.chain.runner.CompileFallbackWarning`; the failure is
            remembered for this kind of step and shapes, so later calls run eagerly at once
            (their plan's ``fallback`` says why). An error the eager steps raise too is raised
            as they raise it.
        backend: which engine runs the chain — the same words for every sampler that has a
            kernel, ``window_adaptation`` and the command line (the table of what each kernel
            covers is :data:`fnebm.kernels.dispatch.FAST_PATHS`; docs/internals.md):
            ``"auto"`` (default) takes a hand-written kernel where one covers the run (a
            whole-chain Triton kernel on CUDA, a whole-chain C kernel on the CPU for
            ``fnebm.langevin``/``fnebm.mala`` on the analytic families; NUTS's transition in C on
            the CPU) and the torch engine otherwise; ``on_plan``'s plan names the engine
            (``plan.engine``) and each kernel it passed over with why (``plan.skipped``).
            ``"triton"`` and ``"c"`` require their kernel and raise ``ValueError`` naming the first
            reason it does not apply; ``"torch"`` never uses one (then ``compile`` chooses
            compiled or eager). ``compile`` only concerns the torch engine. Same keys, same draws
            on every engine (to float tolerance). ``"compiled"`` and ``"eager"`` (earlier
            releases) mean ``backend="torch"`` with ``compile=True`` / ``False``.
        progress: a tqdm bar on stderr; ``None`` shows one when stderr is a terminal.
        chain_ndim: leading chain axes of ``state`` (default 1 with one key, ``key.ndim - 1``
            with per-chain keys; 0 for one chain).
        out: ``(trace, info)`` buffers from an earlier call of the same shapes, filled in place
            and returned. The run is then chunked so that each compiled call's scratch output
            stays under 8 MiB and is recycled from call to call (on W1, 1.02-1.10x as fast as a new
            trace per call); the draws are copied into your buffers.
        on_chunk: ``on_chunk(steps_done, steps_total, seconds)`` after every chunk, outside the
            compiled call (the device is synchronised first, so the seconds are real).
        on_plan: ``on_plan(plan)`` once before the first step, with the
            :class:`~fnebm.chain.runner.RunPlan` of this call (compiled or eager, whether a
            compile starts now, and why): a command line can say "compiling ..." before a wait.
            Should that compile fail, ``on_plan`` is told a second time, with a plan whose
            ``revised`` is true and ``fallback`` says why (the rest of the call runs eagerly).
        cache: where compiled runners live (default: a module-level :class:`RunnerCache`).

    Returns:
        ``chain``, a :class:`ChainState` (``chain.state`` is the final sampler state); ``trace``,
        ``collect``'s pytree with leaves ``(n_kept, *chains, ...)`` — draw ``j`` is the state
        after step ``burn_in + (j + 1) * thin`` of this call; ``info``, the step's info at the
        kept steps, same layout.
    """
    _checks.check_callable("step", step, "step(state, keys) -> (state, info)")
    n_steps = _checks.check_int("n_steps", n_steps, 1)
    burn_in = _checks.check_int("burn_in", burn_in, 0)
    thin = _checks.check_int("thin", thin, 1)
    if thin > n_steps:
        raise ValueError(f"thin must be <= n_steps to keep any draw, got thin={thin}, n_steps={n_steps}")
    if chunk_size is not None:
        chunk_size = _checks.check_int("chunk_size", chunk_size, 1)
    collect = position if collect is None else collect
    _checks.check_callable("collect", collect, "state -> pytree of tensors")
    if on_chunk is not None:
        _checks.check_callable("on_chunk", on_chunk, "on_chunk(steps_done, steps_total, seconds)")
    if on_plan is not None:
        _checks.check_callable("on_plan", on_plan, "on_plan(plan: RunPlan)")
    dispatch.check_backend(backend)
    if compile not in (True, False, "auto"):
        raise ValueError(f'compile must be True, False or "auto", got {compile!r}')
    if isinstance(state, ChainState):
        if key is not None:
            raise ValueError("state is a ChainState, which carries its keys and step count: pass key=None to continue it")
        _checks.check_key(state.keys, "state.keys")
        chain = state
        n = state.keys.ndim - 1
        if chain_ndim is not None and chain_ndim != n:
            raise ValueError(f"state.keys has {n} chain axes but chain_ndim={chain_ndim}")
        if _chain_shape(chain.state, n) != tuple(chain.keys.shape[:-1]):
            raise ValueError("state.keys must have one key per chain of state.state")
    else:
        if key is None:
            raise TypeError("key must be a key tensor from fnebm.random.key(seed) (None only continues a ChainState)")
        chain = init(state, key, chain_ndim=chain_ndim)
        n = chain.keys.ndim - 1
    _check_sampler_state(step, chain.state)
    leaves = pytree.tree_leaves(chain.state)
    devices = {x.device for x in leaves}
    if len(devices) > 1 or chain.keys.device not in devices:
        raise ValueError(f"state and key must be on one device, got state on {devices} and key on {chain.keys.device}")
    _check_values(chain.keys, chain.state)
    req = dispatch.RunRequest(step, chain.state, chain.keys, chain.steps_taken, _collect_name(collect),
                              needs_grad(step, chain.state))
    decision = dispatch.choose(req, backend, compile)
    step, compile = decision.step, decision.compile
    if compile not in (True, False, "auto"):
        raise ValueError(f'compile must be True, False or "auto", got {compile!r}')
    total = burn_in + n_steps
    n_kept = n_steps // thin
    show = sys.stderr.isatty() if progress is None else bool(progress)
    if decision.engine != "torch":
        if on_plan is not None:
            where = "C kernel (CPU)" if decision.engine == "c" else "Triton kernel"
            on_plan(RunPlan(False, False, f"backend={backend!r}: the whole-chain {where}", None, 0.0, total,
                            kernel=True, engine=decision.engine, skipped=decision.skipped))
        engine = KernelEngine(decision.path, step, chain, n_kept, burn_in, thin,
                              collect is position_and_energy, out)
        if chunk_size is None:
            chunk_size = -(-total // 20) if show else total  # one launch unless a bar shows
    else:
        engine = _torch_engine(step, collect, chain, n, n_kept, thin, total, compile, out, on_chunk, on_plan,
                               cache, decision)
        if chunk_size is None:
            chunk_size = _torch_chunk_size(engine, show, out is not None, total, n_kept)
    _drive(engine, total, burn_in, thin, n_kept, chunk_size, show, on_chunk, chain.keys.device)
    final, trace, info = engine.finish()
    return ChainState(final, chain.keys, chain.steps_taken + total), trace, info


# the collects a whole-chain kernel can write, by name (fnebm.kernels.dispatch's vocabulary)
_COLLECTS = {position: "position", position_and_energy: "position_and_energy"}


def _collect_name(collect: Any) -> str | None:
    # by identity: a collect of the user's own may be unhashable (a dataclass instance)
    return next((name for fn, name in _COLLECTS.items() if fn is collect), None)


def _torch_engine(step, collect, chain: ChainState, n: int, n_kept: int, thin: int, total: int, compile: Any,
                  out: Any, on_chunk: Callable | None, on_plan: Callable | None, cache: RunnerCache | None,
                  decision: dispatch.Decision) -> TorchEngine:
    """The torch engine for this call: the probe, the output checks, and compiled or eager (``plan``)."""
    cache = default_cache if cache is None else cache
    leaves = pytree.tree_leaves(chain.state)
    runner_key = (code_key(step), code_key(collect), pytree.tree_structure(chain.state), n)
    shapes = tuple((x.shape, x.dtype, x.device) for x in leaves)
    ledger = cache.ledger(runner_key, shapes)
    if compile is not False and cache._measure and not ledger.compiled and not cache.described(runner_key, shapes):
        # what this runner compiles to, described the same in every process: a compile of it is recorded on
        # this machine, and a later process whose Inductor cache still holds it expects a cheaper compile
        cache.describe(runner_key, shapes, _signature.signature(
            "chain", step, collect, _signature.stable_text(str(runner_key[2])), n, shapes, torch.get_num_threads()))
    timed = ledger if compile == "auto" and not ledger.compiled and ledger.eager_steps == 0 else None
    # a first step that, slow as it is, keeps this call's steps (and the probe) within a compile's cost
    budget = cache._compile_cost(runner_key, shapes)[0] / (total + 1) if timed is not None else math.inf
    first = []  # the probe's step, when it runs: this call's first step
    probed = cache.probe(runner_key, shapes, lambda: _probe(step, collect, chain, n, timed, budget, first))
    expected = _expected(probed, n_kept)
    bufs = None if out is None else _check_out(out, expected)
    plan = cache.plan(runner_key, shapes, total, compile)
    plan = plan._replace(engine="compiled" if plan.compiled else "eager", skipped=decision.skipped,
                         transition=decision.transition or "")
    if decision.transition:
        fields = step_fields(step)
        traces = getattr(fields.func, "kernel_traces", None)
        calls_back = traces is not None and not traces(fields)
        how = fields.keywords.get("compile_energy", "auto")
        kernel = f"each {fields.sampler} transition in the {dispatch.NAMES[decision.transition]} kernel"
        if calls_back:  # eager by necessity, whatever compile= said (it went to the evaluations)
            plan = plan._replace(reason=f"eager steps: {kernel}, which evaluates the energy in torch between its "
                                        f"steps (compile_energy={how!r})")
        else:
            plan = plan._replace(reason=f"{plan.reason}; {kernel}")
    if not plan.compiled and engines.graphable(chain.keys.device, total):
        no_graph = ledger.graph_failed
        plan = plan._replace(reason=f"{plan.reason}; " + (engines.GRAPH_NOTE if no_graph is None else
                                                          f"eager steps one by one: no CUDA graph of a step ({no_graph})"))
    if not plan.compiled and _takes_fused_mala(step_fields(step), chain):
        plan = plan._replace(reason=f"{plan.reason}; {mala_step.NOTE}")
    if on_plan is not None:
        missed = decision.unavailable  # a C kernel that covers the run could not build or load
        on_plan(plan if missed is None else plan._replace(reason=f"{plan.reason}; {missed.describe()}"))
    if ledger.failed is not None and not ledger.failure_said:  # a background compile failed since the last call
        _fall_back(plan, ledger, ledger.failed, 0, None)
    run = cache.get(runner_key) if plan.compiled else None
    engine = TorchEngine(step, collect, chain, n, plan, run, ledger, expected, bufs, n_kept, thin,
                         record=compile == "auto" or on_chunk is not None, on_plan=on_plan, fall_back=_fall_back,
                         compiled=cache.get(runner_key) if plan.background else None,
                         background_failed=lambda p, led, a: _fall_back(p, led, led.failed, a, None)._replace(
                             background=False), between_chunks=on_chunk is not None)
    engine.known = structure(*probed)  # the compiled loop need not trace a step to learn it
    if first and not plan.compiled and not plan.background and engine.state is chain.state:
        engine.first = first[0]  # the probe ran step 0 eagerly on this very state: the run's step 0
    if plan.background and ledger.pending is None:
        # two steps from the run's start, in the layout the compiled calls will see: only the graph is kept
        ts = chain.steps_taken + torch.arange(2, device=chain.keys.device)
        torch._dynamo.mark_dynamic(ts, 0)
        cache.compile_in_background(runner_key, shapes, (step, collect, chain.keys, engine.state, ts, engine.known))
    engine.per_step_bytes = sum(x.numel() * x.element_size() for x in pytree.tree_leaves(probed))
    return engine


UNAVAILABLE = dispatch.UNAVAILABLE  # in a plan's reason, with the library's reason


def _torch_chunk_size(engine: TorchEngine, show: bool, with_out: bool, total: int, n_kept: int) -> int:
    if show:
        return -(-total // 20)
    if with_out:
        # A compiled call returns every step's draws in a fresh buffer. With your own trace
        # buffers, keep that scratch under _SCRATCH_BYTES per call: the allocator then recycles
        # it from call to call instead of touching new pages each time.
        return max(2, min(total, _SCRATCH_BYTES // max(engine.per_step_bytes, 1)))
    # chunks of n_kept steps (at least 256) keep the scratch near the trace's size
    return max(n_kept, min(total, 256))


def _drive(engine: Any, total: int, burn_in: int, thin: int, n_kept: int, chunk_size: int, show: bool,
           on_chunk: Callable | None, device: torch.device) -> None:
    """The run loop of every engine: chunks, the draws each keeps, progress and ``on_chunk``.

    ``engine.chunk(a, b, kept)`` runs steps ``[a, b)`` and writes the kept draws; chunk sizes come
    from the engine (fixed, or the C kernel's timed launches). A lone last step joins the chunk
    before it unless the engine takes any size (one compiled graph serves every chunk length)."""
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="step", desc="sampling" if engine.name == "torch" else f"sampling ({engine.name})",
                   file=sys.stderr)
    size = engine.first_size(chunk_size)
    a = 0
    try:
        while a < total:
            b = min(total, a + size)
            if total - b == 1 and not engine.exact_sizes:  # as fnebm.chain.schedule.chunks: no lone last step
                b = total
            t0 = time.perf_counter()
            engine.chunk(a, b, kept_in(a, b, burn_in, thin, n_kept))
            size = engine.next_size(b - a, time.perf_counter() - t0, chunk_size)
            if on_chunk is not None:
                sync(device)
                on_chunk(b, total, time.perf_counter() - t0)
            if bar is not None:
                bar.update(b - a)
            a = b
    finally:
        if bar is not None:
            bar.close()
