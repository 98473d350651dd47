"""Named collectives and tiling: ``nx.all_gather``, ``nx.psum_scatter``,
``nx.all_to_all``, ``nx.ppermute``, ``nx.tile``, ``nx.untile``, and the axis
queries ``nx.axis_index``, ``nx.axis_size``, ``nx.one_hot``.

A logical name resolves to physical axes, major to minor: mesh axes first,
then the vmap tile (that is how ``nx.xmap`` lays them out). The vmap part is
local work (JAX's batching rules turn it into reshapes); the mesh part is one
collective over all the mesh axes of the name, whose implementation the
registry picks when the op is traced (from the mesh's platform).
"""
from __future__ import annotations

import math

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from nxops._jax import axis_index_at_vmap_level as _axis_index_at_vmap_level
from nxops._jax import mesh_lib as _mesh
from nxops._errors import NxopsError
from nxops import kernels as _kernels
from nxops.ops import _axis_env, _fusion
from nxops.kernels.xla import collectives as xla_collectives
from nxops.kernels.xla import tile as xla_tile
from nxops.ops._mesh_variance import mark_mesh_variance
from nxops.ops._primitive import kernel_primitive, selection_param
from nxops._typing import ArrayLike, AxisNames, DTypeLike, Tiling


def _physical(axis_name, op: str, *, allow_loop=False):
    _axis_env.refuse_nested(axis_name, op=f"nx.{op}")
    names = _axis_env.as_name_tuple(axis_name)
    for n in names:
        if isinstance(n, int):
            raise NxopsError(f"nx.{op}: axis_name {axis_name!r} must name axes, not positions.")
    physical = _axis_env.resolve(names, op=f"nx.{op}", allow_loop=allow_loop)
    vmap_names, mesh_names = _axis_env.split_vmap_and_mesh(physical, op=f"nx.{op}")
    if vmap_names and mesh_names and physical != mesh_names + vmap_names:
        # Mixed names in minor-mesh order: fall back to JAX's own collective.
        return physical, (), ()
    return physical, vmap_names, mesh_names


def _mesh_platform() -> str:
    """Lowering platform (cpu, cuda, rocm, tpu) of the devices the collective
    runs on: the one `explain` traces for, else the concrete mesh's devices',
    else the default devices'."""
    if _kernels.target_platform() is not None:
        return _kernels.target_platform()
    devices = getattr(_mesh.get_concrete_mesh(), "devices", None)
    first = devices.flat[0] if devices is not None and devices.size else None
    device = first if isinstance(first, jax.Device) else jax.devices()[0]
    if device.platform == "gpu":  # JAX names CUDA and ROCm devices "gpu"
        return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"
    return device.platform


def _auto_partitioned_axes_here() -> bool:
    """Whether XLA partitions some mesh axes of size > 1 automatically here
    (a shard_map over only some axes of an Auto mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return any(size > 1 and name not in mesh.manual_axes
               for name, size in zip(mesh.axis_names, mesh.axis_sizes))


# The reference implementation of each mesh collective (its result's shape).
_XLA_COLLECTIVES = {"all_gather": xla_collectives.all_gather,
                    "reduce_scatter": xla_collectives.reduce_scatter}


def _mesh_collective(op: str, x, mesh_names: tuple[str, ...], **params):
    """Runs collective ``op`` over ``mesh_names`` in the kernel the registry
    picks for this mesh's platform (one collective over all the names)."""
    platform = _mesh_platform()
    axis_name = _one_or_tuple(mesh_names)
    aval = jax.typeof(x)
    if x.size == 0:
        # No data to move; XLA's verifier rejects a zero-size all-gather dim.
        out = jax.eval_shape(lambda v: _XLA_COLLECTIVES[op](v, axis_name, **params), x)
        return jnp.zeros(out.shape, out.dtype)
    choice = _kernels.choose(op, platform, _kernels.current_selection(), (aval,),
                              _auto_partitioned_axes_here(), axis_name=axis_name, **params)
    _kernels.report(op, choice, (aval,))
    # Collectives over mesh axes take values that vary over them (check_vma).
    invariant = tuple(n for n in mesh_names if n not in aval.manual_axis_type.varying)
    if invariant:
        x = lax.pcast(x, invariant, to="varying")
    out = choice.kernel.fn(x, axis_name, platform=platform, **params)
    # What the kernel's equations may not say (xmap reads it: _mesh_variance.py).
    return mark_mesh_variance(out, mesh_names, varies=op != "all_gather")


