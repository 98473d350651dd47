"""``nx.var`` and ``nx.std``: ``jnp.var``/``jnp.std`` over positional and
named axes, on every placement.

Two passes, as ``jnp.var``: the mean, then the mean square of the deviations
from it (one pass, ``E[x^2] - E[x]^2``, loses every digit when the mean is
large). Each pass is one named sum (``nx.sum``'s kernel, then one psum over
the mesh names), so the result and its gradient are the same whether a name is
vmapped or on mesh axes.
"""
from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax

from nxops._errors import NxopsError
from nxops._typing import ArrayLike, Axis
from nxops.ops._axis_env import physical_axis_size
from nxops.ops._reduce import _expand, _reduce_resolved, _resolve_axes

_UPCAST = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _computation_dtype(dtype) -> tuple:
    """(the dtype to compute in, the result's dtype), as jnp.var: integers
    and bool give the default float; bf16/f16 are computed in f32."""
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.dtype(jnp.result_type(float))
    compute = jnp.dtype(jnp.float32) if dtype in _UPCAST else dtype
    return compute, dtype


def _check_ddof(ddof, op: str):
    if isinstance(ddof, bool) or not isinstance(ddof, (int, float)):
        raise NxopsError(f"nx.{op}: ddof={ddof!r} must be a number (the count correction: "
                         f"0 for the population variance, 1 for the sample variance).")


def var(x: ArrayLike, axis: Axis, *, ddof: int | float = 0) -> jax.Array:
    """Variance of ``x`` over ``axis`` (ints and/or names), as ``jnp.var``:
    ``sum(|x - mean|^2) / (N - ddof)`` with ``N`` the number of elements
    reduced; complex inputs give real variances, integers give floats.

    Examples:
        >>> f = nx.xmap(lambda row: nx.var(row, 'row'), [['row', ...]], [...])
        >>> print(f(jnp.arange(6.).reshape(2, 3)))
        [2.25 2.25 2.25]
    """
    return _variance(x, axis, ddof, "var")


def std(x: ArrayLike, axis: Axis, *, ddof: int | float = 0) -> jax.Array:
    """Standard deviation of ``x`` over ``axis`` (ints and/or names), as
    ``jnp.std``: ``sqrt(nx.var(x, axis, ddof=ddof))``.

    Examples:
        >>> f = nx.xmap(lambda row: nx.std(row, 'row', ddof=1), [['row', ...]], [...])
        >>> print(np.asarray(f(jnp.arange(6.).reshape(2, 3))).round(4))    # sqrt(4.5)
        [2.1213 2.1213 2.1213]
    """
    return lax.sqrt(_variance(x, axis, ddof, "std"))


def _variance(x: ArrayLike, axis: Axis, ddof, op: str) -> jax.Array:
    _check_ddof(ddof, op)
    x = jnp.asarray(x)
    compute, dtype = _computation_dtype(x.dtype)
    x = x.astype(compute)
    positional, vmap_names, mesh_names = _resolve_axes(x, axis, op)
    # Multiplied one by one: sizes may be symbolic (jax.export).
    count = functools.reduce(operator.mul, [x.shape[a] for a in positional] +
                             [physical_axis_size(n) for n in vmap_names + mesh_names], 1)
    mean = _reduce_resolved(x, positional, vmap_names, mesh_names, "sum") / jnp.asarray(count, compute)
    centered = x - _expand(mean, positional)
    squares = (centered * jnp.conj(centered)).real if jnp.iscomplexobj(centered) \
        else centered * centered
    total = _reduce_resolved(squares, positional, vmap_names, mesh_names, "sum")
    normalizer = jnp.asarray(count, total.dtype) - jnp.asarray(ddof, total.dtype)
    # No degrees of freedom left (ddof >= N): nan, as jnp.var.
    result = jnp.where(normalizer > 0, total / normalizer, jnp.asarray(jnp.nan, total.dtype))
    return result.astype(jnp.finfo(dtype).dtype)   # complex -> its real dtype
