"""Reference collectives over mesh axes: XLA's all-gather and reduce-scatter
(NCCL on GPU, ICI on TPU). Called inside ``shard_map`` bodies."""
from __future__ import annotations

import jax
from jax import lax

from nxops._jax import vma_checked
from nxops.kernels._registry import PLATFORMS, Kernel, register

def all_gather(x: jax.Array, axis_name, *, axis: int, tiled: bool, platform: str = "cpu") -> jax.Array:
    """``lax.all_gather``: one all-gather over ``axis_name`` (a name or tuple).

    Under ``check_vma=True`` the result is typed invariant (replicated) over
    ``axis_name``, so it can leave a ``shard_map`` with ``out_specs=P()``;
    ``x`` must be varying over ``axis_name``. Under ``check_vma=False`` (as in
    nx.xmap) it stays varying: shard_map then divides a replicated result's
    cotangent by the mesh size, and only the varying all-gather's transpose (a
    reduce-scatter) sums it back; the invariant one's (a slice) would not.
    """
    del platform
    to = "invarying" if vma_checked() else "varying"
    return lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to=to)


def reduce_scatter(x: jax.Array, axis_name, *, scatter_dimension: int, tiled: bool,
                   platform: str = "cpu") -> jax.Array:
    """``lax.psum_scatter``: one reduce-scatter over ``axis_name``."""
    del platform
    return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=tiled)


ALL_GATHER = register(Kernel(
    op="all_gather", backend="xla", platforms=PLATFORMS, fn=all_gather,
    description="XLA all-gather",
))
REDUCE_SCATTER = register(Kernel(
    op="reduce_scatter", backend="xla", platforms=PLATFORMS, fn=reduce_scatter,
    description="XLA reduce-scatter",
))
