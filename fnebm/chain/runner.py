"""The compiled runner: one ``torch.compile(fullgraph=True)`` function per kind of step, in an explicit cache.

The step, ``collect`` and the per-chain keys are *arguments* of the compiled function, not
constants baked into it: Dynamo guards a ``functools.partial`` or a closure by its code and
treats the tensors it holds (step sizes, energy parameters, network weights) as graph inputs.
So a sampler rebuilt with new values of the same shapes reuses the graph — no recompile, no
new C++ compile. Runners are keyed by the *code* of the step and of ``collect`` (and the
state's tree structure), so an inline ``lambda`` passed on every call hits the same entry, and
each kind of step gets a Dynamo cache of its own (many samplers in one process never reach
Dynamo's recompile limit).
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import types
from collections import OrderedDict
from typing import Any, Callable, Hashable, NamedTuple

import torch

from fnebm import _inductor
from fnebm.chain.loop import loop

__all__ = ["RunnerCache", "RunPlan", "CompileFallbackWarning", "default_cache", "code_key", "describe_failure"]


class CompileFallbackWarning(UserWarning):
    """A compile failed on a run's step, and the run went on with eager steps (the same draws).

    ``sample_chain`` (and the warm-ups that run through it) warns once per kind of step and
    shapes; later calls in the process run eagerly without trying the compile again, and their
    :class:`RunPlan` carries the reason in ``fallback``."""

# fnebm's Inductor backend lives in fnebm._inductor (the evaluations of fnebm.samplers.evaluation
# compile with it too); importable from here as before
inductor_backend = _inductor.inductor_backend
# what compile="auto" expects a compile of a runner this machine compiled before to take (its graph in
# Inductor's on-disk cache), before such a compile is recorded: on this project's 2-core host the Langevin
# runners of bench/user.py's 784-D MLP and ConvNet took 17.7 and 19.7 s to compile with empty caches, and
# 6.2 and 5.2 s in the next process
CACHED_COMPILE_S = 6.0
# compiled chunks timed (each after the compile) before their best rate is taken for what compiling buys,
# and at most (a timed chunk ends in a device sync: on a GPU, the first chunks of a runner only)
GAIN_CHUNKS = 3
GAIN_TIMED = 8
# the least share of the eager time auto counts as rent where a gain is known: a gain measured at or above
# 1 (compiled steps no faster) still compiles after ten times a compile's cost of eager time, so a reading
# that one noisy chunk made too high is measured again, and the rule keeps a bound
MIN_SAVING = 0.1

_IDS = itertools.count()


def code_key(fn: Any, _depth: int = 0) -> Hashable:
    """What identifies a callable's *code and static configuration*, not its values: partials by
    their function and arguments, functions by their code object and closure, bound methods by
    theirs, other objects by type. An argument or closure cell that is callable counts by its
    own code (an energy, a kernel); a tensor by its dtype, number of axes and device (its values
    and sizes are graph inputs); a Python constant (an int trajectory length, a bool switch, a
    tuple of integrator coefficients) by its value, since the compiled code is specialised on it.

    So ``mala(gaussian_a, 0.1).step`` and ``mala(gaussian_b, 0.2).step`` share a key (and a
    graph), while MALA on a Gaussian and MALA on a network, or HMC with two integrators, get
    runners of their own: each configuration compiles once, instead of recompiling a shared
    runner back and forth (and into Dynamo's recompile limit).
    """
    if _depth > 6:
        return ("deep", type(fn))
    if isinstance(fn, functools.partial):
        args = tuple(_static(a, _depth) for a in fn.args)
        kwargs = tuple((k, _static(v, _depth)) for k, v in sorted(fn.keywords.items()))
        return ("partial", code_key(fn.func, _depth + 1), args, kwargs)
    if isinstance(fn, types.MethodType):
        return ("method", code_key(fn.__func__, _depth + 1))
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = []
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                cells.append(_static(cell.cell_contents, _depth))
            except ValueError:  # an empty cell
                cells.append(None)
        return (code, tuple(cells)) if cells else code
    return ("object", type(fn))


def _static(value: Any, depth: int) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.ndim, value.device.type)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(value), value)
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        return (type(value), tuple(_static(v, depth + 1) for v in value))
    if callable(value):
        return code_key(value, depth + 1)
    return ("object", type(value))


_INNER = "Got graph break/error:"
_IN_STEP = "in the step, inside the compiled loop:"


def describe_failure(exc: BaseException) -> str:
    """One line saying why a compile failed: the exception's type and the first line of its message,
    the wrapped error's for Dynamo's ``BackendCompilerFailed`` (``"backend='inductor' raised:"``),
    and Dynamo's own reason for a step it could not trace inside the loop's scan body."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # what failed inside the compiled loop's body (the step): Dynamo's reason, not the loop's preamble
    # ("This higher order operator doesn't work unless it is captured completely ... Got graph break/error:")
    inner = next((i for i, line in enumerate(lines) if line.endswith(_INNER)), None)
    if inner is not None and inner + 1 < len(lines):
        lines = [f"{_IN_STEP} {lines[inner + 1]}"]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _chunk(step, lifted, collect, keys, state, ts, known):
    if lifted:  # the step's 0-dim float64 tensors, passed as (1,) (see _lift), 0-dim again
        step = functools.partial(step.func, *step.args, **{k: v.reshape(()) if k in lifted else v
                                                         for k, v in step.keywords.items()})
    return loop(step, collect, keys, state, ts, unroll=False, known=known)


def _lift(step: Any) -> tuple[Any, tuple[str, ...]]:
    """``(step, names)``: a partial's 0-dim float64 CPU tensors (a sampler's step size or noise
    scale made from a number) reshaped to ``(1,)``, and their keyword names.

    Dynamo's fake tensors give every 0-dim float64 or integer CPU input a symbolic value (as if
    ``.item()`` might be called); when the graph never uses it as a number, AOT autograd's
    scalar pass finds the symbol unused and restarts the whole trace to specialise it away: every
    sampler compiled twice over (on the 784-D MLP, 19 s of a 90 s compile). A ``(1,)`` input
    has no such value; the compiled function reshapes it back, so the kernel sees what it was
    given, and a new value still recompiles nothing.
    """
    if not isinstance(step, functools.partial):
        return step, ()
    names = tuple(k for k, v in step.keywords.items()
                  if type(v) is torch.Tensor and v.ndim == 0 and v.dtype == torch.float64 and v.device.type == "cpu")
    if not names:
        return step, ()
    keywords = {k: v.reshape(1) if k in names else v for k, v in step.keywords.items()}
    return functools.partial(step.func, *step.args, **keywords), names


def _lifting(compiled: Callable) -> Callable:
    """The compiled ``_chunk`` called as ``run(step, collect, keys, state, ts, known=None)``, its step
    lifted; ``known``: :func:`fnebm._loop.structure` of the step's outputs when a step ran before."""

    def run(step, collect, keys, state, ts, known=None):
        step, lifted = _lift(step)
        return compiled(step, lifted, collect, keys, state, ts, known)

    return run


def _fresh(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: Dynamo keeps graphs per code object and its
    automatic-dynamic decisions per code name, so runners never share either."""
    name = f"{fn.__name__}_{next(_IDS)}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


class RunPlan(NamedTuple):
    """How ``sample_chain`` runs a call, decided before its first step (see ``compile="auto"``).

    compiled: the compiled runner runs (else the steps run eagerly); compiles: a graph is
    compiled first (nothing of this kind and shapes has been compiled in this process yet; the
    compile may still be served by Inductor's on-disk cache); reason: one line saying why;
    eager_step_s: seconds per eager step for this kind and shapes, the fastest rate measured so far
    (``None`` before any was timed); compile_estimate_s: what ``auto`` takes a compile to cost; steps:
    the steps of this call; kernel: a hand-written Triton kernel runs the whole chain (see
    ``backend=``), neither the compiled runner nor the eager loop; engine: which of those runs
    (``"compiled"``, ``"eager"``, ``"c"``, ``"triton"``); skipped: each hand-written kernel
    ``backend="auto"`` passed over, as :class:`fnebm.kernels.dispatch.Skipped` (engine, scope,
    reason, and ``unavailable``: it covers the run but its library could not be used); transition:
    ``"c"`` when each step's transition runs in a C kernel (NUTS), else ``""``; fallback: ``None``, or why the
    compile of this kind of step and shapes failed (the exception, on one line), so the steps run
    eagerly; revised: this plan replaces the one this call reported first — its compile failed
    during the call, and the steps from the chunk that was compiling on run eagerly, or a compile
    that ran in the background finished and the rest of the call runs compiled; background: a
    compile of this kind of step and shapes runs in a background thread (``compile="auto"``,
    :class:`RunnerCache`'s ``background``), and these steps run eagerly meanwhile; gain: the compiled
    runner's seconds per step over the eager steps' where ``auto`` knows it (measured in this process,
    else recorded on this machine for the same runner and shapes; ``None`` otherwise), which ``auto``
    weighs a compile against (:meth:`RunnerCache.plan`; for a runner compiled earlier in this process,
    only what was measured in it).
    """

    compiled: bool
    compiles: bool
    reason: str
    eager_step_s: float | None
    compile_estimate_s: float
    steps: int
    kernel: bool = False  # a hand-written whole-chain kernel runs (sample_chain's backend=)
    fallback: str | None = None  # the compile failed (why, on one line): the steps run eagerly
    revised: bool = False  # a second report of the same call: its compile failed, the rest runs eagerly
    background: bool = False  # a compile runs in the background while these steps run eagerly
    engine: str = ""  # what runs the steps: "compiled", "eager", "c" or "triton" (sample_chain fills it in)
    skipped: tuple = ()  # the fast paths backend="auto" passed over: fnebm.kernels.dispatch.Skipped values
    transition: str = ""  # the engine of a transition kernel inside the steps ("c": NUTS's C kernel), or ""
    gain: float | None = None  # compiled seconds per step over eager ones, where auto knows it (measured here or recorded)


class _Ledger:
    """What ``auto`` knows of one kind of step at one set of shapes."""

    __slots__ = ("eager_s", "eager_steps", "best_step_s", "compiled", "failed", "pending", "failure_said",
                 "graph_failed", "described", "signature", "before", "best_compiled_s", "compiled_chunks",
                 "recorded_gain", "gain_written")

    def __init__(self):
        self.eager_s = 0.0      # seconds spent running this eagerly (the probe steps included)
        self.eager_steps = 0
        self.best_step_s = None  # the fastest measured rate: a noisy machine only ever slows a step
        self.compiled = False   # the compiled runner has run at these shapes
        self.failed = None      # why its compile failed (then it runs eagerly, never compiled again)
        self.pending = None     # the thread compiling it in the background, while eager steps run
        self.failure_said = False  # a background compile's failure has been warned of
        self.graph_failed = None  # why its eager step could not be captured as a CUDA graph (not tried again)
        # its description, the same in every process (fnebm._signature; None where there is none), once
        # described, and whether this machine compiled it in an earlier process (looked up once)
        self.described, self.signature, self.before = False, None, None
        # the compiled runner's fastest rate in this process (chunks after the one that compiled) and how
        # many chunks were timed; the gain this machine recorded for it (False: not looked up yet); and
        # the gain last written to that record
        self.best_compiled_s, self.compiled_chunks = None, 0
        self.recorded_gain: float | None | bool = False
        self.gain_written: float | None = None

    def record(self, seconds: float, steps: int) -> None:
        """``steps`` eager steps took ``seconds``."""
        self.eager_s += seconds
        self.eager_steps += steps
        rate = seconds / steps
        self.best_step_s = rate if self.best_step_s is None else min(self.best_step_s, rate)
        self._write_gain()

    def record_compiled(self, seconds: float, steps: int) -> None:
        """``steps`` steps of the compiled runner took ``seconds`` (a chunk without a compile in it)."""
        rate = seconds / steps
        self.best_compiled_s = rate if self.best_compiled_s is None else min(self.best_compiled_s, rate)
        self.compiled_chunks += 1
        self._write_gain()

    def step_s(self) -> float | None:
        return self.best_step_s

    def measured_gain(self) -> float | None:
        """The compiled runner's seconds per step over the eager steps', both the fastest measured in
        this process (a busy machine only ever slows a step), once :data:`GAIN_CHUNKS` compiled chunks
        were timed; else ``None``."""
        if not self.best_compiled_s or not self.best_step_s or self.compiled_chunks < GAIN_CHUNKS:
            return None
        return self.best_compiled_s / self.best_step_s

    def _write_gain(self) -> None:
        """Keep the measured gain in this machine's record (``fnebm._inductor.record_gain``), under the
        runner's description, when it is new or moved by more than 5 %."""
        gain = self.measured_gain()
        if gain is None or self.signature is None:
            return
        if self.gain_written is None or abs(gain - self.gain_written) > 0.05 * self.gain_written:
            self.gain_written = gain
            _inductor.record_gain(self.signature, gain)


class RunnerCache:
    """Compiled runners, least recently used dropped beyond ``maxsize``.

    ``get(key)`` returns ``run(step, collect, keys, state, ts) -> (state, kept, info)``, compiled
    the first time it is called (eager runners are not cached: they hold nothing). Pass your
    own instance to ``sample_chain(cache=...)`` to keep graphs apart, drop them (and forget the
    compiles that failed, so that the next call tries again) with ``clear()``,
    or compile with another ``torch.compile`` backend (e.g. ``"aot_eager"`` to debug, or a
    counting backend in tests).

    ``compile_estimate_s``: what ``sample_chain(compile="auto")`` takes a new compile to cost
    (default: 20 s for Inductor — on a 2-core CPU a sampler's graph took 29-37 s with an empty
    on-disk cache and about 6 s with a warm one — and 0 for any other backend, so that ``auto``
    always compiles with a debugging or counting backend). With the default, what compiles took on
    this machine replaces it (:meth:`_compile_cost`): first compiles, and for a runner this machine
    compiled in an earlier process whose graph Inductor's on-disk cache still holds, compiles served
    by that cache (:data:`CACHED_COMPILE_S` before one is recorded).

    ``background`` (default ``False``; experimental): when ``compile="auto"`` decides to compile,
    the compile runs in a background thread and the steps go on eagerly (the same keys, the same
    draws up to float rounding); a call whose compile finishes switches to the compiled runner at
    its next chunk (``on_plan`` is told, with a revised plan), and later calls run compiled from
    the start; a compile that fails there is warned of once (:class:`CompileFallbackWarning`) and
    the steps stay eager. **Not safe with ``nn.Module`` energies:** while it traces, torch's FX
    tracer patches ``nn.Module.__call__`` for the whole process, and a module called on another
    thread meanwhile (the eager steps, or your training loop) fails ("module is not installed as
    a submodule"). On 2 cores the eager steps also ran about 4x slower while it compiled. Use it
    for energies written as functions, on a machine with cores to spare. ``False``: the call that
    decides to compile waits for it (announced by a :class:`CompileNotice`), as ``compile=True`` does.
    """

    def __init__(self, maxsize: int = 64, backend: Any = "inductor", compile_estimate_s: float | None = None,
                 background: bool = False):
        self.maxsize = maxsize
        self.backend = backend
        if not isinstance(background, bool):
            raise TypeError(f"background must be a bool, got {type(background).__name__}")
        self.background = background
        self._measure = compile_estimate_s is None and backend == "inductor"  # see compile_s
        if compile_estimate_s is None:
            compile_estimate_s = 20.0 if backend == "inductor" else 0.0
        if not (isinstance(compile_estimate_s, (int, float)) and compile_estimate_s >= 0):
            raise ValueError(f"compile_estimate_s must be a number >= 0, got {compile_estimate_s!r}")
        self.compile_estimate_s = float(compile_estimate_s)
        self._runners: OrderedDict[Hashable, Callable] = OrderedDict()
        self._probes: OrderedDict[Hashable, Any] = OrderedDict()
        self._ledgers: OrderedDict[Hashable, _Ledger] = OrderedDict()
        self._lock = threading.Lock()
        # seconds of each runner's first compiled call (compile + one chunk), measured in this
        # process: auto's cost of a compile once one is known (only with the default estimate)
        self.compile_s: dict[Hashable, float] = {}
        # the Inductor graphs each runner's compile gave, and the shapes it compiles for (its plan's): its
        # first compiled call records them under that ledger's description (_timed)
        self._graph_keys: dict[Hashable, list[str]] = {}
        self._shapes: dict[Hashable, Hashable] = {}

    def ledger(self, key: Hashable, shapes: Hashable) -> _Ledger:
        """The eager time spent and compile state of one kind of step at one set of shapes."""
        with self._lock:
            found = self._ledgers.pop((key, shapes), None) or _Ledger()
            self._ledgers[(key, shapes)] = found
            while len(self._ledgers) > 4 * self.maxsize:
                self._ledgers.popitem(last=False)
            return found

    def plan(self, key: Hashable, shapes: Hashable, steps: int, compile: bool | str) -> RunPlan:
        """Eager or compiled for a call of ``steps`` steps (``compile``: True, False or "auto").

        ``auto`` rents before it buys (the ski-rental rule): it runs eagerly while the eager
        time spent on this kind of step and shapes, plus this call's (measured seconds per
        eager step x steps), stays within ``compile_estimate_s``, and compiles once it would
        not. A sequence of calls then costs at most about twice what the better choice made
        in hindsight would have; a long run compiles at once, a short one never waits for a
        compile. Where it knows what compiling buys (:meth:`gain`: the compiled steps' time over the
        eager steps', measured in this process or recorded on this machine for the same runner and
        shapes), the rent is what the eager steps cost beyond compiled ones: it compiles once the
        eager time spent and this call's, times ``1 - gain`` (at least :data:`MIN_SAVING`), would pass
        the compile's cost; a runner whose compile buys little is not compiled again after a call or
        two in every new process. A runner compiled earlier in this process whose compiled steps were
        measured here no faster than its eager ones runs eagerly again.
        """
        plan = self._plan(key, shapes, steps, compile)
        if plan.compiled or plan.background:
            self._shapes[key] = shapes  # what its first compiled call is recorded under (_timed)
        return plan

    def _plan(self, key: Hashable, shapes: Hashable, steps: int, compile: bool | str) -> RunPlan:
        ledger = self.ledger(key, shapes)
        est, per = self.compile_estimate_s, ledger.step_s()
        if compile is False:
            return RunPlan(False, False, "compile=False", per, est, steps)
        if ledger.failed is not None:
            return RunPlan(False, False, f"eager: the compile failed earlier in this process ({ledger.failed})",
                           per, est, steps, fallback=ledger.failed)
        if ledger.compiled:
            gain = ledger.measured_gain() if compile == "auto" and self._measure else None
            if gain is not None and gain >= 1.0:
                return RunPlan(False, False, f"eager: the steps compiled earlier in this process ran {gain:.3g}x the "
                                             "eager steps' time (measured here), no faster", per, est, steps, gain=gain)
            return RunPlan(True, False, "compiled earlier in this process", per, est, steps, gain=gain)
        if ledger.pending is not None and compile == "auto":
            return RunPlan(False, False, "eager: the compile started earlier is still running in the background",
                           per, est, steps, background=True)
        if compile is True:
            return RunPlan(True, True, "compile=True", per, est, steps)
        est, measured = self._compile_cost(key, shapes)
        gain, where = self.gain(key, shapes)
        if per is None:
            return self._buy(RunPlan(True, True, "no eager step timed", per, est, steps, gain=gain), measured)
        eager = per * steps
        cost = {"process": "a compile took here", "machine": "compiles took on this machine (the median recorded)",
                "cached": "a compile of a graph this machine compiled before (in Inductor's on-disk cache) is expected to take"}.get(
            measured, "a compile is taken to cost")
        if gain is None:
            if ledger.eager_s + eager <= est:
                return RunPlan(False, False, f"eager: {steps} steps x {per * 1e3:.3g} ms = {eager:.3g} s, within "
                                             f"the {est:.3g} s {cost}", per, est, steps)
            return self._buy(RunPlan(True, True, f"compiled: {steps} eager steps would take {eager:.3g} s (+{ledger.eager_s:.3g} s "
                                                 f"spent eagerly), more than the {est:.3g} s {cost}", per, est, steps),
                             measured)
        # the rent is what the eager steps cost beyond compiled ones (at least MIN_SAVING of their time): a compile
        # is bought once the rent paid and this call's passes its price
        share = max(1.0 - gain, MIN_SAVING)
        saved = (ledger.eager_s + eager) * share
        known = (f"its compiled steps ran {gain:.3g}x the eager steps' time ({where}), so the rent is {share:.0%} of "
                 f"the {ledger.eager_s:.3g} s spent eagerly and this call's {eager:.3g} s: {saved:.3g} s")
        if saved <= est:
            return RunPlan(False, False, f"eager: {known}, within the {est:.3g} s {cost}", per, est, steps, gain=gain)
        return self._buy(RunPlan(True, True, f"compiled: {known}, more than the {est:.3g} s {cost}", per, est, steps,
                                 gain=gain), measured)

    def gain(self, key: Hashable, shapes: Hashable) -> tuple[float | None, str]:
        """What compiling buys runner ``key`` at ``shapes`` under ``auto``: its compiled seconds per step
        over the eager steps', measured in this process (:meth:`_Ledger.measured_gain`), else recorded on
        this machine for the same description (:func:`fnebm._inductor.recorded_gain`, looked up once), and
        where it was measured; ``(None, "")`` when unknown, or when the cost model is not the default's."""
        if not self._measure:
            return None, ""
        ledger = self.ledger(key, shapes)
        gain = ledger.measured_gain()
        if gain is not None:
            return gain, "measured in this process"
        if ledger.signature is None:
            return None, ""  # not described (yet): nothing to look up under
        if ledger.recorded_gain is False:
            ledger.recorded_gain = _inductor.recorded_gain(ledger.signature)
        if ledger.recorded_gain is None:
            return None, ""
        return ledger.recorded_gain, "recorded on this machine"

    def _buy(self, plan: RunPlan, measured: str | bool) -> RunPlan:
        """``auto`` decided to compile: in the background (eager steps meanwhile) or now, announced."""
        if self.background:
            return _announce(plan._replace(compiled=False, background=True,
                                           reason=f"eager while the compile runs in the background ({plan.reason})"),
                             measured)
        return _announce(plan, measured)

    def compile_in_background(self, key: Hashable, shapes: Hashable, args: tuple) -> None:
        """Start compiling runner ``key`` at ``shapes`` in a daemon thread by one call on ``args``
        (``(step, collect, keys, state, ts, known)``, two steps; its result is dropped). The ledger records
        the outcome: ``compiled``, or ``failed`` with why (a later call warns of it once)."""
        ledger = self.ledger(key, shapes)
        if ledger.pending is not None or ledger.compiled or ledger.failed is not None:
            return
        run = self.get(key)

        def work():
            try:
                run(*args)
            except Exception as exc:  # noqa: BLE001 - any failure of the compile: the steps stay eager
                ledger.failed = describe_failure(exc)
            else:
                ledger.compiled = True
            finally:
                ledger.pending = None

        ledger.pending = threading.Thread(target=work, name="fnebm-compile", daemon=True)
        ledger.pending.start()

    def describe(self, key: Hashable, shapes: Hashable, signature: str | None) -> None:
        """Runner ``key``'s description at ``shapes``, the same in every process
        (:func:`fnebm._signature.signature` of its step, ``collect``, shapes and threads): its compile at
        those shapes is recorded under it, and a later process that finds it recorded, with its graphs
        still in Inductor's on-disk cache, expects a cheaper compile."""
        ledger = self.ledger(key, shapes)
        if not ledger.described:
            ledger.described, ledger.signature = True, signature

    def described(self, key: Hashable, shapes: Hashable) -> bool:
        return self.ledger(key, shapes).described

    def compiled_before(self, key: Hashable, shapes: Hashable) -> bool:
        """Whether this machine compiled runner ``key`` at ``shapes`` before (in an earlier process) and
        Inductor's on-disk cache still holds its graphs; looked up once per runner and shapes."""
        ledger = self.ledger(key, shapes)
        if ledger.signature is None:
            return False
        if ledger.before is None:
            ledger.before = _inductor.compiled_before(ledger.signature)
        return ledger.before

    def _compile_cost(self, key: Hashable, shapes: Hashable = None) -> tuple[float, str | bool]:
        """What ``auto`` takes a compile to cost, and where that was measured (``"process"``,
        ``"cached"``, ``"machine"``, or ``False`` for the assumed figure): this runner's first
        compiled call where it ran in this process (its graph, maybe from Inductor's on-disk
        cache); for a runner this machine compiled before whose graphs Inductor's on-disk cache still
        holds (:meth:`compiled_before`), the median of such compiles recorded here (else
        :data:`CACHED_COMPILE_S`); for another graph the median of the first compiled calls recorded on this machine
        (:func:`fnebm._inductor.machine_compile_s`), else ``compile_estimate_s``, raised to the
        longest first call measured in this process (a busy machine compiles slower)."""
        if not self._measure:
            return self.compile_estimate_s, False
        if key in self.compile_s:
            return self.compile_s[key], "process"
        if self.compiled_before(key, shapes):
            cached = _inductor.machine_compile_s("chain-cached")
            return (cached if cached is not None else CACHED_COMPILE_S), "cached"
        longest = max(self.compile_s.values(), default=0.0)
        machine = _inductor.machine_compile_s("chain")
        base, measured = (machine, "machine") if machine is not None else (self.compile_estimate_s, False)
        return (longest, "process") if longest > base else (base, measured)

    def _timed(self, key: Hashable, run: Callable) -> Callable:
        """``run`` whose first successful call is timed into ``compile_s[key]``."""
        if not self._measure:
            return run
        import time

        def first_timed(*args):
            if key in self.compile_s:
                return run(*args)
            hits0, misses0 = _inductor.cache_hits()
            t0 = time.perf_counter()
            out = run(*args)
            self.compile_s[key] = time.perf_counter() - t0
            hits, misses = _inductor.cache_hits()
            # served by Inductor's on-disk cache: timed apart from first compiles (_compile_cost); another
            # thread's compile meanwhile (a background one) can move the counters, and then it counts as a first
            cached = hits > hits0 and misses == misses0
            _inductor.record_compile_s("chain-cached" if cached else "chain", self.compile_s[key])
            if key in self._shapes:  # planned by sample_chain (not a direct get(): nothing described)
                ledger = self.ledger(key, self._shapes[key])
                _inductor.record_graph(ledger.signature, self._graph_keys.get(key, []))
                ledger.before = None
            return out

        return first_timed

    def probe(self, key: Hashable, shapes: Hashable, make: Callable[[], Any]) -> Any:
        """``make()`` (one eager step: what a run keeps, as meta tensors), once per runner and shapes."""
        with self._lock:
            found = self._probes.get((key, shapes))
        if found is None:
            found = make()
            with self._lock:
                self._probes[(key, shapes)] = found
                while len(self._probes) > 4 * self.maxsize:
                    self._probes.popitem(last=False)
        return found

    def get(self, key: Hashable) -> Callable:
        with self._lock:
            run = self._runners.pop(key, None)
            if run is None:
                backend = self._recording(key) if self.backend == "inductor" else self.backend
                run = self._timed(key, _lifting(torch.compile(_fresh(_chunk), fullgraph=True, backend=backend)))
            self._runners[key] = run
            while len(self._runners) > self.maxsize:
                self._runners.popitem(last=False)
            return run

    def _recording(self, key: Hashable) -> Callable:
        """Inductor (:func:`fnebm._inductor.inductor_backend`), keeping the keys of the graphs it gives runner ``key``."""

        def backend(gm, example_inputs):
            compiled = inductor_backend(gm, example_inputs)
            found = self._graph_keys.setdefault(key, [])
            found.extend(k for k in _inductor.graph_keys(compiled) if k not in found)
            return compiled

        return backend

    def __len__(self) -> int:
        return len(self._runners)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the compiles running in the background (at most ``timeout`` seconds); ``True``
        when none is left running."""
        with self._lock:
            threads = [led.pending for led in self._ledgers.values() if led.pending is not None]
        for thread in threads:
            thread.join(timeout)
        return not any(thread.is_alive() for thread in threads)

    def clear(self) -> None:
        with self._lock:
            self._runners.clear()
            self._probes.clear()
            self._ledgers.clear()
            self.compile_s.clear()
            self._shapes.clear()
            self._graph_keys.clear()


default_cache = RunnerCache()


class CompileNotice(UserWarning):
    """``sample_chain(compile="auto")`` is about to compile a graph: in the background while the
    steps go on eagerly (:class:`RunnerCache`'s default), or now, and the call waits for it.

    Said as a warning (once per calling line, Python's default) beside the ``RunPlan`` that
    ``on_plan`` gets, so a compile never stalls a loop unannounced; ``compile=False`` keeps
    eager steps, ``compile=True`` compiles from the first call without this notice.
    """


def _announce(plan: RunPlan, measured: str | bool) -> RunPlan:
    import sys
    import warnings

    # the first frame outside fnebm, the user's call (stacklevel 1 is this function, 2 its caller)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    if measured == "machine":
        cost = f"compiles took {plan.compile_estimate_s:.3g} s on this machine, the median recorded"
    elif measured == "cached":
        cost = (f"this machine compiled this sampler before and Inductor's on-disk cache holds its graph: such a "
                f"compile is expected to take {plan.compile_estimate_s:.3g} s")
    elif measured:
        cost = f"a compile took {plan.compile_estimate_s:.3g} s in this process"
    else:
        cost = "a first compile takes tens of seconds on a small CPU (less from Inductor's on-disk cache)"
    if plan.background:
        what = ("compiles this sampler in the background; the steps run eagerly meanwhile and switch to the "
                "compiled code when it is ready")
    else:
        what = "compiles this sampler now, and this call waits for it"
    warnings.warn(f"fnebm.sample_chain(compile='auto') {what} ({plan.reason}; {cost}). Pass compile=False to keep "
                  "eager steps, or compile=True to compile from the first call.", CompileNotice, stacklevel=level)
    return plan
