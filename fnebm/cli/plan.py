"""What ``fnebm sample`` reads of the library's dispatch: the backend it asks
:func:`fnebm.sample_chain` for, which engine ran a call (the call's :class:`~fnebm.chain.RunPlan`,
from ``on_plan``), why, and whether the run will build a C kernel first.

The command decides nothing about engines itself: ``--backend`` is ``sample_chain``'s word (the
same for ``fnebm.nuts``), the plan says which engine ran (``plan.engine``) and which kernels were
passed over and why (``plan.skipped``), and the kernels a run may build are looked up in
:data:`fnebm.kernels.dispatch.FAST_PATHS`.
"""

from __future__ import annotations

from typing import Any

import torch

from fnebm.kernels import dispatch as kernels_dispatch


def backend(cfg: Any) -> str:
    """``sample_chain``'s backend: ``--backend``, where ``--compile`` (asking for torch.compile's code)
    makes ``auto`` mean ``torch``."""
    chosen = getattr(cfg, "backend", "auto")
    return "torch" if chosen == "auto" and cfg.compile is True else chosen


def sampler_backend(sampler: str, compiled: bool, chosen: str = "auto") -> dict[str, Any]:
    """The sampler's own ``backend`` argument (NUTS runs its transition's kernel inside its step,
    also in the warm-up): the command's backend word where NUTS takes it (``auto``, ``c``,
    ``torch``), ``torch`` under ``--compile``."""
    if sampler != "nuts":
        return {}
    word = "torch" if chosen == "auto" and compiled else chosen
    return {"backend": word} if word in ("c", "torch") else {}


_KERNEL_WORDS = {"c": "the whole-chain C kernel (CPU)", "triton": "the whole-chain Triton kernel"}


def ran_kernel(plan: Any) -> bool:
    """Whether a call's chains ran in a hand-written whole-chain kernel (C or Triton)."""
    return getattr(plan, "engine", "") in _KERNEL_WORDS


def path(plans: list[Any], main: int, compile: bool | str) -> tuple[bool | None, str]:
    """``(compiled, why)`` for the main call of a run whose calls reported ``plans`` (``compile``:
    the command's ``--compile`` setting), and a word on the burn-in ramp's calls if they differ.
    ``compiled`` is ``None`` where a hand-written kernel ran the call."""
    if main >= len(plans) or plans[main] is None:
        return None, "a hand-written kernel (no plan reported)"
    plan = plans[main]
    if ran_kernel(plan):
        return None, _KERNEL_WORDS[plan.engine] + ", nothing compiled"
    if getattr(plan, "fallback", None):
        return False, f"the compile failed ({plan.fallback}), so the steps ran eagerly"
    if compile is True:
        why = "--compile"
    elif compile is False:
        why = "--no-compile"
    elif any(p is not None and p.compiles for p in plans[:main]):
        why = "auto: compiled during the burn-in ramp"
    elif plan.reason.startswith("compiled earlier"):
        why = plan.reason
    else:  # the compile="auto" decision's words, without their "eager: "/"compiled: " label
        why = "auto: " + plan.reason.split("; ")[0].removeprefix("eager: ").removeprefix("compiled: ")
    if getattr(plan, "transition", ""):
        why += f"; each transition in the {kernels_dispatch.NAMES[plan.transition]} kernel"
    ramp = [p for p in plans[:main] if p is not None and p.compiled != plan.compiled]
    if ramp:
        why += f"; {sum(p.steps for p in ramp)} burn-in steps ran {'compiled' if ramp[0].compiled else 'eagerly'}"
    # a kernel that covers the run but did not build or load: say why, whatever the branch above
    notes = [s.describe() for s in getattr(plan, "skipped", ()) if s.unavailable]
    return plan.compiled, "; ".join([why, *notes])


def profiled_instead(compiled: bool | None, why: str) -> str | None:
    """The kernel a run took, in words, when ``--profile`` times the compiled runner instead
    (``compiled``, ``why``: :func:`path`'s); ``None`` when the run's own steps were timed."""
    return why.split(",")[0] if compiled is None else None


def kernel_to_build(cfg: Any, target: Any) -> str | None:
    """``"nuts"`` or ``"chain"``: the C kernel this run will compile before its first use on this
    machine (``None``: none, or one already built), from the table of fast paths."""
    chosen = backend(cfg)
    if chosen not in ("auto", "c") or torch.device(cfg.device).type != "cpu" or cfg.dtype != "float32":
        return None
    path = next((p for p in kernels_dispatch.FAST_PATHS if p.engine == "c" and cfg.sampler in p.samplers), None)
    if path is None:
        return None
    module = kernels_dispatch.module(path)
    chain = next(p for p in kernels_dispatch.FAST_PATHS if p.engine == "c" and p.scope == "chain")
    covers = getattr(module, "covers", None) or kernels_dispatch.module(chain).covers  # NUTS: the same families
    if covers(target) is not None:
        return None
    return None if module.built() else ("nuts" if path.scope == "transition" else "chain")
