"""``nx.attention``: ``softmax(q·k / sqrt(d) + bias, masked) · v`` over a named
(or positional) key sequence, never holding the queries x keys scores.

The named layer: the keys' sequence name resolves to physical axes; its vmap
part is gathered into a positional dim of ``k``, ``v`` (and the bias), with
the keys' global positions (``nx.axis_index``) beside them. Every other
vmapped name reaches the primitive's batching rule: a name that only the
queries vary along (query positions, the query heads of a key/value head's
group) becomes more query rows; one the keys vary along too (batch, heads)
becomes a batch member. Along key names' mesh axes that the queries vary
along too, the key shards pass around a ring of ``ppermute``s (gathered
instead where a bias or mask comes with them); along mesh axes the queries
do not vary along, each device attends to its key shard, and one ``pmax``
and one ``psum`` of per-query rows (the weighted outputs and the sum of
weights) combine the shards.
"""
from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from nxops._errors import NxopsError
from nxops._jax import varying_like
from nxops._typing import ArrayLike
from nxops.kernels.xla import attention as xla_attention
from nxops.ops import _axis_env, _collectives, _sum_then_tile
from nxops.ops._attention_backward import backward as attention_backward
from nxops.ops._axis_env import mesh_platform
from nxops.ops._named_layout import along_vmap_names
from nxops.ops._positions import axis_index, axis_size
from nxops.ops._cross_entropy import _check_axis_argument, _positional_dim, _resolve_name
from nxops.ops._primitive import (jvp_of_evaluation, kernel_primitive, local_primitive, match_varying,
                                  selection_param, step_primitive)
from nxops.ops._replicated import replicated_over
from nxops.ops._sequence_layout import SequenceLayout

OP = "nx.attention"

attention_p = kernel_primitive("nx_attention", "attention", xla_attention.attention)
# Operands q [B, Tq, D], k [B, Tk, D], v [B, Tk, E], q_pos [B, Tq], k_pos
# [B, Tk] and optionally bias [1 or B, Tq, Tk] (f32); one result, f32
# [B, Tq, E + 1]: the output and the logsumexp. Parameters: scale, causal,
# block, kernels (the selection), need_lse (False: nothing reads the
# logsumexp column, so a kernel that cannot give it, cuDNN's, may run),
# positions ("iota": q_pos[b, i] == i and k_pos[b, j] == j, known
# statically, so a kernel whose causal mask is on local indices may take
# causal; None: only the arrays say).


def _bind(q, k, v, q_pos, k_pos, bias, *, scale, causal, block, kernels, need_lse=True,
          positions=None):
    operands = (q, k, v, q_pos, k_pos) + (() if bias is None else (bias,))
    return attention_p.bind(*operands, scale=scale, causal=causal, block=block, kernels=kernels,
                            need_lse=need_lse, positions=positions)


# --- batching: query-only names become query rows, the others batch members ----


def _batch_first(x, dim, size):
    if dim is None:
        return jnp.broadcast_to(x, (size, *x.shape))
    return jnp.moveaxis(x, dim, 0)


def _into_rows(x, dim, size):
    """[size, B, T, ...] -> [B, size * T, ...]."""
    x = jnp.swapaxes(_batch_first(x, dim, size), 0, 1)
    return x.reshape(x.shape[0], size * x.shape[2], *x.shape[3:])


