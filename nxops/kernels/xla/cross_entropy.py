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

# Default columns per step: as many as keep one step's f32 logits within
# this budget (8192 tokens: 128 columns, 4 MiB), a power of two in [128, 4096].
CHUNK_LOGITS_BYTES = 4 << 20
MIN_CHUNK, MAX_CHUNK = 128, 4096


def chunk_size(tokens: int, vocab: int, chunk: int | None) -> int:
    """Columns per step: ``chunk``, or by default the budget's; at most the vocab."""
    if chunk is None:
        fits = CHUNK_LOGITS_BYTES // (4 * max(tokens, 1))
        chunk = min(MAX_CHUNK, max(MIN_CHUNK, 1 << max(fits, 1).bit_length() - 1))
    return max(1, min(chunk, vocab))


def _chunk_starts(vocab: int, size: int) -> tuple[int, int]:
    """(number of chunks, start of the last one). Every chunk has ``size``
    columns: the last one starts at ``vocab - size`` (no padded copy of w),
    and the columns it shares with the one before are masked out of it."""
    count = -(-vocab // size)
    return count, vocab - size


def _chunk(w, step, size: int, vocab: int):
    """(w's columns of chunk ``step``, their vocab ids, which of them are new)."""
    if size < vocab:
        # The barrier ties w to the loop's step, so that nothing of the whole
        # w is loop-invariant: XLA:CPU computes a bf16 slice in f32, and would
        # hoist the convert of the whole weight out of the loop (a 2x-sized
        # copy of it); inside the loop it fuses into the slice and converts
        # one chunk. (One chunk: no loop, and the barrier would only block fusion.)
        w, step = lax.optimization_barrier((w, step))
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
        # dh takes each column once; dw's columns shared with the chunk before
        # are recomputed whole and overwritten (a plain in-place update).
        dh = dh + lax.dot_general(jnp.where(new, dlogits, 0.0).astype(h.dtype), w_chunk,
                                  (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        dw_chunk = lax.dot_general(h, dlogits.astype(h.dtype), (((0,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        return dh, lax.dynamic_update_slice_in_dim(dw, dw_chunk.astype(dw.dtype), start, axis=1)

    init = (jnp.zeros(h.shape, jnp.float32), jnp.zeros(w.shape, w.dtype))
    dh, dw = lax.fori_loop(0, count, step, init)
    return dh.astype(h.dtype), dw


def forward(h, w, labels, size: int) -> jax.Array:
    """[2, T]: the logsumexp and the label's logit (no derivative: see ``cross_entropy``)."""
    return jnp.stack(_forward(h, w, labels, size))


def backward(h, w, labels, lse, g, size: int):
    """(dh, dw) for the cotangent ``g`` [2, T] of ``forward``'s result."""
    return _backward(h, w, labels, lse, g[0], g[1], size)


def differentiable(forward_fn):
    """``forward_fn(h, w, labels, size)`` with this module's backward as its VJP
    (the registry's kernels compute the forward; every one shares the backward)."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def fused(h, w, labels, size):
        return forward_fn(h, w, labels, size)

    def fwd(h, w, labels, size):
        out = forward_fn(h, w, labels, size)
        return out, (h, w, labels, out[0])

    def bwd(size, residuals, g):
        h, w, labels, lse = residuals
        dh, dw = backward(h, w, labels, lse, g, size)
        return dh, dw, None

    fused.defvjp(fwd, bwd)
    return fused


_lse_and_label_logit = differentiable(forward)


def cross_entropy(h: jax.Array, w: jax.Array, labels: jax.Array, *, chunk: int | None = None,
                  platform: str = "cpu") -> jax.Array:
    """[2, T] f32: the logsumexp of ``h @ w`` over its V columns, and the
    logit at ``labels`` (0 where a label is outside [0, V)). Differentiable
    in ``h`` and ``w`` without materializing [T, V]. ``chunk``: columns per
    step (None: see ``chunk_size``)."""
    del platform
    if w.shape[1] == 0:
        raise ValueError("cross_entropy over an empty vocabulary")   # checked by nx.cross_entropy
    size = chunk_size(h.shape[0], w.shape[1], chunk)
    return _lse_and_label_logit(h, w, labels.astype(jnp.int32), size)


KERNEL = register(Kernel(
    op="cross_entropy", backend="xla", platforms=PLATFORMS, fn=cross_entropy,
    description="lax.fori_loop over vocab chunks, online logsumexp; custom_vjp recomputes chunks",
))
