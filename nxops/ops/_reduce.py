"""Named-axis reductions: ``nx.sum/max/min/mean/prod/logsumexp`` and
``nx.psum/pmax/pmin/pmean``.

``axis`` mixes positional ints and names. Positional axes and the names bound
by enclosing ``vmap``s (xmap's local tiles included) are reduced by one
``nx_reduce`` primitive: its batching rule turns each vmapped name into a
positional axis, so after vectorization the whole reduction is positional and
runs in the kernel the registry picks. Names that are manual mesh axes are
then reduced by one XLA collective over all of them.
"""
from __future__ import annotations

import functools
import math
import numbers
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching

from nxops._errors import NxopsError
from nxops.kernels.xla import reduce as xla_reduce
from nxops.kernels.xla import collectives as xla_collectives
from nxops.ops import _axis_env, _sum_then_tile
from nxops.ops._axis_env import mesh_platform as _mesh_platform
from nxops.ops._named_layout import along_vmap_names as _along_vmap_names
from nxops.ops._positions import axis_size
from nxops.ops._primitive import kernel_primitive, selection_param
from nxops._typing import ArrayLike, Axis, AxisNames, PyTree

reduce_p = kernel_primitive("nx_reduce", "reduce", xla_reduce.reduce,
                            naming_params=("axis_names",))
# Parameters: axes (positional, sorted), op, axis_names (vmap names still to be
# batched into positional axes), kernels (the selection).


def bind_reduce(x, *, axes, op, axis_names, kernels):
    return reduce_p.bind(x, axes=tuple(sorted(axes)), op=op, axis_names=tuple(axis_names),
                         kernels=kernels)


# --- batching: a vmapped name becomes a positional axis --------------------


def _reduce_batcher(axis_data, vals_in, dims_in, *, axes, op, axis_names, kernels):
    (x,), (d,) = vals_in, dims_in
    rest = tuple(n for n in axis_names if n != axis_data.name)
    if d is None:
        y = bind_reduce(x, axes=axes, op=op, axis_names=rest, kernels=kernels)
        if axis_data.name in axis_names:
            # Replicated along the name: `size` equal copies, in closed form.
            return _reduce_equal_copies(y, op, axis_data.size), None
        return y, None
    # The batch dim stays where it is (moving it would copy x): the positional
    # axes after it shift by one.
    shifted = tuple(a + (a >= d) for a in axes)
    if axis_data.name in axis_names:
        return bind_reduce(x, axes=shifted + (d,), op=op, axis_names=rest, kernels=kernels), None
    out = bind_reduce(x, axes=shifted, op=op, axis_names=axis_names, kernels=kernels)
    return out, d - len([a for a in shifted if a < d])


def _reduce_equal_copies(y, op: str, size: int):
    """``op`` over ``size`` copies of the already reduced ``y``."""
    if op == "sum":
        return y * jnp.asarray(size, y.dtype)
    if op == "prod":
        return y ** size
    if op == "logsumexp":
        return y + jnp.log(jnp.asarray(size, y.dtype))
    return y  # max, min


batching.fancy_primitive_batchers[reduce_p] = _reduce_batcher


# --- differentiation --------------------------------------------------------


def _expand(y, axes):
    return lax.expand_dims(y, axes) if axes else y


def _sum_transpose(ct, x, *, axes, op, axis_names, kernels):
    # Positional axes: broadcast back. Named axes: like lax.psum (psum +
    # pbroadcast), the cotangent is summed over the names again.
    aval = x.aval
    if type(ct) is ad.Zero:
        return (ad.Zero(aval),)
    if axis_names:
        ct = bind_reduce(ct, axes=(), op="sum", axis_names=axis_names, kernels=kernels)
    ct = jnp.broadcast_to(_expand(ct, axes), aval.shape).astype(aval.dtype)
    return (ct,)


