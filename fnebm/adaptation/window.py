"""Stan's windowed warm-up: dual averaging of the step size and Welford's mass matrix on a
schedule held as data, the whole warm-up one compiled scan.

.. code-block:: text

    +---------+------+------------+------------------------+------+
    |  fast   | slow |   slow     |        slow            | fast |
    +---------+------+------------+------------------------+------+
     initial    25       50              100 + rest          final
     buffer 75                                               buffer 50

* fast (initial and final buffers): only the step size adapts;
* slow windows, each twice the last (the last one stretched to the final buffer): the draws
  also feed a Welford covariance; at a window's end the inverse mass matrix becomes the
  regularised estimate, the estimate restarts, and dual averaging restarts from its averaged
  step size.

The schedule (:func:`build_schedule`) is a few integer tensors of a fixed size (the slow range
and the windows' ends), carried in the :class:`WindowAdaptationState` and compared with its
iteration counter (:func:`stages`); window ends are ``torch.where``, not Python branches.
The step rebuilds the sampler from the current step size and mass matrix tensors at every
iteration (``algorithm(energy_fn, step_size,
inverse_mass_matrix, **extra).step``), so the warm-up is one compiled call of
:func:`fnebm.sample_chain`, and a second warm-up with other values (another target's
parameters, another initial step size or target acceptance, another ``num_steps``) reuses the
graph.

This module imports neither :mod:`fnebm.chain` (above it) nor the samplers it knows: the warm-up
runs through a runner (:func:`fnebm._loop.default_runner`, which :mod:`fnebm.chain` sets to
``sample_chain``'s), and the defaults of :func:`fnebm.nuts` and :func:`fnebm.hmc` are a table
keyed by the constructor's name (:data:`SAMPLER_DEFAULTS`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fnebm import _checks
from fnebm import _loop
from fnebm import random as fr
from fnebm.adaptation import mass_matrix as mm
from fnebm.adaptation import step_size as ss
from fnebm.integrators.metrics import Dense, Diagonal, check_inverse_mass_matrix
from fnebm.samplers.base import check_energy

__all__ = [
    "Schedule",
    "build_schedule",
    "stages",
    "WindowAdaptationState",
    "WindowAdaptationInfo",
    "AdaptationResults",
    "WindowAdaptation",
    "window_adaptation",
    "default_step_size",
    "default_num_integration_steps",
    "default_target_acceptance_rate",
    "SamplerDefaults",
    "SAMPLER_DEFAULTS",
]

# The acceptance statistic dual averaging aims at when the caller names none: NUTS's (the mean
# over the tree) at 0.8, as Stan; one HMC trajectory's at 0.65 (Beskos et al. 2013).
NUTS_TARGET_ACCEPTANCE_RATE = 0.8
HMC_TARGET_ACCEPTANCE_RATE = 0.65

# Dual averaging's gamma for a pooled step size. Averaged over many chains the acceptance
# statistic is nearly a deterministic function of the step size, and with Stan's gamma (0.05,
# tuned for one chain's noisy statistic) the step size then circles in a limit cycle after each
# restart (steps of ~2 in log h at t ~ t0): its average lands where the acceptance is 0.1-0.3 above
# the target. 0.3 damps the cycle; per chain, Stan's 0.05 stays.
POOLED_GAMMA = 0.3
STAN_GAMMA = 0.05
# A restart at a window's end shrinks towards the step size reached (Stan: 10 times it, which
# sends the first iterations after every restart to steps that are rejected).
RESTART_SHRINK_FACTOR = 1.0


# Slow windows double: 25 * (2^32 - 1) iterations need 32 of them at most
MAX_WINDOWS = 32


class Schedule(NamedTuple):
    """Stan's windows as data of a fixed size (one graph serves every ``num_steps``): the slow
    iterations are ``[slow_start, slow_stop)`` (0-dim int64 each), and ``window_ends:
    (MAX_WINDOWS,)`` int64 holds the last iteration of each slow window, padded with -1.
    :func:`stages` reads the flags of any iteration."""

    slow_start: Tensor
    slow_stop: Tensor
    window_ends: Tensor


torch.serialization.add_safe_globals([Schedule])


def _slow_windows(num_steps: int, initial_buffer: int, first_window: int, final_buffer: int) -> list[tuple[int, int]]:
    """Stan's slow windows ``[start, stop)``; none below 20 iterations (the step size only)."""
    if num_steps < 20:
        return []
    if initial_buffer + first_window + final_buffer > num_steps:
        # Stan's fallback: 15% / 75% / 10%
        initial_buffer = int(0.15 * num_steps)
        final_buffer = int(0.1 * num_steps)
        first_window = num_steps - initial_buffer - final_buffer
    end = num_steps - final_buffer
    windows, start, size = [], initial_buffer, first_window
    while start < end:
        if 3 * size <= end - start:  # room for this window and the next, twice as long
            stop, size = start + size, 2 * size
        else:  # the last window runs to the final buffer
            stop = end
        windows.append((start, stop))
        start = stop
    return windows


