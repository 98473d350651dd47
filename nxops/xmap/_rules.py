"""Logical axis rules: ``axis_resources`` as a flax-style rule table.

A rule table is a sequence ``[(logical_name, mesh_axis | (mesh_axes...) | None), ...]``
(``flax.linen.get_logical_axis_rules()`` returns one). It is resolved with the
priority semantics of ``flax.linen.spmd.logical_to_mesh_axes``: rules are tried
in order; a rule assigns its mesh axes to its name if the name is still
unassigned and none of those mesh axes is used yet; ``None`` assigns "no
resources"; a name that no rule assigns runs without resources.

flax resolves a table per array. An xmap resolves it once over *all* its
names, in order of first appearance, as if they were the dims of one value:
a mesh axis then carries at most one name of the program, so names can never
meet on a shared resource inside the body.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Sequence

from nxops._errors import NxopsError
from nxops._typing import AxisRules

Rules = tuple[tuple[str, Any], ...]

_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("nxops_axis_rules",
                                                                     default=None)


def check_rules(rules: Any) -> Rules:
    """Validates a rule table; returns it as a hashable tuple of pairs."""
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise NxopsError(f"axis rules must be a sequence of (logical_name, mesh_axes) pairs, "
                         f"e.g. [('batch', 'data'), ('hidden', ('x', 'y')), ('heads', None)]; "
                         f"got {rules!r}.")
    checked = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise NxopsError(f"axis rule {rule!r} is not a (logical_name, mesh_axes) pair, "
                             f"e.g. ('batch', 'data').")
        name, axes = rule
        if axes is not None:
            axes = (axes,) if isinstance(axes, str) else axes
            if not (isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes)):
                raise NxopsError(f"axis rule {rule!r}: the resources must be a mesh axis name, "
                                 f"a tuple of them, or None.")
            axes = tuple(axes)
        checked.append((name, axes))
    return tuple(checked)


@contextlib.contextmanager
def axis_rules(rules: AxisRules) -> Iterator[None]:
    """Uses ``rules`` for every ``nx.xmap`` called in the block without
    ``axis_resources`` (like flax's ``nn.logical_axis_rules``).

    Examples:
        >>> f = nx.xmap(lambda v: v + 1, ['batch', ...], ['batch', ...])   # no axis_resources
        >>> with jax.set_mesh(jax.make_mesh((1,), ('data',))), nx.axis_rules([('batch', 'data')]):
        ...     print(f(jnp.arange(2.)))                 # 'batch' runs over mesh axis 'data'
        [1. 2.]
    """
    token = _RULES.set(check_rules(rules))
    try:
        yield
    finally:
        _RULES.reset(token)


# The rules of the enclosing nx.axis_rules block. A bound C method, not a
# function: every xmap call reads it.
current_axis_rules: Callable[[], Rules | None] = _RULES.get


def resources_from_rules(names: Sequence[str], rules: Rules) -> dict[str, tuple[str, ...]]:
    """``{name: mesh_axes}`` for an xmap's ``names`` (flax's priority semantics)."""
    assigned: dict[str, tuple[str, ...] | None] = {}
    used: set[str] = set()
    for name, axes in rules:
        if name not in names or name in assigned:
            continue
        if axes is not None and used.intersection(axes):
            continue   # a mesh axis carries at most one name
        assigned[name] = axes
        used.update(axes or ())
    return {name: axes for name, axes in assigned.items() if axes}
