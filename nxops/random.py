"""Per-position random numbers inside named bodies (``nx.random``).

The old xmap's samplers drew different bits along named axes, the same under
any resources. Here a key is folded with the *global* position along named
axes (``nx.axis_index``), so a position's numbers never depend on
``axis_resources`` (vmap, mesh, serial loop, mixed, several processes) and
differ between positions::

    def body(x):                      # inside nx.xmap(..., in_axes=['batch', ...])
        noise = nx.random.normal(key, x.shape)             # varies along every bound name
        drop = nx.random.bernoulli(key, 0.9, x.shape, names=('batch',))   # along 'batch' only
        return x * drop + noise

Migrating from ``NamedShape`` samplers (``jax.random.normal(key, NamedShape(3, batch=8))``):
call ``nx.random.normal(key, (3,), names=('batch',))`` inside the body instead.
The key may be closed over or passed in as a replicated argument.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nxops._errors import NxopsError
from nxops._traceback import api_boundary
from nxops.ops import axis_index
from nxops.ops._axis_env import as_name_tuple, current_logical_axes
from nxops._typing import ArrayLike, DTypeLike

__all__ = ["bernoulli", "bits", "fold_in_names", "key_here", "normal", "uniform"]


@api_boundary
def fold_in_names(key: jax.Array, *names: str) -> jax.Array:
    """``key`` folded with this position along each of ``names``, in order.

    Examples:
        >>> key = jax.random.key(0)
        >>> f = nx.xmap(lambda k: jax.random.key_data(nx.random.fold_in_names(k, 'i')), [[...]],
        ...             ['i', ...], axis_sizes={'i': 2})
        >>> data = f(key)
        >>> bool((data[1] == jax.random.key_data(jax.random.fold_in(key, 1))).all())
        True
    """
    for name in names:
        key = jax.random.fold_in(key, axis_index(name))
    return key


@api_boundary
def key_here(key: jax.Array, names: str | Sequence[str] | None = None) -> jax.Array:
    """``key`` for this position along ``names`` (default: every logical name
    bound by the enclosing ``nx.xmap`` bodies, in sorted order).

    Examples:
        >>> key = jax.random.key(0)
        >>> f = nx.xmap(lambda k: jax.random.key_data(nx.random.key_here(k)), [[...]],
        ...             ['i', 'j', ...], axis_sizes={'i': 2, 'j': 2})
        >>> data = f(key)                                # folded with i's position, then j's
        >>> here = jax.random.fold_in(jax.random.fold_in(key, 1), 0)
        >>> bool((data[1, 0] == jax.random.key_data(here)).all())
        True
    """
    if names is None:
        names = sorted(current_logical_axes())
    return fold_in_names(key, *as_name_tuple(names))


@api_boundary
def uniform(key: jax.Array, shape: Sequence[int] = (), dtype: DTypeLike | None = None,
            minval: ArrayLike = 0.0, maxval: ArrayLike = 1.0, *,
            names: str | Sequence[str] | None = None) -> jax.Array:
    """``jax.random.uniform`` with different numbers at each named position
    (``dtype`` defaults as there: float64 under ``jax_enable_x64``).

    Examples:
        >>> key = jax.random.key(0)
        >>> f = nx.xmap(lambda k: nx.random.uniform(k, (2,), names='i'), [[...]], ['i', ...],
        ...             axis_sizes={'i': 3})
        >>> draws = f(key)                               # position p draws with fold_in(key, p)
        >>> print(draws.shape, bool((draws[2] == jax.random.uniform(jax.random.fold_in(key, 2), (2,))).all()))
        (3, 2) True
    """
    _check_sampler_args(key, shape, "uniform")
    return jax.random.uniform(key_here(key, names), shape, dtype, minval, maxval)


@api_boundary
def normal(key: jax.Array, shape: Sequence[int] = (), dtype: DTypeLike | None = None, *,
           names: str | Sequence[str] | None = None) -> jax.Array:
    """``jax.random.normal`` with different numbers at each named position
    (``dtype`` defaults as there: float64 under ``jax_enable_x64``).

    Examples:
        >>> key = jax.random.key(0)
        >>> f = nx.xmap(lambda k: nx.random.normal(k, (2,), names='i'), [[...]], ['i', ...],
        ...             axis_sizes={'i': 3})
        >>> draws = f(key)                               # position p draws with fold_in(key, p)
        >>> print(draws.shape, bool((draws[2] == jax.random.normal(jax.random.fold_in(key, 2), (2,))).all()))
        (3, 2) True
    """
    _check_sampler_args(key, shape, "normal")
    return jax.random.normal(key_here(key, names), shape, dtype)


@api_boundary
def bits(key: jax.Array, shape: Sequence[int] = (), dtype: DTypeLike | None = None, *,
         names: str | Sequence[str] | None = None) -> jax.Array:
    """``jax.random.bits`` with different bits at each named position.

    Examples:
        >>> key = jax.random.key(0)
        >>> f = nx.xmap(lambda k: nx.random.bits(k, (2,), names='i'), [[...]], ['i', ...],
        ...             axis_sizes={'i': 3})
        >>> draws = f(key)                               # position p draws with fold_in(key, p)
        >>> print(draws.shape, bool((draws[2] == jax.random.bits(jax.random.fold_in(key, 2), (2,))).all()))
        (3, 2) True
    """
    _check_sampler_args(key, shape, "bits")
    return jax.random.bits(key_here(key, names), shape, dtype)


@api_boundary
def bernoulli(key: jax.Array, p: ArrayLike = 0.5, shape: Sequence[int] | None = None, *,
              names: str | Sequence[str] | None = None) -> jax.Array:
    """``jax.random.bernoulli`` with different draws at each named position.

    Examples:
        >>> key = jax.random.key(0)
        >>> f = nx.xmap(lambda k: nx.random.bernoulli(k, 0.5, (2,), names='i'), [[...]], ['i', ...],
        ...             axis_sizes={'i': 3})
        >>> draws = f(key)                               # position p draws with fold_in(key, p)
        >>> third = jax.random.bernoulli(jax.random.fold_in(key, 2), 0.5, (2,))
        >>> print(draws.shape, bool((draws[2] == third).all()))
        (3, 2) True
    """
    _check_sampler_args(key, () if shape is None else shape, "bernoulli")
    return jax.random.bernoulli(key_here(key, names), p, shape)


def _check_sampler_args(key, shape, op: str) -> None:
    """JAX's own errors here are a bare TypeError (a float key) and an MLIR
    verifier error (a negative dim): say what is wrong, and the fix."""
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    if not typed and (dtype != jnp.uint32 or jnp.ndim(key) < 1):
        what = (f"an array of dtype {dtype} and shape {jnp.shape(key)}" if dtype is not None
                else f"{key!r}")
        raise NxopsError(
            f"nx.random.{op}: the key is {what}, not a PRNG key. Make one with "
            f"jax.random.key(seed) (or the legacy uint32 jax.random.PRNGKey(seed)) and pass "
            f"it unchanged: a key cast to another dtype or computed from data is not a key.")
    try:
        dims = tuple(shape)
    except TypeError:
        raise NxopsError(f"nx.random.{op}: shape={shape!r} must be a tuple of sizes, "
                         f"e.g. (3,) or x.shape.") from None
    negative = [d for d in dims if isinstance(d, (int, np.integer)) and d < 0]
    if negative:
        raise NxopsError(f"nx.random.{op}: shape={shape!r} has the negative size {negative[0]}; "
                         f"sizes are >= 0 (there is no -1 to infer): give the full shape, "
                         f"e.g. x.shape.")