def build_schedule(num_steps: int, initial_buffer: int = 75, first_window: int = 25, final_buffer: int = 50,
                   *, device: torch.device | str | None = None) -> Schedule:
    """Stan's warm-up schedule for ``num_steps`` iterations, as tensors.

    An initial fast buffer, slow windows doubling from ``first_window`` (the last one stretched
    to the final buffer), a final fast buffer. When the three do not fit, they become 15%, 75%
    and 10% of ``num_steps`` (Stan, BlackJAX); below 20 iterations every iteration is fast (the
    mass matrix keeps its initial value).
    """
    num_steps = _checks.check_int("num_steps", num_steps, 1)
    initial_buffer = _checks.check_int("initial_buffer", initial_buffer, 0)
    first_window = _checks.check_int("first_window", first_window, 1)
    final_buffer = _checks.check_int("final_buffer", final_buffer, 0)
    windows = _slow_windows(num_steps, initial_buffer, first_window, final_buffer)
    if len(windows) > MAX_WINDOWS:
        raise ValueError(f"the schedule has {len(windows)} slow windows, more than {MAX_WINDOWS}: "
                         "use a larger first_window")
    ends = [stop - 1 for _, stop in windows] + [-1] * (MAX_WINDOWS - len(windows))
    start, stop = (windows[0][0], windows[-1][1]) if windows else (0, 0)
    def as_tensor(x):
        return torch.tensor(x, dtype=torch.int64, device=device)
    return Schedule(as_tensor(start), as_tensor(stop), as_tensor(ends))


def stages(schedule: Schedule, t: Tensor) -> tuple[Tensor, Tensor]:
    """``(slow, window_end)`` flags (bool, ``t``'s shape) of iterations ``t`` (an int64 tensor):
    the draw feeds the mass matrix estimate; the iteration ends a slow window."""
    slow = (t >= schedule.slow_start) & (t < schedule.slow_stop)
    end = (t.unsqueeze(-1) == schedule.window_ends).any(-1)
    return slow, end


class WindowAdaptationState(NamedTuple):
    """The warm-up's state: the whole ensemble as one pytree (``sample_chain`` runs it as one
    "chain"). The step size and mass matrix fields are shared when pooled, per chain otherwise.

    state: the sampler's state, fields ``(*chains, ...)``;
    step: 0-dim int64, the index of the next iteration in ``schedule``;
    schedule: the :class:`Schedule` (fixed-size data: a new ``num_steps`` reuses the graph);
    target: 0-dim, the target acceptance statistic;
    dual_averaging: :class:`~fnebm.adaptation.step_size.DualAveragingState`, shape ``()`` pooled
    or ``chains``;
    welford: :class:`~fnebm.adaptation.mass_matrix.WelfordState` of the current slow window;
    step_size: the step size in use, ``()`` or ``chains``;
    inverse_mass_matrix: the one in use, ``(d,)``/``(d, d)`` pooled or ``(*chains, d)``/``(*chains, d, d)``.
    """

    state: Any
    step: Tensor
    schedule: Schedule
    target: Tensor
    dual_averaging: ss.DualAveragingState
    welford: mm.WelfordState
    step_size: Tensor
    inverse_mass_matrix: Tensor

    @property
    def position(self) -> Tensor:
        return self.state.position


class WindowAdaptationInfo(NamedTuple):
    """Per iteration: the step size used (``()`` or ``chains``), and each chain's acceptance
    statistic and divergence flag (``chains``)."""

    step_size: Tensor
    acceptance_rate: Tensor
    is_divergent: Tensor


class AdaptationResults(NamedTuple):
    """``state``: the chains' sampler state after warm-up; ``parameters``: keyword arguments of the
    algorithm (``algorithm(energy_fn, **parameters)`` samples with the tuned values); ``info``:
    the :class:`WindowAdaptationInfo` of every iteration (leading axis ``num_steps``)."""

    state: Any
    parameters: dict[str, Any]
    info: WindowAdaptationInfo


torch.serialization.add_safe_globals([WindowAdaptationState, WindowAdaptationInfo])


def default_step_size(d: int) -> float:
    """The rule of thumb for a first step size in ``d`` dimensions: ``d^(-1/4)``."""
    return float(d) ** -0.25


