"""Reference fused cross-entropy: a loop over vocab chunks that never holds
the tokens x vocab logits, forward or backward.

Positional: ``h`` [T, H], ``w`` [H, V], ``labels`` [T] (int, already local to
this vocab shard: a label outside [0, V) picks nothing). The result is one
f32 array [2, T]: row 0 the logsumexp over the V columns, row 1 the label's
logit (0 where the label is outside [0, V)). Two results stacked in one, so
that the op is one kernel primitive with one output.

The forward carries the online (max, sum of exp) per token; the backward
(``jax.custom_vjp``) recomputes each chunk's logits from the saved logsumexp
and produces dh (accumulated in f32) and dw chunk by chunk. Dots take the
inputs' dtype and accumulate in f32 (``preferred_element_type``); the
backward's dot operands are the chunk's d(logits) cast to that dtype, as the
unfused program's transposed einsum would take them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from nxops.kernels._registry import PLATFORMS, Kernel, register

DEFAULT_CHUNK = 1024


def chunk_size(vocab: int, chunk: int | None) -> int:
    """Columns per step: ``chunk`` (default 1024), at most the vocab."""
    return max(1, min(chunk or DEFAULT_CHUNK, vocab))


def _chunk_starts(vocab: int, size: int) -> tuple[int, int]:
    """(number of chunks, start of the last one). Every chunk has ``size``
    columns: the last one starts at ``vocab - size`` (no padded copy of w),
    and the columns it shares with the one before are masked out of it."""
    count = -(-vocab // size)
    return count, vocab - size


def _chunk(w, step, size: int, vocab: int):
    """(w's columns of chunk ``step``, their vocab ids, which of them are new)."""
    first = step * size
    start = jnp.minimum(first, vocab - size)
    columns = start + lax.broadcasted_iota(jnp.int32, (1, size), 1)
    return lax.dynamic_slice_in_dim(w, start, size, axis=1), start, columns, columns >= first


def _logits(h, w_chunk):
    return lax.dot_general(h, w_chunk, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _forward(h, w, labels, size: int):
    vocab = w.shape[1]
    count, _ = _chunk_starts(vocab, size)
    tokens = h.shape[0]

    def step(i, carry):
        top, total, picked = carry
        w_chunk, _, columns, new = _chunk(w, i, size, vocab)
        logits = jnp.where(new, _logits(h, w_chunk), -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(logits, axis=1))
        # A token whose logits are all -inf so far keeps a -inf top: shift by 0 there.
        shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        total = total * jnp.exp(top - shift) + jnp.sum(jnp.exp(logits - shift[:, None]), axis=1)
        hit = (columns == labels[:, None]) & new
        picked = picked + jnp.sum(jnp.where(hit, logits, 0.0), axis=1)
        return new_top, total, picked

    init = (jnp.full((tokens,), -jnp.inf, jnp.float32), jnp.zeros((tokens,), jnp.float32),
            jnp.zeros((tokens,), jnp.float32))
    top, total, picked = lax.fori_loop(0, count, step, init)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    return shift + jnp.log(total), picked


def _backward(h, w, labels, lse, g_lse, g_picked, size: int):
    """(dh, dw) for cotangents ``g_lse`` of the logsumexp and ``g_picked`` of
    the label's logit: d(logits) = softmax * g_lse + onehot(label) * g_picked."""
    vocab = w.shape[1]
    count, _ = _chunk_starts(vocab, size)

    def step(i, carry):
        dh, dw = carry
        w_chunk, start, columns, new = _chunk(w, i, size, vocab)
        logits = _logits(h, w_chunk)
        softmax = jnp.exp(logits - lse[:, None])
        hit = columns == labels[:, None]
        dlogits = softmax * g_lse[:, None] + jnp.where(hit, g_picked[:, None], 0.0)
        dlogits = jnp.where(new, dlogits, 0.0).astype(h.dtype)
        dh = dh + lax.dot_general(dlogits, w_chunk, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32)
        dw_chunk = lax.dot_general(h, dlogits, (((0,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        # Columns shared with the previous chunk get + 0 here: the add is exact.
        old = lax.dynamic_slice_in_dim(dw, start, size, axis=1).astype(jnp.float32)
        dw = lax.dynamic_update_slice_in_dim(dw, (old + dw_chunk).astype(dw.dtype), start, axis=1)
        return dh, dw

    init = (jnp.zeros(h.shape, jnp.float32), jnp.zeros(w.shape, w.dtype))
    dh, dw = lax.fori_loop(0, count, step, init)
    return dh.astype(h.dtype), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _lse_and_label_logit(h, w, labels, size):
    lse, picked = _forward(h, w, labels, size)
    return jnp.stack([lse, picked])


def _fwd(h, w, labels, size):
    lse, picked = _forward(h, w, labels, size)
    return jnp.stack([lse, picked]), (h, w, labels, lse)


def _bwd(size, residuals, g):
    h, w, labels, lse = residuals
    dh, dw = _backward(h, w, labels, lse, g[0], g[1], size)
    return dh, dw, None


_lse_and_label_logit.defvjp(_fwd, _bwd)


def cross_entropy(h: jax.Array, w: jax.Array, labels: jax.Array, *, chunk: int | None = None,
                  platform: str = "cpu") -> jax.Array:
    """[2, T] f32: the logsumexp of ``h @ w`` over its V columns, and the
    logit at ``labels`` (0 where a label is outside [0, V)). Differentiable
    in ``h`` and ``w`` without materializing [T, V]."""
    del platform
    if w.shape[1] == 0:
        raise ValueError("cross_entropy over an empty vocabulary")   # checked by nx.cross_entropy
    return _lse_and_label_logit(h, w, labels.astype(jnp.int32), chunk_size(w.shape[1], chunk))


KERNEL = register(Kernel(
    op="cross_entropy", backend="xla", platforms=PLATFORMS, fn=cross_entropy,
    description="lax.fori_loop over vocab chunks, online logsumexp; custom_vjp recomputes chunks",
))
