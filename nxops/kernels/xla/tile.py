"""Reference tile: one position's slice of a replicated array (no communication)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from nxops.kernels._registry import PLATFORMS, Kernel, register


def tile(x: jax.Array, index: jax.Array, *, dim: int, count: int, platform: str = "cpu") -> jax.Array:
    """Tile number ``index`` of ``count`` equal tiles of ``x`` along ``dim``."""
    del platform
    size = x.shape[dim] // count
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)


KERNEL = register(Kernel(
    op="tile", backend="xla", platforms=PLATFORMS, fn=tile,
    description="lax.dynamic_slice",
))


def clamp_index(index, count: int):
    """The tile ``dynamic_slice`` takes for ``index``: a negative start counts
    from the end (``index + count``), then the start is clamped into range
    (also inside kernels, on a loaded index)."""
    return jnp.clip(jnp.where(index < 0, index + count, index), 0, count - 1)


def effective_index(index, count: int) -> jax.Array:
    return clamp_index(jnp.asarray(index, jnp.int32), count)


def tile_vjp(shape, index, g: jax.Array, *, dim: int, count: int) -> jax.Array:
    """The cotangent of ``x`` (of ``shape``) in ``tile(x, index)``: ``g`` at
    the tile, zeros elsewhere (kernels reuse it as their VJP)."""
    dim = dim % len(shape)
    start = effective_index(index, count) * (shape[dim] // count)
    return lax.dynamic_update_slice_in_dim(jnp.zeros(shape, g.dtype), g, start, axis=dim)


def tile_reasons(x, dim: int, count: int, what: str) -> list[str]:
    """Why a tile kernel (``what``: "the Pallas tile", ...) that copies 16- and
    32-bit elements cannot take ``x``: the checks every backend's kernel shares."""
    reasons = []
    if x.ndim == 0:
        reasons.append("a scalar has no dim to tile")
    elif x.shape[dim % x.ndim] % count:
        reasons.append(f"dim {dim} of size {x.shape[dim % x.ndim]} is not divisible into {count} tiles")
    dtype = jnp.dtype(x.dtype)
    if dtype.itemsize not in (2, 4) or dtype == jnp.bool_:
        reasons.append(f"dtype {dtype}: {what} copies 16- and 32-bit elements")
    return reasons