def default_num_integration_steps(d: int) -> int:
    """The rule of thumb for HMC's trajectory in ``d`` dimensions: ``ceil(sqrt(d))`` steps."""
    return max(1, math.ceil(math.sqrt(d)))


def _unwrap(algorithm: Any) -> tuple[Any, set[str]]:
    """The function under any ``functools.partial`` layers, and the keywords they bind."""
    bound: set[str] = set()
    while isinstance(algorithm, functools.partial):
        bound |= set(algorithm.keywords)
        algorithm = algorithm.func
    return algorithm, bound


class SamplerDefaults(NamedTuple):
    """What the warm-up assumes of an algorithm the caller leaves unsaid.

    target_acceptance_rate: of the algorithm's acceptance statistic; trajectory_rule: the
    algorithm takes ``num_integration_steps``, and a warm-up given none fills in
    ``ceil(sqrt(d))`` (:func:`default_num_integration_steps`)."""

    target_acceptance_rate: float
    trajectory_rule: bool = False


# By the constructor's name (module and qualified name, under any functools.partial): NUTS's
# statistic (the mean over the tree) at 0.8, as Stan; one HMC trajectory's at 0.65 and its length
# by the rule of thumb. Any other algorithm: 0.65 and no rule, or what it declares (a
# ``target_acceptance_rate`` attribute).
SAMPLER_DEFAULTS: dict[str, SamplerDefaults] = {
    "fnebm.samplers.nuts.nuts": SamplerDefaults(NUTS_TARGET_ACCEPTANCE_RATE),
    "fnebm.samplers.hmc.hmc": SamplerDefaults(HMC_TARGET_ACCEPTANCE_RATE, trajectory_rule=True),
}
_OTHER = SamplerDefaults(HMC_TARGET_ACCEPTANCE_RATE)


def sampler_name(algorithm: Any) -> str:
    """``module.qualname`` of the constructor under any ``functools.partial`` layers."""
    fn, _ = _unwrap(algorithm)
    return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _defaults(algorithm: Any) -> SamplerDefaults:
    return SAMPLER_DEFAULTS.get(sampler_name(algorithm), _OTHER)


def default_target_acceptance_rate(algorithm: Any) -> float:
    """0.8 for :func:`fnebm.nuts`, 0.65 for :func:`fnebm.hmc` and any other algorithm (also under
    ``functools.partial``; :data:`SAMPLER_DEFAULTS`); an algorithm may declare its own with a
    ``target_acceptance_rate`` attribute."""
    fn, _ = _unwrap(algorithm)
    declared = getattr(algorithm, "target_acceptance_rate", getattr(fn, "target_acceptance_rate", None))
    if declared is not None:
        return float(declared)
    return _defaults(algorithm).target_acceptance_rate


def _extra_for(extra: dict[str, Any], steps_rule: bool, d: int) -> dict[str, Any]:
    if steps_rule:
        return {**extra, "num_integration_steps": default_num_integration_steps(d)}
    return extra


def _tree_where(condition: Tensor, a: Any, b: Any) -> Any:
    return pytree.tree_map(lambda x, y: torch.where(condition, x, y), a, b)


def _adapt_step(adapt: WindowAdaptationState, key: Tensor, *, algorithm: Callable, energy_fn: Callable,
                extra: dict[str, Any], diagonal: bool, steps_rule: bool, t0: float, gamma: float | None,
                kappa: float) -> tuple[WindowAdaptationState, WindowAdaptationInfo]:
    """One warm-up iteration for every chain: ``key: (2,)`` is split into one key per chain."""
    position = adapt.state.position
    chains, d = tuple(position.shape[:-1]), position.shape[-1]
    keys = fr.split(key, math.prod(chains)).reshape(chains + (2,))
    wrap = Diagonal if diagonal else Dense
    alg = algorithm(energy_fn, adapt.step_size, wrap(adapt.inverse_mass_matrix), **_extra_for(extra, steps_rule, d))
    state, info = alg.step(adapt.state, keys)
    accept = info.acceptance_rate
    divergent = getattr(info, "is_divergent", None)
    divergent = torch.zeros(chains, dtype=torch.bool, device=position.device) if divergent is None else divergent
    new = _adapt_update(adapt, state, accept, t0, gamma, kappa)
    return new, WindowAdaptationInfo(adapt.step_size, accept, divergent)


