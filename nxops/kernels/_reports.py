"""Reporting which kernel ran each op (for ``explain``, the demo and the
measuring tool): lowering rules call ``report``; ``collect_reports`` listens."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from typing import Any, Iterator, Sequence

from nxops._jax import config as _jax_config
from nxops.kernels._choice import Choice


@dataclasses.dataclass(frozen=True)
class Report:
    """One op of a program and the kernel chosen for it."""

    op: str
    operands: str
    choice: Choice

    def __str__(self) -> str:
        return f"{self.op:<15} {self.operands:<40} {self.choice.kernel.name:<20} {self.choice.describe()}"


# The report lists of the enclosing `collect_reports` blocks of this thread /
# context (a context variable: threads explaining at once never mix reports).
_COLLECTORS: contextvars.ContextVar[tuple[list[Report], ...]] = contextvars.ContextVar(
    "nxops_report_collectors", default=())

# A fresh value per `collect_reports` block; part of the trace context, so jit
# caches cannot skip the tracing and lowering that make the reports.
_COLLECTION_EPOCH = _jax_config.int_state(
    "nxops_report_epoch", 0, "internal: forces a retrace while nxops collects kernel reports",
    include_in_jit_key=True, include_in_trace_context=True)
_epochs = itertools.count(1)


def report(op: str, choice: Choice, avals: Sequence[Any], /) -> None:
    """Called by lowering rules (and trace-time dispatch) with each choice."""
    collectors = _COLLECTORS.get()
    if not collectors:
        return
    operands = ", ".join(f"{getattr(a, 'dtype', '?')}{list(getattr(a, 'shape', ()))}" for a in avals)
    for collector in collectors:
        collector.append(Report(op, operands, choice))


# The platform a program is being traced for, when not the devices' own (set
# by `explain(..., platform=...)`): ops that choose kernels at trace time
# (collectives) choose for it.
_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "nxops_target_platform", default=None)


def target_platform() -> str | None:
    return _TARGET_PLATFORM.get()


@contextlib.contextmanager
def collect_reports(platform: str | None = None) -> Iterator[list[Report]]:
    """Records every kernel choice made while the block traces or lowers
    (for ``platform``, when given)."""
    reports: list[Report] = []
    collectors_token = _COLLECTORS.set(_COLLECTORS.get() + (reports,))
    token = _TARGET_PLATFORM.set(platform)
    try:
        with _COLLECTION_EPOCH(next(_epochs)):
            yield reports
    finally:
        _TARGET_PLATFORM.reset(token)
        _COLLECTORS.reset(collectors_token)
