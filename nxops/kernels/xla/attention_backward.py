"""The reference backward of the attention op as a registry op of its own
(``attention_backward``, family ``attention``): FlashAttention-2's blockwise
backward of :mod:`nxops.kernels.xla.attention`, from the cotangent rows
(``attention.cotangent_rows``: the output's cotangent, the logsumexp, the
softmax's row constant), so that a kernel can take the backward where it
takes the forward.

Positional: q, k, v, q_pos, k_pos (the forward's), ``g_o`` [B, Tq, E] (v's
dtype), ``lse`` and ``row_term`` [B, Tq] (f32), optionally ``bias`` [1 or
B, Tq, Tk] (f32). Results: dq, dk, dv in the dtypes of q, k, v, and with a
bias its gradient (f32, the bias's shape).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from nxops.kernels._registry import PLATFORMS, Kernel, register
from nxops.kernels.xla import attention as forward


def attention_backward(q, k, v, q_pos, k_pos, g_o, lse, row_term, bias=None, *, scale: float,
                       causal: bool, block: int | None = None, platform: str = "cpu",
                       positions: str | None = None) -> tuple[jax.Array, ...]:
    """(dq, dk, dv[, dbias]) of the attention op for its cotangent rows
    (``positions``: as the forward's)."""
    del platform, positions
    if q.shape[1] == 0 or k.shape[1] == 0:
        zeros = (jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype),
                 jnp.zeros(v.shape, v.dtype))
        return zeros + (() if bias is None else (jnp.zeros(bias.shape, jnp.float32),))
    dq, dk, dv, dbias = forward._backward_rows(
        q, k, v, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32),
        None if bias is None else bias.astype(jnp.float32), g_o, lse, row_term,
        scale=float(scale), causal=bool(causal), block=block)
    return (dq, dk, dv) + (() if bias is None else (dbias,))


KERNEL = register(Kernel(
    op="attention_backward", backend="xla", platforms=PLATFORMS, fn=attention_backward,
    description="fori_loops over key blocks (dk, dv) and query blocks (dq), recomputing the "
                "probabilities from the saved logsumexp (FlashAttention-2)",
))
