"""Serial-loop resources: ``SerialLoop(n)`` and ``with serial_loop(name, n):``.

A named axis mapped to a loop of length ``n`` is computed in ``n`` sequential
chunks (``lax.scan``), so the temporaries of one chunk are live at a time.
Under differentiation a scan would keep every step's residuals for the
backward pass, as much memory as no loop at all; so by default each step is
rematerialized (``jax.checkpoint``): the backward pass recomputes one step's
forward at a time (one extra forward per step) and keeps only the step inputs.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from typing import Any, Callable, Iterator

from nxops._errors import NxopsError

_anonymous_ids = itertools.count()


def check_remat(remat: Any, where: str) -> None:
    """``remat`` is True (rematerialize each step), False (keep every step's
    residuals) or a ``jax.checkpoint`` policy (a callable, e.g.
    ``jax.checkpoint_policies.dots_saveable``: what a step may keep)."""
    if not (isinstance(remat, bool) or callable(remat)):
        raise NxopsError(
            f"{where}: remat={remat!r}; pass True (recompute each loop step in the backward "
            f"pass, the default), False (keep every step's residuals) or a jax.checkpoint "
            f"policy such as jax.checkpoint_policies.dots_saveable.")


@dataclasses.dataclass(frozen=True)
class SerialLoop:
    """An anonymous loop resource of ``length`` steps, for ``axis_resources``.

    Each ``SerialLoop(n)`` object is a distinct loop: ``{'a': SerialLoop(4)}``.
    ``remat`` (differentiation only): True (default) recomputes each step's
    forward in the backward pass, so only one step's residuals are live; False
    keeps all of them (faster, no memory saved); a ``jax.checkpoint`` policy
    keeps what it names (e.g. ``jax.checkpoint_policies.dots_saveable``).

    Examples:
        >>> f = nx.xmap(lambda v: v * 2, ['i', ...], ['i', ...],
        ...             axis_resources={'i': nx.SerialLoop(2)})   # 'i' in 2 steps of 2
        >>> print(f(jnp.arange(4.)))
        [0. 2. 4. 6.]
    """

    length: int
    uid: int = dataclasses.field(default_factory=lambda: next(_anonymous_ids),
                                 compare=True, repr=False)
    remat: Any = dataclasses.field(default=True, kw_only=True)

    def __post_init__(self):
        if not isinstance(self.length, int) or isinstance(self.length, bool) or self.length < 1:
            raise NxopsError(f"SerialLoop({self.length!r}): the loop length must be a "
                             f"positive int, e.g. SerialLoop(4).")
        check_remat(self.remat, f"SerialLoop({self.length})")

    def __repr__(self) -> str:   # the default remat unshown, as before it existed
        remat = "" if self.remat is True else f", remat={self.remat!r}"
        return f"SerialLoop(length={self.length}{remat})"

    @property
    def name(self) -> str:
        return f"SerialLoop#{self.uid}({self.length})"


@dataclasses.dataclass(frozen=True)
class NamedLoop:
    """A loop resource bound by ``serial_loop(name, length)``."""

    name: str
    length: int
    remat: Any = True


_LOOPS: contextvars.ContextVar[tuple[NamedLoop, ...]] = contextvars.ContextVar(
    "nxops_serial_loops", default=())


@contextlib.contextmanager
def serial_loop(name: str, length: int, *, remat: Any = True) -> Iterator[None]:
    """Makes the loop resource ``name`` of ``length`` steps available to
    ``nx.xmap(..., axis_resources={axis: name})`` calls inside the block.

    Loops nest; an inner loop may not reuse the name of an enclosing one.
    ``remat``: as for ``SerialLoop``.

    Examples:
        >>> f = nx.xmap(lambda v: v * 2, ['i', ...], ['i', ...], axis_resources={'i': 'steps'})
        >>> with nx.serial_loop('steps', 2):
        ...     print(f(jnp.arange(4.)))
        [0. 2. 4. 6.]
    """
    if not isinstance(name, str):
        raise NxopsError(f"serial_loop({name!r}, {length!r}): the loop name must be a str.")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise NxopsError(f"serial_loop({name!r}, {length!r}): the loop length must be a "
                         f"positive int.")
    if any(loop.name == name for loop in _LOOPS.get()):
        raise NxopsError(f"serial_loop({name!r}, {length}): a loop named {name!r} is "
                         f"already in scope; use another name.")
    check_remat(remat, f"serial_loop({name!r}, {length})")
    token = _LOOPS.set(_LOOPS.get() + (NamedLoop(name, length, remat),))
    try:
        yield
    finally:
        _LOOPS.reset(token)


# The named loops bound by enclosing ``serial_loop`` blocks. A bound C method,
# not a function: every xmap call reads it.
loops_in_scope: Callable[[], tuple[NamedLoop, ...]] = _LOOPS.get