def _reduce_jvp(primals, tangents, *, axes, op, axis_names, kernels):
    (x,), (t,) = primals, tangents
    params = dict(axes=axes, axis_names=axis_names, kernels=kernels)
    y = bind_reduce(x, op=op, **params)
    if type(t) is ad.Zero or t.dtype == jax.dtypes.float0:
        return y, ad.Zero.from_primal_value(y)
    if op in ("max", "min"):
        return y, _extremum_tangent(x, t, y, axes, axis_names, op)
    if op == "sum":
        return y, bind_reduce(t, op="sum", **params)
    if op == "logsumexp":
        weights = jnp.exp(x - _expand(y, axes).astype(x.dtype))
        return y, bind_reduce(t * weights, op="sum", **params).astype(y.dtype)
    if op == "prod":
        return y, _prod_tangent(x, t, axes, axis_names)
    raise NotImplementedError(op)


def _positional_view(v, axes, axis_names):
    """``v`` with its vmap names gathered into one leading positional axis (a
    reshape once batched, no communication), and the axes to reduce in it."""
    if not axis_names:
        return v, tuple(axes)
    v = _along_vmap_names(jnp.expand_dims(v, 0), "gather", axis_names, 0)
    return v, (0,) + tuple(a + 1 for a in axes)


def _extremum_tangent(x, t, y, axes, axis_names, op):
    """The tangent of max/min: ties share it equally, as in jnp.max.

    The tie mask ``x == max`` alone can come out empty (0/0: NaN tangents):
    XLA may recompute ``x``'s producer in the reduction's fusion and again in
    the mask's, rounded differently (an optimization barrier does not stop it
    on CPU). The arg-max, one variadic reduction, always names one element, so
    the mask always holds it."""
    x, reduced = _positional_view(x, axes, axis_names)
    t, _ = _positional_view(t, axes, axis_names)
    kept = [a for a in range(x.ndim) if a not in reduced]
    # the leading size spelled out: -1 cannot be inferred where y has size 0
    flat = (math.prod(x.shape[a] for a in reduced), *y.shape)
    flat_x = jnp.transpose(x, (*reduced, *kept)).reshape(flat)
    flat_t = jnp.transpose(t, (*reduced, *kept)).reshape(flat)
    return _leading_extremum_tangent(flat_x, flat_t, y, op)


def _leading_extremum_tangent(flat_x, flat_t, y, op):
    """``_extremum_tangent`` over the leading axis of ``flat_x``, whose max
    (or min) is ``y``."""
    weights = _extremum_weights(flat_x, y, op).astype(flat_t.dtype)
    return _nan_where_nan(y, jnp.sum(flat_t * weights, axis=0))


def _extremum_weights(flat_x, y, op):
    """Each element's share of the tangent along the leading axis: 1/ties at
    the elements equal to ``y``, and at the arg-max/min in any case."""
    mask = flat_x == y[None]
    if not jnp.issubdtype(flat_x.dtype, jnp.complexfloating) and flat_x.shape[0]:
        chosen = (jnp.argmax if op == "max" else jnp.argmin)(flat_x, axis=0)
        mask = mask | (lax.broadcasted_iota(chosen.dtype, flat_x.shape, 0) == chosen[None])
    mask = mask.astype(jnp.result_type(float) if not jnp.issubdtype(y.dtype, jnp.inexact)
                       else jnp.finfo(y.dtype).dtype)
    return mask / jnp.sum(mask, axis=0)


def _nan_where_nan(y, tangent):
    """A NaN extremum has a NaN tangent, as in jnp.max."""
    return jnp.where(jnp.isnan(y), jnp.asarray(jnp.nan, tangent.dtype), tangent)


def _prod_tangent(x, t, axes, axis_names):
    """The tangent of the product, as jnp.prod's: JAX's product tree, exact at
    zeros and at every order (``prod * sum(t / x)`` is 0/0 at a zero). The
    vmap names are gathered into one leading positional axis first (a reshape
    once batched, no communication)."""
    def positional_prod(v):
        v, reduced = _positional_view(v, axes, axis_names)
        return jnp.prod(v, axis=reduced)
    return jax.jvp(positional_prod, (x,), (t,))[1]


