"""Named collectives: ``nx.all_gather``, ``nx.psum_scatter``,
``nx.all_to_all``, ``nx.ppermute``.

A logical name resolves to physical axes, major to minor: mesh axes first,
then the vmap tile (that is how ``nx.xmap`` lays them out). The vmap part is
local work (JAX's batching rules turn it into reshapes); the mesh part is one
collective over all the mesh axes of the name, whose implementation the
registry picks when the op is traced (from the mesh's platform).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nxops._errors import NxopsError
from nxops._jax import vma_checked, vmap_names_collective
from nxops.kernels import _choice, _reports, _selection
from nxops._typing import ArrayLike, AxisNames
from nxops.kernels.xla import collectives as xla_collectives
from nxops.ops import _axis_env
from nxops.ops._named_layout import along_vmap_names
from nxops.ops._positions import axis_index, axis_size
from nxops.ops._mesh_variance import mark_mesh_variance


def _auto_partitioned_axes_here() -> bool:
    """Whether XLA partitions some mesh axes of size > 1 automatically here
    (a shard_map over only some axes of an Auto mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return any(size > 1 and name not in mesh.manual_axes
               for name, size in zip(mesh.axis_names, mesh.axis_sizes))


# The reference implementation of each mesh collective (its result's shape).
_XLA_COLLECTIVES = {"all_gather": xla_collectives.all_gather,
                    "reduce_scatter": xla_collectives.reduce_scatter}


def mesh_collective(op: str, x, mesh_names: tuple[str, ...], **params):
    """Runs collective ``op`` over ``mesh_names`` in the kernel the registry
    picks for this mesh's platform (one collective over all the names)."""
    platform = _axis_env.mesh_platform()
    axis_name = _axis_env.one_or_tuple(mesh_names)
    aval = jax.typeof(x)
    if x.size == 0:
        # No data to move; XLA's verifier rejects a zero-size all-gather dim.
        out = jax.eval_shape(lambda v: _XLA_COLLECTIVES[op](v, axis_name, **params), x)
        return jnp.zeros(out.shape, out.dtype)
    choice = _choice.choose(op, platform, _selection.current_selection(), (aval,),
                              _auto_partitioned_axes_here(), axis_name=axis_name, **params)
    _reports.report(op, choice, (aval,))
    # Collectives over mesh axes take values that vary over them (check_vma).
    invariant = tuple(n for n in mesh_names if n not in aval.manual_axis_type.varying)
    if invariant:
        x = lax.pcast(x, invariant, to="varying")
    out = choice.kernel.fn(x, axis_name, platform=platform, **params)
    # What the kernel's equations may not say (xmap reads it: _mesh_variance.py).
    return mark_mesh_variance(out, mesh_names, varies=op != "all_gather")


def all_gather(x: ArrayLike, axis_name: AxisNames, *, axis: int = 0,
               tiled: bool = False) -> jax.Array:
    """Gathers ``x`` along named ``axis_name`` (``lax.all_gather``'s semantics).

    Over mesh axes it is one all-gather (never an all-reduce of a padded
    buffer); the result is replicated over them.

    Examples:
        >>> f = nx.xmap(lambda v: nx.all_gather(v, 'i'), [['i']], ['i', ...])
        >>> print(f(jnp.array([1., 2., 3.])))           # every position holds all three
        [[1. 2. 3.]
         [1. 2. 3.]
         [1. 2. 3.]]
    """
    x = jnp.asarray(x)
    rank = x.ndim if tiled else x.ndim + 1
    if not -rank <= axis < rank:
        raise NxopsError(f"nx.all_gather: axis {axis} is out of range for a result of rank {rank} "
                         f"(x has shape {x.shape}, tiled={tiled}).")
    axis %= rank
    names = _axis_env.as_name_tuple(axis_name)
    physical, vmap_names, mesh_names = _axis_env.physical_parts(axis_name, "all_gather")
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
        x = along_vmap_names(x, "gather", vmap_names, axis)
    if mesh_names:
        x = mesh_collective("all_gather", x, mesh_names, axis=axis, tiled=True)
    return x


def psum_scatter(x: ArrayLike, axis_name: AxisNames, *, scatter_dimension: int = 0,
                 tiled: bool = False) -> jax.Array:
    """Sums ``x`` over ``axis_name`` and scatters the result along
    ``scatter_dimension`` (``lax.psum_scatter``'s semantics): one
    reduce-scatter over mesh axes.

    Examples:
        >>> f = nx.xmap(lambda v: nx.psum_scatter(v, 'i', tiled=True), [['i', ...]], ['i', ...])
        >>> print(f(jnp.ones((2, 4))))                  # the sum [2 2 2 2], a half per position
        [[2. 2.]
         [2. 2.]]
    """
    x = jnp.asarray(x)
    if not -x.ndim <= scatter_dimension < x.ndim:
        raise NxopsError(f"nx.psum_scatter: scatter_dimension {scatter_dimension} is out of range "
                         f"for x of shape {x.shape}.")
    dim = scatter_dimension % x.ndim
    physical, vmap_names, mesh_names = _axis_env.physical_parts(axis_name, "psum_scatter")
    total = 1
    for n in physical:
        total *= lax.axis_size(n)
    _axis_env.check_not_size_0(axis_name, total, "psum_scatter")
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
        x = mesh_collective("reduce_scatter", x, mesh_names, scatter_dimension=dim, tiled=True)
    if vmap_names:
        x = along_vmap_names(x, "scatter", vmap_names, dim)
    return x if tiled else jnp.squeeze(x, dim)


def all_to_all(x: ArrayLike, axis_name: AxisNames, split_axis: int, concat_axis: int, *,
               tiled: bool = False) -> jax.Array:
    """``lax.all_to_all`` over named ``axis_name`` (one all-to-all over mesh
    axes). Negative axes count from the end, as in ``lax``.

    Examples:
        >>> f = nx.xmap(lambda v: nx.all_to_all(v, 'i', 0, 0), [['i', ...]], ['i', ...])
        >>> print(f(jnp.arange(4.).reshape(2, 2)))      # a transpose across positions
        [[0. 2.]
         [1. 3.]]
    """
    x = jnp.asarray(x)
    size = axis_size(axis_name)
    split_axis, concat_axis = _check_all_to_all(x, axis_name, size, split_axis, concat_axis, tiled)
    physical, vmap_names, mesh_names = _axis_env.physical_parts(axis_name, "all_to_all")
    if vmap_names and mesh_names:   # a name on devices and a local tile: positionally
        return _via_gather(x, axis_name, lambda xs: lax.all_to_all(
            xs, _POSITIONS, split_axis, concat_axis, tiled=tiled))
    if vmap_names:
        # Both the value and (under a grad in the body) its cotangent must vary
        # along the names: JAX's vmap rule of all_to_all gives wrong shapes for
        # one that is the same at every position. The select's transpose makes
        # the cotangent vary.
        x = _varying_along(x, vmap_names)
        with vmap_names_collective():
            out = lax.all_to_all(x, _axis_env.one_or_tuple(physical), split_axis, concat_axis,
                                 tiled=tiled)
        return _varying_along(out, vmap_names)
    return lax.all_to_all(x, _axis_env.one_or_tuple(physical), split_axis, concat_axis, tiled=tiled)


def _varying_along(x, vmap_names):
    """``x`` as a value that varies along the vmapped names (broadcast along
    them if it does not): JAX's vmap rule of all_to_all gives a wrong shape for
    a value that is the same at every position of the name. The select is a
    no-op once compiled."""
    position = lax.axis_index(_axis_env.one_or_tuple(vmap_names))
    return lax.select(jnp.broadcast_to(position >= 0, x.shape), x, x)


def _check_all_to_all(x, axis_name, size, split_axis, concat_axis, tiled):
    for what, axis in (("split_axis", split_axis), ("concat_axis", concat_axis)):
        if not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
            raise NxopsError(f"nx.all_to_all: {what}={axis!r} is not a dim of x with shape "
                             f"{x.shape}; use an int in [{-x.ndim}, {x.ndim}).")
    split_axis, concat_axis = split_axis % x.ndim, concat_axis % x.ndim
    length = x.shape[split_axis]
    if tiled:
        _axis_env.check_not_size_0(axis_name, size, "all_to_all")
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
    with vmap_names_collective():   # positional_op's collectives are over _POSITIONS
        results = jax.vmap(positional_op, axis_name=_POSITIONS)(everyone)
    return results[axis_index(axis_name)]


def ppermute(x: ArrayLike, axis_name: AxisNames,
             perm: Sequence[tuple[int, int]]) -> jax.Array:
    """``lax.ppermute`` over named ``axis_name``: ``perm`` pairs (source, destination)
    positions along the (logical) axis; positions no pair sends to get zeros.

    Examples:
        >>> f = nx.xmap(lambda v: nx.ppermute(v, 'i', [(0, 1), (1, 2), (2, 0)]), [['i']], ['i'])
        >>> print(f(jnp.array([1., 2., 3.])))           # a shift by one, around the ring
        [3. 1. 2.]
    """
    x = jnp.asarray(x)
    size = axis_size(axis_name)
    perm = _check_perm(perm, axis_name, size)
    physical, vmap_names, mesh_names = _axis_env.physical_parts(axis_name, "ppermute")
    if size == 0:   # no positions: none sends, none receives (and there is no table to index)
        return jnp.zeros_like(x)
    if mesh_names and not vmap_names:   # lax.ppermute on devices zero-fills partial perms
        names, perm = _perm_in_mesh_order(mesh_names, perm)
        return lax.ppermute(x, _axis_env.one_or_tuple(names), perm)
    if len(perm) == size and len(physical) == 1 and not vma_checked():
        return lax.ppermute(x, physical[0], perm)   # a full permutation of a vmapped name
    # Otherwise positionally (JAX's ppermute asserts over several vmapped axes,
    # over vmapped and mesh axes together, and over a vmapped axis in a
    # shard_map body under check_vma=True, where it casts its operand to vary
    # along the axis as if it were a mesh axis).
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
    positions in mesh order whatever the order of the names given (e.g.
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