# --- the vmap part: layout changes along a vmapped name ------------------------
# JAX's all_gather/psum_scatter batching rules are fragile inside shard_map
# bodies (they insert pvary for the vmap name); along a vmapped name these ops
# are reshapes, which this primitive's batching rule does directly.

named_layout_p = Primitive("nx_named_layout")
# Parameters: kind (gather, scatter, tile, place), name, dim, size (the name's),
# chunk: the per-position size along dim (gather's input, scatter's result).
# Carried, not recomputed as the gathered size // size, which a size-0 name
# cannot give back (the transpose of a gather over it).


def _layout_shape(shape, kind, dim, size, chunk):
    shape = list(shape)
    shape[dim] = chunk * size if kind in ("gather", "place") else chunk
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
    if kind == "gather":  # varying along the name -> replicated, concatenated along dim
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
    other = {"gather": "scatter", "scatter": "gather", "tile": "place", "place": "tile"}[kind]
    if type(ct) is ad.Zero:
        return (ad.Zero(x.aval),)
    return (named_layout_p.bind(ct, kind=other, name=name, dim=dim, size=size, chunk=chunk),)


ad.deflinear2(named_layout_p, _layout_transpose)


def _along_vmap_names(x, kind, vmap_names, dim):
    """Gathers go minor name first, scatters and tiles major name first, so
    that a position along the logical axis is major-to-minor over the names."""
    order = tuple(reversed(vmap_names)) if kind == "gather" else vmap_names
    for name in order:
        size = _axis_env.physical_axis_size(name)
        # (scatters and tiles refuse a size-0 name before they get here)
        chunk = x.shape[dim] if kind in ("gather", "place") else x.shape[dim] // size
        x = named_layout_p.bind(x, kind=kind, name=name, dim=dim, size=size, chunk=chunk)
    return x


def all_gather(x: ArrayLike, axis_name: AxisNames, *, axis: int = 0,
               tiled: bool = False) -> jax.Array:
    """Gathers ``x`` along named ``axis_name`` (``lax.all_gather``'s semantics).

    Over mesh axes it is one all-gather (never an all-reduce of a padded
    buffer); the result is replicated over them.
    """
    x = jnp.asarray(x)
    rank = x.ndim if tiled else x.ndim + 1
    if not -rank <= axis < rank:
        raise NxopsError(f"nx.all_gather: axis {axis} is out of range for a result of rank {rank} "
                         f"(x has shape {x.shape}, tiled={tiled}).")
    axis %= rank
    names = _axis_env.as_name_tuple(axis_name)
    physical, vmap_names, mesh_names = _physical(axis_name, "all_gather")
    if not vmap_names and not mesh_names and len(names) > 1:
        # Names whose physical axes interleave mesh and tile: gather the minor
        # name first, so positions come out major to minor.
        x = x if tiled else jnp.expand_dims(x, axis)
        for name in reversed(names):
            x = all_gather(x, name, axis=axis, tiled=True)
        return x
    if not vmap_names and not mesh_names:
        return lax.all_gather(x, physical, axis=axis, tiled=tiled)
    if not tiled:
        x = jnp.expand_dims(x, axis)
    if vmap_names:  # minor names first: a local gather (a reshape after batching)
        x = _along_vmap_names(x, "gather", vmap_names, axis)
    if mesh_names:
        x = _mesh_collective("all_gather", x, mesh_names, axis=axis, tiled=True)
    return x


