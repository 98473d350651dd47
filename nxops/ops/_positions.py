"""Where this position is along named axes: ``nx.axis_index``,
``nx.axis_size``, ``nx.one_hot``."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from nxops._errors import NxopsError
from nxops._jax import axis_index_at_vmap_level as _axis_index_at_vmap_level
from nxops._typing import ArrayLike, AxisNames, DTypeLike
from nxops.ops import _axis_env


def _position_parts(axis_name, op: str):
    _axis_env.refuse_nested(axis_name, op=op)
    names = _axis_env.as_name_tuple(axis_name)
    physical = _axis_env.resolve(names, op=op, allow_loop=True)
    _axis_env.split_vmap_and_mesh(physical, op=op)   # every physical name is bound here
    return _axis_env.position_parts(names, op=op)


def axis_index(axis_name: AxisNames) -> jax.Array:
    """This position along named ``axis_name``: global, whatever carries it
    (mesh axes, serial loops, the vmap tile; names in a tuple major to minor).

    Examples:
        >>> f = nx.xmap(lambda v: v * nx.axis_index('i'), [['i']], ['i'])
        >>> print(f(jnp.ones(4)))
        [0. 1. 2. 3.]
    """
    parts = _position_parts(axis_name, "nx.axis_index")
    names = tuple(p.physical for p in parts)
    # Physical axes only: one lax.axis_index (over several names it asks the
    # axis environment for sizes, which a lazily traced custom rule lacks).
    if all(p.index is None for p in parts) and _axis_env.bound_here(names):
        return lax.axis_index(_axis_env.one_or_tuple(names))
    index = jnp.int32(0)
    for part in parts:
        here = _physical_axis_index(part.physical) if part.index is None else part.index
        index = index * part.size + here.astype(jnp.int32)
    return index


def _physical_axis_index(name) -> jax.Array:
    if not _axis_env.bound_here((name,)):   # a lazily traced custom rule: see TileAxisName
        at_level = _axis_index_at_vmap_level(name)
        if at_level is not None:
            return at_level
    return lax.axis_index(name)


def axis_size(axis_name: AxisNames) -> int:
    """The size of named ``axis_name`` (a static int, loops included).

    Examples:
        >>> f = nx.xmap(lambda v: v * nx.axis_size('i'), [['i']], ['i'])
        >>> print(f(jnp.ones(4)))
        [4. 4. 4. 4.]
    """
    return math.prod(p.size for p in _position_parts(axis_name, "nx.axis_size"))


def one_hot(x: ArrayLike, num_classes: int | None = None, *, axis: int | AxisNames = -1,
            dtype: DTypeLike = jnp.float32) -> jax.Array:
    """``jax.nn.one_hot``, where ``axis`` may be a name: the result then varies
    along that named axis (``x == axis_index(axis)``), as in the old xmap.

    Examples:
        >>> f = nx.xmap(lambda label: nx.one_hot(label, 3, axis='cls'), [['b']], ['b', 'cls'],
        ...             axis_sizes={'cls': 3})
        >>> print(f(jnp.array([2, 0])))
        [[0. 0. 1.]
         [1. 0. 0.]]
    """
    if isinstance(axis, int):
        if num_classes is None:
            raise NxopsError("nx.one_hot: num_classes is needed for a positional axis.")
        return jax.nn.one_hot(x, num_classes, dtype=dtype, axis=axis)
    size = axis_size(axis)
    if num_classes is not None and num_classes != size:
        raise NxopsError(f"nx.one_hot: num_classes={num_classes} differs from the size {size} of "
                         f"named axis {axis!r}; omit num_classes for a named axis.")
    return (jnp.asarray(x)[...] == axis_index(axis)).astype(dtype)
