"""The energy and gradient of every chain at once, for kernels that call back into torch.

:func:`evaluator` gives ``x: (*chains, d) -> (E (*chains,), dE/dx (*chains, d))`` for an energy:
the function :mod:`fnebm.kernels.cpu_nuts` calls between the C kernel's integrator steps when the
energy is one the kernel does not compute itself (a network, a log density you wrote). It is
:func:`fnebm.gradients.value_and_grad` over the chain axes (the energy's whole-batch form where
it has one, else ``vmap``), eager or compiled:

* ``compile=False``: eager, every call.
* ``compile=True``: ``torch.compile`` of it from the first call (one small graph: the energy's
  forward and backward pass for all chains; the tree's arithmetic stays in C).
* ``compile="auto"``: eager for the first :data:`TRACE_AFTER_S` seconds of evaluations, then
  traced once (Dynamo and AOTAutograd, the ``aot_eager`` backend: a second or two, no code
  generation) and run as plain aten calls without ``torch.func``'s per-operation overhead; then
  compiled by Inductor (announced by an :class:`EnergyCompileNotice`) once the evaluations of
  this energy have taken as long as a compile is expected to take: for an evaluation this machine
  compiled in an earlier process whose graph Inductor's on-disk cache still holds
  (:meth:`_Evaluation.compiled_before`), what such compiles took here (else :data:`CACHED_COMPILE_S`);
  otherwise the longest compile of an
  evaluation measured in this process, else the median recorded on this machine, else
  :data:`AUTO_COMPILE_AFTER_S`, 12 s: a first compile of a small energy's evaluation on this
  project's 2-core host took 11.8-12.9 s on a machine that had never compiled (the 100-D Gaussian
  posterior; empty Inductor and fnebm caches, four runs) and 5.6 s for a new energy on one that
  had (the vector-ISA probe recorded, :mod:`fnebm._inductor`).
  The rule of renting skis: a run never spends much more than twice what the better choice in
  hindsight would have; a short run never waits for a compile, a long one waits once. A kernel's
  loop that says how many evaluations it still expects (:meth:`Evaluate.expect`) and would finish
  them in less time than the compile is not stopped for it mid-way: it ends on its tier, and the
  next loop of that energy compiles at its first call (the compile's cost moves to a call that
  gains from it; a single call does not pay for a compile it cannot use).

Threads: an evaluation of a small energy is a few hundred microseconds, and torch's parallel
regions can cost more than they save there (on a busy 2-core machine a 2-thread evaluation of a
1,000-row logistic regression took 7.5 ms against 0.24 ms on one thread). So an evaluator times
its first :data:`TUNE_CALLS` calls alternately on torch's threads and on one, and keeps one
thread unless torch's were clearly faster (each way's fastest call; :data:`TWO_THREADS_BY`); the
traced and compiled tiers keep that choice. One thread is set only around its own calls. That
is ``"auto"``'s only: a thread count can change a reduction's rounding, and ``"auto"``'s
choices (the threads, and when it traces and compiles) follow timings, so its evaluations can
round differently from run to run (the keys, and so the draws up to float tolerance, do not
change). ``compile_energy=True`` or ``False`` keep torch's threads and give the same bits every
run.

Compiled on the CPU, the graph is built with Inductor's C++ wrapper (:data:`CPP_WRAPPER`), and a
kernel's loop on it calls the graph's C++ entry without Python between trips (:meth:`Evaluate.native`,
:mod:`fnebm.kernels.cpu_trips`). A compile that fails (an energy Dynamo cannot trace) is warned of
once and the evaluations stay eager. One evaluator is kept per energy object (the last 16, which
it keeps alive with their data), so the warm-up's samplers, rebuilt at every iteration, and the
sampling after it share its compiled code and its clock.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import sys
import threading
import time
import types
import warnings
from typing import Any, Callable, Iterator

from torch import Tensor

from fnebm import _checks
from fnebm.gradients import value_and_grad

__all__ = ["evaluator", "EnergyCompileNotice", "AUTO_COMPILE_AFTER_S", "CACHED_COMPILE_S", "TRACE_AFTER_S", "COMPILE_CHOICES",
           "TUNE_CALLS", "TWO_THREADS_BY", "EXPECTED_FACTOR"]

AUTO_COMPILE_AFTER_S = 12.0  # eager evaluation seconds after which "auto" compiles, before any compile is measured
# (a first energy compile measured here on a machine that had never compiled; module docstring)
# what "auto" expects a compile of an evaluation this machine compiled before to take, before any such
# compile is recorded: the eight-schools evaluation's first compiled call in a later process took 3.1-4.1 s
# on this project's 2-core host (Inductor's on-disk cache hit; 10-13 s in the first, empty caches)
CACHED_COMPILE_S = 4.0
TRACE_AFTER_S = 0.5  # eager evaluation seconds after which "auto" traces the evaluation (no code generation)
TUNE_CALLS = 8  # calls timed, alternately on torch's threads and on one, before an evaluator keeps the faster
# torch's threads are kept only when their fastest call beats one thread's by this factor: the choice
# holds for the compiled code too (timing it again would compile it again: Dynamo guards on the
# thread count), whose parallel regions cost relatively more, and a tie within the noise goes to one
TWO_THREADS_BY = 0.9
# "auto" compiles at once when the evaluations a kernel's loop still expects would take this many times
# what a compile is expected to: then even compiled code half as fast as the eager tier's recovers the
# compile, and a prediction off by this factor costs at most the compile
EXPECTED_FACTOR = 2.0
# a pinned compiled evaluation (a kernel's trips) calls Inductor's graph without AOTAutograd's runtime
# wrapper where that is checked to give the same (_direct); False: always through the wrapper
DIRECT = True
# a compiled CPU evaluation gets Inductor's C++ wrapper where the kernels' trips run in C++
# (fnebm.kernels.cpu_trips calls its entry without Python: the 100-D Gaussian's warm-up and sampling
# in 0.43x and 0.50x the time of the Python loop on an AVX2 host; eight schools' too). Where they
# cannot, only one that calls a library's matrix products (MKL: a linear predictor, a quadratic form,
# a network's layers): its Python wrapper allocated each buffer and called each product and kernel
# from Python, about 1 us each, where the C++ wrapper does that in C++ for a fixed cost per call (the
# 100-D Gaussian's evaluation, 4 chains: 16.8-17.9 -> 12.7-13.3 us; the logistic regression's the
# same within the noise); one without products (eight schools: two fused kernels) called from Python
# was as fast or faster with the Python wrapper (4.9-6.5 against 5.5-8.7 us). The C++ wrapper is one
# more build in a compile from empty caches (about 1.2 s here).
CPP_WRAPPER = True
COMPILE_CHOICES = (True, False, "auto")
_KEEP = 16


class EnergyCompileNotice(UserWarning):
    """A sampler compiles an energy's value and gradient now (``compile_energy="auto"``), and the
    call waits for it: tens of seconds for a first compile on a small CPU, less from Inductor's
    on-disk cache. ``compile_energy=False`` keeps eager evaluations, ``True`` compiles at once."""


class _Evaluation:
    """One energy's evaluation over ``chain_ndim`` chain axes: eager, and compiled once asked."""

    def __init__(self, energy_fn: Any, chain_ndim: int) -> None:
        self.eager = value_and_grad(energy_fn, chain_ndim)
        self.energy_fn, self.chain_ndim = energy_fn, chain_ndim
        self.graph_keys: list[str] = []  # the Inductor graphs its compile gave (their on-disk cache keys)
        self._before: dict = {}  # whether this machine compiled it before, per positions' layout and threads
        self.entry = _fresh(self.eager)  # what torch.compile sees: a code object of this evaluator's own
        self.compiled: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None
        self.failed: str | None = None
        self.eager_s = 0.0  # seconds of eager evaluations so far
        self.recent: tuple[float, int] = (0.0, 0)  # (seconds, calls) of the current tier's calls (eager or traced)
        self.expected_calls: float | None = None  # calls a kernel's loop expects still to make (Evaluate.expect)
        self.compile_s: float | None = None  # seconds of the compiled code's first call
        self.one_thread: bool | None = None  # None while the first calls are timed both ways
        self.trials: list[tuple[bool, float]] = []
        self.scoped = False  # inside scope(), one thread set for the rest of the loop
        self.in_scope = False
        self.scope_threads = 1  # torch's threads when the scope began
        self.traced: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None  # the middle tier ("auto")
        self.trace_failed = False
        # inside a scope: the compiled graph Dynamo chose at the scope's first call, called directly
        # for the rest of it (see pinned())
        self.pin_armed = False
        self.pin: tuple | None = None  # (graph, its inputs, where the positions are, their shape/strides/dtype/device)
        self.pin_entry: int | None = None  # the pinned graph's C++ entry, for a kernel's trips in C++ (_entry)
        self._pin_x: Tensor | None = None  # the positions of the call being recorded
        self._pin_out: Any = None  # that call's graph outputs, until checked against what Dynamo returned

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Around a loop of evaluations: one thread for all of them once that was measured faster
        (setting torch's threads around every call cost about 90 us a call here), from the scope's
        start or from the call that decides it (a long loop, a warm-up in one kernel call, times its
        first calls inside its scope)."""
        import torch

        if self.in_scope:  # nested: the outer scope holds the threads
            yield
            return
        self.in_scope, self.scope_threads = True, torch.get_num_threads()
        try:
            self._scope_one_thread()
            yield
        finally:
            if self.scoped:
                torch.set_num_threads(self.scope_threads)
            self.scoped = self.in_scope = False

    @contextlib.contextmanager
    def _chosen_threads(self) -> Iterator[None]:
        """One thread around a call outside a one-thread scope, once one was measured faster (as
        :meth:`run` sets it for the calls after)."""
        import torch

        threads = torch.get_num_threads()
        if not (self.one_thread and not self.scoped and threads > 1):
            yield
            return
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _scope_one_thread(self) -> None:
        """Inside a scope, once one thread was measured faster: set it for the rest of the scope."""
        import torch

        if self.in_scope and not self.scoped and self.one_thread and self.scope_threads > 1:
            torch.set_num_threads(1)
            self.scoped = True

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """Around a loop of evaluations that runs no other code (a kernel's trips): the scope's first
        compiled call goes through ``torch.compile`` as always, whose guards check the energy's
        tensors and code and pick (or build) the graph; the other calls of the scope run that graph
        directly, with the new positions in place of the old (same shape, strides and dtype, else
        through ``torch.compile`` again). Nothing the guards check can change between two trips, and
        a trip saves their cost and Dynamo's frame: 117 -> 84 us an evaluation of the logistic
        regression (docs/performance.md). An energy's Python side effects outside its tensors (a
        call counter in a list, a print) run at each loop's first call only, as they run once when
        a graph is traced; its values are the graph's either way."""
        if self.pin_armed or self.pin is not None:  # nested, or kept by the eager block: the pin holds
            yield
            return
        self.pin_armed = True
        try:
            yield
        finally:
            self.pin_armed, self._pin_x, self._pin_out = False, None, None
            # inside an eager block of steps (sample_chain's eager engine: a warm-up's iterations, whose
            # transitions each hold a scope) no user code runs until the block ends, so the pin is kept
            # until then: the guards are checked once a block, not once a transition
            if self.pin is not None and not _checks.at_block_exit(self._unpin):
                self.pin = None

    def _unpin(self) -> None:
        self.pin = None

    def _recording(self, compiled: Callable) -> Callable:
        """The graph ``compiled`` as Dynamo calls it; inside :meth:`pinned`, its first call is kept
        when the positions are one of its inputs and its outputs are the evaluation's two results."""

        direct: list = []  # the graph's own call, once checked (_direct), and its C++ entry (or None)

        def call(*args):
            out = compiled(*args)
            x = self._pin_x
            if self.pin_armed and self.pin is None and x is not None:
                at = [i for i, a in enumerate(args) if a is x]
                if len(at) == 1 and isinstance(out, (list, tuple)) and len(out) == 2:
                    if DIRECT and not direct:
                        direct.append(_direct(compiled, args, out))
                        direct.append(_entry(compiled, args, out) if direct[0] is not None else None)
                    graph = (direct[0] if DIRECT else None) or compiled
                    self.pin = (graph, list(args), at[0], (x.shape, x.stride(), x.dtype, x.device))
                    self.pin_entry = direct[1] if DIRECT and direct[0] is not None else None
                    self._pin_out = out
            return out

        return call

    def _backend(self, gm: Any, example_inputs: Any) -> Callable:
        from fnebm import _inductor

        # Inductor's checks of its inputs' sizes and strides at every call repeat what Dynamo's guards
        # check (shapes are static), and a pinned call's positions are checked against the pin
        extra = {"size_asserts": False}
        compiled = None
        if CPP_WRAPPER and _inductor.inputs_on_cpu(example_inputs) and (
                _inductor.has_products(gm) or _native_trips()):
            try:  # the library products called from C++, not Python (CPP_WRAPPER)
                compiled = _inductor.inductor_backend(gm, example_inputs, extra=dict(extra, cpp_wrapper=True))
            except Exception:  # noqa: BLE001 - an operation the C++ wrapper cannot call: the Python wrapper
                pass
        if compiled is None:
            compiled = _inductor.inductor_backend(gm, example_inputs, extra=extra)
        self.graph_keys.extend(k for k in _inductor.graph_keys(compiled) if k not in self.graph_keys)
        return self._recording(compiled)

    def _traced_backend(self, gm: Any, example_inputs: Any) -> Callable:
        from torch._dynamo.backends.debugging import aot_eager  # the "aot_eager" backend itself

        return self._recording(aot_eager(gm, example_inputs))

    def _call_compiled(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self._call_pinned(self.compiled, x)

    def _call_traced(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self._call_pinned(self.traced, x)

    def _call_pinned(self, fn: Callable, x: Tensor) -> tuple[Tensor, Tensor]:
        pin = self.pin
        if pin is not None:
            compiled, args, i, meta = pin
            if (x.shape, x.stride(), x.dtype, x.device) == meta:
                args = list(args)
                args[i] = x
                # kept with these positions: a kernel's trips call on one buffer (Evaluate.__call__'s fast path)
                self.pin = (compiled, args, i, meta)
                e, g = compiled(*args)
                return e, g
        if not self.pin_armed:
            return fn(x)
        self._pin_x = x
        try:
            out = fn(x)
        finally:
            self._pin_x = None
        graph_out, self._pin_out = self._pin_out, None
        if self.pin is not None and graph_out is not None:  # the graph's outputs must be what Dynamo returned
            if not (isinstance(out, tuple) and len(out) == 2 and out[0] is graph_out[0] and out[1] is graph_out[1]):
                self.pin = None
        return out

    def run(self, fn: Callable[[Tensor], tuple[Tensor, Tensor]], x: Tensor,
            tune: bool = True) -> tuple[tuple[Tensor, Tensor], float]:
        """``fn(x)`` on the chosen threads (timing both ways while undecided, when ``tune``), and its seconds."""
        import torch

        if self.scoped or not tune:
            t0 = time.perf_counter()
            out = fn(x)
            return out, time.perf_counter() - t0
        threads = torch.get_num_threads()
        one = self.one_thread
        if one is None:
            one = threads > 1 and len(self.trials) % 2 == 1
        if one and threads > 1:
            # the switch of threads is left out of the timing: a loop that runs on one thread sets it
            # once around the loop (scope), not around every call (about 90 us a call here, which
            # counted against one thread and, once a compiled evaluation took 40 us, chose two)
            torch.set_num_threads(1)
            try:
                t0 = time.perf_counter()
                out = fn(x)
                seconds = time.perf_counter() - t0
            finally:
                torch.set_num_threads(threads)
        else:
            t0 = time.perf_counter()
            out = fn(x)
            seconds = time.perf_counter() - t0
        if self.one_thread is None:
            if threads == 1:
                self.one_thread = False
            else:
                self.trials.append((one, seconds))
                if len(self.trials) >= TUNE_CALLS:
                    # each way's fastest call: a machine's noise only ever adds time (the first call
                    # of all, on torch's threads, is the slowest), and the middle of four calls
                    # chose two threads on a single slow one-thread call (the 100-D Gaussian's
                    # evaluations then ran compiled on two threads: 45 s of warm-up against 13 s)
                    best = {k: min(s for o, s in self.trials if o == k) for k in (True, False)}
                    self.one_thread = not best[False] < TWO_THREADS_BY * best[True]
                    self._scope_one_thread()
                    self.recent = (0.0, 0)  # the rate on the threads chosen, not the trials' mix
        return out, seconds

    def compile_now(self, announce: bool, expected: float | None = None, estimate: float | None = None,
                    cached: bool = False) -> None:
        if self.compiled is not None or self.failed is not None:
            return
        import torch

        if announce:
            cost = "a compile is expected to take" if estimate is None else f"the {estimate:.3g} s a compile is expected to take"
            if cached:
                cost += " (this machine compiled it before: Inductor's on-disk cache holds its graph)"
            why = (f"as long as {cost}" if expected is None else
                   f"and this run expects about {expected:.3g} s more of them, over {EXPECTED_FACTOR:g} times {cost}")
            warnings.warn(f"fnebm: compiling this energy's value and gradient now (its eager evaluations took "
                          f"{self.eager_s:.3g} s so far, {why}; "
                          "compile_energy='auto'). Pass compile_energy=False to keep them eager, or True to compile "
                          "from the start.", EnergyCompileNotice, stacklevel=_outside_fnebm())
        self.compiled = torch.compile(self.entry, dynamic=False, backend=self._backend)
        self.pin = None  # a pinned traced graph (the tier below) is not what this loop runs from now on

    def compiled_call(self, x: Tensor, tune: bool = True) -> tuple[Tensor, Tensor]:
        if self.compile_s is not None:
            return self.run(self._call_compiled, x, tune)[0]
        from fnebm import _inductor

        hits0, misses0 = _inductor.cache_hits()
        t0 = time.perf_counter()
        try:
            with self._chosen_threads():  # compiled for the threads its calls run on (Dynamo guards on them)
                out = self.compiled(x)
        except Exception as exc:  # the energy is not traceable: eager from now on (an eager error re-raises)
            out = self.eager(x)
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self.compiled = None
            warnings.warn(f"fnebm: compiling the energy's value and gradient failed ({self.failed}); its "
                          "evaluations stay eager", RuntimeWarning, stacklevel=_outside_fnebm())
            return out
        self.compile_s = time.perf_counter() - t0
        hits, misses = _inductor.cache_hits()
        # a compile served by Inductor's on-disk cache is timed apart from a first one (what a compile of a
        # graph this machine compiled before is expected to cost, compile_estimate)
        cached = hits > hits0 and misses == misses0
        _inductor.record_compile_s("energy-cached" if cached else "energy", self.compile_s)
        _inductor.record_graph(self.signature(x), self.graph_keys)
        self._before.clear()
        # The threads stay as the tier below chose them: Dynamo guards on torch's thread count, so
        # timing the compiled code on both would compile it twice (a second 2.9 s compile in the 100-D
        # Gaussian's cold warm-up, and a second trace in every cold run that traced)
        return out

    def signature(self, x: Tensor) -> str | None:
        """What this evaluation compiles to, described the same way in every process
        (:func:`fnebm._signature.signature`): the energy, the chain axes, the positions' shape, dtype
        and device, and the threads its compiled code runs on; ``None`` before those are chosen."""
        if self.one_thread is None and self.compiled is None:
            return None
        import torch

        from fnebm import _signature

        threads = 1 if self.one_thread else torch.get_num_threads()
        return _signature.signature("evaluation", self.energy_fn, self.chain_ndim, tuple(x.shape), x.dtype,
                                    x.device.type, threads)

    def compiled_before(self, x: Tensor) -> bool:
        """Whether this machine compiled this evaluation (at ``x``'s layout, on these threads) before and
        its graphs are still in Inductor's on-disk cache; looked up once per layout and threads."""
        import torch

        at = (tuple(x.shape), x.dtype, x.device.type, self.one_thread, torch.get_num_threads())
        found = self._before.get(at)
        if found is None:
            signature = self.signature(x)
            if signature is None:
                return False
            from fnebm import _inductor

            found = self._before[at] = _inductor.compiled_before(signature)
        return found

    def traced_call(self, x: Tensor, tune: bool = True) -> tuple[Tensor, Tensor]:
        """The evaluation traced once by Dynamo and AOTAutograd and run as plain aten calls (the
        ``aot_eager`` backend): no code generation, a second or two to trace, and none of
        ``torch.func``'s per-operation overhead at every call (1.75x faster than eager on the
        eight-schools posterior here). Counted as eager time for the compile's rent."""
        import torch

        if self.traced is None:
            t0 = time.perf_counter()
            try:
                self.traced = torch.compile(self.entry, dynamic=False, backend=self._traced_backend)
                with self._chosen_threads():
                    out = self.traced(x)
            except Exception:  # noqa: BLE001 - not traceable: eager (an error of the energy re-raises there)
                self.traced, self.trace_failed = None, True
                return self.eager_call(x)
            self.eager_s += time.perf_counter() - t0  # threads as chosen (compiled_call)
            self.recent = (0.0, 0)  # the traced tier's own rate from now on
            return out
        out, seconds = self.run(self._call_traced, x, tune)
        self.eager_s += seconds
        self.recent = (self.recent[0] + seconds, self.recent[1] + 1)
        return out

    def eager_call(self, x: Tensor, tune: bool = True) -> tuple[Tensor, Tensor]:
        out, seconds = self.run(self.eager, x, tune)
        self.eager_s += seconds
        self.recent = (self.recent[0] + seconds, self.recent[1] + 1)
        return out

    def expected_s(self) -> float | None:
        """Seconds the calls a kernel's loop still expects to make would take at the current tier's
        rate; ``None`` without an expectation or a rate."""
        seconds, calls = self.recent
        if self.expected_calls is None or self.one_thread is None or calls < TUNE_CALLS:
            return None  # no expectation, or the threads still being timed (a trial on the slower is no rate)
        return self.expected_calls * seconds / calls


_IDS = itertools.count()


def _fresh(fn: Callable[[Tensor], tuple[Tensor, Tensor]]) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """A call of ``fn`` whose code object is its own. Dynamo keeps compiled graphs per code object
    (eight at most) and ``value_and_grad``'s functions share theirs across energies; so each
    evaluator compiles a frame of its own, as ``sample_chain``'s runners do. Its outputs are
    contiguous: a compiled graph may otherwise give the gradient in the layout of a product it
    transposed (the 100-D Gaussian's ``(4, 100)`` with strides ``(1, 4)``), which the C kernel's loop
    then copied at every trip (about 8 us); asked in the graph, the last kernel writes it in place."""

    def evaluate(x: Tensor) -> tuple[Tensor, Tensor]:
        e, g = fn(x)
        return e.contiguous(), g.contiguous()

    name = f"evaluate_{next(_IDS)}"
    code = evaluate.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, evaluate.__globals__, name, evaluate.__defaults__, evaluate.__closure__)


def _direct(compiled: Callable, args: tuple, out: Any) -> Callable | None:
    """``compiled``'s Inductor graph called without AOTAutograd's runtime wrapper (about 3.5 us a
    call less: :func:`fnebm._inductor.innermost_call`), as a function of the same arguments, or
    ``None``. Taken only when the graph, called once more on ``args``, gives what the wrapper gave
    (``out``): two outputs of the same dtypes, shapes, strides and bits. Once per compiled graph."""
    import torch

    from fnebm import _inductor

    try:
        call = _inductor.innermost_call(compiled)
        if call is None:
            return None
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return None  # the wrapper's outputs could be tracked by autograd; the graph's are not
        again = call(list(args))
        ok = (isinstance(again, (list, tuple)) and len(again) == 2
              and all(isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride() and a.device == b.device and _same_bits(a, b)
                      for a, b in zip(again, out)))
    except Exception:  # pragma: no cover - any surprise: the wrapper, as always
        return None
    if not ok:
        return None

    def direct(*a):
        return call(list(a))

    return direct


def _native_trips() -> bool:
    """Whether a kernel's trips can run in C++ here (:mod:`fnebm.kernels.cpu_trips`): then every CPU
    evaluation gets the C++ wrapper, whose entry those trips call without Python (CPP_WRAPPER)."""
    from fnebm.kernels import cpu_trips

    return cpu_trips.available() is None


def _entry(compiled: Callable, args: tuple, out: Any) -> int | None:
    """The C++ entry of ``compiled``'s graph (:func:`fnebm._inductor.cpp_entry`), for
    :mod:`fnebm.kernels.cpu_trips`, where the library runs here and the graph's two outputs are what
    the C kernels read as they are: contiguous float32 CPU tensors (their layout is the graph's,
    fixed by its static shapes). Once per compiled graph, after :func:`_direct` took it."""
    import torch

    from fnebm import _inductor
    from fnebm.kernels import cpu_trips

    if not all(isinstance(o, torch.Tensor) and o.dtype == torch.float32 and o.is_cpu and o.is_contiguous()
               for o in out):
        return None
    if not (all(isinstance(a, torch.Tensor) and a.is_cpu for a in args) and len(args) <= cpu_trips.MAX_INPUTS):
        return None  # the C++ loop passes tensor handles, at most MAX_INPUTS
    if not _native_trips():
        return None
    return _inductor.cpp_entry(compiled, len(args))


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Equal bit for bit (a NaN equals the same NaN, and -0.0 differs from 0.0, unlike ``torch.equal``)."""
    import torch

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if ints is None or not a.dtype.is_floating_point:
        return bool(torch.equal(a, b))
    return bool(torch.equal(a.contiguous().view(ints), b.contiguous().view(ints)))


def _outside_fnebm() -> int:
    """The ``stacklevel``, for a ``warnings.warn`` in the caller, of the first frame outside fnebm (a
    warning names the user's call)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


_lock = threading.Lock()
_kept: "collections.OrderedDict[tuple[int, int], tuple[Any, _Evaluation]]" = collections.OrderedDict()


def _evaluation(energy_fn: Any, chain_ndim: int) -> _Evaluation:
    key = (id(energy_fn), chain_ndim)
    with _lock:
        hit = _kept.get(key)
        if hit is not None and hit[0] is energy_fn:
            _kept.move_to_end(key)
            return hit[1]
        ev = _Evaluation(energy_fn, chain_ndim)
        _kept[key] = (energy_fn, ev)
        while len(_kept) > _KEEP:
            _kept.popitem(last=False)
        return ev


def compile_estimate(ev: _Evaluation | None = None, x: Tensor | None = None) -> float:
    """Seconds a compile of an evaluation is expected to take. For ``ev`` at ``x`` when this machine
    compiled it before and its graphs are still in Inductor's on-disk cache
    (:meth:`_Evaluation.compiled_before`): the median recorded here of such compiles, else
    :data:`CACHED_COMPILE_S`. Otherwise: the longest measured in this process (of the evaluators
    kept), else the median recorded on this machine of first compiles
    (:func:`fnebm._inductor.machine_compile_s`), else :data:`AUTO_COMPILE_AFTER_S`."""
    from fnebm import _inductor

    if ev is not None and x is not None and ev.compiled_before(x):
        cached = _inductor.machine_compile_s("energy-cached")
        return cached if cached is not None else CACHED_COMPILE_S
    with _lock:
        seen = [ev.compile_s for _, ev in _kept.values() if ev.compile_s is not None]
    if seen:
        return max(seen)
    machine = _inductor.machine_compile_s("energy")
    return machine if machine is not None else AUTO_COMPILE_AFTER_S


def check_compile(compile: Any) -> Any:
    if compile not in COMPILE_CHOICES or not isinstance(compile, (bool, str)):
        raise ValueError(f"compile_energy must be True, False or 'auto', got {compile!r}")
    return compile


class Evaluate:
    """``x -> (E, dE/dx)`` for every chain (``__call__``), and ``scope()`` to hold around a loop of calls."""

    def __init__(self, ev: _Evaluation, compile: bool | str) -> None:
        self.ev, self.mode = ev, compile

    def _settled(self, x: Tensor) -> tuple | None:
        """The pin, when a call at ``x`` runs it and nothing else: a kernel's trips on its own positions
        buffer, compiled and pinned, threads chosen (nothing left to decide or time)."""
        ev = self.ev
        pin = ev.pin
        if (pin is not None and pin[1][pin[2]] is x and ev.compile_s is not None and ev.failed is None
                and self.mode is not False and (self.mode != "auto" or ev.one_thread is not None)):
            return pin
        return None

    def native(self, x: Tensor) -> tuple[int, list[Tensor]] | None:
        """``(the C++ entry of the graph a call at x runs, its arguments)`` when that graph is all a call
        at ``x`` would run and it has one (:func:`_entry`): a kernel's loop may then run its trips in
        C++ (:mod:`fnebm.kernels.cpu_trips`), the same graph on the same arguments; else ``None``."""
        pin = self._settled(x)
        if pin is None or self.ev.pin_entry is None:
            return None
        return self.ev.pin_entry, pin[1]

    def __call__(self, x: Tensor) -> tuple[Tensor, Tensor]:
        ev, tune = self.ev, self.mode == "auto"  # threads are chosen by timing under "auto" only
        pin = self._settled(x)
        if pin is not None:  # what the path below would run
            return pin[0](*pin[1])
        if self.mode is False or ev.failed is not None:
            return ev.eager_call(x, tune)
        if self.mode == "auto" and ev.compiled is None:
            estimate = compile_estimate(ev, x)
            expected = ev.expected_s()
            if ev.eager_s >= estimate:
                # the budget is spent: compile, unless this loop's remaining evaluations would take less
                # than the compile; then the loop ends on this tier and the next one compiles at its first call
                if expected is None or expected >= estimate:
                    ev.compile_now(announce=True, estimate=estimate, cached=ev.compiled_before(x))
            elif expected is not None and expected >= EXPECTED_FACTOR * estimate:
                ev.compile_now(announce=True, expected=expected, estimate=estimate, cached=ev.compiled_before(x))
        if ev.compiled is not None:
            return ev.compiled_call(x, tune)
        if tune and not ev.trace_failed and (ev.traced is not None or ev.eager_s >= TRACE_AFTER_S):
            return ev.traced_call(x)
        return ev.eager_call(x, tune)

    def expect(self, calls: float | None) -> None:
        """A kernel's loop expects about ``calls`` more evaluations (``None``: no idea). Under ``"auto"``,
        once those would take :data:`EXPECTED_FACTOR` times what a compile is expected to take at the
        current rate, the evaluation compiles at once rather than after its budget: a long run (the
        100-D Gaussian's warm-up, 155,000 evaluations) does not spend the whole budget on the slow tier
        first. Reset when the loop's scope ends."""
        self.ev.expected_calls = calls

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Around a kernel's loop of evaluations: the compiled graph pinned for the loop (any mode),
        and under ``"auto"`` the thread count chosen by timing."""
        try:
            with self.ev.pinned(), (self.ev.scope() if self.mode == "auto" else contextlib.nullcontext()):
                yield
        finally:
            self.ev.expected_calls = None


def evaluator(energy_fn: Any, chain_ndim: int, compile: bool | str = False) -> Evaluate:
    """``x: (*chains, d) -> (E, dE/dx)`` over the first ``chain_ndim`` axes, eager or compiled (module docstring)."""
    check_compile(compile)
    ev = _evaluation(energy_fn, chain_ndim)
    if compile is True:
        ev.compile_now(announce=False)
    return Evaluate(ev, compile)