def psum_scatter(x: ArrayLike, axis_name: AxisNames, *, scatter_dimension: int = 0,
                 tiled: bool = False) -> jax.Array:
    """Sums ``x`` over ``axis_name`` and scatters the result along
    ``scatter_dimension`` (``lax.psum_scatter``'s semantics): one
    reduce-scatter over mesh axes."""
    x = jnp.asarray(x)
    if not -x.ndim <= scatter_dimension < x.ndim:
        raise NxopsError(f"nx.psum_scatter: scatter_dimension {scatter_dimension} is out of range "
                         f"for x of shape {x.shape}.")
    dim = scatter_dimension % x.ndim
    physical, vmap_names, mesh_names = _physical(axis_name, "psum_scatter")
    total = 1
    for n in physical:
        total *= lax.axis_size(n)
    _check_not_size_0(axis_name, total, "psum_scatter")
    if x.shape[dim] % total:
        raise NxopsError(f"nx.psum_scatter: dim {dim} of x (shape {x.shape}) has size {x.shape[dim]}, "
                         f"not divisible by the size {total} of {axis_name!r}.")
    if not tiled and x.shape[dim] != total:
        raise NxopsError(f"nx.psum_scatter: with tiled=False dim {dim} of x (shape {x.shape}) must "
                         f"have the size {total} of {axis_name!r}; use tiled=True to scatter tiles.")
    if not vmap_names and not mesh_names and len(physical) > 1:
        # Names interleaving mesh axes and local tiles (JAX's psum_scatter
        # asserts there): the sum, then this position's tile of it.
        from nxops.ops._reduce import psum   # it imports this module
        chunk = x.shape[dim] // total
        mine = lax.dynamic_slice_in_dim(psum(x, axis_name), axis_index(axis_name) * chunk,
                                        chunk, dim)
        return mine if tiled else jnp.squeeze(mine, dim)
    if not vmap_names and not mesh_names:
        return lax.psum_scatter(x, physical, scatter_dimension=dim, tiled=tiled)
    # The sum's dtype is jnp.sum's (bool, int8 -> int32) on every placement: the
    # vmap part promotes, XLA's reduce-scatter over the mesh would not (or refuse bool).
    x = x.astype(jax.eval_shape(jnp.sum, jax.ShapeDtypeStruct((), x.dtype)).dtype)
    if mesh_names:  # major names first: one reduce-scatter over the mesh
        x = _mesh_collective("reduce_scatter", x, mesh_names, scatter_dimension=dim, tiled=True)
    if vmap_names:
        x = _along_vmap_names(x, "scatter", vmap_names, dim)
    return x if tiled else jnp.squeeze(x, dim)


def all_to_all(x: ArrayLike, axis_name: AxisNames, split_axis: int, concat_axis: int, *,
               tiled: bool = False) -> jax.Array:
    """``lax.all_to_all`` over named ``axis_name`` (one all-to-all over mesh
    axes). Negative axes count from the end, as in ``lax``."""
    x = jnp.asarray(x)
    size = axis_size(axis_name)
    split_axis, concat_axis = _check_all_to_all(x, axis_name, size, split_axis, concat_axis, tiled)
    physical, vmap_names, mesh_names = _physical(axis_name, "all_to_all")
    if vmap_names and mesh_names:   # a name on devices and a local tile: positionally
        return _via_gather(x, axis_name, lambda xs: lax.all_to_all(
            xs, _POSITIONS, split_axis, concat_axis, tiled=tiled))
    if vmap_names:
        # Both the value and (under a grad in the body) its cotangent must vary
        # along the names: JAX's vmap rule of all_to_all gives wrong shapes for
        # one that is the same at every position. The select's transpose makes
        # the cotangent vary (r10).
        x = _varying_along(x, vmap_names)
        out = lax.all_to_all(x, _one_or_tuple(physical), split_axis, concat_axis, tiled=tiled)
        return _varying_along(out, vmap_names)
    return lax.all_to_all(x, _one_or_tuple(physical), split_axis, concat_axis, tiled=tiled)


def _varying_along(x, vmap_names):
    """``x`` as a value that varies along the vmapped names (broadcast along
    them if it does not): JAX's vmap rule of all_to_all gives a wrong shape for
    a value that is the same at every position of the name. The select is a
    no-op once compiled."""
    position = lax.axis_index(_one_or_tuple(vmap_names))
    return lax.select(jnp.broadcast_to(position >= 0, x.shape), x, x)


def _check_all_to_all(x, axis_name, size, split_axis, concat_axis, tiled):
    for what, axis in (("split_axis", split_axis), ("concat_axis", concat_axis)):
        if not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
            raise NxopsError(f"nx.all_to_all: {what}={axis!r} is not a dim of x with shape "
                             f"{x.shape}; use an int in [{-x.ndim}, {x.ndim}).")
    split_axis, concat_axis = split_axis % x.ndim, concat_axis % x.ndim
    length = x.shape[split_axis]
    if tiled:
        _check_not_size_0(axis_name, size, "all_to_all")
    if (length % size if tiled else length != size):
        need = f"a multiple of {size}" if tiled else f"exactly {size}"
        raise NxopsError(f"nx.all_to_all: dim {split_axis} of x (shape {x.shape}) has size {length}; "
                         f"with tiled={tiled} it must be {need}, the size of {axis_name!r}.")
    return split_axis, concat_axis


_POSITIONS = _axis_env.InternalAxisName("nxops#positions")


