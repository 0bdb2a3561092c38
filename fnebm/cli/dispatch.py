"""What ``fnebm sample`` reads of the library's dispatch: the backend it asks
:func:`fnebm.sample_chain` for, which engine ran a call (from the call's plan, ``on_plan``), why, and
whether the run will build a C kernel first.

The command decides nothing about engines itself: every rule here restates one of the library's
(``fnebm/chain/backend.py``, ``fnebm/samplers/nuts.py``) or reads its reason strings, and each
such place is marked ``# dispatch:``. Nothing else in :mod:`fnebm.cli` asks the dispatch anything
(two more markers, in ``options.py``'s ``--compile`` help and a comment in ``presets.py``, name
the families the kernels cover), so a structured plan replaces the bodies here and no caller.
"""

from __future__ import annotations

from typing import Any

import torch

from fnebm.chain.backend import UNAVAILABLE


def backend(cfg: Any) -> str:
    """``sample_chain``'s backend: ``--compile`` asks for torch.compile, so it never takes a
    hand-written kernel; otherwise one runs where it covers the run (docs/kernels.md)."""
    # dispatch: the command's --compile/--no-compile mapped onto sample_chain's backend vocabulary
    return "compiled" if cfg.compile is True else "auto"


def sampler_backend(sampler: str, compiled: bool) -> dict[str, Any]:
    """The sampler's own ``backend`` argument: with ``--compile`` (``compiled``), NUTS's torch kernel
    rather than its C kernel (the flag asks for torch.compile's code, as it does of ``sample_chain``,
    whose ``backend="compiled"`` would still run NUTS's C transition)."""
    # dispatch: NUTS dispatches inside its step (samplers/nuts.py), apart from sample_chain's backend
    return {"backend": "torch"} if sampler == "nuts" and compiled else {}


def ran_kernel(plan: Any) -> bool:
    """Whether a call's chains ran in a hand-written kernel (C or Triton) rather than torch steps."""
    # dispatch: RunPlan.kernel says that a kernel ran, not which one (path() parses the reason for that)
    return bool(getattr(plan, "kernel", False))


def path(plans: list[Any], main: int, compile: bool | str) -> tuple[bool | None, str]:
    """``(compiled, why)`` for the main call of a run whose calls reported ``plans`` (``compile``:
    the command's ``--compile`` setting), and a word on the burn-in ramp's calls if they differ.
    ``compiled`` is ``None`` where a hand-written kernel ran the call."""
    if main >= len(plans) or plans[main] is None:
        return None, "a hand-written kernel (no plan reported)"
    plan = plans[main]
    if ran_kernel(plan):  # e.g. "backend='auto': the whole-chain C kernel (CPU)"
        # dispatch: the kernel's name is parsed out of the reason string
        return None, plan.reason.split(": ", 1)[-1] + ", nothing compiled"
    if getattr(plan, "fallback", None):
        return False, f"the compile failed ({plan.fallback}), so the steps ran eagerly"
    if compile is True:
        why = "--compile"
    elif compile is False:
        why = "--no-compile"
    elif any(p is not None and p.compiles for p in plans[:main]):
        why = "auto: compiled during the burn-in ramp"
    elif plan.reason.startswith("compiled earlier"):  # dispatch: reads the reason string's prefix
        why = plan.reason
    else:  # dispatch: the compile="auto" decision's reason, its "eager: "/"compiled: " prefix dropped
        why = "auto: " + plan.reason.removeprefix("eager: ").removeprefix("compiled: ")
    ramp = [p for p in plans[:main] if p is not None and p.compiled != plan.compiled]
    if ramp:
        why += f"; {sum(p.steps for p in ramp)} burn-in steps ran {'compiled' if ramp[0].compiled else 'eagerly'}"
    # a C kernel that covers the run but did not build or load: say why, whatever the branch above
    # dispatch: the note is found in the reason string by backend.py's UNAVAILABLE phrase
    notes = [n for n in plan.reason.split("; ") if UNAVAILABLE in n and n not in why]
    return plan.compiled, "; ".join([why, *notes])


def profiled_instead(compiled: bool | None, why: str) -> str | None:
    """The kernel a run took, in words, when ``--profile`` times the compiled runner instead
    (``compiled``, ``why``: :func:`path`'s); ``None`` when the run's own steps were timed."""
    # dispatch: "a kernel ran" is read back from path's words
    return why.split(",")[0] if compiled is None and "kernel" in why else None


def kernel_to_build(cfg: Any, target: Any) -> str | None:
    """``"nuts"`` or ``"chain"``: the C kernel this run will compile before its first use on this
    machine (``None``: none, or one already built)."""
    # dispatch: restates when sample_chain (backend.py) and nuts (samplers/nuts.py) take a C kernel
    if cfg.compile is True or cfg.sampler not in ("langevin", "mala", "nuts"):
        return None
    if cfg.compile is False and cfg.sampler != "nuts":  # --no-compile: Langevin and MALA run their eager steps
        return None
    if torch.device(cfg.device).type != "cpu" or cfg.dtype != "float32":
        return None
    from fnebm.kernels import cpu_chain, cpu_nuts

    if cpu_chain.covers(target) is not None:
        return None
    if cfg.sampler == "nuts":
        return None if cpu_nuts.built() else "nuts"
    return None if cpu_chain.built() else "chain"
