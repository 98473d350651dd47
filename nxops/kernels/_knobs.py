"""The kernels' tuning knobs (block caps, the programs a launch wants, ...),
one mechanism for every backend.

Each backend declares its knobs once, in groups, with their defaults
(:func:`declare`); a kernel reads one when it is traced (:func:`value`); a
block of code overrides some of them (:func:`tuned`), in the current thread
or task only. Tests shrink blocks so that small arrays span many of them.
Knobs are read at trace time: a function jit already traced keeps the
values it was traced with.
"""
from __future__ import annotations

import contextlib
import contextvars
import types
from typing import Iterator, Mapping

_DEFAULTS: dict[str, dict[str, int]] = {}
_OVERRIDES: contextvars.ContextVar[Mapping[str, dict[str, int]]] = contextvars.ContextVar(
    "nxops_kernel_knobs", default=types.MappingProxyType({}))


def declare(group: str, **defaults: int) -> None:
    """Declares ``group``'s knobs and their defaults (once, at import)."""
    if group in _DEFAULTS:
        raise ValueError(f"kernel knobs {group!r} are declared twice")
    _DEFAULTS[group] = dict(defaults)


def value(group: str, name: str) -> int:
    """The knob ``name`` of ``group`` in force."""
    overrides = _OVERRIDES.get().get(group, {})
    return overrides[name] if name in overrides else _DEFAULTS[group][name]


@contextlib.contextmanager
def tuned(group: str, **values: int) -> Iterator[None]:
    """Overrides knobs of ``group`` within the block."""
    if group not in _DEFAULTS:
        raise ValueError(f"unknown kernel knobs {group!r}; groups: {sorted(_DEFAULTS)}")
    unknown = sorted(set(values) - set(_DEFAULTS[group]))
    if unknown:
        raise ValueError(f"kernel knobs {group!r} have no {unknown}; "
                         f"knobs: {sorted(_DEFAULTS[group])}")
    current = _OVERRIDES.get()
    token = _OVERRIDES.set({**current, group: {**current.get(group, {}), **values}})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)