ad.primitive_jvps[reduce_p] = _reduce_jvp
ad.primitive_transposes[reduce_p] = _sum_transpose


# --- the public functions ---------------------------------------------------

@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _mesh_extremum(y, ties, mesh_names, op):
    """``lax.pmax``/``pmin`` with a derivative (JAX has none): ties share the
    tangent equally, as ``jnp.max`` does. NaN propagates as in ``jnp.max``,
    which XLA:CPU's all-reduce max does not do: floats are reduced as integer
    keys of a total order in which NaN wins (one all-reduce, no NaN flag).

    ``ties``: None, or how many elements of the local stage each element of
    ``y`` stands for (``_local_ties``): a device's share of the tangent is
    then in proportion, so that every tied element gets the same share, as
    in one reduction over all of them."""
    reduce_keys = lax.pmax if op == "max" else lax.pmin
    if not jnp.issubdtype(y.dtype, jnp.floating):
        return reduce_keys(y, mesh_names)
    if jnp.dtype(y.dtype) not in _KEY_DTYPES:   # 8-bit floats: exact in f32 (the result is an input)
        return _mesh_extremum(y.astype(jnp.float32), ties, mesh_names, op).astype(y.dtype)
    keys = reduce_keys(_float_order_keys(y, nan_wins=op), mesh_names)
    return _floats_of_order_keys(keys, y.dtype)


# A float's bits as a signed integer are ordered like the float for values
# >= +0.0 and reversed below it; flipping all but the sign bit of negative
# ones gives keys ordered as -NaN < -inf < ... < -0.0 < +0.0 < ... < +inf <
# +NaN (the order jnp.max and jnp.min use for signed zeros too). NaNs are
# first made the NaN of the winning sign. 16-bit floats get int32 keys (NCCL
# has no 16-bit integer reduction).
_KEY_DTYPES = {jnp.dtype(jnp.float16): jnp.int16, jnp.dtype(jnp.bfloat16): jnp.int16,
               jnp.dtype(jnp.float32): jnp.int32, jnp.dtype(jnp.float64): jnp.int64}


def _float_order_keys(y, nan_wins: str):
    """Integer keys of ``y`` ordered like it, with its NaNs above (``nan_wins``
    "max") or below ("min") every other value."""
    nan = jnp.asarray(jnp.nan if nan_wins == "max" else -jnp.nan, y.dtype)
    bits = lax.bitcast_convert_type(jnp.where(jnp.isnan(y), nan, y), _KEY_DTYPES[y.dtype])
    keys = jnp.where(bits < 0, bits ^ jnp.iinfo(bits.dtype).max, bits)
    return keys.astype(jnp.int32) if bits.dtype == jnp.int16 else keys


def _floats_of_order_keys(keys, dtype):
    """The inverse of ``_float_order_keys`` (a NaN comes back as ``jnp.nan``)."""
    bits_dtype = _KEY_DTYPES[jnp.dtype(dtype)]
    bits = keys.astype(bits_dtype)
    bits = jnp.where(bits < 0, bits ^ jnp.iinfo(bits_dtype).max, bits)
    out = lax.bitcast_convert_type(bits, dtype)
    return jnp.where(jnp.isnan(out), jnp.asarray(jnp.nan, dtype), out)


@_mesh_extremum.defjvp
def _mesh_extremum_jvp(mesh_names, op, primals, tangents):
    (y, ties), (t, _) = primals, tangents
    out = _mesh_extremum(y, ties, mesh_names, op)
    weight = _gathered_extremum_weight(y, ties, mesh_names, op).astype(t.dtype)
    return out, _nan_where_nan(out, lax.psum(t * weight, mesh_names))


