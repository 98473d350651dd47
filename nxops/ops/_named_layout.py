"""The vmap part of the named collectives and of tile: layout changes along a
vmapped name (``nx_named_layout``).

JAX's all_gather/psum_scatter batching rules are fragile inside shard_map
bodies (they insert pvary for the vmap name); along a vmapped name these ops
are reshapes, which this primitive's batching rule does directly.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from nxops._errors import NxopsError
from nxops.ops import _axis_env

named_layout_p = Primitive("nx_named_layout")
# Parameters: kind (gather, scatter, tile, place, gather_whole), name, dim, size (the name's),
# chunk: the per-position size along dim (gather's input, scatter's result).
# Carried, not recomputed as the gathered size // size, which a size-0 name
# cannot give back (the transpose of a gather over it).
# gather_whole is a gather whose consumer hands back one cotangent already
# summed over the positions (a ring's backward): its transpose gives each
# position its tile of it, where a gather's sums the positions' cotangents.
GATHERS = ("gather", "gather_whole")


def _layout_shape(shape, kind, dim, size, chunk):
    shape = list(shape)
    shape[dim] = chunk * size if kind in (*GATHERS, "place") else chunk
    return tuple(shape)


def _layout_abstract_eval(x, *, kind, name, dim, size, chunk):
    del name
    return x.update(shape=_layout_shape(x.shape, kind, dim, size, chunk))


def _split_dim(x, dim, size, chunk):
    """[..., size * chunk, ...] -> [..., size, chunk, ...]"""
    return x.reshape(x.shape[:dim] + (size, chunk) + x.shape[dim + 1:])


def _layout_batcher(axis_data, vals_in, dims_in, *, kind, name, dim, size, chunk):
    (x,), (d,) = vals_in, dims_in
    params = dict(kind=kind, name=name, size=size, chunk=chunk)
    if axis_data.name != name:
        if d is None:
            return named_layout_p.bind(x, dim=dim, **params), None
        x = jnp.moveaxis(x, d, 0)
        return named_layout_p.bind(x, dim=dim + 1, **params), 0
    if kind in GATHERS:  # varying along the name -> replicated, concatenated along dim
        if d is None:   # size copies (a concatenate of none fails where size is 0)
            x = jnp.broadcast_to(jnp.expand_dims(x, dim), x.shape[:dim] + (size,) + x.shape[dim:])
        else:
            x = jnp.moveaxis(x, d, dim)
        # explicit sizes: -1 is ambiguous for empty arrays
        return x.reshape(x.shape[:dim] + (size * chunk,) + x.shape[dim + 2:]), None
    if kind == "scatter":  # summed over the name, then tile number i to position i
        x = x * size if d is None else jnp.sum(x, axis=d)
        return _split_dim(x, dim, size, chunk), dim
    if kind == "place":
        return _place_batched(x, d, dim, size), 0
    # tile: position i takes tile i of its own value
    if d is None:
        return _split_dim(x, dim, size, chunk), dim
    x = jnp.moveaxis(x, d, 0)
    tiles = _split_dim(x, dim + 1, size, chunk)  # [size(batch), ..., size(tiles), chunk, ...]
    return jnp.moveaxis(jnp.diagonal(tiles, axis1=0, axis2=dim + 1), -1, 0), 0


def _place_batched(x, d, dim, size):
    """Position i's value in tile i of zeros along ``dim``, for every position
    (batch dim 0 of the result): the per-position transpose of tile."""
    x = jnp.expand_dims(x, 0) if d is None else jnp.moveaxis(x, d, 0)
    x = jnp.expand_dims(x, dim + 1)                  # [batch, ..., 1, chunk, ...]
    mask_shape = [1] * x.ndim
    mask_shape[0] = mask_shape[dim + 1] = size
    mask = jnp.eye(size, dtype=bool).reshape(mask_shape)
    placed = jnp.where(mask, x, jnp.zeros((), x.dtype))   # [size, ..., size, chunk, ...]
    shape = placed.shape
    return placed.reshape(shape[:dim + 1] + (shape[dim + 1] * shape[dim + 2],) + shape[dim + 3:])


def _layout_lowering(ctx, x, *, kind, name, dim, size, chunk):
    raise NxopsError(f"nxops {kind} over {name!r} reached lowering: the name must be bound by "
                     f"an enclosing vmap or xmap.")


named_layout_p.def_abstract_eval(_layout_abstract_eval)
batching.fancy_primitive_batchers[named_layout_p] = _layout_batcher
mlir.register_lowering(named_layout_p, _layout_lowering)


def _layout_transpose(ct, x, *, kind, name, dim, size, chunk):
    # gather <-> scatter are each other's transposes (psum semantics, as lax);
    # tile <-> place: a replicated input's in-body gradient stays per position
    # (docs/xmap.md), so tile's cotangent goes to this position's tile only,
    # as the mesh and loop parts (dynamic_update_slice into zeros) do.
    other = {"gather": "scatter", "scatter": "gather", "tile": "place", "place": "tile",
             "gather_whole": "tile"}[kind]
    if type(ct) is ad.Zero:
        return (ad.Zero(x.aval),)
    return (named_layout_p.bind(ct, kind=other, name=name, dim=dim, size=size, chunk=chunk),)


ad.deflinear2(named_layout_p, _layout_transpose)


def along_vmap_names(x, kind, vmap_names, dim):
    """Gathers go minor name first, scatters and tiles major name first, so
    that a position along the logical axis is major-to-minor over the names."""
    order = tuple(reversed(vmap_names)) if kind in GATHERS else vmap_names
    for name in order:
        size = _axis_env.physical_axis_size(name)
        # (scatters and tiles refuse a size-0 name before they get here)
        chunk = x.shape[dim] if kind in (*GATHERS, "place") else x.shape[dim] // size
        x = named_layout_p.bind(x, kind=kind, name=name, dim=dim, size=size, chunk=chunk)
    return x
