"""``profile_sampling``: where a sampler's time goes, measured on your energy, shapes and device.

It runs :func:`fnebm.sample_chain` as you would (cold, then warm) and times, alone and at the
same shapes, the parts of a step that can be cut out of it:

* **energy and gradient** — one batched ``value_and_grad`` of the sampler's energy at the
  chains' positions, times the number of energy evaluations per step (counted in a few eager
  steps: 1 for Langevin and MALA, ``L`` for HMC, the tree's size for NUTS);
* **random draws** — the per-step ``fold_in`` of every chain's key and the ``fnebm.random``
  calls the step makes (recorded, with their shapes, in the same eager steps, then replayed);
* **trace write** — a loop that only writes what the run keeps (``collect``'s output and the
  step's info) at every step;

each as a loop of the run's length, compiled (with a cache of this module's own, so your
graphs and compile counts are untouched) or eager as the run is, warm, the median over the
timed repeats of its time less an empty loop's (the run pays its loop once). **Update and checks** is the remainder: the warm step minus those parts (it
holds the proposal arithmetic, the accept/reject, the finiteness checks, the carry copies and
the loop itself). Parts timed alone can cost more than inside the fused step; when they add up
to more than the step, the remainder is 0 and the shares are of their sum
(``parts_over_step`` says by how much).

Nothing here runs inside a step or syncs in one: the device is synchronised before every
clock reading, between calls.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import sys
import textwrap
import threading
import time
import types
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch._higher_order_ops.scan import scan

from fnebm import _checks
from fnebm import random as fr
from fnebm.chain import ChainState, RunnerCache, sample_chain
from fnebm.chain import init as chain_init
from fnebm.chain.runner import code_key, inductor_backend
from fnebm.gradients import value_and_grad
from fnebm.samplers.base import SamplingAlgorithm, over_batch

__all__ = ["profile_sampling", "SamplingProfile", "COMPONENTS"]

COMPONENTS = ("gradient", "random", "update", "trace")
_LABELS = {
    "gradient": "energy and gradient",
    "random": "random draws",
    "update": "update and checks",
    "trace": "trace write",
}


class SamplingProfile(NamedTuple):
    """What :func:`profile_sampling` measured. Times in seconds; ``str()`` gives a table.

    ``compile_s``: the first run's time minus a warm run's (Dynamo, AOTAutograd, the backend's
    code generation and build, and the one eager probe step); ``None`` when eager.
    ``first_result_s``: the first call of ``sample_chain``, from the call to the trace in hand.
    ``warm_s``: the median warm run; ``step_s = warm_s / steps``.
    ``component_s``: seconds per step for each of :data:`COMPONENTS` (``update`` is the
    remainder); ``shares``: the same as fractions summing to 1. ``parts_over_step``: the
    measured parts (gradient, random, trace) over the step; above 1 they overlap inside the
    fused step. ``loop_s``: an empty loop's time per step (taken off each part; in ``update``).
    ``energy_evals_per_step`` and ``draws_per_step``: counted in
    ``probe_steps`` eager steps. ``method``: how the figures were taken. ``page_faults_per_run``:
    the process's minor page faults during a warm run (median; ``None`` where the platform does
    not count them): on a CPU, thousands mean the run maps memory afresh every call (its trace
    above all, and an eager run's large temporaries), which :func:`fnebm.reuse_freed_memory`
    avoids.
    """

    device: str
    mode: str
    chains: tuple[int, ...]
    steps: int
    repeats: int
    compile_s: float | None
    first_result_s: float
    warm_s: float
    step_s: float
    component_s: dict[str, float]
    shares: dict[str, float]
    parts_over_step: float
    loop_s: float
    energy_evals_per_step: float
    draws_per_step: float
    method: str
    page_faults_per_run: int | None = None

    def __str__(self) -> str:
        chains = "x".join(map(str, self.chains)) + " chains" if self.chains else "one chain"
        lines = [
            f"fnebm.profile_sampling: {chains}, {self.steps} steps per run, {self.mode}, on {self.device}",
            f"  compile               {'-' if self.compile_s is None else _fmt(self.compile_s)}",
            f"  time to first result  {_fmt(self.first_result_s)}",
            f"  warm run              {_fmt(self.warm_s)}  (median of {self.repeats})",
            f"  warm time per step    {_fmt(self.step_s)}",
            *([] if self.page_faults_per_run is None else [
                f"  page faults           {self.page_faults_per_run:,} per warm run"
                + (" (memory mapped afresh: fnebm.reuse_freed_memory() keeps freed blocks mapped, docs/performance.md)"
                   if self.page_faults_per_run >= _MANY_FAULTS else "")]),
            "",
            f"  {'per step':<22}{'time':>10}{'share':>8}",
        ]
        notes = {
            "gradient": f"{self.energy_evals_per_step:g} evaluation{'' if self.energy_evals_per_step == 1 else 's'}",
            "random": f"fold_in + {self.draws_per_step:g} call{'' if self.draws_per_step == 1 else 's'}",
            "update": f"the remainder; an empty loop takes {_fmt(self.loop_s)}",
            "trace": "",
        }
        for name in COMPONENTS:
            lines.append(f"  {_LABELS[name]:<22}{_fmt(self.component_s[name]):>10}{self.shares[name]:>8.1%}"
                         + (f"  ({notes[name]})" if notes[name] else ""))
        if self.parts_over_step > 1:
            lines.append(f"  the parts timed alone add up to {self.parts_over_step:.2f}x the step "
                         "(fused in it): shares are of their sum")
        lines.append(textwrap.fill(self.method, 100, initial_indent="  method: ", subsequent_indent="    "))
        return "\n".join(lines)


def _fmt(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


# ------------------------------------------------------------------ finding and counting


def _find_energy(fn: Any, depth: int = 0) -> Any:
    """The energy a step holds: an ``energy_fn`` keyword of a partial (fnebm's samplers, the
    adaptation steps), or a closure cell named ``energy_fn``/``energy``, searched through
    wrapping partials and closures."""
    if depth > 5 or isinstance(fn, Tensor):
        return None
    if isinstance(fn, functools.partial):
        found = fn.keywords.get("energy_fn")
        if callable(found):
            return found
        inner = [fn.func, *fn.args, *fn.keywords.values()]
    else:
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
        if code is None:
            return None
        inner = []
        for name, cell in zip(code.co_freevars, cells):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if name in ("energy_fn", "energy") and callable(value):
                return value
            inner.append(value)
    for value in inner:
        if callable(value) and (found := _find_energy(value, depth + 1)) is not None:
            return found
    return None


def _energy_code(energy: Any) -> tuple[types.CodeType, Any]:
    """The code object a call of ``energy`` runs, and the ``self`` it runs with (or ``None``)."""
    fn = energy
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, types.FunctionType):
        return fn.__code__, None
    if isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType):
        return fn.__func__.__code__, fn.__self__
    call = getattr(type(fn), "__call__", None)
    if isinstance(call, types.FunctionType):
        return call.__code__, fn
    raise TypeError(f"energy_fn must be a Python function or an object with a Python __call__ "
                    f"(its calls are counted), got {type(energy).__name__}")


def _first_argument(frame: types.FrameType, has_self: bool) -> Any:
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount][1 if has_self else 0:]
    if names:
        return frame.f_locals.get(names[0])
    if code.co_flags & 0x04:  # *args
        args = frame.f_locals.get(code.co_varnames[code.co_argcount + code.co_kwonlyargcount], ())
        return args[0] if args else None
    return None


_F = torch._C._functorch


def _physical(t: Tensor) -> tuple[tuple[int, ...], int, Tensor]:
    """A tensor seen inside ``vmap``/``grad``: its shape with the mapped axes leading (outermost
    first), the number of mapped axes, and the plain tensor underneath (for dtype and device)."""
    mapped = []
    while _F.is_functorch_wrapped_tensor(t):
        if _F.is_batchedtensor(t):
            inner = _F.get_unwrapped(t)
            mapped.append(inner.shape[_F.maybe_get_bdim(t)])
            t = inner
        else:
            t = _F.get_unwrapped(t)
    return tuple(reversed(mapped)), len(mapped), t


_DRAWS = {getattr(fr, name).__code__: name for name in ("split", "fold_in", "bits", "uniform", "normal", "bernoulli")}


def _spec(name: str, value: Any) -> Any:
    """A draw's argument as hashable data: a key by its physical shape (the work it is), another
    tensor by its shape per sample (it broadcasts against the draw), anything else as it is."""
    if isinstance(value, Tensor):
        mapped, _, plain = _physical(value)
        shape = mapped + tuple(value.shape) if name == "key" else tuple(value.shape)
        return ("tensor", shape, plain.dtype, plain.device)
    if isinstance(value, list):
        return tuple(value)
    return value


class _Probe(NamedTuple):
    evals: int  # energy calls (outermost) over all probe steps
    x: tuple[tuple[int, ...], int, torch.dtype, torch.device] | None  # (shape, mapped axes, dtype, device)
    draws: dict[Any, int]  # draw signature -> calls over all probe steps


def _probe(step: Callable, chain: ChainState, energy: Any, n: int) -> _Probe:
    """Run ``n`` eager steps, counting the energy's calls and recording every ``fnebm.random``
    call the step makes (a profile hook on this thread, removed afterwards)."""
    code, self_obj = _energy_code(energy)
    evals, active, x_spec = 0, 0, None
    draws: dict[Any, int] = {}
    random_file = fr.__file__

    def hook(frame, event, arg):
        nonlocal evals, active, x_spec
        if event not in ("call", "return"):
            return
        c = frame.f_code
        if c is code and (self_obj is None or frame.f_locals.get("self") is self_obj):
            if event == "return":
                active -= 1
                return
            if active == 0:
                evals += 1
                x = _first_argument(frame, self_obj is not None)
                if x_spec is None and isinstance(x, Tensor):
                    mapped, levels, plain = _physical(x)
                    x_spec = (mapped + tuple(x.shape), levels, plain.dtype, plain.device)
            active += 1
        elif event == "call" and c in _DRAWS and frame.f_back.f_code.co_filename != random_file:
            args = tuple((k, _spec(k, frame.f_locals[k])) for k in c.co_varnames[: c.co_argcount])
            sig = (_DRAWS[c], args)
            draws[sig] = draws.get(sig, 0) + 1

    state = chain.state
    old = sys.getprofile()
    for i in range(n):
        keys = fr.fold_in(chain.keys, chain.steps_taken + i)
        sys.setprofile(hook)
        try:
            state, _ = step(state, keys)
        finally:
            sys.setprofile(old)
    return _Probe(evals, x_spec, draws)


# ------------------------------------------------------------------ the pieces, timed alone

_IDS = itertools.count()
_PIECES: OrderedDict[Any, Callable] = OrderedDict()
_PIECES_MAX = 32
_LOCK = threading.Lock()


def _fresh(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: each piece keeps its own Dynamo cache."""
    name = f"profile_{fn.__name__}_{next(_IDS)}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _compiled(key: Any, make: Callable[[], Callable], backend: Any) -> Callable:
    """The compiled piece for ``key`` (this module's own cache: least recently used dropped)."""
    with _LOCK:
        fn = _PIECES.pop((key, backend), None)
        if fn is None:
            # Inductor as sample_chain compiles it (cacheable loops, the C++ wrapper for while_loops)
            fn = torch.compile(_fresh(make()), fullgraph=True,
                               backend=inductor_backend if backend == "inductor" else backend)
        _PIECES[(key, backend)] = fn
        while len(_PIECES) > _PIECES_MAX:
            _PIECES.popitem(last=False)
        return fn


def _copy(old: Tensor, new: Tensor) -> Tensor:
    return torch.empty_like(old).copy_(new)  # a scan carry keeps its strides and aliases nothing


def _make_gradient(levels: int) -> Callable:
    def gradient(energy, x, carry, ts):
        vag = over_batch(value_and_grad(energy), levels)
        if not torch.compiler.is_compiling():
            for _ in range(ts.shape[0]):
                carry = vag(x)
            return carry

        def body(carry, t):
            return tuple(map(_copy, carry, vag(x))), t.clone()

        return scan(body, tuple(carry), ts)[0]

    return gradient


def _make_random(draws: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]) -> Callable:
    def random(keys, tensors, carry, ts):
        def all_draws(t):
            k = fr.fold_in(keys, t)  # sample_chain's key for step t
            k0 = k[(0,) * k.ndim]  # keys of the recorded shapes, made to depend on step t
            outs, given = [k], iter(tensors)
            for name, args in draws:
                kw = {a: (next(given) if isinstance(s, tuple) and s[:1] == ("tensor",) else s) for a, s in args}
                kw["key"] = (kw["key"] + k0) & 0xFFFFFFFF
                outs.append(getattr(fr, name)(**kw))
            return tuple(outs)

        if not torch.compiler.is_compiling():
            for i in range(ts.shape[0]):
                carry = all_draws(ts[i])
            return carry

        def body(carry, t):
            return tuple(map(_copy, carry, all_draws(t))), t.clone()

        return scan(body, tuple(carry), ts)[0]

    return random


