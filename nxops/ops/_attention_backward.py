"""The backward of ``nx.attention`` as a primitive of its own, lowered to the
kernel the registry picks for ``attention_backward`` (the selection's
``attention`` family, as the forward): FlashAttention-2's backward from the
saved output and logsumexp (the XLA reference's blockwise loops, or the
Pallas kernels).

Operands q, k, v, q_pos, k_pos (the forward's), the cotangent rows g_o,
lse, row_term (``xla.attention.cotangent_rows``) and optionally the bias;
results dq, dk, dv (and the bias's gradient). Parameters: scale, causal,
block, positions (the forward's), kernels (the selection in force where the
gradient is traced).
"""
from __future__ import annotations

from jax.interpreters import batching
import jax.numpy as jnp

from nxops.kernels.xla import attention as xla_attention
from nxops.kernels.xla import attention_backward as xla_backward
from nxops.ops._primitive import kernel_primitive, selection_param

attention_backward_p = kernel_primitive("nx_attention_backward", "attention_backward",
                                        xla_backward.attention_backward, multiple_results=True)


def backward(q, k, v, q_pos, k_pos, bias, out, g, *, scale, causal, block, positions=None):
    """(dq, dk, dv, dbias) for the cotangent ``g`` [B, Tq, E + 1] of the
    forward's rows ``out`` (dbias None without a bias)."""
    rows = xla_attention.cotangent_rows(out[..., :-1], out[..., -1], g[..., :-1], g[..., -1],
                                        v.dtype)
    operands = (q, k, v, q_pos, k_pos, *rows) + (() if bias is None else (bias,))
    grads = attention_backward_p.bind(*operands, scale=scale, causal=causal, block=block,
                                      positions=positions, kernels=selection_param())
    return tuple(grads) + ((None,) if bias is None else ())


def _batcher(vals_in, dims_in, **params):
    """Every vmapped member a batch member of its own (operands it does not
    vary along broadcast): each member's gradients are its own (vmap of
    grad), never summed over the members."""
    size = next(x.shape[d] for x, d in zip(vals_in, dims_in) if d is not None)
    batch = vals_in[0].shape[dims_in[0] is not None]

    def member_first(x, d):
        return jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)

    operands = [member_first(x, d) for x, d in zip(vals_in, dims_in)]
    shared_bias = len(operands) > 8 and operands[8].shape[1] != batch
    if shared_bias:   # one bias for the forward's batch: each member's copy of it
        operands[8] = jnp.broadcast_to(operands[8], (size, batch, *operands[8].shape[2:]))
    grads = attention_backward_p.bind(
        *(x.reshape(size * x.shape[1], *x.shape[2:]) for x in operands), **params)
    grads = [x.reshape(size, x.shape[0] // size, *x.shape[1:]) for x in grads]
    if shared_bias:
        grads[3] = jnp.sum(grads[3], axis=1, keepdims=True)
    return grads, [0] * len(grads)


batching.primitive_batchers[attention_backward_p] = _batcher