def _gathered_extremum_weight(y, ties, mesh_names, op):
    """This device's share of the tangent, from one gathered copy of every
    device's ``y``. A tie mask ``y == pmax(y)`` with counts psum'd beside it
    reads ``y`` in several fusions, and XLA may recompute ``y``'s producer in
    each, rounded differently (seen on CPU: counts of 1 beside empty masks,
    so zero tangents, or 0/0). Compared within the gathered copy, the ties
    are exact. (Costs an all-gather of ``y``, in derivatives only.)"""
    everyone = _gather_everyone(y, mesh_names)
    extremum = (jnp.max if op == "max" else jnp.min)(everyone, axis=0)
    weights = _extremum_weights(everyone, extremum, op)
    if ties is not None:
        weights = weights * _gather_everyone(ties, mesh_names).astype(weights.dtype)
        weights = weights / jnp.sum(weights, axis=0)
    return lax.dynamic_index_in_dim(weights, lax.axis_index(mesh_names), 0, keepdims=False)


def _gather_everyone(v, mesh_names):
    """Every device's ``v``, stacked along a new leading axis."""
    invariant = tuple(n for n in mesh_names if n not in jax.typeof(v).manual_axis_type.varying)
    v = lax.pcast(v, invariant, to="varying") if invariant else v   # all_gather wants varying
    return xla_collectives.all_gather(v, mesh_names, axis=0, tiled=False)


def _local_ties(x, y, positional, vmap_names, op):
    """For a max/min reduced locally (over ``positional`` axes and
    ``vmap_names``) to ``y`` before the mesh stage: how many elements of
    ``x`` equal it (at least 1: ``y`` is one of them, should a recomputed
    ``x`` round otherwise), or None where no derivative can flow."""
    if op not in ("max", "min") or not jnp.issubdtype(x.dtype, jnp.floating):
        return None
    x, y = lax.stop_gradient(x), lax.stop_gradient(y)
    tied = (x == _expand(y, positional)).astype(jnp.float32)
    counts = bind_reduce(tied, axes=positional, op="sum", axis_names=vmap_names,
                         kernels=selection_param())
    return jnp.maximum(counts, 1.0)


_MESH_REDUCERS = {   # (sum is handled first: it records the partial for sum-then-tile)
    "max": lambda y, mesh_names, ties: _mesh_extremum(y, ties, mesh_names, "max"),
    "min": lambda y, mesh_names, ties: _mesh_extremum(y, ties, mesh_names, "min"),
}


def _split_axis_argument(x, axis, *, op: str) -> tuple[tuple[int, ...], tuple]:
    """(positional axes normalised to non-negative, names) from ``axis``."""
    _axis_env.refuse_nested(axis, op=f"nx.{op}")
    items = axis if isinstance(axis, (tuple, list)) else (axis,)
    ndim = jnp.ndim(x)
    positional, names = [], []
    for item in items:
        if isinstance(item, bool) or item is None:
            raise NxopsError(f"nx.{op}: axis {axis!r} contains {item!r}; use ints for "
                             f"positional axes and strings for named axes.")
        if isinstance(item, numbers.Number) and not isinstance(item, numbers.Integral):
            raise NxopsError(f"nx.{op}: axis {axis!r} contains the {type(item).__name__} "
                             f"{item!r}; use an int for a positional axis (e.g. "
                             f"{int(getattr(item, 'real', 0))}) or a string for a named axis.")
        if isinstance(item, numbers.Integral):
            item = int(item)
            if not -ndim <= item < ndim:
                raise NxopsError(f"nx.{op}: positional axis {item} is out of range for an "
                                 f"array of shape {jnp.shape(x)} (rank {ndim}).")
            positional.append(item % ndim)
        else:
            names.append(item)
    _axis_env.check_no_duplicates(positional, op=f"nx.{op}", what="axis")
    _axis_env.check_no_duplicates(names, op=f"nx.{op}", what="axis")
    return tuple(sorted(positional)), tuple(names)


