"""Reference collectives over mesh axes: XLA's all-gather and reduce-scatter
(NCCL on GPU, ICI on TPU). Called inside ``shard_map`` bodies."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType

from nxops._jax import vma_checked
from nxops.kernels._registry import PLATFORMS, Kernel, register


# XLA:CPU aborts the process (CHECK "Invalid binary instruction opcode copy")
# compiling a bf16/f16 all-reduce or reduce-scatter over part of a mesh (or a
# size-1 mesh axis). On CPU every collective that sums -- psum, reduce-scatter,
# and all-gather, whose transpose is a reduce-scatter -- runs on f32 values.
CPU_UNSAFE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def summed_in_f32_on_cpu(collective):
    """``collective(x, ..., platform=)`` computed in f32 for 16-bit floats on
    CPU (the sums round once, at the end); other platforms and dtypes as is.
    The casts are linear, so the derivatives' collectives are f32 too."""
    @functools.wraps(collective)
    def run(x, *args, platform: str = "cpu", **params):
        if platform == "cpu" and jnp.dtype(x.dtype) in CPU_UNSAFE_DTYPES:
            out = collective(x.astype(jnp.float32), *args, platform=platform, **params)
            return out.astype(x.dtype)
        return collective(x, *args, platform=platform, **params)
    return run


@summed_in_f32_on_cpu
def psum(x: jax.Array, axis_name, *, platform: str = "cpu") -> jax.Array:
    """``lax.psum``: one all-reduce over ``axis_name``."""
    del platform
    return lax.psum(x, axis_name)


@summed_in_f32_on_cpu
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
    if vma_checked():
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to="invarying")
    if _explicit_axes_left_automatic():   # its transpose would be a psum_scatter (below)
        return _all_gather_by_all_to_all(x, axis_name, axis, tiled)
    return lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to="varying")


@summed_in_f32_on_cpu
def reduce_scatter(x: jax.Array, axis_name, *, scatter_dimension: int, tiled: bool,
                   platform: str = "cpu") -> jax.Array:
    """``lax.psum_scatter``: one reduce-scatter over ``axis_name``.

    Inside a ``shard_map`` that leaves an Explicit mesh axis automatic, JAX
    0.11+ cannot lower ``psum_scatter``, nor so the transpose of ``all_gather``
    (``_reduce_scatter_lowering`` fails: "Length of sharding.spec (1) must be
    equal to aval's ndim (0)", a JAX bug; plain shard_map reproduces it).
    There, on every JAX version alike, it is an all-to-all and a local sum,
    which moves the same bytes per device ((n-1)/n of ``x``).
    """
    del platform
    if _explicit_axes_left_automatic():
        return _reduce_scatter_by_all_to_all(x, axis_name, scatter_dimension, tiled)
    return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=tiled)


def _explicit_axes_left_automatic() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _positions_along(axis_name) -> int:
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    return math.prod(lax.axis_size(name) for name in names)


def _all_gather_by_all_to_all(x, axis_name, axis: int, tiled: bool) -> jax.Array:
    """All-gather as an all-to-all of ``n`` copies (the same bytes per device as
    a ring all-gather); its transpose is an all-to-all and a sum, not JAX's
    ``psum_scatter``."""
    n = _positions_along(axis_name)
    copies = jnp.broadcast_to(jnp.expand_dims(x, axis), x.shape[:axis] + (n,) + x.shape[axis:])
    gathered = lax.all_to_all(copies, axis_name, axis, axis)   # dim axis: position j's x
    if tiled:
        return gathered.reshape(x.shape[:axis] + (n * x.shape[axis],) + x.shape[axis + 1:])
    return gathered


def _reduce_scatter_by_all_to_all(x, axis_name, dim: int, tiled: bool) -> jax.Array:
    n = _positions_along(axis_name)
    if tiled:   # [.., n*k, ..] -> [.., n, k, ..]: chunk j goes to position j
        x = x.reshape(x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1:])
    received = lax.all_to_all(x, axis_name, dim, dim)   # dim j: position j's chunk for me
    return received.sum(dim).astype(x.dtype)


ALL_GATHER = register(Kernel(
    op="all_gather", backend="xla", platforms=PLATFORMS, fn=all_gather,
    description="XLA all-gather",
))
REDUCE_SCATTER = register(Kernel(
    op="reduce_scatter", backend="xla", platforms=PLATFORMS, fn=reduce_scatter,
    description="XLA reduce-scatter",
))