def _make_loop() -> Callable:
    def loop(counter, ts):  # the loop alone: what every piece pays per step besides its work
        if not torch.compiler.is_compiling():
            for i in range(ts.shape[0]):
                counter = counter + ts[i]
            return counter

        def body(carry, t):  # every piece emits t: Inductor (torch 2.13) fails on a scan emitting nothing
            return (carry[0] + t,), t.clone()

        return scan(body, (counter,), ts)[0]

    return loop


def _make_trace() -> Callable:
    def trace(templates, counter, ts):
        if not torch.compiler.is_compiling():  # as the eager loop: a clone per step, stacked at the end
            written = [tuple(x.clone() for x in templates) for _ in range(ts.shape[0])]
            return tuple(torch.stack(xs) for xs in zip(*written))

        def body(carry, t):
            return (carry[0] + t,), (t.clone(), *(x.clone() for x in templates))

        return scan(body, (counter,), ts)[1][1:]

    return trace


def _chains_last(x: Tensor, n_chain_axes: int) -> Tensor:
    # sample_chain keeps small one-axis states chain-innermost while its loop runs
    # (docs/internals.md, "Layout"); the pieces use the same layout
    if n_chain_axes == 1 and x.ndim >= 2 and math.prod(x.shape[1:]) <= 64:
        return x.movedim(0, -1).contiguous().movedim(-1, 0)
    return x