def _via_gather(x, axis_name, positional_op):
    """A collective computed positionally: gather every position's ``x``, apply
    ``positional_op`` under a vmap over all positions, keep this position's
    result. Exact for any placement (used where XLA has no collective for the
    mix of mesh axes and a local tile), at the cost of an all-gather."""
    everyone = all_gather(x, axis_name, axis=0, tiled=False)
    results = jax.vmap(positional_op, axis_name=_POSITIONS)(everyone)
    return results[axis_index(axis_name)]


def _one_or_tuple(names: tuple):
    return names if len(names) > 1 else names[0]


def ppermute(x: ArrayLike, axis_name: AxisNames,
             perm: Sequence[tuple[int, int]]) -> jax.Array:
    """``lax.ppermute`` over named ``axis_name``: ``perm`` pairs (source, destination)
    positions along the (logical) axis; positions no pair sends to get zeros."""
    x = jnp.asarray(x)
    size = axis_size(axis_name)
    perm = _check_perm(perm, axis_name, size)
    physical, vmap_names, mesh_names = _physical(axis_name, "ppermute")
    if size == 0:   # no positions: none sends, none receives (and there is no table to index)
        return jnp.zeros_like(x)
    if mesh_names and not vmap_names:   # lax.ppermute on devices zero-fills partial perms
        names, perm = _perm_in_mesh_order(mesh_names, perm)
        return lax.ppermute(x, _one_or_tuple(names), perm)
    if len(perm) == size and len(physical) == 1:   # a full permutation of a vmapped name
        return lax.ppermute(x, physical[0], perm)
    # Otherwise positionally (JAX's ppermute asserts over several vmapped axes,
    # or over vmapped and mesh axes together).
    source = np.full(size, -1, np.int32)
    for src, dst in perm:
        source[dst] = src
    mine = jnp.asarray(source)[axis_index(axis_name)]
    everyone = all_gather(x, axis_name, axis=0, tiled=False)
    received = lax.dynamic_index_in_dim(everyone, jnp.maximum(mine, 0), 0, keepdims=False)
    return jnp.where(mine >= 0, received, jnp.zeros_like(received))


def _perm_in_mesh_order(mesh_names: tuple, perm: list) -> tuple[tuple, list]:
    """``(names, perm)`` with the mesh axes in the mesh's order and ``perm``'s
    positions renumbered for it. JAX's ppermute over shard_map axes numbers
    positions in mesh order whatever the order of the names given (t04:
    {'a': ('y', 'x')} on an ('x', 'y') mesh), while axis_index, all_gather and
    the logical position go major to minor in the order given."""
    mesh_axes = jax.sharding.get_abstract_mesh().axis_names
    ordered = tuple(sorted(mesh_names, key=mesh_axes.index))
    if ordered == tuple(mesh_names):
        return ordered, perm
    sizes = [_axis_env.physical_axis_size(n) for n in mesh_names]
    moved = [mesh_names.index(n) for n in ordered]

    def renumber(position: int) -> int:
        digits = np.unravel_index(position, sizes)
        return int(np.ravel_multi_index([digits[i] for i in moved], [sizes[i] for i in moved]))
    return ordered, [(renumber(src), renumber(dst)) for src, dst in perm]


def _check_perm(perm, axis_name, size) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(p) for p in perm]
        ok = all(len(p) == 2 and all(isinstance(i, (int, np.integer)) for i in p) for p in pairs)
    except TypeError:
        ok = False
    if not ok:
        raise NxopsError(f"nx.ppermute: perm={perm!r} must be a list of (source, destination) "
                         f"position pairs, e.g. [(0, 1), (1, 0)].")
    pairs = [(int(s), int(d)) for s, d in pairs]
    for src, dst in pairs:
        if not (0 <= src < size and 0 <= dst < size):
            raise NxopsError(f"nx.ppermute: pair {(src, dst)} of perm is out of range for "
                             f"{axis_name!r} of size {size}.")
    for which, idx in (("source", 0), ("destination", 1)):
        vals = [p[idx] for p in pairs]
        if len(set(vals)) != len(vals):
            raise NxopsError(f"nx.ppermute: perm {pairs} repeats a {which}; each position may "
                             f"send and receive at most once.")
    return pairs


def _position_parts(axis_name, op: str):
    _axis_env.refuse_nested(axis_name, op=op)
    names = _axis_env.as_name_tuple(axis_name)
    physical = _axis_env.resolve(names, op=op, allow_loop=True)
    _axis_env.split_vmap_and_mesh(physical, op=op)   # every physical name is bound here
    return _axis_env.position_parts(names, op=op)