def _adapt_update(adapt: WindowAdaptationState, state: Any, accept: Tensor, t0: float, gamma: float | None,
                  kappa: float) -> WindowAdaptationState:
    """The warm-up's state after an iteration whose transition gave ``state`` and acceptance statistics
    ``accept`` (``chains``): Welford's update in a slow window, the metric at a window's end, dual averaging."""
    chains = tuple(accept.shape)
    slow, end = stages(adapt.schedule, adapt.step)
    welford = _tree_where(slow, mm.update(adapt.welford, state.position), adapt.welford)
    # at a window's end: the new metric, a fresh estimate, and dual averaging restarted where it got to
    imm = torch.where(end, mm.final(welford), adapt.inverse_mass_matrix)
    welford = pytree.tree_map(lambda x: torch.where(end, torch.zeros_like(x), x), welford)
    if gamma is None:  # pooled over more than one chain, or not: a static (shape) choice
        gamma = POOLED_GAMMA if math.prod(chains) > adapt.step_size.numel() else STAN_GAMMA
    da = ss.update(adapt.dual_averaging, accept, adapt.target, t0, gamma, kappa)
    da = _tree_where(end, ss.init(ss.final(da), RESTART_SHRINK_FACTOR), da)
    return WindowAdaptationState(state, adapt.step + 1, adapt.schedule, adapt.target, da, welford,
                                 torch.exp(da.log_step_size), imm)


# the floats one call of _adapt_many writes at most (positions, gradients, the adaptation's state after
# every iteration: a dense metric's d x d twice), 16 MB of float32; a longer block runs in several calls
_MANY_FLOATS = 1 << 22