def _replay_plan(draws: dict[Any, int], n_probe: int, cap: int = 64) -> tuple[list[Any], float]:
    """Each recorded draw as often per step as the step made it (rounded; at most ``cap`` in
    all), and the factor from the replayed count to the recorded one."""
    exact = sum(draws.values()) / n_probe
    reps = {sig: max(1, round(c / n_probe)) for sig, c in draws.items()}
    total = sum(reps.values())
    if total > cap:
        reps = {sig: max(1, r * cap // total) for sig, r in reps.items()}
        total = sum(reps.values())
    plan = [sig for sig, r in reps.items() for _ in range(r)]
    return plan, (exact / total if total else 0.0)


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


# 1,000 page faults are 4 MB of fresh pages in a warm run: worth a word in the table
_MANY_FAULTS = 1000


def _minor_faults() -> int | None:
    """The process's minor page faults so far (``None`` where ``resource`` is missing: Windows)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


# ------------------------------------------------------------------ the entry point


def profile_sampling(
    step_or_algorithm: SamplingAlgorithm | Callable[[Any, Tensor], tuple[Any, Any]],
    state_or_positions: Any,
    key: Tensor | None,
    n_steps: int,
    *,
    burn_in: int = 0,
    thin: int = 1,
    collect: Callable[[Any], Any] | None = None,
    chunk_size: int | None = None,
    chain_ndim: int | None = None,
    compile: bool = True,
    compile_backend: Any = "inductor",
    repeats: int = 5,
    energy_fn: Callable[[Tensor], Tensor] | None = None,
    probe_steps: int = 2,
) -> SamplingProfile:
    """Time a sampling run and split its warm step into gradient, random draws, update and trace write.

    Args:
        step_or_algorithm: a ``SamplingAlgorithm`` (``fnebm.mala(...)``) or a batched
            ``step(state, keys) -> (state, info)``, as :func:`fnebm.sample_chain` takes.
        state_or_positions: positions ``(*chains, *event)`` (with a ``SamplingAlgorithm``: its
            ``init`` is mapped over the ``chain_ndim`` leading axes), a sampler state whose
            fields lead with the chain axes, or a :class:`~fnebm.ChainState` (then ``key=None``).
        key, n_steps, burn_in, thin, collect, chunk_size, chain_ndim, compile: as in
            :func:`fnebm.sample_chain`; each timed run is that call (``progress`` off).
        compile_backend: the ``torch.compile`` backend of the run and of the pieces (the run
            compiles in a :class:`~fnebm.chain.RunnerCache` of its own, so the compile is always
            timed). The run is ``sample_chain``'s torch engine (``backend="torch"``, compiled or
            eager), never a hand-written kernel, which has no parts to time.
        repeats: warm runs of the step and of each piece, interleaved; medians are reported.
        energy_fn: the energy the step evaluates; found by itself in fnebm's samplers (their
            ``energy_fn``) and in closures over a variable ``energy_fn`` or ``energy``.
        probe_steps: eager steps in which energy evaluations and random draws are counted
            (the count of a NUTS step varies from step to step: more gives a steadier mean).

    Returns:
        a :class:`SamplingProfile`; ``print`` it for the table.

    The cost: one cold run, ``repeats`` warm runs, and ``repeats`` loops of each piece (about
    one more run in all); compiled, three small extra graphs the first time a kind of energy
    and shapes is profiled in a process (cached here, not in your ``RunnerCache``).
    """
    if isinstance(step_or_algorithm, SamplingAlgorithm):
        alg = step_or_algorithm
        step = alg.step
    else:
        alg = None
        step = step_or_algorithm
        _checks.check_callable("step_or_algorithm", step, "a SamplingAlgorithm or step(state, keys) -> (state, info)")
    n_steps = _checks.check_int("n_steps", n_steps, 1)
    burn_in = _checks.check_int("burn_in", burn_in, 0)
    repeats = _checks.check_int("repeats", repeats, 1)
    probe_steps = _checks.check_int("probe_steps", probe_steps, 1)
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool, got {type(compile).__name__}")
    if not (isinstance(compile_backend, str) or callable(compile_backend)):
        raise TypeError("compile_backend must be a torch.compile backend name or callable, got "
                        f"{type(compile_backend).__name__}")
    backend = compile_backend
    if energy_fn is None:
        energy_fn = _find_energy(step)
        if energy_fn is None:
            raise ValueError("could not find the energy in step_or_algorithm (fnebm's samplers hold it as "
                             "energy_fn): pass energy_fn=, the energy the step evaluates")
    _checks.check_callable("energy_fn", energy_fn, "x -> E(x) (one sample in, a 0-dim energy out)")
    _energy_code(energy_fn)  # refuses what cannot be counted before any run

    state = state_or_positions
    if alg is not None and isinstance(state, Tensor):
        n_axes = 1 if chain_ndim is None else _checks.check_int("chain_ndim", chain_ndim, 0)
        if state.ndim < n_axes + 1:
            raise ValueError(f"state_or_positions holds positions (*chains, *event) with {n_axes} chain "
                             f"axis(es), got shape {tuple(state.shape)}")
        state = over_batch(alg.init, n_axes)(state)
    if isinstance(state, ChainState):
        if key is not None:
            raise ValueError("state_or_positions is a ChainState, which carries its keys: pass key=None")
        chain = state
    else:
        if key is None:
            raise TypeError("key must be a key tensor from fnebm.random.key(seed) (None only with a ChainState)")
        chain = chain_init(state, key, chain_ndim=chain_ndim)
    device = chain.keys.device
    n_axes = chain.keys.ndim - 1
    total = burn_in + n_steps

    # the run itself, cold then warm: sample_chain as the user calls it, in a cache of its own
    runners = RunnerCache(maxsize=2, backend=backend)

    def run():
        return sample_chain(step, state, key, n_steps, burn_in=burn_in, thin=thin, collect=collect,
                            chunk_size=chunk_size, compile=compile, backend="torch",
                            progress=False, chain_ndim=chain_ndim, cache=runners)

    result = []
    first_s = _timed(lambda: result.append(run()), device)
    _, trace, info = result.pop()

    # what a step does, counted in eager steps from the starting state
    probe = _probe(step, chain, energy_fn, min(probe_steps, total))
    evals = probe.evals / min(probe_steps, total)
    plan, draw_scale = _replay_plan(probe.draws, min(probe_steps, total))
    draws_per_step = sum(probe.draws.values()) / min(probe_steps, total)

    ts = torch.arange(total, device=device)
    if compile and total >= 2:
        torch._dynamo.mark_dynamic(ts, 0)  # one graph for every run length, as sample_chain

    pieces: dict[str, Callable[[], Any]] = {}
    scale = {"gradient": evals, "random": draw_scale if plan else 1.0, "trace": 1.0}

    if evals > 0 and probe.x is not None:
        shape, levels, dtype, xdev = probe.x
        x = getattr(chain.state, "position", None)
        if not (isinstance(x, Tensor) and tuple(x.shape) == shape and x.dtype == dtype):
            x = fr.normal(fr.key(0, device=xdev), shape, dtype)
        x = _chains_last(x, n_axes)
        carry = tuple(over_batch(value_and_grad(energy_fn), levels)(x))
        grad_key = ("gradient", code_key(energy_fn), levels, shape, dtype, xdev)
        grad_fn = (_compiled(grad_key, functools.partial(_make_gradient, levels), backend) if compile
                   else _make_gradient(levels))
        pieces["gradient"] = lambda: grad_fn(energy_fn, x, carry, ts)
    else:
        scale["gradient"] = 0.0

    draws = tuple(plan)
    tensors = []
    for _, args in draws:
        for name, s in args:
            if isinstance(s, tuple) and s[:1] == ("tensor",):
                _, shape, dtype, dev = s
                if name == "key":  # word-major, as fnebm.random stores a batch of keys
                    words = torch.arange(math.prod(shape), dtype=torch.int64, device=dev) * 2654435761
                    tensors.append((words & 0x7FFFFFFF).reshape(2, *shape[:-1]).movedim(0, -1))
                elif dtype.is_floating_point:
                    tensors.append(torch.full(shape, 0.5, dtype=dtype, device=dev))
                else:
                    tensors.append(torch.zeros(shape, dtype=dtype, device=dev))
    random_fn = _make_random(draws)
    random_carry = random_fn(chain.keys, tensors, None, ts[:1])  # one eager round: the carry's layout
    if compile:
        random_fn = _compiled(("random", draws, tuple(chain.keys.shape), device), functools.partial(_make_random, draws),
                              backend)
    pieces["random"] = lambda: random_fn(chain.keys, tensors, random_carry, ts)

    templates = tuple(_chains_last(x[0], n_axes) for x in pytree.tree_leaves((trace, info)) if x.shape[0] > 0)
    counter = torch.zeros((), dtype=torch.int64, device=device)
    trace_key = ("trace", tuple((x.shape, x.stride(), x.dtype) for x in templates), device)
    trace_fn = _compiled(trace_key, _make_trace, backend) if compile else _make_trace()
    pieces["trace"] = lambda: trace_fn(templates, counter, ts)
    loop_fn = _compiled(("loop", device), _make_loop, backend) if compile else _make_loop()
    pieces["loop"] = lambda: loop_fn(counter, ts)
    del trace, info

    for piece in pieces.values():  # warm: compiles the pieces once
        _timed(piece, device)

    # interleaved rounds (run, gradient, random, trace, loop, run, ...): a noisy moment hits all alike
    times: dict[str, list[float]] = {name: [] for name in ("run", *pieces)}
    faults: list[int] = []
    for _ in range(repeats):
        before = _minor_faults()
        times["run"].append(_timed(run, device))
        if before is not None:
            faults.append(_minor_faults() - before)
        for name, piece in pieces.items():
            times[name].append(_timed(piece, device))
    warm_s = statistics.median(times["run"])
    step_s = warm_s / total
    loop_s = statistics.median(times["loop"]) / total
    # each piece less the bare loop of the same round (the run pays its loop once, in the remainder)
    parts = {name: max(statistics.median(a - b for a, b in zip(times[name], times["loop"])), 0.0) / total * scale[name]
             if name in pieces else 0.0 for name in ("gradient", "random", "trace")}
    measured = sum(parts.values())
    update = max(step_s - measured, 0.0)
    seconds = {"gradient": parts["gradient"], "random": parts["random"], "update": update, "trace": parts["trace"]}
    denom = step_s if measured <= step_s else measured
    shares = {name: (v / denom if denom > 0 else 0.0) for name, v in seconds.items()}

    k = min(probe_steps, total)
    how = "compiled" if compile else "eager"
    method = (
        f"warm medians of {repeats} interleaved repeats; energy+gradient (one batched value_and_grad x "
        f"{evals:g} evaluation(s) per step), fold_in+draws (the step's fnebm.random calls replayed) and the trace "
        f"write (a loop that only writes) each timed alone as {how} loops of {total} steps at the run's shapes, "
        f"less an empty loop's time; counts from {k} eager step{'s' if k > 1 else ''}; update and checks = the "
        f"step minus those parts (with the loop itself)"
    )
    if plan and abs(draw_scale - 1.0) > 1e-9:
        method += f"; draws replayed {len(plan)} per step and scaled by {draw_scale:.3g}"
    name = str(device)
    if device.type == "cuda":
        name += f" ({torch.cuda.get_device_name(device)})"
    return SamplingProfile(
        device=name,
        mode=f"compiled ({backend if isinstance(backend, str) else getattr(backend, '__name__', 'custom')})" if compile
        else "eager",
        chains=tuple(chain.keys.shape[:-1]),
        steps=total,
        repeats=repeats,
        compile_s=max(first_s - warm_s, 0.0) if compile else None,
        first_result_s=first_s,
        warm_s=warm_s,
        step_s=step_s,
        component_s=seconds,
        shares=shares,
        parts_over_step=measured / step_s if step_s > 0 else 0.0,
        loop_s=loop_s,
        energy_evals_per_step=evals,
        draws_per_step=draws_per_step,
        method=method,
        page_faults_per_run=int(statistics.median(faults)) if faults else None,
    )
