"""Choosing the kernel for one case: the backend the selection asks for, or
under ``auto`` the first candidate of `auto`'s rule (``_auto``) that can run."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from nxops._errors import NxopsError
from nxops.kernels import _auto, _autotune, _measured, _registry
from nxops.kernels._registry import BACKENDS, OP_FAMILY, Kernel
from nxops.kernels._selection import Selection


@dataclasses.dataclass(frozen=True)
class Choice:
    """The kernel picked for one case, and why others were passed over."""

    kernel: Kernel
    requested: str
    passed_over: tuple[tuple[str, tuple[str, ...]], ...] = ()
    why: str = ""   # why this kernel (what was measured, or why XLA)
    case: str = ""  # the measured tables' key of this case (_measured.Case.key; "" if none)

    def describe(self) -> str:
        text = f"{self.kernel.backend} (requested {self.requested}"
        text += f": {self.why})" if self.why else ")"
        for backend, reasons in self.passed_over:
            text += f"; {backend} not used: {'; '.join(reasons)}"
        return text


def _shapes(avals: Sequence[Any]) -> str:
    return ", ".join(f"{getattr(a, 'dtype', '?')}{list(getattr(a, 'shape', ()))}" for a in avals)


def reasons(kernel: Kernel, platform: str, avals: Sequence[Any], params: dict,
            auto_partitioned: bool, /) -> tuple[str, ...]:
    """Why ``kernel`` cannot take this case on ``platform`` (empty: it can)."""
    if platform not in kernel.platforms:
        return (f"it runs on {', '.join(kernel.platforms)}, not {platform}",)
    load_problems = _registry.load_problems(kernel.backend, platform)
    if load_problems:
        return load_problems
    symbolic = any(not isinstance(d, int) for aval in avals for d in getattr(aval, "shape", ()))
    if symbolic and kernel.backend != "xla":   # xla is pure JAX: it takes symbolic sizes
        return ("symbolic sizes (jax.export shape polymorphism): the kernel's blocks and grid "
                "need concrete sizes",)
    if auto_partitioned and platform in kernel.manual_only_platforms:
        return (f"on {platform} it cannot be partitioned automatically; run it where every "
                f"mesh axis is manual (map all mesh axes in axis_resources, or use shard_map)",)
    return tuple(kernel.not_supported_reasons(*avals, platform=platform, **params))


def choose(op: str, platform: str, selection: Selection, avals: Sequence[Any],
           auto_partitioned: bool = False, producers: Sequence[str] | None = None, /,
           **params: Any) -> Choice:
    """The kernel that runs ``op`` for this case on ``platform``.

    ``auto`` keeps XLA unless `auto`'s rule (on cuda: the measured table) lets
    a kernel take the case; then it takes the first of its candidates that is
    registered, loads and supports the case. An explicitly requested backend
    that cannot take the case raises NxopsError with its reasons.
    ``auto_partitioned`` says the op is lowered where XLA partitions some mesh
    axes automatically; ``producers`` says what made each operand (see
    ``_auto.ARGUMENT``; None: unknown).
    """
    requested = selection.backend_for(op)
    if any(getattr(aval, "size", 1) == 0 for aval in avals):
        choice = _zero_size(op, requested)
    elif requested == "auto":
        choice = _choose_auto(op, platform, avals, auto_partitioned, producers, params)
    else:
        choice = _choose_requested(op, requested, platform, avals, auto_partitioned, params)
    case = _measured.case_of(op, avals, params)
    return dataclasses.replace(choice, case=case.key if case else "")


def _zero_size(op: str, requested: str) -> Choice:
    """Nothing to compute: any selection takes the reference, which returns the
    empty (or identity-filled) result without launching a kernel."""
    why = "zero-size operands: nothing for a kernel to do"
    if requested in ("auto", "xla"):
        return Choice(_registry.lookup(op, "xla"), requested, (), why)
    return Choice(_registry.lookup(op, "xla"), requested, ((requested, (why,)),))


def _choose_requested(op: str, requested: str, platform: str, avals: Sequence[Any],
                      auto_partitioned: bool, params: dict) -> Choice:
    kernel = _registry.lookup(op, requested)
    family = OP_FAMILY[op]
    if kernel is None:
        have = ", ".join(k.backend for k in _registry.registered(op))
        raise NxopsError(
            f"NXOPS_KERNELS asks for the {requested!r} implementation of {family!r} "
            f"(op {op!r}), but nxops has no {requested!r} kernel for {op!r} (its "
            f"implementations: {have}). Use {family}=auto or one of those backends.")
    why_not = reasons(kernel, platform, avals, params, auto_partitioned)
    if why_not:
        raise NxopsError(
            f"the {requested!r} implementation of {op!r} cannot run this case "
            f"({_shapes(avals)}; {params}) on {platform}: {'; '.join(why_not)}. "
            f"Use NXOPS_KERNELS={family}=auto to fall back to xla for such cases.")
    return Choice(kernel, requested)


def _choose_auto(op: str, platform: str, avals: Sequence[Any], auto_partitioned: bool,
                 producers: Sequence[str] | None, params: dict) -> Choice:
    kernels = {k.backend: k for k in _registry.registered(op) if k.backend != "xla"}
    if platform == "cuda" and not _auto.fused_producer(producers) and _autotune.active(platform):
        supported = [b for b in BACKENDS if _registry.lookup(op, b) is not None and
                     not reasons(_registry.lookup(op, b), platform, avals, params,
                                 auto_partitioned)]
        backend, why = _autotune.winner(op, avals, params, supported)
        return Choice(_registry.lookup(op, backend), "auto", (), why)
    candidates, why_xla = _auto.auto_rule(op, platform, avals, params, producers, kernels)
    passed_over = []
    for backend, why in candidates:
        kernel = kernels.get(backend)
        if kernel is None:
            continue
        why_not = reasons(kernel, platform, avals, params, auto_partitioned)
        if not why_not:
            return Choice(kernel, "auto", tuple(passed_over), why)
        passed_over.append((backend, why_not))
    return Choice(_registry.lookup(op, "xla"), "auto", tuple(passed_over), why_xla)