def axis_index(axis_name: AxisNames) -> jax.Array:
    """This position along named ``axis_name``: global, whatever carries it
    (mesh axes, serial loops, the vmap tile; names in a tuple major to minor)."""
    parts = _position_parts(axis_name, "nx.axis_index")
    names = tuple(p.physical for p in parts)
    # Physical axes only: one lax.axis_index (over several names it asks the
    # axis environment for sizes, which a lazily traced custom rule lacks).
    if all(p.index is None for p in parts) and _axis_env.bound_here(names):
        return lax.axis_index(_one_or_tuple(names))
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
    """The size of named ``axis_name`` (a static int, loops included)."""
    return math.prod(p.size for p in _position_parts(axis_name, "nx.axis_size"))


def one_hot(x: ArrayLike, num_classes: int | None = None, *, axis: int | AxisNames = -1,
            dtype: DTypeLike = jnp.float32) -> jax.Array:
    """``jax.nn.one_hot``, where ``axis`` may be a name: the result then varies
    along that named axis (``x == axis_index(axis)``), as in the old xmap."""
    if isinstance(axis, int):
        if num_classes is None:
            raise NxopsError("nx.one_hot: num_classes is needed for a positional axis.")
        return jax.nn.one_hot(x, num_classes, dtype=dtype, axis=axis)
    size = axis_size(axis)
    if num_classes is not None and num_classes != size:
        raise NxopsError(f"nx.one_hot: num_classes={num_classes} differs from the size {size} of "
                         f"named axis {axis!r}; omit num_classes for a named axis.")
    return (jnp.asarray(x)[...] == axis_index(axis)).astype(dtype)


# --- tile / untile -----------------------------------------------------------

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
    summed = xla_collectives.psum(ct_x, extra, platform=_mesh_platform()) if extra else ct_x
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
    """The sum-then-tile rewrite (``ops/_fusion.py``): when ``x`` is
    ``psum(p, mesh_names)`` over exactly the mesh axes this tile splits over,
    this device's tile is ``p`` reduce-scattered along ``dim`` (half the bytes
    of the all-reduce). None when ``x`` is not such a sum."""
    partial = _fusion.summed_partial(x, mesh_names)
    if partial is None:
        return None
    return psum_scatter(partial, mesh_names, scatter_dimension=dim, tiled=True)


def _check_not_size_0(name, size: int, op: str) -> None:
    if size == 0:
        raise NxopsError(
            f"nx.{op} over {name!r}, a named axis of size 0: there are no positions to "
            f"split the value among (a tile of 1/0 of it is undefined). Skip the op when "
            f"the axis is empty, or give {name!r} a size of at least 1.")


def tile(x: ArrayLike, axes: Tiling) -> jax.Array:
    """This position's tile of ``x`` (replicated over the names) along each
    ``{name: dim}``: ``x`` split into ``axis_size(name)`` equal tiles along
    ``dim``. A key may be a tuple of names (major to minor), as in ``untile``.
    No communication: the inverse of ``untile``."""
    x = _check_tiling(x, axes, "tile")
    for key, dim in axes.items():
        dim %= x.ndim
        size = axis_size(key)
        _check_not_size_0(key, size, "tile")
        if x.shape[dim] % size:
            raise NxopsError(f"nx.tile: dim {dim} of x (shape {x.shape}) has size {x.shape[dim]}, "
                             f"not divisible by the size {size} of {key!r}.")
        _, vmap_names, mesh_names = _physical(key, "tile", allow_loop=True)
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
    physical, vmap_names, mesh_names = _physical(name, "tile", allow_loop=True)
    if mesh_names or not vmap_names:
        count = math.prod(map(_axis_env.physical_axis_size, mesh_names)) if vmap_names else size
        axes_here = mesh_names or physical
        index = lax.axis_index(_one_or_tuple(axes_here))
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
        x = _along_vmap_names(x, "tile", vmap_names, dim)
    return x


def untile(x: ArrayLike, axes: Tiling) -> jax.Array:
    """Gathers the tiles of ``x`` along each ``{name: dim}`` (one all-gather per
    name over its mesh axes; local work for vmapped names). The result is
    replicated over the names: the inverse of ``tile``."""
    x = _check_tiling(x, axes, "untile")
    for name, dim in axes.items():
        x = all_gather(x, name, axis=dim % x.ndim, tiled=True)
    return x
