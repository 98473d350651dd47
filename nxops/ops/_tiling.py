"""``nx.tile`` (this position's tile of a replicated value: no communication)
and its inverse ``nx.untile`` (one all-gather per name)."""
from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching

from nxops._errors import NxopsError
from nxops._typing import ArrayLike, Tiling
from nxops.kernels.xla import collectives as xla_collectives
from nxops.kernels.xla import tile as xla_tile
from nxops.ops import _axis_env, _sum_then_tile
from nxops.ops._collectives import all_gather, psum_scatter
from nxops.ops._named_layout import along_vmap_names
from nxops.ops._positions import axis_size
from nxops.ops._primitive import kernel_primitive, selection_param


tile_p = kernel_primitive("nx_tile", "tile", xla_tile.tile)


def _tile_batcher(vals_in, dims_in, *, dim, count, kernels):
    (x, index), (dx, di) = vals_in, dims_in
    if di is not None:
        out = jax.vmap(lambda a, i: xla_tile.tile(a, i, dim=dim, count=count),
                       in_axes=(dx, di))(x, index)
        return out, 0
    x = jnp.moveaxis(x, dx, 0)
    return tile_p.bind(x, index, dim=dim + 1, count=count, kernels=kernels), 0


batching.primitive_batchers[tile_p] = _tile_batcher


def _tile_jvp(primals, tangents, *, dim, count, kernels):
    (x, index), (t, _) = primals, tangents
    out = tile_p.bind(x, index, dim=dim, count=count, kernels=kernels)
    if type(t) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    return out, tile_p.bind(t, index, dim=dim, count=count, kernels=kernels)


def _tile_transpose(ct, x, index, *, dim, count, kernels):
    del kernels
    size = x.aval.shape[dim] // count
    zeros = jnp.zeros(x.aval.shape, x.aval.dtype)
    ct_x = lax.dynamic_update_slice_in_dim(zeros, ct, index * size, dim)
    # x was replicated over the mesh axes the index varies over: sum the tiles.
    extra = tuple(jax.typeof(ct_x).manual_axis_type.varying - x.aval.manual_axis_type.varying)
    summed = xla_collectives.psum(ct_x, extra, platform=_axis_env.mesh_platform()) if extra else ct_x
    return summed, None


ad.primitive_jvps[tile_p] = _tile_jvp
ad.primitive_transposes[tile_p] = _tile_transpose


def _check_tiling(x, axes: Mapping, op: str):
    if not isinstance(axes, Mapping) or not axes:
        raise NxopsError(f"nx.{op}: axes must be a non-empty dict {{name: dim}}, got {axes!r}.")
    x = jnp.asarray(x)
    for name, dim in axes.items():
        if not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
            raise NxopsError(f"nx.{op}: dim {dim!r} for {name!r} is not a dim of x with shape {x.shape}.")
    return x


def _tile_as_reduce_scatter(x, mesh_names: tuple, dim: int):
    """The sum-then-tile rewrite (``ops/_sum_then_tile.py``): when ``x`` is
    ``psum(p, mesh_names)`` over exactly the mesh axes this tile splits over,
    this device's tile is ``p`` reduce-scattered along ``dim`` (half the bytes
    of the all-reduce). None when ``x`` is not such a sum."""
    partial = _sum_then_tile.summed_partial(x, mesh_names)
    if partial is None:
        return None
    return psum_scatter(partial, mesh_names, scatter_dimension=dim, tiled=True)


def tile(x: ArrayLike, axes: Tiling) -> jax.Array:
    """This position's tile of ``x`` (replicated over the names) along each
    ``{name: dim}``: ``x`` split into ``axis_size(name)`` equal tiles along
    ``dim``. A key may be a tuple of names (major to minor), as in ``untile``.
    No communication: the inverse of ``untile``.

    Examples:
        >>> f = nx.xmap(lambda v: nx.tile(v, {'i': 0}), [[...]], ['i', ...], axis_sizes={'i': 2})
        >>> print(f(jnp.arange(4.)))                    # position p keeps tile p
        [[0. 1.]
         [2. 3.]]
    """
    x = _check_tiling(x, axes, "tile")
    for key, dim in axes.items():
        dim %= x.ndim
        size = axis_size(key)
        _axis_env.check_not_size_0(key, size, "tile")
        if x.shape[dim] % size:
            raise NxopsError(f"nx.tile: dim {dim} of x (shape {x.shape}) has size {x.shape[dim]}, "
                             f"not divisible by the size {size} of {key!r}.")
        _, vmap_names, mesh_names = _axis_env.physical_parts(key, "tile", allow_loop=True)
        fused = _tile_as_reduce_scatter(x, mesh_names, dim) if mesh_names else None
        if fused is not None:
            x = fused
            continue
        # Tile i*n_b + j over ('a', 'b') is sub-tile j of tile i: one name at a time.
        for name in _axis_env.as_name_tuple(key):
            x = _tile_one_name(x, name, dim)
    return x


def _tile_one_name(x, name, dim: int):
    """``nx.tile`` over one logical name: the mesh part first (this device's
    tile), then this loop step's, then the vmap tile's."""
    size = axis_size(name)
    physical, vmap_names, mesh_names = _axis_env.physical_parts(name, "tile", allow_loop=True)
    if mesh_names or not vmap_names:
        count = math.prod(map(_axis_env.physical_axis_size, mesh_names)) if vmap_names else size
        axes_here = mesh_names or physical
        index = lax.axis_index(_axis_env.one_or_tuple(axes_here))
        x = tile_p.bind(x, index.astype(jnp.int32), dim=dim, count=count,
                        kernels=selection_param())
    steps = [p for p in _axis_env.position_parts((name,), op="nx.tile") if p.index is not None]
    if steps:  # loops sit between the mesh axes and the tile
        step = jnp.int32(0)
        for p in steps:
            step = step * p.size + p.index.astype(jnp.int32)
        x = tile_p.bind(x, step, dim=dim, count=math.prod(p.size for p in steps),
                        kernels=selection_param())
    if vmap_names:
        x = along_vmap_names(x, "tile", vmap_names, dim)
    return x


def untile(x: ArrayLike, axes: Tiling) -> jax.Array:
    """Gathers the tiles of ``x`` along each ``{name: dim}`` (one all-gather per
    name over its mesh axes; local work for vmapped names). The result is
    replicated over the names: the inverse of ``tile``.

    Examples:
        >>> f = nx.xmap(lambda v: nx.untile(v, {'i': 0}), [['i', ...]], [...])
        >>> print(f(jnp.arange(4.).reshape(2, 2)))      # the tiles, gathered in order
        [0. 1. 2. 3.]
    """
    x = _check_tiling(x, axes, "untile")
    for name, dim in axes.items():
        x = all_gather(x, name, axis=dim % x.ndim, tiled=True)
    return x