def _mesh_logsumexp(y, mesh_names):
    # The shift is real (XLA has no complex all-reduce max; jax.nn.logsumexp
    # also shifts complex values by the max of their real parts).
    top = lax.pmax(lax.stop_gradient(jnp.real(y)), mesh_names)
    top = jnp.where(jnp.isfinite(top), top, 0)
    return top + jnp.log(lax.psum(jnp.exp(y - top), mesh_names))


def _mesh_prod(y, mesh_names):
    gathered = xla_collectives.all_gather(y, mesh_names, axis=0, tiled=False,
                                          platform=_mesh_platform())
    return jnp.prod(gathered, axis=0)


def _resolve_axes(x, axis, name: str):
    """(positional axes, vmap names, mesh names) of ``axis`` for ``nx.<name>``."""
    positional, logical = _split_axis_argument(x, axis, op=name)
    physical = _axis_env.resolve(logical, op=f"nx.{name}")
    _axis_env.check_no_duplicates(physical, op=f"nx.{name}", what="physical axes")
    return (positional, *_axis_env.split_vmap_and_mesh(physical, op=f"nx.{name}"))


def _reduce_resolved(x, positional, vmap_names, mesh_names, op: str):
    """The local reduction (one primitive, a kernel after batching), then one
    collective over the mesh names."""
    y, ties = x, None
    if positional or vmap_names:
        y = bind_reduce(y, axes=positional, op=op, axis_names=vmap_names,
                        kernels=selection_param())
        if mesh_names:
            ties = _local_ties(x, y, positional, vmap_names, op)
    else:   # the local reduction's dtype (sum: int8 -> int32, as jnp) on every placement
        y = y.astype(_reduced_dtype(y.dtype, op))
    if not mesh_names:
        return y
    return _reduce_over_mesh(y, mesh_names, op, ties)


def _reduce_over_mesh(y, mesh_names, op: str, ties=None):
    """``op`` of the locally reduced ``y`` over ``mesh_names``: one collective.
    ``ties``: see ``_mesh_extremum``."""
    if op in ("max", "min") and jnp.issubdtype(y.dtype, jnp.complexfloating):
        # XLA has no complex all-reduce max; jnp orders complex numbers lexicographically.
        gathered = xla_collectives.all_gather(y, mesh_names, axis=0, tiled=False,
                                              platform=_mesh_platform())
        return (jnp.max if op == "max" else jnp.min)(gathered, axis=0)
    if y.dtype in xla_collectives.CPU_UNSAFE_DTYPES and _mesh_platform() == "cpu":
        # XLA:CPU aborts (CHECK "Invalid binary instruction opcode copy") on a
        # bf16/f16 all-reduce over some of the mesh axes: reduce in f32 there
        # (every op; sums of other nx ops: xla_collectives.summed_in_f32_on_cpu).
        return _reduce_over_mesh(y.astype(jnp.float32), mesh_names, op, ties).astype(y.dtype)
    if op == "sum":
        return _sum_then_tile.mesh_sum(y, mesh_names, platform=_mesh_platform())
    if op in _MESH_REDUCERS:
        return _MESH_REDUCERS[op](y, mesh_names, ties)
    if op == "logsumexp":
        return _mesh_logsumexp(y, mesh_names)
    return _mesh_prod(y, mesh_names)


def _reduced_dtype(dtype, op: str):
    """The dtype of ``op`` over positional axes of a ``dtype`` value: the
    reference kernel's (jnp's), under the x64 setting in force."""
    return _reduced_dtype_cached(jnp.dtype(dtype), op, bool(jax.config.jax_enable_x64))


@functools.lru_cache(maxsize=256)
def _reduced_dtype_cached(dtype, op: str, x64: bool):
    # Every op keeps a float dtype JAX holds as is (not float64 without x64):
    # known without the trace, which every first psum of a float in a fresh
    # process would otherwise pay.
    if jnp.issubdtype(dtype, jnp.floating) and (x64 or dtype.itemsize <= 4):
        return dtype
    reference = functools.partial(xla_reduce.reduce, axes=(0,), op=op)
    return jax.eval_shape(reference, jax.ShapeDtypeStruct((1,), dtype)).dtype