def _adapt_many(step: functools.partial, adapt: WindowAdaptationState,
                keys: Tensor) -> tuple[WindowAdaptationState, WindowAdaptationInfo] | None:
    """``keys: (T, 2)``, the keys of ``T`` iterations: the first ``T' <= T`` of them at once, stacked
    (every field with a leading ``T'``), where the sampler's transition runs in C on an energy it
    evaluates in torch and the sampler can run the warm-up's iterations there too (its step's
    ``kernel_warmup``: NUTS, :func:`fnebm.kernels.cpu_nuts.nuts_warmup`); ``None`` otherwise (the
    iterations then run one at a time). The same iterations as :func:`_adapt_step`'s from the same
    keys to float rounding: each transition the kernel's, bit for bit, from its state, step size and
    metric; dual averaging and Welford's update in C in float32 in torch's order of operations (C's
    ``sqrt`` and ``exp`` and a mean over many chains can differ from torch's in the last bit, and the
    trajectories then part), each window's end in torch (this module's code). An iteration's Python (building the sampler, a dozen small tensor operations)
    cost more than its transition on a small posterior (about 0.6 ms against 0.2 ms on eight schools)."""
    kw = step.keywords
    inner = _c_iterations(step, adapt)
    if inner is None or not isinstance(keys, Tensor) or keys.ndim != 2:
        return None
    hook = inner.func.kernel_warmup
    position = adapt.state.position
    chains, d = tuple(position.shape[:-1]), position.shape[-1]
    n, pool = math.prod(chains), tuple(adapt.step_size.shape)
    n_p, m_el = math.prod(pool), d if kw["diagonal"] else d * d
    per_iteration = n * (2 * d + 5) + n_p * (7 + d + 2 * m_el) + 1
    t_n = max(1, min(keys.shape[0], _MANY_FLOATS // per_iteration))
    keys = keys[:t_n]
    ts = adapt.step + torch.arange(t_n, device=adapt.step.device)
    slow, end = stages(adapt.schedule, ts)
    gamma = kw["gamma"]
    if gamma is None:
        gamma = POOLED_GAMMA if n > n_p else STAN_GAMMA

    def window_end(mean: Tensor, m2: Tensor, count: Tensor, dual: Any) -> tuple:
        welford = mm.WelfordState(mean, m2, count)
        imm = mm.final(welford)
        welford = pytree.tree_map(torch.zeros_like, welford)
        da = ss.init(ss.final(ss.DualAveragingState(*dual)), RESTART_SHRINK_FACTOR)
        return imm, welford, da, torch.exp(da.log_step_size)

    ran = hook(inner, adapt.state, fr.split(keys, n).reshape((t_n,) + chains + (2,)),
               dual_averaging=tuple(adapt.dual_averaging), welford=tuple(adapt.welford), slow=slow, end=end,
               target=float(adapt.target), t0=kw["t0"], gamma=gamma, kappa=kw["kappa"], window_end=window_end)
    if ran is None:
        return None
    states, out = ran
    lead = (t_n,)
    stacked = WindowAdaptationState(
        states, ts + 1, Schedule(*(f.expand(lead + tuple(f.shape)) for f in adapt.schedule)),
        adapt.target.expand(lead), ss.DualAveragingState(*out.dual_averaging), mm.WelfordState(*out.welford),
        out.step_size, out.inverse_mass_matrix)
    used = torch.cat([adapt.step_size.unsqueeze(0), out.step_size[:-1]])  # the step size each iteration took
    return stacked, WindowAdaptationInfo(used, out.acceptance_rate, out.is_divergent)


_adapt_step.kernel_many = _adapt_many  # several iterations at once, read by fnebm.chain's eager loop


def _inner_step(step: functools.partial, adapt: WindowAdaptationState) -> Any:
    """The sampler's step with the warm-up's current step size and metric (what an iteration of
    ``step``, a partial of :func:`_adapt_step`, runs), or ``None`` where building it fails (the
    iteration itself then says why)."""
    kw = step.keywords
    wrap = Diagonal if kw["diagonal"] else Dense
    try:
        return kw["algorithm"](kw["energy_fn"], adapt.step_size, wrap(adapt.inverse_mass_matrix),
                               **_extra_for(kw["extra"], kw["steps_rule"], adapt.state.position.shape[-1])).step
    except (TypeError, ValueError):
        return None


def _c_iterations(step: functools.partial, adapt: WindowAdaptationState) -> Any:
    """The sampler's step built for ``adapt`` when :func:`_adapt_many` can take the warm-up's iterations
    (the step has a ``kernel_warmup``, and the adaptation's state is float32 on the CPU with no gradient
    through it), else ``None``; the transition's own conditions are its ``kernel_warmup``'s to check."""
    if not isinstance(adapt.state.position, Tensor):
        return None
    inner = _inner_step(step, adapt)
    fields = [*adapt.dual_averaging, *adapt.welford, adapt.step_size, adapt.inverse_mass_matrix, adapt.target]
    if inner is None or getattr(getattr(inner, "func", None), "kernel_warmup", None) is None or any(
            not isinstance(f, Tensor) or f.dtype != torch.float32 or f.device.type != "cpu"
            or (f.requires_grad and torch.is_grad_enabled()) for f in fields):
        return None
    return inner


def _say_c_iterations(on_plan: Callable, step: functools.partial) -> Callable:
    """``on_plan`` told what runs when the C kernel takes the warm-up's iterations (the runner's own
    reason only says that its steps are eager)."""
    how = step.keywords["extra"].get("compile_energy", "auto")
    name = getattr(_unwrap(step.keywords["algorithm"])[0], "__name__", "the sampler")
    note = (f"eager iterations: each {name} transition and the adaptation (dual averaging, Welford) in the C "
            f"kernel, which evaluates the energy in torch between its steps (compile_energy={how!r}); each "
            "window's end in torch")

    def said(plan: Any) -> Any:
        if hasattr(plan, "_replace") and not getattr(plan, "compiled", True):
            plan = plan._replace(reason=note)
        return on_plan(plan)

    return said


def _eager_transitions(step: functools.partial, adapt: WindowAdaptationState,
                       compile: Any) -> tuple[Any, Any, bool]:
    """``(step, compile, evaluated)`` for the run: eager iterations when the sampler's transition returns
    to Python between its steps (NUTS in C on an energy the kernel does not compute itself, whose
    ``step.func.kernel_traces`` says so; ``evaluated`` is then True); ``compile`` then says whether
    those evaluations are compiled (``compile_energy``). Anything else runs as asked."""
    kw = step.keywords
    position = adapt.state.position
    chains = tuple(position.shape[:-1])
    inner = _inner_step(step, adapt)
    if inner is None:  # the warm-up's own step says what is wrong, as it always has
        return step, True if compile is None else compile, False
    func = getattr(inner, "func", None)
    traces, reason = getattr(func, "kernel_traces", None), getattr(func, "kernel_reason", None)
    keys = torch.zeros(chains + (2,), dtype=torch.int64, device=position.device)
    if compile is not None and compile is not True and compile is not False and compile != "auto":
        return step, compile, False  # the runner names what is wrong with it
    if traces is None or reason is None or traces(inner) or reason(inner, adapt.state, keys) is not None:
        return step, True if compile is None else compile, False
    if compile is not None and compile != "auto" and "compile_energy" not in kw["extra"]:
        step = functools.partial(step.func, *step.args, **{**kw, "extra": {**kw["extra"], "compile_energy": bool(compile)}})
    return step, False, True


@_loop.fieldwise
def _schedule_index(adapt: WindowAdaptationState) -> Tensor:
    """What ``sample_chain`` keeps per iteration: the iteration counter (the info holds the rest)."""
    return adapt.step


class WindowAdaptation(NamedTuple):
    """The warm-up of :func:`window_adaptation`.

    * ``run(position_or_state, key) -> AdaptationResults(state, parameters, info)``: the whole
      warm-up, one compiled call;
    * ``init(position_or_state) -> WindowAdaptationState``, ``step(adapt_state, key: (2,)) ->
      (adapt_state, info)`` and ``final(adapt_state) -> (state, parameters)``: the same pieces
      for a loop of your own (``fnebm.chain.run(step, init(x), key, num_steps)`` inside your
      compiled function);
    * ``schedule``: the :class:`Schedule` (on the CPU; ``init`` moves it to the chains' device).
    """

    init: Callable[..., WindowAdaptationState]
    step: Callable[[WindowAdaptationState, Tensor], tuple[WindowAdaptationState, WindowAdaptationInfo]]
    final: Callable[[WindowAdaptationState], tuple[Any, dict[str, Any]]]
    run: Callable[..., AdaptationResults]
    schedule: Schedule


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _initial_imm(given: Any, diagonal: bool, pool: tuple[int, ...], d: int, like: Tensor) -> Tensor:
    """The first inverse mass matrix, shaped ``pool + event`` (a fresh tensor)."""
    event = (d,) if diagonal else (d, d)
    if given is None:
        imm = torch.ones(d, dtype=like.dtype, device=like.device) if diagonal else \
            torch.eye(d, dtype=like.dtype, device=like.device)
    else:
        imm = given.inverse_mass_matrix if isinstance(given, (Diagonal, Dense)) else given
        if tuple(imm.shape) not in (event, pool + event):
            kind = "diagonal" if diagonal else "dense"
            raise ValueError(
                f"initial_inverse_mass_matrix has shape {tuple(imm.shape)}; a {kind} one for positions "
                f"of dimension {d} is {event}" + (f" or {pool + event} (per chain)" if pool else "")
            )
        imm = imm.to(dtype=like.dtype, device=like.device)
    return imm.expand(pool + event).clone()


def _initial_step_size(given: Tensor | None, pool: tuple[int, ...], chains: tuple[int, ...], d: int,
                       like: Tensor) -> Tensor:
    if given is None:
        h = torch.tensor(default_step_size(d), dtype=like.dtype, device=like.device)
    else:
        h = given.to(dtype=like.dtype, device=like.device)
        if h.ndim and not pool:
            raise ValueError(
                f"initial_step_size has shape {tuple(h.shape)} but the warm-up is pooled over the chains "
                "(one step size): give one value, or pooled=False for one step size per chain"
            )
        _checks.check_tunable_shape("initial_step_size", h, chains)
        h = h.reshape(tuple(h.shape) + (1,) * (len(pool) - h.ndim))
    return h.expand(pool).clone()


def window_adaptation(
    algorithm: Callable[..., Any],
    energy_fn: Callable[[Tensor], Tensor],
    num_steps: int,
    *,
    target_acceptance_rate: float | Tensor | None = None,
    is_mass_matrix_diagonal: bool = True,
    initial_step_size: float | Tensor | None = None,
    initial_inverse_mass_matrix: Tensor | Diagonal | Dense | None = None,
    pooled: bool | None = None,
    initial_buffer: int = 75,
    first_window: int = 25,
    final_buffer: int = 50,
    t0: float = 10.0,
    gamma: float | None = None,
    kappa: float = 0.75,
    **extra: Any,
) -> WindowAdaptation:
    """Stan's window adaptation of the step size and inverse mass matrix of ``algorithm``.

    Args:
        algorithm: a constructor ``algorithm(energy_fn, step_size, inverse_mass_matrix, **extra)
            -> SamplingAlgorithm`` whose info has ``acceptance_rate`` (and ``is_divergent``):
            :func:`fnebm.hmc`, :func:`fnebm.nuts`, or a ``functools.partial`` of one.
        energy_fn: ``x -> E(x)`` for one sample ``x: (d,)``.
        num_steps: warm-up iterations (the schedule: :func:`build_schedule`).
        target_acceptance_rate: of the sampler's acceptance statistic; default 0.8 for NUTS,
            0.65 otherwise (:func:`default_target_acceptance_rate`). A number or a 0-dim tensor.
        is_mass_matrix_diagonal: adapt a diagonal inverse mass matrix (default) or a dense one.
        initial_step_size: default ``d^(-1/4)`` (:func:`default_step_size`); a number or tensor,
            0-dim, or per chain when not pooled.
        initial_inverse_mass_matrix: default the identity; ``(d,)`` diagonal / ``(d, d)`` dense
            (or per chain when not pooled), matching ``is_mass_matrix_diagonal``.
        pooled: one step size and one mass matrix for all the chains, from every chain's
            acceptance and draws (``True``), or one per chain (``False``). Default: pooled when
            there is more than one chain.
        initial_buffer, first_window, final_buffer: Stan's 75, 25, 50.
        t0, gamma, kappa: dual averaging's (Stan's 10, 0.05, 0.75), except that ``gamma=None``
            is 0.3 for a step size pooled over chains (:data:`POOLED_GAMMA`: the averaged statistic
            is nearly deterministic, and 0.05 sets the step size circling; see the module's notes)
            and 0.05 per chain. Restarts at a window's end shrink towards the step size reached.
        **extra: further arguments of ``algorithm`` (``integrator``, ``max_tree_depth``, ...). For
            :func:`fnebm.hmc` without ``num_integration_steps``, the rule of thumb
            ``ceil(sqrt(d))`` (:func:`default_num_integration_steps`).

    Returns:
        :class:`WindowAdaptation`; ``run(position_or_state, key, *, compile=None, cache=None,
        progress=False, on_plan=None, runner=None) -> AdaptationResults(state, parameters, info)``.
        ``position_or_state``: positions ``(*chains, d)`` or a sampler state of the algorithm;
        ``key``: one key ``(2,)``. ``compile`` (``True``, ``False`` or ``"auto"``; ``None``, the
        default: ``True``, the whole warm-up one compiled call, except for a sampler whose
        transition runs eagerly and calls back into torch — NUTS in C on an energy the kernel
        does not compute itself — whose evaluations then compile as its ``compile_energy`` says,
        ``"auto"`` by default) and
        ``on_plan`` (told before the warm-up whether it compiles, and why) are
        :func:`fnebm.sample_chain`'s; so is the fallback: a compile that fails on your energy
        runs the warm-up eagerly instead (the same result), with one
        :class:`~fnebm.chain.runner.CompileFallbackWarning`. ``runner``: what runs the warm-up's
        steps, ``runner(step, state, key, n_steps, *, collect, compile, cache, progress, on_plan)
        -> (state, trace, info)`` (default: ``sample_chain``'s, see :mod:`fnebm._loop`;
        ``fnebm._loop.eager_runner`` is the plain loop).
        ``parameters`` has ``step_size`` (the averaged dual-averaging iterate: 0-dim pooled, or
        ``chains``), ``inverse_mass_matrix`` (a :class:`~fnebm.integrators.metrics.Diagonal` or
        :class:`~fnebm.integrators.metrics.Dense`, shared or per chain) and the ``extra``
        arguments (with the rule-of-thumb ``num_integration_steps``), so that
        ``algorithm(energy_fn, **parameters)`` samples with the tuned values.
    """
    _checks.check_callable("algorithm", algorithm, "algorithm(energy_fn, step_size, inverse_mass_matrix, **extra)")
    expected = "algorithm(energy_fn, step_size, inverse_mass_matrix, **extra)"
    _checks.check_signature(
        "algorithm", algorithm, 3, what=expected,
        hint="window_adaptation tunes a step size and an inverse mass matrix: give it fnebm.hmc or fnebm.nuts "
             "(or a functools.partial of one); fnebm.mala and fnebm.langevin take no mass matrix (tune MALA's "
             "step size alone with fnebm.adaptation.dual_averaging, see docs/api.md)")
    check_energy(energy_fn)
    num_steps = _checks.check_int("num_steps", num_steps, 1)
    diagonal = _check_flag("is_mass_matrix_diagonal", is_mass_matrix_diagonal)
    if pooled is not None:
        _check_flag("pooled", pooled)
    if target_acceptance_rate is None:
        target_acceptance_rate = default_target_acceptance_rate(algorithm)
    target = ss.check_target("target_acceptance_rate", target_acceptance_rate)
    if initial_step_size is not None:
        initial_step_size = _checks.tunable("initial_step_size", initial_step_size)
    if initial_inverse_mass_matrix is not None:
        kind = Diagonal if diagonal else Dense
        if isinstance(initial_inverse_mass_matrix, (Diagonal, Dense)) and not isinstance(initial_inverse_mass_matrix, kind):
            raise ValueError(f"initial_inverse_mass_matrix is {type(initial_inverse_mass_matrix).__name__} but "
                             f"is_mass_matrix_diagonal={diagonal}")
        if not isinstance(initial_inverse_mass_matrix, (Diagonal, Dense)):
            initial_inverse_mass_matrix = kind(initial_inverse_mass_matrix)
        check_inverse_mass_matrix(initial_inverse_mass_matrix, "initial_inverse_mass_matrix")
    # the triple's own checks of t0, gamma and kappa (the step calls its functions directly)
    ss.dual_averaging(target, t0=t0, gamma=STAN_GAMMA if gamma is None else gamma, kappa=kappa)
    for name in ("step_size", "inverse_mass_matrix"):
        if name in extra:
            raise TypeError(f"{name} is what window_adaptation tunes; give initial_{name} instead")
    _checks.check_signature("algorithm", algorithm, 3, extra, what=expected,
                            hint="window_adaptation passes its other keyword arguments on to algorithm")
    schedule = build_schedule(num_steps, initial_buffer, first_window, final_buffer)
    _, bound = _unwrap(algorithm)
    steps_rule = _defaults(algorithm).trajectory_rule and "num_integration_steps" not in set(extra) | bound
    step = functools.partial(_adapt_step, algorithm=algorithm, energy_fn=energy_fn, extra=dict(extra),
                             diagonal=diagonal, steps_rule=steps_rule, t0=float(t0),
                             gamma=None if gamma is None else float(gamma),
                             kappa=float(kappa))

    def init(position_or_state: Any) -> WindowAdaptationState:
        if isinstance(position_or_state, Tensor):
            position = position_or_state
            if not position.is_floating_point() or position.ndim < 1:
                raise TypeError(f"positions must be a floating tensor (*chains, d), got dtype {position.dtype} "
                                f"and shape {tuple(position.shape)}")
            chains = tuple(position.shape[:-1])
            if not bool(torch.isfinite(position).all()):
                raise ValueError("positions must be finite (no NaN or inf)")
            state = None
        else:
            position = getattr(position_or_state, "position", None)
            if not isinstance(position, Tensor) or position.ndim < 1:
                raise TypeError("position_or_state must be positions (*chains, d) or a sampler state with a "
                                f"position field (*chains, d), got {type(position_or_state).__name__}")
            chains, state = tuple(position.shape[:-1]), position_or_state
        d = position.shape[-1]
        is_pooled = (math.prod(chains) > 1) if pooled is None else pooled
        pool = () if is_pooled else chains
        h0 = _initial_step_size(initial_step_size, pool, chains, d, position)
        imm = _initial_imm(initial_inverse_mass_matrix, diagonal, pool, d, position)
        if state is None:
            alg = algorithm(energy_fn, h0, Diagonal(imm) if diagonal else Dense(imm),
                            **_extra_for(dict(extra), steps_rule, d))
            one = alg.init
            for _ in chains:
                one = torch.func.vmap(one)
            state = one(position)
        device = position.device
        return WindowAdaptationState(
            state,
            torch.zeros((), dtype=torch.int64, device=device),
            Schedule(*(x.to(device) for x in schedule)),
            target.to(dtype=position.dtype, device=device),
            ss.init(h0),
            mm.init(position.new_zeros(pool + (d,)), diagonal),
            h0.clone(),
            imm,
        )

    def final(adapt: WindowAdaptationState) -> tuple[Any, dict[str, Any]]:
        d = adapt.state.position.shape[-1]
        wrap = Diagonal if diagonal else Dense
        parameters = {"step_size": ss.final(adapt.dual_averaging),
                      "inverse_mass_matrix": wrap(adapt.inverse_mass_matrix),
                      **_extra_for(dict(extra), steps_rule, d)}
        return adapt.state, parameters

    def run(position_or_state: Any, key: Tensor, *, compile: bool | str | None = None, cache: Any = None,
            progress: bool = False, on_plan: Any = None, runner: Callable[..., Any] | None = None) -> AdaptationResults:
        if runner is None:
            runner = _loop.default_runner()  # sample_chain's once fnebm.chain is imported (import fnebm does)
        else:
            _checks.check_callable("runner", runner, "runner(step, state, key, n_steps, **options) -> (state, trace, info)")
        _checks.check_key(key)
        if key.ndim != 1:
            raise ValueError(f"key must be one key of shape (2,) (the warm-up splits it over the chains), "
                             f"got shape {tuple(key.shape)}")
        adapt = init(position_or_state)
        run_step, compile, evaluated = _eager_transitions(step, adapt, compile)
        if on_plan is not None and evaluated and _c_iterations(run_step, adapt) is not None:
            on_plan = _say_c_iterations(on_plan, run_step)
        # the whole ensemble is one "chain" of the runner (no chain axes): pooled fields have no
        # chain axis, and the step splits its key over the chains
        adapted, _, info = runner(run_step, adapt, key, num_steps, collect=_schedule_index, compile=compile, cache=cache,
                                  progress=progress, on_plan=on_plan)
        state, parameters = final(adapted)
        return AdaptationResults(state, parameters, info)

    return WindowAdaptation(init, step, final, run, schedule)
