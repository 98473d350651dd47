"""Serial-loop resources: ``SerialLoop(n)`` and ``with serial_loop(name, n):``.

A named axis mapped to a loop of length ``n`` is computed in ``n`` sequential
chunks (``lax.scan``), so the temporaries of one chunk are live at a time.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from typing import Callable, Iterator

from nxops._errors import NxopsError

_anonymous_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class SerialLoop:
    """An anonymous loop resource of ``length`` steps, for ``axis_resources``.

    Each ``SerialLoop(n)`` object is a distinct loop: ``{'a': SerialLoop(4)}``.
    """

    length: int
    uid: int = dataclasses.field(default_factory=lambda: next(_anonymous_ids),
                                 compare=True, repr=False)

    def __post_init__(self):
        if not isinstance(self.length, int) or isinstance(self.length, bool) or self.length < 1:
            raise NxopsError(f"SerialLoop({self.length!r}): the loop length must be a "
                             f"positive int, e.g. SerialLoop(4).")

    @property
    def name(self) -> str:
        return f"SerialLoop#{self.uid}({self.length})"


@dataclasses.dataclass(frozen=True)
class NamedLoop:
    """A loop resource bound by ``serial_loop(name, length)``."""

    name: str
    length: int


_LOOPS: contextvars.ContextVar[tuple[NamedLoop, ...]] = contextvars.ContextVar(
    "nxops_serial_loops", default=())


@contextlib.contextmanager
def serial_loop(name: str, length: int) -> Iterator[None]:
    """Makes the loop resource ``name`` of ``length`` steps available to
    ``nx.xmap(..., axis_resources={axis: name})`` calls inside the block.

    Loops nest; an inner loop may not reuse the name of an enclosing one.
    """
    if not isinstance(name, str):
        raise NxopsError(f"serial_loop({name!r}, {length!r}): the loop name must be a str.")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise NxopsError(f"serial_loop({name!r}, {length!r}): the loop length must be a "
                         f"positive int.")
    if any(loop.name == name for loop in _LOOPS.get()):
        raise NxopsError(f"serial_loop({name!r}, {length}): a loop named {name!r} is "
                         f"already in scope; use another name.")
    token = _LOOPS.set(_LOOPS.get() + (NamedLoop(name, length),))
    try:
        yield
    finally:
        _LOOPS.reset(token)


# The named loops bound by enclosing ``serial_loop`` blocks. A bound C method,
# not a function: every xmap call reads it.
loops_in_scope: Callable[[], tuple[NamedLoop, ...]] = _LOOPS.get