def _check_extremum_not_empty(x, axis, positional, vmap_names, op: str, public: str):
    """A max/min over no elements has no value: say so (jnp raises a bare ValueError)."""
    if op not in ("max", "min"):
        return
    sizes = [x.shape[a] for a in positional]
    sizes += [_axis_env.physical_axis_size(n) for n in vmap_names]
    if any(isinstance(s, int) and s == 0 for s in sizes):   # (symbolic sizes are >= 1)
        raise NxopsError(
            f"nx.{public}(x, {axis!r}) reduces over a dimension of size 0 (x has local "
            f"shape {x.shape}): the {op}imum of no elements is undefined. Check the size "
            f"before reducing, or pad the axis with {'-inf' if op == 'max' else 'inf'} "
            f"(or the dtype's {'lowest' if op == 'max' else 'highest'} value).")


def reduce(x, axis, op: str, *, public_name: str | None = None):
    """Reduces ``x`` with ``op`` over ``axis`` (ints, names, or a tuple of both)."""
    x = jnp.asarray(x)
    resolved = _resolve_axes(x, axis, public_name or op)
    _check_extremum_not_empty(x, axis, *resolved[:2], op, public_name or op)
    return _reduce_resolved(x, *resolved, op)


def sum(x: ArrayLike, axis: Axis) -> jax.Array:
    """Sum of ``x`` over ``axis``: an int, a name, or a tuple mixing both.

    Examples:
        >>> f = nx.xmap(lambda row: nx.sum(row, 0), in_axes=[['row', ...]], out_axes=['row'])
        >>> print(f(jnp.arange(6.).reshape(2, 3)))      # a positional dim: each row's sum
        [ 3. 12.]
        >>> g = nx.xmap(lambda row: nx.sum(row, ('row', 0)), [['row', ...]], [...])
        >>> print(g(jnp.arange(6.).reshape(2, 3)))      # the name and the dim: everything
        15.0
    """
    return reduce(x, axis, "sum")


def max(x: ArrayLike, axis: Axis) -> jax.Array:
    """Maximum of ``x`` over ``axis`` (ints and/or names).

    Examples:
        >>> f = nx.xmap(lambda row: nx.max(row, 'row'), [['row', ...]], [...])
        >>> print(f(jnp.arange(6.).reshape(2, 3)))      # over the named rows: per column
        [3. 4. 5.]
    """
    return reduce(x, axis, "max")


def min(x: ArrayLike, axis: Axis) -> jax.Array:
    """Minimum of ``x`` over ``axis`` (ints and/or names).

    Examples:
        >>> f = nx.xmap(lambda row: nx.min(row, 'row'), [['row', ...]], [...])
        >>> print(f(jnp.arange(6.).reshape(2, 3)))
        [0. 1. 2.]
    """
    return reduce(x, axis, "min")


def prod(x: ArrayLike, axis: Axis) -> jax.Array:
    """Product of ``x`` over ``axis`` (ints and/or names).

    Examples:
        >>> f = nx.xmap(lambda row: nx.prod(row, 0), [['row', ...]], ['row'])
        >>> print(f(jnp.arange(1., 7.).reshape(2, 3)))
        [  6. 120.]
    """
    return reduce(x, axis, "prod")


def logsumexp(x: ArrayLike, axis: Axis) -> jax.Array:
    """``log(sum(exp(x)))`` over ``axis``, computed stably (max-shifted).

    Examples:
        >>> f = nx.xmap(lambda row: nx.logsumexp(row, 'row'), [['row', ...]], [...])
        >>> print(np.asarray(f(jnp.zeros((4, 2)))).round(4))    # log(4) per column
        [1.3863 1.3863]
    """
    return reduce(x, axis, "logsumexp")


