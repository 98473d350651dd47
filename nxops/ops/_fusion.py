"""Sum-then-tile fusion: a sum over mesh axes whose result is then tiled over
the same mesh axes is one reduce-scatter, not an all-reduce and a slice (half
the bytes per device).

Named ops that finish with a psum over mesh axes remember, for the result
tracer, the partial value before the psum. ``nx.tile`` over exactly those axes
then reduce-scatters the partial value instead; the unused psum is dead code,
which jit removes.
"""
from __future__ import annotations

import weakref

_partials: dict[int, tuple[weakref.ref, object, tuple[str, ...]]] = {}


def remember_mesh_sum(result, partial, mesh_names: tuple[str, ...]):
    """Records that ``result`` is ``psum(partial, mesh_names)``; returns ``result``."""
    key = id(result)
    try:
        ref = weakref.ref(result, lambda _: _partials.pop(key, None))
    except TypeError:  # not weak-referenceable (a concrete constant): nothing to fuse
        return result
    _partials[key] = (ref, partial, tuple(mesh_names))
    return result


def partial_of(value, mesh_names: tuple[str, ...]):
    """The partial value whose psum over ``mesh_names`` is ``value``, or None."""
    entry = _partials.get(id(value))
    if entry is None or entry[0]() is not value or entry[2] != tuple(mesh_names):
        return None
    return entry[1]
