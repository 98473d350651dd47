"""The pairwise contraction primitive behind ``nx.einsum`` and ``nx.pdot``.

``nx_dot_general`` is ``lax.dot_general`` plus ``contract_names``: vmap names
that are summed over. Its batching rule turns such a name into a positional
contracting dimension, and any other vmapped name into a batch or free
dimension, exactly like ``lax.dot_general``'s. After vectorization the whole
contraction is one positional dot_general, which the registry sends to a
kernel (Pallas blocked matmul, Triton, or XLA).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad, batching

from nxops.kernels import _layout
from nxops.kernels.xla import dot_general as xla_dot_general
from nxops.ops._primitive import kernel_primitive, match_varying
from nxops.ops._reduce import bind_reduce

dot_general_p = kernel_primitive("nx_dot_general", "dot_general", xla_dot_general.dot_general,
                                 naming_params=("contract_names",))


def bind_dot_general(a, b, *, dimension_numbers, contract_names=(), precision=None,
                     preferred_element_type=None, kernels):
    (ac, bc), (ab, bb) = dimension_numbers
    dims = ((tuple(ac), tuple(bc)), (tuple(ab), tuple(bb)))
    a, b = match_varying(a, b)
    return dot_general_p.bind(a, b, dimension_numbers=dims, contract_names=tuple(contract_names),
                              precision=precision, preferred_element_type=preferred_element_type,
                              kernels=kernels)


def _shift(dims, at):
    """Dim numbers of the unbatched operand, in the operand with a batch dim at ``at``."""
    return tuple(d + (d >= at) for d in dims)



def _dot_batcher(axis_data, vals_in, dims_in, *, dimension_numbers, contract_names, **params):
    """Batch dims stay in place (dot_general takes dims anywhere): no transposes."""
    (a, b), (da, db) = vals_in, dims_in
    (ac, bc), (ab, bb) = dimension_numbers
    if da is not None:
        ac, ab = _shift(ac, da), _shift(ab, da)
    if db is not None:
        bc, bb = _shift(bc, db), _shift(bb, db)
    name = axis_data.name
    if name in contract_names:
        rest = tuple(n for n in contract_names if n != name)
        if da is None and db is None:  # both replicated: `size` equal terms
            out = bind_dot_general(a, b, dimension_numbers=dimension_numbers,
                                   contract_names=rest, **params)
            return out * jnp.asarray(axis_data.size, out.dtype), None
        if da is None or db is None:  # bilinear: sum the varying operand first
            if da is None:
                b = bind_reduce(b, axes=(db,), op="sum", axis_names=(), kernels=params["kernels"])
                bc, bb = dimension_numbers[0][1], dimension_numbers[1][1]
            else:
                a = bind_reduce(a, axes=(da,), op="sum", axis_names=(), kernels=params["kernels"])
                ac, ab = dimension_numbers[0][0], dimension_numbers[1][0]
            dims = ((ac, bc), (ab, bb))
            return bind_dot_general(a, b, dimension_numbers=dims, contract_names=rest, **params), None
        dims = ((ac + (da,), bc + (db,)), (ab, bb))
        return bind_dot_general(a, b, dimension_numbers=dims, contract_names=rest, **params), None
    if da is None and db is None:
        return bind_dot_general(a, b, dimension_numbers=dimension_numbers,
                                contract_names=contract_names, **params), None
    if da is not None and db is not None:
        dims = ((ac, bc), ((da,) + ab, (db,) + bb))
        out = bind_dot_general(a, b, dimension_numbers=dims, contract_names=contract_names, **params)
        return out, 0
    out = bind_dot_general(a, b, dimension_numbers=((ac, bc), (ab, bb)),
                           contract_names=contract_names, **params)
    # The result's dims: batch dims, then a's free dims, then b's, each in order.
    if da is not None:
        return out, len(ab) + _layout.free_dims(a.ndim, ac, ab).index(da)
    n_a_free = len(_layout.free_dims(a.ndim, ac, ab))
    return out, len(ab) + n_a_free + _layout.free_dims(b.ndim, bc, bb).index(db)


batching.fancy_primitive_batchers[dot_general_p] = _dot_batcher


# --- differentiation: bilinear, so the transposes are dot_generals too -------


def _remaining(n, *dim_lists):
    used = {d for dims in dim_lists for d in dims}
    return [d for d in range(n) if d not in used]


def _transpose_lhs(ct, x, y, *, dimension_numbers, contract_names, precision,
                   preferred_element_type, kernels, swap_ans=False):
    """Cotangent of ``x`` in ``dot_general(x, y)`` (lax's rule, with names)."""
    del preferred_element_type
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_aval = x.aval
    y_ndim = jnp.ndim(y)
    x_kept = _remaining(x_aval.ndim, x_contract, x_batch)
    y_kept = _remaining(y_ndim, y_contract, y_batch)
    nb = len(x_batch)
    if swap_ans:
        ans_y = tuple(range(nb, nb + len(y_kept)))
    else:
        ans_y = tuple(range(nb + len(x_kept), nb + len(x_kept) + len(y_kept)))
    dims = ((ans_y, tuple(y_kept)), (tuple(range(nb)), tuple(y_batch)))
    # The result's last dims are y's contracting dims in increasing order.
    x_contract_sorted_by_y = [x_contract[i] for i in np.argsort(y_contract)]
    out_axes = np.argsort(list(x_batch) + x_kept + x_contract_sorted_by_y)
    if contract_names:
        # A named contraction is a local product, then a psum over the names;
        # the psum transposes first, like lax.psum (the ct sums over the names),
        # exactly as the mesh path (local dot, then lax.psum) transposes.
        ct = bind_reduce(ct, axes=(), op="sum", axis_names=contract_names, kernels=kernels)
    x_bar = bind_dot_general(ct, y, dimension_numbers=dims, precision=precision,
                             preferred_element_type=x_aval.dtype, kernels=kernels)
    x_bar = lax.transpose(x_bar, tuple(int(a) for a in out_axes))
    return x_bar.astype(x_aval.dtype)


def _transpose_rhs(ct, x, y, *, dimension_numbers, **params):
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return _transpose_lhs(ct, y, x, dimension_numbers=swapped, swap_ans=True, **params)


ad.defbilinear(dot_general_p, _transpose_lhs, _transpose_rhs)