def mean(x: ArrayLike, axis: Axis) -> jax.Array:
    """Mean of ``x`` over ``axis`` (ints and/or names); integer inputs give floats, as in jnp.

    Examples:
        >>> f = nx.xmap(lambda row: nx.mean(row, 'row'), [['row', ...]], [...])
        >>> print(f(jnp.arange(6.).reshape(2, 3)))
        [1.5 2.5 3.5]
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.result_type(float))
    positional, vmap_names, mesh_names = _resolve_axes(x, axis, "mean")
    total = _reduce_resolved(x, positional, vmap_names, mesh_names, "sum")
    # Multiplied one by one: sizes may be symbolic (jax.export), which math.prod
    # would turn into ints.
    count = functools.reduce(operator.mul, [x.shape[a] for a in positional] +
                             [_axis_env.physical_axis_size(n) for n in vmap_names + mesh_names], 1)
    return total / jnp.asarray(count, total.dtype)


def _names_only(axis_name, op: str):
    _axis_env.refuse_nested(axis_name, op=f"nx.{op}")
    names = _axis_env.as_name_tuple(axis_name)
    for n in names:
        if isinstance(n, int):
            raise NxopsError(f"nx.{op}: axis_name {axis_name!r} contains the int {n}; "
                             f"{op} reduces named axes only. Use nx.{op[1:]} for positional axes.")
    return names


def _is_static(leaf) -> bool:
    """A Python or NumPy value: the same on every position along any name."""
    return not isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)


def psum(x: PyTree, axis_name: AxisNames) -> PyTree:
    """Sum over named axes (``lax.psum``'s semantics, logical names allowed).

    Works on pytrees, like ``lax.psum``. A static value (Python/NumPy) is the
    same everywhere, so its psum is static too: ``nx.psum(1, 'i')`` is the
    size of ``'i'``, as in the old xmap tutorial.

    Examples:
        >>> f = nx.xmap(lambda v: v / nx.psum(v, 'i'), [['i']], ['i'])
        >>> print(f(jnp.array([1., 3.])))               # each position's share of the total
        [0.25 0.75]
    """
    names = _names_only(axis_name, "psum")

    def one(v):
        if _is_static(v):
            return v * axis_size(names)
        return reduce(v, names, "sum", public_name="psum")
    return jax.tree_util.tree_map(one, x)


def pmax(x: PyTree, axis_name: AxisNames) -> PyTree:
    """Maximum over named axes (on pytrees, like ``lax.pmax``).

    Examples:
        >>> f = nx.xmap(lambda v: nx.pmax(v, 'i'), [['i']], [...])
        >>> print(f(jnp.array([1., 3., 2.])))
        3.0
    """
    names = _names_only(axis_name, "pmax")
    return jax.tree_util.tree_map(lambda v: reduce(v, names, "max", public_name="pmax"), x)


def pmin(x: PyTree, axis_name: AxisNames) -> PyTree:
    """Minimum over named axes (on pytrees, like ``lax.pmin``).

    Examples:
        >>> f = nx.xmap(lambda v: nx.pmin(v, 'i'), [['i']], [...])
        >>> print(f(jnp.array([1., 3., 2.])))
        1.0
    """
    names = _names_only(axis_name, "pmin")
    return jax.tree_util.tree_map(lambda v: reduce(v, names, "min", public_name="pmin"), x)


def pmean(x: PyTree, axis_name: AxisNames) -> PyTree:
    """Mean over named axes (on pytrees, like ``lax.pmean``).

    Examples:
        >>> f = nx.xmap(lambda v: v - nx.pmean(v, 'i'), [['i']], ['i'])
        >>> print(f(jnp.array([1., 3., 2.])))           # centred along 'i'
        [-1.  1.  0.]
    """
    names = _names_only(axis_name, "pmean")
    return jax.tree_util.tree_map(lambda v: mean(v, names), x)
