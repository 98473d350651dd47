"""Reference tile: one position's slice of a replicated array (no communication)."""
from __future__ import annotations

import jax
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