def _into_batch(x, dim, size):
    x = _batch_first(x, dim, size)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _attention_batcher(vals_in, dims_in, *, scale, causal, block, kernels, need_lse,
                       positions):
    q, k, v, q_pos, k_pos, *rest = vals_in
    q_dim, k_dim, v_dim, q_pos_dim, k_pos_dim, *bias_dims = dims_in
    bias, bias_dim = (rest[0], bias_dims[0]) if rest else (None, None)
    size = next(x.shape[d] for x, d in zip(vals_in, dims_in) if d is not None)
    params = dict(scale=scale, causal=causal, block=block, kernels=kernels, need_lse=need_lse,
                  positions=positions)
    if k_dim is None and v_dim is None and k_pos_dim is None:
        # The same keys for every member: its queries are more rows of one
        # pass (whose positions repeat: no longer the rows' indices).
        if bias is not None:
            bias = _into_rows(bias, bias_dim, size)
        out = _bind(_into_rows(q, q_dim, size), k, v, _into_rows(q_pos, q_pos_dim, size), k_pos,
                    bias, **dict(params, positions=None))
        return out.reshape(out.shape[0], size, out.shape[1] // size, out.shape[-1]), 1
    if bias is not None and (bias_dim is not None or bias.shape[0] != 1):
        bias = _into_batch(bias, bias_dim, size)   # a bias shared by the batch stays [1, ...]
    out = _bind(*(_into_batch(x, d, size) for x, d in zip(vals_in[:5], dims_in[:5])), bias,
                **params)
    return out.reshape(size, out.shape[0] // size, *out.shape[1:]), 0


batching.primitive_batchers[attention_p] = _attention_batcher


# --- a ring's steps: one key shard each, through the registry's kernels ---------
#
# Where the selection picks XLA's reference, a step is its fused form (the
# online softmax continued in the rows' buffer; the gradients added into the
# accumulators); where it picks a kernel (Pallas flash attention), the
# kernel's own pass over the shard, merged into those. k and v may come as
# their bits (see _as_bits).


def _as_values(x, dtype):
    """A shard that travels as its bits, as values of ``dtype`` again."""
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def _step_with_kernel(attend, q, k, v, q_pos, k_pos, rows, *, scale, causal, block):
    """attention_step_p's result with ``attend``, a kernel of the registry's
    ``attention``: its output and logsumexp over this shard, merged into
    ``rows``'s (the queries' over the shards before)."""
    k, v = _as_values(k, q.dtype), _as_values(v, q.dtype)
    q_pos, k_pos = _per_member(q_pos, q), _per_member(k_pos, k)

    def update(rows):
        new = attend(q, k, v, q_pos, k_pos, None, scale=scale, causal=causal, block=block,
                     need_lse=True)
        o, lse = _merged(rows[..., :-1], rows[..., -1], new[..., :-1], new[..., -1])
        return jnp.concatenate([o, lse[..., None]], -1)
    return (xla_attention.unless_hidden(update, rows, q_pos, k_pos, causal, q, k, v),)


def _gradients_with_kernel(backward, q, k, v, q_pos, k_pos, g_o, lse, row_term, dq, dk, dv, *,
                           scale, causal, block):
    """partial_gradients_p's result with ``backward``, a kernel of the
    registry's ``attention_backward``: this shard's dq, dk, dv added in
    float32 to the accumulators."""
    k, v = _as_values(k, q.dtype), _as_values(v, q.dtype)
    q_pos, k_pos = _per_member(q_pos, q), _per_member(k_pos, k)

    def update(accumulators):
        shares = backward(q, k, v, q_pos, k_pos, g_o, lse, row_term, scale=scale,
                          causal=causal, block=block)
        return tuple(a + s.astype(jnp.float32) for a, s in zip(accumulators, shares))
    return xla_attention.unless_hidden(update, (dq, dk, dv), q_pos, k_pos, causal,
                                       q, k, v, g_o, lse, row_term)


def _per_member(positions, x):
    """Positions [1 or B, T] as [B, T] (a kernel reads one row per batch member)."""
    return jnp.broadcast_to(positions, (x.shape[0], positions.shape[1]))


def _gradients_reference(q, k, v, q_pos, k_pos, g_o, lse, row_term, dq, dk, dv, *, scale, causal,
                         block):
    """partial_gradients_p's fused form. k and v come as bits (a shard that
    travelled) or as values (the local shard, the backward's last): those
    become bits inside the branch that reads them. XLA:CPU copies a
    bitcast_convert_type; made outside, the copies (two shards) were
    scheduled first and held through the whole backward ring."""
    def update(accumulators):
        return xla_attention.partial_gradients(q, _as_bits(k), _as_bits(v), q_pos, k_pos, g_o,
                                               lse, row_term, *accumulators, scale=scale,
                                               causal=causal, block=block)
    return xla_attention.unless_hidden(update, (dq, dk, dv), q_pos, k_pos, causal,
                                       q, k, v, g_o, lse, row_term)


partial_gradients_p = step_primitive("nx_attention_partial_gradients", "attention_backward",
                                     _gradients_reference, _gradients_with_kernel,
                                     operands=range(8))
# Operands q, k, v, q_pos, k_pos (as attention_p's), the rows the backward
# reads of the output over every key shard and its cotangent (g_o [B, Tq, E],
# lse [B, Tq], row_term [B, Tq]: xla_attention.cotangent_rows), and the
# float32 accumulators dq, dk, dv; results: the accumulators plus this key
# shard's share. Parameters: scale, causal, block, kernels.
_KEY_SIDE = (1, 2, 4, 9, 10)        # k, v, k_pos and the dk, dv accumulators
_QUERY_SIDE = (0, 3, 5, 6, 7, 8)    # q, q_pos, the cotangent rows and the dq accumulator


def _partial_gradients(*operands, **params):
    return partial_gradients_p.bind(*operands, **params)


def _partial_gradients_batcher(vals_in, dims_in, **params):
    """As attention_p's: a name the keys do not vary along makes more query
    rows of one pass (whose dk, dv sum over them in the pass, never one per
    query), the others batch members."""
    size = next(x.shape[d] for x, d in zip(vals_in, dims_in) if d is not None)
    if all(dims_in[i] is None for i in _KEY_SIDE):
        operands = list(vals_in)
        for i in _QUERY_SIDE:
            operands[i] = _into_rows(vals_in[i], dims_in[i], size)
        dq, dk, dv = _partial_gradients(*operands, **params)
        return (dq.reshape(dq.shape[0], size, dq.shape[1] // size, dq.shape[2]), dk, dv), \
            (1, None, None)
    grads = _partial_gradients(*(_into_batch(x, d, size) for x, d in zip(vals_in, dims_in)),
                               **params)
    return tuple(x.reshape(size, x.shape[0] // size, *x.shape[1:]) for x in grads), (0, 0, 0)


batching.primitive_batchers[partial_gradients_p] = _partial_gradients_batcher


def _continued(*operands, **params):
    return (xla_attention.continued(*operands, **params),)


attention_step_p = step_primitive("nx_attention_step", "attention", _continued,
                                  _step_with_kernel, operands=range(5),
                                  op_params=dict(need_lse=True))
# Operands q, k, v, q_pos, k_pos (as attention_p's) and the float32 rows
# [B, Tq, E + 1] (output and logsumexp) of the queries over other keys; its
# result: those rows over these keys too. Parameters: scale, causal, block,
# kernels.


def _attention_step(q, k, v, k_pos, q_pos, rows, params):
    return attention_step_p.bind(q, k, v, q_pos, k_pos, rows, **params)[0]


def _attention_step_batcher(vals_in, dims_in, **params):
    """As partial_gradients_p's: a name the keys do not vary along makes more
    query rows of one pass, the others batch members."""
    size = next(x.shape[d] for x, d in zip(vals_in, dims_in) if d is not None)
    if all(dims_in[i] is None for i in (1, 2, 4)):
        operands = list(vals_in)
        for i in (0, 3, 5):
            operands[i] = _into_rows(vals_in[i], dims_in[i], size)
        (rows,) = attention_step_p.bind(*operands, **params)
        return (rows.reshape(rows.shape[0], size, rows.shape[1] // size, rows.shape[2]),), (1,)
    (rows,) = attention_step_p.bind(*(_into_batch(x, d, size) for x, d in zip(vals_in, dims_in)),
                                    **params)
    return (rows.reshape(size, rows.shape[0] // size, *rows.shape[1:]),), (0,)


batching.primitive_batchers[attention_step_p] = _attention_step_batcher


# --- differentiation: the registry's forward, the reference's backward --------


# The JVP of attention_p is its forward plus attention_tangent_p, a primitive
# linear in the tangents dq, dk, dv (and dbias): evaluated, it is forward mode
# (jax.jvp, jacfwd), a blockwise pass with the forward's own derivative;
# transposed, it is the backward (jax.grad, jacrev), FlashAttention-2's from
# the saved output and logsumexp. Operands: q, k, v, q_pos, k_pos, the output
# rows [B, Tq, E + 1], dq, dk, dv, and with a bias: bias, dbias.


def _tangent_impl(q, k, v, q_pos, k_pos, out, dq, dk, dv, *bias, scale, causal, block,
                  positions=None):
    del out, positions   # the transpose's: forward mode recomputes by blocks
    config = (scale, causal, block)

    def forward(q, k, v, *b):
        return xla_attention.forward(q, k, v, q_pos, k_pos, b[0] if b else None, config)
    primals, tangents = (q, k, v, *bias[:1]), (dq, dk, dv, *bias[1:])
    return (jax.jvp(forward, primals, tangents)[1],)


attention_tangent_p = local_primitive("nx_attention_tangent", _tangent_impl)
# The tangent has the output rows' type: no need to trace the pass to know it.
attention_tangent_p.def_abstract_eval(lambda *avals, **params: [avals[5]])
_TANGENT_KEY_SIDE = (1, 2, 4, 7, 8)      # k, v, k_pos, dk, dv
_TANGENT_QUERY_SIDE = (0, 3, 5, 6)       # q, q_pos, the output rows, dq


def _tangent_transpose(cts, *operands, scale, causal, block, positions=None):
    (ct,) = cts
    q, k, v, q_pos, k_pos, out = operands[:6]
    bias = operands[9] if len(operands) > 9 else None
    linear = (6, 7, 8) + ((10,) if bias is not None else ())
    if type(ct) is ad.Zero or not any(ad.is_undefined_primal(operands[i]) for i in linear):
        return [None] * len(operands)
    dq, dk, dv, dbias = attention_backward(q, k, v, q_pos, k_pos, bias, out, ct, scale=scale,
                                           causal=causal, block=block, positions=positions)
    grads = dict(zip(linear, (dq, dk, dv, dbias)))
    return [grads[i] if i in grads and ad.is_undefined_primal(operands[i]) else None
            for i in range(len(operands))]


ad.primitive_transposes[attention_tangent_p] = _tangent_transpose


# Forward mode of forward mode: the blockwise pass's own JVP (positions and out get none).
ad.primitive_jvps[attention_tangent_p] = jvp_of_evaluation(_tangent_impl, without_tangent=(3, 4, 5))


def _tangent_batcher(vals_in, dims_in, **params):
    """As attention_p's: names the keys (and their tangents) do not vary
    along make more query rows of one pass, the others batch members."""
    size = next(x.shape[d] for x, d in zip(vals_in, dims_in) if d is not None)
    operands, bias_rows = list(vals_in), (9, 10)[:len(vals_in) - 9]
    if all(dims_in[i] is None for i in _TANGENT_KEY_SIDE):
        for i in _TANGENT_QUERY_SIDE + bias_rows:
            operands[i] = _into_rows(vals_in[i], dims_in[i], size)
        (t,) = attention_tangent_p.bind(*operands, **dict(params, positions=None))
        return (t.reshape(t.shape[0], size, t.shape[1] // size, t.shape[-1]),), (1,)
    # A bias (and its tangent) shared by the batch stays [1, ...], as attention_p's.
    shared = bias_rows and all(dims_in[i] is None and vals_in[i].shape[0] == 1
                               for i in bias_rows)
    for i, (x, d) in enumerate(zip(vals_in, dims_in)):
        if not (shared and i in bias_rows):
            operands[i] = _into_batch(x, d, size)
    (t,) = attention_tangent_p.bind(*operands, **params)
    return (t.reshape(size, t.shape[0] // size, *t.shape[1:]),), (0,)


batching.primitive_batchers[attention_tangent_p] = _tangent_batcher


def _attention_jvp(primals, tangents, *, scale, causal, block, kernels, need_lse, positions):
    del need_lse   # the backward recomputes from the logsumexp
    q, k, v, q_pos, k_pos, *bias = primals
    out = _bind(q, k, v, q_pos, k_pos, bias[0] if bias else None, scale=scale, causal=causal,
                block=block, kernels=kernels, positions=positions)
    diff = (0, 1, 2) + ((5,) if bias else ())
    if all(type(tangents[i]) is ad.Zero for i in diff):
        return out, ad.Zero.from_primal_value(out)
    dq, dk, dv, *dbias = (ad.instantiate_zeros(tangents[i]) for i in diff)
    extra = (bias[0], dbias[0]) if bias else ()
    (tangent,) = attention_tangent_p.bind(q, k, v, q_pos, k_pos, out, dq, dk, dv, *extra,
                                          scale=scale, causal=causal, block=block,
                                          positions=positions)
    return out, tangent


ad.primitive_jvps[attention_p] = _attention_jvp


# --- the named layer ------------------------------------------------------------


def _check_dtypes(q, k, v, bias, mask):
    for operand, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise NxopsError(f"{OP}: {operand} has dtype {x.dtype}; it must be floating "
                             f"(float32, bfloat16, float16).")
    if not q.dtype == k.dtype == v.dtype:
        raise NxopsError(f"{OP}: q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; give them "
                         f"one dtype (the scores accumulate in float32 either way).")
    if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
        raise NxopsError(f"{OP}: bias has dtype {bias.dtype}; an additive bias is floating "
                         f"(use mask= for a boolean mask).")
    if mask is not None and mask.dtype != jnp.bool_:
        raise NxopsError(f"{OP}: mask has dtype {mask.dtype}; give a boolean mask (True: the "
                         f"key is seen), or an additive float bias as bias=.")


def _keys_seq_before_head(k, v, seq, into_ring=lambda mesh_names: False):
    """(k, v with the keys' sequence as their second-to-last dim, the key
    positions [Tk] (global), the seq's vmap names, its mesh names).
    ``into_ring(mesh_names)``: whether k and v go into a ring, whose
    backward sums the dk (dv) of every query along the vmap names in one
    pass (its batching rules): a cotangent already whole, of which each
    position takes its tile (``gather_whole``), where a gather's transpose
    would count it once per position for a gradient taken inside the body."""
    if k.ndim < 1 or v.ndim < 1:
        raise NxopsError(f"{OP}: k has shape {tuple(k.shape)} and v {tuple(v.shape)}; both need "
                         f"the head dim as their last positional dim.")
    if isinstance(seq, str):
        logical = _axis_env.current_logical_axes().get(seq)
        if logical is not None and logical.loops:
            raise NxopsError(
                f"{OP}: the keys' sequence {seq!r} runs on the serial loop "
                f"{logical.loops[0].name!r}: each loop step holds only its chunk of keys, and "
                f"every query needs all of them. Loop over the queries instead: give them "
                f"their own name in in_axes (q_seq=...) and map that one to the loop.")
        vmap_names, mesh_names = _resolve_name(seq, what="seq", op=OP)
        kind = "gather_whole" if into_ring(mesh_names) else "gather"
        k = along_vmap_names(k[..., None, :], kind, vmap_names, k.ndim - 1)
        v = along_vmap_names(v[..., None, :], kind, vmap_names, v.ndim - 1)
        k_pos = along_vmap_names(axis_index(seq)[None], "gather", vmap_names, 0)
        return k, v, k_pos, vmap_names, mesh_names
    dim = _positional_dim(seq, k.ndim, what="seq", operand="k", shape=k.shape, op=OP)
    if dim == k.ndim - 1:
        raise NxopsError(f"{OP}: seq={seq} is k's last dim (shape {tuple(k.shape)}), its head "
                         f"dim; give the keys' sequence axis (the head dim is always last).")
    if v.ndim != k.ndim:
        raise NxopsError(f"{OP}: k has shape {tuple(k.shape)} and v {tuple(v.shape)}; with a "
                         f"positional seq={seq} they need the same rank.")
    k, v = jnp.moveaxis(k, dim, -2), jnp.moveaxis(v, dim, -2)
    return k, v, jnp.arange(k.shape[-2], dtype=jnp.int32), (), ()


def _static_positions(seq, q_seq, token_shape, batch_ndim, layout):
    """``"iota"`` (``IOTA_POSITIONS``) where the kernel's rows are known to sit at their
    own indices: both sequences positional (built here from an iota, no
    offset), stored in order, and the queries' sequence the only query dim
    longer than 1 (other query dims, e.g. a group's query heads, fold into
    rows whose positions repeat); else None."""
    if not (isinstance(seq, int) and isinstance(q_seq, int)) or layout is not None:
        return None
    query_dims = range(batch_ndim, len(token_shape))
    q_dim = q_seq % (len(token_shape) + 1)
    if q_dim not in query_dims:
        return None
    if any(token_shape[d] > 1 for d in query_dims if d != q_dim):
        return None
    return xla_attention.IOTA_POSITIONS


def _gathered_axes(seq, q_seq, q, q_pos, mesh_names) -> tuple:
    """The keys' mesh axes the queries vary along too: the key shards are
    gathered there, or passed around a ring."""
    along_queries = _query_mesh_axes(seq, q_seq, q, q_pos, mesh_names)
    return tuple(n for n in mesh_names if n in along_queries)


def _check_shapes(q, k, v, seq):
    if v.shape[:-1] != k.shape[:-1]:
        raise NxopsError(f"{OP}: k has shape {tuple(k.shape)} and v {tuple(v.shape)} (seq "
                         f"{seq!r} before the head dim); they must match but for the last dim.")
    batch = k.shape[:-2]
    if q.ndim < len(batch) + 1 or q.shape[-1] != k.shape[-1] or q.shape[:len(batch)] != batch:
        raise NxopsError(
            f"{OP}: q has shape {tuple(q.shape)} and k {tuple(k.shape)} (seq {seq!r} before the "
            f"head dim): q must be (*batch, *queries, head) with k's batch dims {tuple(batch)} "
            f"first and k's head dim {k.shape[-1]} last.")
    lengths = (*q.shape[len(batch):-1], k.shape[-2])
    if not all(isinstance(n, int) for n in lengths):
        raise NxopsError(f"{OP}: q has shape {tuple(q.shape)} and k {tuple(k.shape)}: the "
                         f"query and key lengths must be static (the blocks are sized from "
                         f"them); export with concrete sequence lengths (batch dims may be "
                         f"symbolic).")
    if k.shape[-2] == 0:
        raise NxopsError(f"{OP}: the keys' sequence {seq!r} has length 0 (k has shape "
                         f"{tuple(k.shape)}); a softmax over no keys is undefined.")


def _query_positions(q_seq, token_shape, layout):
    """Global query positions of q's token shape (0 without a q_seq)."""
    if q_seq is None:
        return jnp.zeros(token_shape, jnp.int32)
    if isinstance(q_seq, str):
        stored, length = axis_index(q_seq).astype(jnp.int32), axis_size(q_seq)
    else:
        dim = _positional_dim(q_seq, len(token_shape) + 1, what="q_seq", operand="q",
                              shape=(*token_shape, "head"), op=OP)
        if dim == len(token_shape):
            raise NxopsError(f"{OP}: q_seq={q_seq} is q's last dim, its head dim; give the "
                             f"queries' sequence axis.")
        stored, length = lax.broadcasted_iota(jnp.int32, token_shape, dim), token_shape[dim]
    return jnp.broadcast_to(_global_positions(stored, length, layout, "q_seq", q_seq),
                            token_shape)


def _global_positions(stored, length, layout, what, axis):
    """The global positions of a sequence's stored positions under ``layout``."""
    if layout is None:
        return stored
    layout.check_length(length, f"{OP}: {what}={axis!r}")
    return layout.positions(stored, length)


def _check_layout(layout, causal):
    if layout is None:
        return
    if not isinstance(layout, SequenceLayout):
        raise NxopsError(f"{OP}: sequence_layout={layout!r}; give an nx.SequenceLayout (e.g. "
                         f"nx.SequenceLayout('zigzag', shards=8)) or None (contiguous).")
    if not causal:
        raise NxopsError(f"{OP}: sequence_layout={layout!r} without causal=True: the layout "
                         f"only says which keys the causal mask hides; without the mask the "
                         f"order of the keys changes nothing (drop it).")


def _as_scores(x, what, seq, vmap_names, token_shape, batch_ndim, keys):
    """A bias or mask as [1 or B, Tq, Tk]: its positional dims broadcast
    against (*queries' token shape, Tk); one shared by the batch stays [1, ...]."""
    if isinstance(seq, str):
        x = along_vmap_names(x[..., None], "gather", vmap_names, x.ndim)
    want = (*token_shape, keys)
    try:
        shape = jnp.broadcast_shapes(x.shape, want)
    except ValueError:
        shape = None
    if shape != want:
        raise NxopsError(f"{OP}: {what} has shape {tuple(x.shape)} (the keys' sequence "
                         f"{seq!r} as its last dim); it must broadcast to the scores' shape {want} "
                         f"(q's shape without the head dim, then the keys).")
    shared = all(d == 1 for d in ((1,) * (len(want) - x.ndim) + tuple(x.shape))[:batch_ndim])
    lead = (1,) * batch_ndim if shared else token_shape[:batch_ndim]
    x = jnp.broadcast_to(x, (*lead, *want[batch_ndim:]))
    return x.reshape(math.prod(lead), math.prod(want[batch_ndim:-1]), keys)


def _query_mesh_axes(seq, q_seq, q, q_pos, mesh_names):
    """The keys' mesh axes along which the queries may differ (there the keys
    are gathered; along the others every device holds the same queries, and
    the shards' partial results combine). nx.xmap's mesh bodies carry no
    varying-axes types, so the names decide: the queries may vary along
    every mesh axis of a logical name other than ``seq``, and along ``seq``'s
    own unless ``q_seq`` names another axis (or a dim of q)."""
    varying = set(jax.typeof(q).manual_axis_type.varying) | \
        set(jax.typeof(q_pos).manual_axis_type.varying)
    if q_seq is None or q_seq == seq:
        return set(mesh_names)
    for name, axis in _axis_env.current_logical_axes().items():
        if name != seq:
            varying.update(axis.physical)
    return varying


def _varying_over(x, names):
    missing = tuple(n for n in names if n not in jax.typeof(x).manual_axis_type.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def _gather_keys(k, v, k_pos, bias, names):
    """All the keys of mesh axes ``names`` on every device (the queries vary
    along them too: each device's queries see every key)."""
    def gather(x, axis):   # the registry's all-gather, as nx.all_gather over mesh axes
        return _collectives.mesh_collective("all_gather", x, tuple(names), axis=axis % x.ndim,
                                            tiled=True)
    return (gather(k, -2), gather(v, -2), gather(k_pos, 0),
            None if bias is None else gather(bias, -1))


# The ring's default block is never below this (where the shard is longer):
# smaller blocks' temporaries are small next to a shard anyway.
RING_MIN_BLOCK = 128


def _ring_block(block, keys, e, layout):
    """Queries and keys per step of a ring pass: ``block`` where given; by
    default the largest power of two (at most the default, at least
    RING_MIN_BLOCK) whose f32 scores are no larger than a quarter of the
    shard's output (block² <= keys x E / 4): a device of the ring holds 1/n
    of everything else, and the backward's few score-sized temporaries
    together should not outweigh a shard. In a zig-zag shard (two chunks of
    keys / 2) no block straddles the chunks where a power of two divides
    them: a straddling block pair would be computed for the sake of one
    chunk, and the devices' work would no longer be equal."""
    if block is not None:
        return block
    fitting = 2 ** int(math.log2(max(1.0, math.sqrt(keys * e / 4))))
    fitting = min(xla_attention.DEFAULT_BLOCK, max(fitting, RING_MIN_BLOCK))
    if layout is not None and layout.kind == "zigzag":
        dividing = math.gcd(keys // 2, fitting)
        return dividing if 4 * dividing >= fitting else fitting
    return fitting


def _ring(operands, names, params, out_dtype, layout):
    """(output in ``out_dtype``, float32 logsumexp) of the local queries
    against every key shard of mesh axes ``names``: the key, value and
    position shards pass around the ring (n - 1 ``ppermute``s each), and each
    shard continues the queries' online softmax in one buffer of output rows
    (a scan: one pass's temporaries live at a time).

    Its JVP is the same forward plus ``ring_tangent_p``, linear in dq, dk, dv:
    evaluated (forward mode), the forward ring's own JVP; transposed (reverse
    mode), a backward that keeps only the local shards, the output and the
    last shard the forward saw: it passes the key shards around the ring
    again, the other way, each with its dk, dv accumulators
    (FlashAttention-2's backward per shard against the whole softmax's
    logsumexp), so that no device ever holds more than two shards of the keys."""
    count = math.prod(_axis_env.physical_axis_size(n) for n in names)
    q, k, v = operands[:3]
    params = dict(params, block=_ring_block(params["block"], k.shape[1], v.shape[2], layout))
    if count == 1:
        out = _bind(*operands, None, **params)
        return out[..., :-1].astype(out_dtype), out[..., -1]
    config = dict(names=tuple(names), count=count,
                  **{name: params[name] for name in ("scale", "causal", "block", "kernels")})

    @jax.custom_jvp
    def ring(q, k, v, q_pos, k_pos):
        return _ring_forward(q, k, v, q_pos, k_pos, out_dtype=out_dtype, **config)[0]

    @ring.defjvp
    def ring_jvp(primals, tangents):
        (o, lse), last = _ring_forward(*primals, out_dtype=out_dtype, **config)
        t_o, t_lse = ring_tangent_p.bind(*primals, o, lse, *last, *tangents[:3], **config)
        return (o, lse), (t_o, t_lse)

    return ring(*operands)


def _rotated(xs, names, count, backward=False):
    """``xs`` from the device before (``backward``: after) on the ring."""
    pairs = [((i + 1) % count, i) if backward else (i, (i + 1) % count) for i in range(count)]
    return tuple(lax.ppermute(x, names, pairs) for x in xs)


def _ring_forward(q, k, v, q_pos, k_pos, *, names, count, scale, causal, block, kernels,
                  out_dtype, travel=None):
    """((o, lse), the last key shard (k, v, positions) the device saw). The
    shards travel as ``travel`` makes them (their bits by default; forward
    mode passes values, which carry tangents)."""
    step_params = dict(scale=scale, causal=causal, block=block, kernels=kernels)
    travel = travel or _as_bits

    def step(carry, _):
        rows, *shard = carry
        return (_attention_step(q, *shard, q_pos, rows, step_params),
                *_rotated(shard, names, count)), None

    rows = jnp.concatenate([jnp.zeros((*q.shape[:-1], v.shape[-1]), jnp.float32),
                            jnp.full((*q.shape[:-1], 1), -jnp.inf, jnp.float32)], -1)
    carry = varying_like((rows, travel(k), travel(v), k_pos), q, k, v, q_pos, k_pos)
    (rows, *last), _ = lax.scan(step, carry, length=count - 1)
    rows = _attention_step(q, *last, q_pos, rows, step_params)
    return (rows[..., :-1].astype(out_dtype), rows[..., -1]), tuple(last)


def _ring_backward(q, k, v, q_pos, k_pos, o, lse, last, g_o, g_lse, *, names, count, scale,
                   causal, block, kernels):
    """(dq, dk, dv) in q's, k's, v's dtypes for the cotangents of (o, lse)."""
    rows = xla_attention.cotangent_rows(o, lse, g_o, g_lse, v.dtype)
    step_params = dict(scale=scale, causal=causal, block=block, kernels=kernels)

    def share(shard, accumulators):
        k, v, k_pos = shard
        return _partial_gradients(q, k, v, q_pos, k_pos, *rows, *accumulators, **step_params)

    def step(carry, _):
        # The shard of the next device back arrives with its accumulators.
        dq, dk, dv, *shard = carry
        shard = _rotated(shard, names, count, backward=True)
        dk, dv = _rotated((dk, dv), names, count, backward=True)
        return (*share(shard, (dq, dk, dv)), *shard), None

    # The forward's shards in reverse: the last one first; n - 2 arrive
    # around the ring; the local one is the residual; the accumulators
    # travel n - 1 times and end where their shard lives.
    zeros = tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
    # Zeros made with the forward's last shard, not before the forward's loop
    # (where XLA schedules them beside its output rows when the first share
    # has no branch to create them in: not causal; JAX 0.10.2 drops the barrier).
    zeros, last = lax.optimization_barrier((zeros, tuple(last)))
    carry = varying_like((*share(last, zeros), *last), q, k, v, q_pos, k_pos, o, lse, g_o, g_lse)
    (dq, dk, dv, *_), _ = lax.scan(step, carry, length=count - 2)
    dk, dv = _rotated((dk, dv), names, count, backward=True)
    # The local shard as values: the step makes its bits where it reads them
    # (see _gradients_reference). The barrier keeps that after the loop where
    # the step has no branch to hold it (not causal); JAX 0.10.2's XLA:CPU
    # drops the barrier, and there only a causal step's branch holds it.
    dq, dk, dv, k, v = lax.optimization_barrier((dq, dk, dv, k, v))
    dq, dk, dv = share((k, v, k_pos), (dq, dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# The ring's tangent: operands q, k, v, q_pos, k_pos, the output o (in q's
# dtype) and its logsumexp, the last key shard the forward saw (k, v as they
# travel, positions), and the tangents dq, dk, dv; results: the tangents of
# o and of the logsumexp. Parameters: names, count (the ring), scale, causal,
# block, kernels. Its collectives are the ring's own ppermutes, lowered in place.
_RING_TANGENTS = (10, 11, 12)
_RING_KEY_SIDE = (1, 2, 4, 7, 8, 9, 11, 12)
_RING_QUERY_SIDE = (0, 3, 5, 6, 10)
_RING_KEY_POSITIONS = (4, 9)


def _ring_tangent_eval(q, k, v, q_pos, k_pos, o, lse, last_k, last_v, last_pos, dq, dk, dv,
                       **config):
    """Forward mode: the JVP of the forward ring, the shards as values."""

    def forward(q, k, v):
        return _ring_forward(q, k, v, q_pos, k_pos, out_dtype=o.dtype, travel=lambda x: x,
                             **config)[0]
    return list(jax.jvp(forward, (q, k, v), (dq, dk, dv))[1])


ring_tangent_p = Primitive("nx_attention_ring_tangent")
ring_tangent_p.multiple_results = True
ring_tangent_p.def_abstract_eval(lambda *avals, **params: [avals[5], avals[6]])
mlir.register_lowering(ring_tangent_p, lambda ctx, *args, **params: mlir.lower_fun(
    functools.partial(_ring_tangent_eval, **params), multiple_results=True)(ctx, *args))


def _ring_tangent_transpose(cts, *operands, **config):
    if not any(ad.is_undefined_primal(operands[i]) for i in _RING_TANGENTS):
        return [None] * len(operands)
    q, k, v, q_pos, k_pos, o, lse, *last = operands[:10]
    g_o, g_lse = (jnp.zeros(x.aval.shape, x.aval.dtype) if type(x) is ad.Zero else x
                  for x in cts)
    grads = dict(zip(_RING_TANGENTS, _ring_backward(
        q, k, v, q_pos, k_pos, o, lse, tuple(last), g_o, g_lse, **config)))
    return [grads[i] if i in grads and ad.is_undefined_primal(operands[i]) else None
            for i in range(len(operands))]


ad.primitive_transposes[ring_tangent_p] = _ring_tangent_transpose


def _ring_tangent_batcher(vals_in, dims_in, **params):
    """As attention_p's: names the keys (and their tangents) do not vary
    along make more query rows of the ring, the others batch members."""
    size = next(x.shape[d] for x, d in zip(vals_in, dims_in) if d is not None)
    operands = list(vals_in)
    if all(dims_in[i] is None for i in _RING_KEY_SIDE):
        for i in _RING_QUERY_SIDE:
            operands[i] = _into_rows(vals_in[i], dims_in[i], size)
        outs = ring_tangent_p.bind(*operands, **params)
        return [x.reshape(x.shape[0], size, x.shape[1] // size, *x.shape[2:]) for x in outs], \
            [1, 1]
    # Key positions shared by the batch stay [1, Tk]: they travel around the
    # ring (the backward's), and the kernels broadcast them.
    operands = [x if i in _RING_KEY_POSITIONS and d is None and x.shape[0] == 1
                else _into_batch(x, d, size) for i, (x, d) in enumerate(zip(vals_in, dims_in))]
    outs = ring_tangent_p.bind(*operands, **params)
    return [x.reshape(size, x.shape[0] // size, *x.shape[1:]) for x in outs], [0, 0]


batching.primitive_batchers[ring_tangent_p] = _ring_tangent_batcher


def _ring_second_derivative(primals, tangents, **params):
    """The JVP rule of the ring's tangent and of its backward's steps."""
    raise NxopsError(
        f"{OP}: a second derivative (jax.hessian, jax.jacfwd of jax.jacfwd or of jax.jacrev) "
        f"is not available where the keys and the queries share mesh axes (ring attention: "
        f"its tangent and its backward have no derivatives of their own). Map the queries' "
        f"sequence elsewhere than the keys' mesh axes, or leave the sequence unmapped, for "
        f"second derivatives.")


ad.primitive_jvps[ring_tangent_p] = _ring_second_derivative
ad.primitive_jvps[partial_gradients_p] = _ring_second_derivative


# The ring step's forward mode (in the ring's tangent): the pass's own JVP.
ad.primitive_jvps[attention_step_p] = jvp_of_evaluation(
    lambda *operands, kernels, **params: _continued(*operands, **params), without_tangent=(3, 4))


def _as_bits(x):
    """``x`` as it travels around a ring: XLA:CPU's collectives widen 16-bit
    floats to float32 (twice the bytes, and a float32 copy of each shard in
    flight); the same bits as unsigned ints pass as they are on every
    platform. The kernels take a shard's bits in place of its values."""
    if x.dtype.itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return lax.bitcast_convert_type(x, jnp.uint16)


def _merged(o, lse, o_new, lse_new):
    """The softmax-weighted mean of two partial outputs, and their logsumexp."""
    top = lax.stop_gradient(jnp.maximum(lse, lse_new))
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    old_weight, new_weight = jnp.exp(lse - shift), jnp.exp(lse_new - shift)
    total = old_weight + new_weight
    safe = jnp.where(total > 0, total, 1.0)
    o = (o * old_weight[..., None] + o_new * new_weight[..., None]) / safe[..., None]
    return o, jnp.where(total > 0, shift + jnp.log(safe), -jnp.inf)


def _combine_key_shards(o_local, lse_local, mesh_names):
    """The output and logsumexp over all key shards from each shard's: one
    pmax of the logsumexp and one psum of the weighted outputs with their weights."""
    o_local, lse_local = (_varying_over(x, mesh_names) for x in (o_local, lse_local))
    # The shift cancels in value; its gradient is zero (and pmax has none).
    top = lax.pmax(lax.stop_gradient(lse_local), mesh_names)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.exp(lse_local - shift)
    summed = _sum_then_tile.mesh_sum(jnp.concatenate([o_local * weight[..., None],
                                               weight[..., None]], -1),
                              mesh_names, platform=mesh_platform())
    total = summed[..., -1]
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    o = jnp.where(seen[..., None], summed[..., :-1] / safe[..., None], 0.0)
    return o, jnp.where(seen, shift + jnp.log(safe), -jnp.inf)


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, seq: str | int,
              q_seq: str | int | None = None, causal: bool = False,
              bias: ArrayLike | None = None, mask: ArrayLike | None = None,
              scale: float | None = None, return_lse: bool = False,
              block: int | None = None, sequence_layout: SequenceLayout | None = None
              ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``softmax(q·k * scale + bias, masked) · v`` without the scores.

    ``seq``: the keys' sequence axis (the softmax's), a name (logical, as in
    ``nx.einsum``; it may run on mesh axes) or a position (a dim of ``k`` and
    ``v``). The head dim is the last positional dim of ``q``, ``k`` and ``v``
    (``v``'s may differ in size); ``q`` is (*batch, *queries, head) where
    ``k`` is (*batch, keys, head) with ``batch`` k's other positional dims.
    Every named axis is a token axis (batch, heads, query positions, the
    query heads of a key/value group). ``q_seq``: the queries' sequence
    (name or position in ``q``), needed by ``causal=True``: a query at
    global position i sees the keys at global positions <= i (positions from
    ``nx.axis_index`` where named, from 0 where positional). ``bias`` (added)
    and ``mask`` (bool, True: seen) broadcast against (q's shape without the
    head dim, keys), with the keys last (where ``seq`` is named, they vary
    along it instead). ``scale``: default 1/sqrt(head dim). Returns the output
    in q's dtype (and the float32 logsumexp with ``return_lse=True``);
    accumulates in float32. ``block``: queries and keys per step (default 512).
    ``sequence_layout``: an ``nx.SequenceLayout`` in which both sequences are
    stored (zig-zag or striped, balancing a causal ring); the causal mask
    compares the global positions it gives. None: stored in order.

    Examples:
        >>> q, k, v = jnp.ones((2, 4, 8)), jnp.ones((2, 6, 8)), jnp.arange(96.).reshape(2, 6, 8)
        >>> out = nx.attention(q, k, v, seq=1)       # keys' sequence: dim 1 of k and v
        >>> print(out.shape, bool(jnp.allclose(out, v.mean(1, keepdims=True))))
        (2, 4, 8) True
        >>> causal = nx.attention(q[:, :3], k[:, :3], v[:, :3], seq=1, q_seq=1, causal=True)
        >>> print(causal[0, :, 0])                   # query i averages keys 0..i
        [0. 4. 8.]
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    bias = None if bias is None else jnp.asarray(bias)
    mask = None if mask is None else jnp.asarray(mask)
    _check_axis_argument(seq, what="seq", op=OP)
    if q_seq is not None:
        _check_axis_argument(q_seq, what="q_seq", op=OP)
    if causal and q_seq is None:
        raise NxopsError(f"{OP}: causal=True needs the queries' positions: give q_seq (the "
                         f"queries' sequence axis, a name or a dim of q).")
    if block is not None and (not isinstance(block, numbers.Integral) or block < 1):
        raise NxopsError(f"{OP}: block={block!r}; give a positive int (or None).")
    _check_dtypes(q, k, v, bias, mask)
    _check_layout(sequence_layout, causal)
    if q.ndim < 1:
        raise NxopsError(f"{OP}: q has shape {tuple(q.shape)}; it needs the head dim as its "
                         f"last positional dim.")
    token_shape = q.shape[:-1]
    q_pos = _query_positions(q_seq, token_shape, sequence_layout)

    def into_ring(mesh_names):   # as `ring` below, over more than one device
        gathered = _gathered_axes(seq, q_seq, q, q_pos, mesh_names)
        devices = math.prod(_axis_env.physical_axis_size(n) for n in gathered)
        return bias is None and mask is None and devices > 1
    k, v, k_pos, vmap_names, mesh_names = _keys_seq_before_head(k, v, seq, into_ring)
    gathered = _gathered_axes(seq, q_seq, q, q_pos, mesh_names)
    _check_shapes(q, k, v, seq)
    k_pos = _global_positions(k_pos, axis_size(seq) if isinstance(seq, str) else k.shape[-2],
                              sequence_layout, "seq", seq)
    batch_ndim = k.ndim - 2
    keys = k.shape[-2]
    scores_bias = None
    if bias is not None:
        scores_bias = _as_scores(bias.astype(jnp.float32), "bias", seq, vmap_names, token_shape,
                                 batch_ndim, keys)
    if mask is not None:
        masked = _as_scores(jnp.where(mask, 0.0, -jnp.inf), "mask", seq, vmap_names,
                            token_shape, batch_ndim, keys)
        scores_bias = masked if scores_bias is None else scores_bias + masked

    sharded = tuple(n for n in mesh_names if n not in gathered)
    ring = gathered if scores_bias is None else ()
    if gathered and not ring:
        k, v, k_pos, scores_bias = _gather_keys(k, v, k_pos, scores_bias, gathered)
        keys = k.shape[-2]
    if sharded:
        q = replicated_over(q, sharded)

    batch = math.prod(k.shape[:-2])
    queries = math.prod(token_shape[batch_ndim:])
    operands = (q.reshape(batch, queries, q.shape[-1]), k.reshape(batch, keys, k.shape[-1]),
                v.reshape(batch, keys, v.shape[-1]), q_pos.reshape(batch, queries),
                jnp.broadcast_to(k_pos, (batch, keys)))
    operands = match_varying(*operands, *(() if scores_bias is None else (scores_bias,)))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    params = dict(scale=scale, causal=bool(causal), block=block, kernels=selection_param())
    if ring:
        # Where the shards combine afterwards, they combine in float32.
        o, lse = _ring(operands, ring, params, jnp.float32 if sharded else q.dtype,
                       sequence_layout)
    else:
        out = _bind(*operands[:5], operands[5] if len(operands) > 5 else None, **params,
                    need_lse=return_lse or bool(sharded),
                    positions=_static_positions(seq, q_seq, token_shape, batch_ndim,
                                                sequence_layout))
        o, lse = out[..., :-1], out[..., -1]
    if sharded:
        o, lse = _combine_key_shards(o, lse, sharded)
    o = o.reshape(*token_shape, v.shape[-1]).astype(q.dtype)
    return (o, lse.reshape(token_shape)) if return_lse else o
