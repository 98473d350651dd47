"""Reference fused cross-entropy: a loop over vocab chunks that never holds
the tokens x vocab logits, forward or backward.

Positional: ``h`` [T, H], ``w`` [H, V], ``labels`` [T] (int, already local to
this vocab shard: a label outside [0, V) picks nothing). The result is one
f32 array [2, T]: row 0 the logsumexp over the V columns, row 1 the label's
logit (0 where the label is outside [0, V)). Two results stacked in one, so
that the op is one kernel primitive with one output.

The forward carries the online (max, sum of exp) per token. The derivative
pieces that ``nx.cross_entropy``'s primitive assembles live here too:
``tangent`` (forward mode), ``backward`` (recomputes each chunk's logits from
the saved logsumexp and produces dh, accumulated in f32, and dw chunk by
chunk), and ``forward_with_grads`` / ``backward_from_stored`` (three matmuls:
the gradients made in the forward pass, scaled in the backward). Dots take
the inputs' dtype and accumulate in f32; the backward's dot operands are
d(logits) cast to that dtype, as the unfused program's transposed einsum
would take them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from nxops._jax import varying_like
from nxops.kernels._registry import PLATFORMS, Kernel, register

# Default columns per step: as many as keep one step's f32 logits within
# this budget (8192 tokens: 128 columns, 4 MiB), a power of two in [128, 4096].
CHUNK_LOGITS_BYTES = 4 << 20
MIN_CHUNK, MAX_CHUNK = 128, 4096


def chunk_size(tokens: int, vocab: int, chunk: int | None) -> int:
    """Columns per step: ``chunk``, or by default the budget's; at most the
    vocab. A symbolic token count (``nx.export``) takes the smallest default."""
    if chunk is None and not isinstance(tokens, int):
        chunk = MIN_CHUNK
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


F32 = jnp.float32


def _dot(a, b, contracting: tuple[tuple[int], tuple[int]], dtype=None):
    """``a``·``b`` over the ``contracting`` dims, accumulated in f32, the
    operands taken in ``dtype`` (default: ``a``'s; f32 operands are rounded
    to a 16-bit ``dtype`` first). On XLA:CPU 16-bit operands are upcast
    instead: its dot thunks lack some bf16 x bf16 -> f32 layouts (a transposed
    ``h`` under jit), and a product of two 16-bit floats is exact in f32, so
    the result is the same (and an f32 operand is used unrounded there)."""
    dtype = jnp.dtype(dtype or a.dtype)

    def native(a, b):
        return lax.dot_general(a, b, (contracting, ((), ())), preferred_element_type=F32)

    if dtype.itemsize >= 4:
        return native(a, b)
    return lax.platform_dependent(a, b, cpu=lambda a, b: native(a.astype(F32), b.astype(F32)),
                                  default=lambda a, b: native(a.astype(dtype), b.astype(dtype)))


def _logits(h, w_chunk):
    return _dot(h, w_chunk, ((1,), (0,)))


def _online_step(carry, logits, hit):
    """One chunk's update of the per-token (max, sum of exp, label's logit)."""
    top, total, picked = carry
    new_top = jnp.maximum(top, jnp.max(logits, axis=1))
    # A token whose logits are all -inf (or one +inf) so far: shift by 0 there.
    shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
    total = total * jnp.exp(top - shift) + jnp.sum(jnp.exp(logits - shift[:, None]), axis=1)
    return new_top, total, picked + jnp.sum(jnp.where(hit, logits, 0.0), axis=1)


def _forward(h, w, labels, size: int):
    vocab = w.shape[1]
    count, _ = _chunk_starts(vocab, size)
    tokens = h.shape[0]

    def step(i, carry):
        w_chunk, _, columns, new = _chunk(w, i, size, vocab)
        logits = jnp.where(new, _logits(h, w_chunk), -jnp.inf)
        return _online_step(carry, logits, (columns == labels[:, None]) & new)

    init = (jnp.full((tokens,), -jnp.inf, F32), jnp.zeros((tokens,), F32),
            jnp.zeros((tokens,), F32))
    top, total, picked = lax.fori_loop(0, count, step, varying_like(init, h, w, labels))
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    return shift + jnp.log(total), picked


def _columns(x, start, size: int):
    return lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _tangent(h, w, labels, lse, dh, dw, size: int):
    """Forward mode: (d logsumexp, d label logit) for tangents ``dh`` / ``dw``
    (either None: zero). d(logits) = dh·w + h·dw per chunk, weighted by the
    chunk's softmax (from the known logsumexp) and picked at the label."""
    vocab = w.shape[1]
    count, _ = _chunk_starts(vocab, size)

    def step(i, carry):
        d_lse, d_picked = carry
        w_chunk, start, columns, new = _chunk(w, i, size, vocab)
        softmax = jnp.exp(_logits(h, w_chunk) - lse[:, None])
        dlogits = jnp.zeros(softmax.shape, F32)
        if dh is not None:
            dlogits = dlogits + _dot(dh, w_chunk, ((1,), (0,)))
        if dw is not None:
            dlogits = dlogits + _dot(h, _columns(dw, start, size), ((1,), (0,)))
        dlogits = jnp.where(new, dlogits, 0.0)
        hit = columns == labels[:, None]
        return (d_lse + jnp.sum(jnp.where(new, softmax * dlogits, 0.0), axis=1),
                d_picked + jnp.sum(jnp.where(hit, dlogits, 0.0), axis=1))

    zeros = jnp.zeros(labels.shape, F32)
    init = varying_like((zeros, zeros), h, w, labels, lse, dh, dw)
    return jnp.stack(lax.fori_loop(0, count, step, init))


def _live_rows(g_lse, g_picked):
    """Tokens with a cotangent: the others give no gradient, whatever their
    inputs (a NaN in an ignored row must not reach dw through 0 * NaN)."""
    return (g_lse != 0) | (g_picked != 0)


# The recompute backward's token blocks: all the tokens in one while their
# f32 dh fits this budget; beyond it, blocks of as many as fit. Off CPU the
# blocks are the outer loop, each with its own loop over the vocab chunks, so
# that no f32 array of all the tokens is held (vocab-parallel: the partial dh
# before the sum over the shards); their dw parts add into one array of w's
# dtype (in 16-bit floats dw is then a sum of that many rounded partial sums,
# as where the tokens are on several devices). On CPU the vocab chunks stay
# the outer loop and the blocks are the inner one: XLA:CPU copies a 16-bit
# dw that a loop reads and updates (a dw-sized temp), so dh is accumulated in
# f32 there, and the blocks bound each step's products and h's f32 copy.
DH_BLOCK_BYTES = 8 << 20


def backward_token_block(tokens: int, hidden: int) -> int:
    """Tokens per block of the recompute backward (see ``DH_BLOCK_BYTES``):
    all of them while their f32 dh fits, else the largest power of two that does."""
    fits = max(1, DH_BLOCK_BYTES // (4 * max(hidden, 1)))
    if tokens <= fits:
        return tokens
    return 1 << (fits.bit_length() - 1)


def _block_rows(tokens: int, block: int, i):
    """(first row of token block ``i``, which of its rows are new): the last
    block ends at the last token and shares rows with the one before."""
    first = i * block
    start = jnp.minimum(first, tokens - block)
    return start, start + lax.broadcasted_iota(jnp.int32, (block,), 0) >= first


def _backward_block(h, w, labels, lse, g_lse, g_picked, dw, rows_new, size: int,
                    need_dh: bool, need_dw: bool):
    """One token block's (f32 dh rows, ``dw`` with the block's part added):
    d(logits) = softmax * g_lse + onehot(label) * g_picked, each chunk's
    logits recomputed from the saved logsumexp. ``rows_new``: the rows not
    in the block before (None: all), the only ones added into dw."""
    vocab = w.shape[1]
    count, _ = _chunk_starts(vocab, size)
    # (A NaN row of h would still reach dw through its zero d(logits): the
    # named layer replaces ignored rows before the primitive. Replacing them
    # here too would cost a tokens x hidden copy of h.)
    live = _live_rows(g_lse, g_picked)[:, None]

    def step(i, carry):
        dh, dw = carry
        w_chunk, start, columns, new = _chunk(w, i, size, vocab)
        softmax = jnp.exp(_logits(h, w_chunk) - lse[:, None])
        hit = columns == labels[:, None]
        dlogits = softmax * g_lse[:, None] + jnp.where(hit, g_picked[:, None], 0.0)
        dlogits = jnp.where(live, dlogits, 0.0)
        # dh takes each column once.
        if need_dh:
            dh = dh + _dot(jnp.where(new, dlogits, 0.0).astype(h.dtype), w_chunk, ((1,), (1,)))
        if need_dw and rows_new is None:
            # One block: dw's columns shared with the chunk before are
            # recomputed whole and overwritten (a plain in-place update).
            dw_chunk = _dot(h, dlogits.astype(h.dtype), ((0,), (0,)))
            dw = lax.dynamic_update_slice_in_dim(dw, dw_chunk.astype(dw.dtype), start, axis=1)
        elif need_dw:
            # Blocks: the new rows' part of the new columns, added.
            dlogits = jnp.where(new & rows_new[:, None], dlogits, 0.0)
            dw_chunk = _dot(h, dlogits.astype(h.dtype), ((0,), (0,)))
            dw = lax.dynamic_update_slice_in_dim(
                dw, (_columns(dw, start, size).astype(F32) + dw_chunk).astype(dw.dtype),
                start, axis=1)
        return dh, dw

    init = (jnp.zeros(h.shape if need_dh else (0,), F32), dw)
    return lax.fori_loop(0, count, step,
                         varying_like(init, h, w, labels, lse, g_lse, g_picked, rows_new))


# The recompute backward's loop orders (see ``DH_BLOCK_BYTES``): the token
# blocks inside the vocab chunks (CPU's), or the vocab chunks inside the
# token blocks (the others').
ORDERS = ("blocks_inside", "chunks_inside")


def _backward(h, w, labels, lse, g_lse, g_picked, size: int, need_dh: bool = True,
              need_dw: bool = True, block: int | None = None, order: str | None = None):
    """(dh, dw) for cotangents ``g_lse`` of the logsumexp and ``g_picked`` of
    the label's logit (None for a gradient not needed), by token blocks of
    ``block`` rows (None: all the tokens in one), in loop ``order`` (None:
    the lowering platform's, see ``DH_BLOCK_BYTES``)."""
    block = h.shape[0] if block is None else min(block, h.shape[0])
    by_order = {name: functools.partial(fn, size=size, block=block, need_dh=need_dh,
                                        need_dw=need_dw)
                for name, fn in zip(ORDERS, (_backward_blocks_inner, _backward_blocks))}
    args = (h, w, labels, lse, g_lse, g_picked)
    if order is not None:
        dh, dw = by_order[order](*args)
    elif block == h.shape[0]:
        dh, dw = by_order["chunks_inside"](*args)
    else:
        dh, dw = lax.platform_dependent(*args, cpu=by_order["blocks_inside"],
                                        default=by_order["chunks_inside"])
    return (dh if need_dh else None), (dw if need_dw else None)


def _backward_blocks_inner(h, w, labels, lse, g_lse, g_picked, *, size: int, block: int,
                           need_dh: bool, need_dw: bool):
    """(dh, dw) with the vocab chunks outer and the token blocks inner: an f32
    dh of all the tokens, each chunk's dw summed over the blocks in f32 and
    written once."""
    (tokens, hidden), vocab = h.shape, w.shape[1]
    if block == tokens:
        return _backward_blocks(h, w, labels, lse, g_lse, g_picked, size=size, block=block,
                                need_dh=need_dh, need_dw=need_dw)
    count, _ = _chunk_starts(vocab, size)
    live = _live_rows(g_lse, g_picked)
    operands = (h, w, labels, lse, g_lse, g_picked)

    def chunk_step(i, carry):
        dh, dw = carry
        w_chunk, start, columns, new = _chunk(w, i, size, vocab)

        def block_step(b, block_carry):
            dh, dw_chunk = block_carry
            # The barrier keeps the slices of h in the loop (no f32 copy of
            # the whole h hoisted out of it on XLA:CPU, as for w in ``_chunk``).
            h_all, b = lax.optimization_barrier((h, b))
            first, rows_new = _block_rows(tokens, block, b)
            rows = functools.partial(lax.dynamic_slice_in_dim, start_index=first,
                                     slice_size=block, axis=0)
            h_block = rows(h_all)
            softmax = jnp.exp(_logits(h_block, w_chunk) - rows(lse)[:, None])
            hit = columns == rows(labels)[:, None]
            dlogits = softmax * rows(g_lse)[:, None] + jnp.where(hit, rows(g_picked)[:, None],
                                                                 0.0)
            dlogits = jnp.where((rows(live) & rows_new)[:, None], dlogits, 0.0)
            if need_dh:
                update = _dot(jnp.where(new, dlogits, 0.0).astype(h.dtype), w_chunk,
                              ((1,), (1,)))
                dh = lax.dynamic_update_slice_in_dim(dh, rows(dh) + update, first, axis=0)
            if need_dw:
                dw_chunk = dw_chunk + _dot(h_block, dlogits.astype(h.dtype), ((0,), (0,)))
            return dh, dw_chunk

        init = varying_like((dh, jnp.zeros((hidden, size) if need_dw else (0,), F32)), *operands)
        dh, dw_chunk = lax.fori_loop(0, -(-tokens // block), block_step, init)
        if need_dw:
            # The columns shared with the chunk before: recomputed whole, overwritten.
            dw = lax.dynamic_update_slice_in_dim(dw, dw_chunk.astype(dw.dtype), start, axis=1)
        return dh, dw

    init = (jnp.zeros(h.shape if need_dh else (0,), F32),
            jnp.zeros(w.shape if need_dw else (0,), w.dtype))
    dh, dw = lax.fori_loop(0, count, chunk_step, varying_like(init, *operands))
    return dh.astype(h.dtype), dw


def _backward_blocks(h, w, labels, lse, g_lse, g_picked, *, size: int, block: int,
                     need_dh: bool, need_dw: bool):
    """(dh, dw) by token blocks of ``block`` rows (empty for one not needed)."""
    tokens = h.shape[0]
    dw = jnp.zeros(w.shape if need_dw else (0,), w.dtype)
    if block == tokens:
        dh, dw = _backward_block(h, w, labels, lse, g_lse, g_picked, dw, None, size,
                                 need_dh, need_dw)
        return dh.astype(h.dtype), dw

    def step(i, carry):
        dh, dw = carry
        # The barrier keeps the slices of h in the loop (no f32 copy of the
        # whole h hoisted out of it on XLA:CPU, as for w in ``_chunk``).
        h_all, i = lax.optimization_barrier((h, i))
        start, rows_new = _block_rows(tokens, block, i)
        rows = functools.partial(lax.dynamic_slice_in_dim, start_index=start, slice_size=block,
                                 axis=0)
        dh_block, dw = _backward_block(rows(h_all), w, rows(labels), rows(lse), rows(g_lse),
                                       rows(g_picked), dw, rows_new, size, need_dh, need_dw)
        if need_dh:
            dh = lax.dynamic_update_slice_in_dim(dh, dh_block.astype(h.dtype), start, axis=0)
        return dh, dw

    dh = jnp.zeros(h.shape if need_dh else (0,), h.dtype)
    init = varying_like((dh, dw), h, w, labels, lse, g_lse, g_picked)
    return lax.fori_loop(0, -(-tokens // block), step, init)


def forward(h, w, labels, size: int) -> jax.Array:
    """[2, T]: the logsumexp and the label's logit (no derivative: see ``cross_entropy``)."""
    return jnp.stack(_forward(h, w, labels, size))


def backward(h, w, labels, lse, g, size: int, need_dh: bool = True, need_dw: bool = True,
             block: int | None = None, order: str | None = None):
    """(dh, dw) for the cotangent ``g`` [2, T] of ``forward``'s result, by
    token blocks of ``block`` rows (None: one; see ``backward_token_block``)
    in loop ``order`` (one of ``ORDERS``; None: the lowering platform's)."""
    return _backward(h, w, labels, lse, g[0], g[1], size, need_dh, need_dw, block, order)


def tangent(h, w, labels, lse, dh, dw, size: int) -> jax.Array:
    """[2, T]: the tangent of ``forward``'s result for tangents ``dh``, ``dw`` (None: zero)."""
    return _tangent(h, w, labels, lse, dh, dw, size)


# --- gradients in the forward pass (three matmuls) -----------------------------
#
# A token block at a time, with the block's logits over the whole vocabulary
# (as Liger-Kernel's fused linear cross-entropy): the softmax is final within
# the step, so the step also makes softmax·wᵀ (the block's rows of dh per unit
# cotangent of the logsumexp) and adds hᵀ·softmax into dw. The backward scales
# them: dh exactly for any per-token cotangent; dw only when the logsumexp's
# cotangent is one number c for every token that reaches dw (a sum or mean of
# the losses, ignored positions zeroed), dw = c·(hᵀ·softmax). Otherwise (a
# z-loss, per-token weights) the backward recomputes dw by chunks instead.
# The label's one-hot part is a gather (dh) and a scatter-add (dw).

# One block's f32 logits [tokens in block, vocab]: within this, or within
# twice the f32 dw the path holds anyway where that is larger (fewer, larger
# blocks: fewer read-modify-writes of dw, each a matmul over more tokens; on
# CPU at 2048 x 512 x 32768, 1024-token blocks beat 512-token ones).
BLOCK_LOGITS_BYTES = 32 << 20
# The stored path holds an f32 dw and dh from the forward to the backward:
# ``auto`` takes it while those fit this budget, and recomputes beyond.
STORED_GRADS_BYTES = 256 << 20


def token_block(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per step of the stored path: a power of two whose logits fit the budget."""
    fits = max(1, max(BLOCK_LOGITS_BYTES, 8 * hidden * vocab) // (4 * max(vocab, 1)))
    return max(1, min(tokens, 1 << (fits.bit_length() - 1)))


def stored_grads_fit(tokens, hidden: int, vocab: int) -> bool:
    """Whether ``auto`` stores the gradients (static sizes only)."""
    if not all(isinstance(n, int) for n in (tokens, hidden, vocab)):
        return False
    return 4 * (hidden * vocab + tokens * hidden) <= STORED_GRADS_BYTES and tokens > 0


def label_logits(h, w, labels):
    """[T] f32: each token's logit at its label (0 where the label is outside
    [0, V)): a gather of w's label columns, not a pass over the logits."""
    own = (labels >= 0) & (labels < w.shape[1])
    columns = jnp.take(w, jnp.where(own, labels, 0), axis=1).T          # [T, H]
    picked = jnp.sum(h.astype(F32) * columns.astype(F32), axis=1)
    return jnp.where(own, picked, 0.0)


def exp_rows(logits):
    """A block's (exponentials shifted by each row's max, their row sums,
    logsumexp). The softmax's normalization is per token: the caller scales
    dh's rows and h's rows (for dw) by it, never the [block, V] exponentials."""
    top = jnp.max(logits, axis=1)
    # A row whose logits are all -inf (or one +inf): shift by 0 there.
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    exp = jnp.exp(logits - shift[:, None])
    total = jnp.sum(exp, axis=1)
    return exp, total, shift + jnp.log(total)


def forward_with_grads_by(h, w, labels, block_softmax):
    """(stats [2, T] as ``forward``, softmax·wᵀ [T, H] f32, hᵀ·softmax [H, V]
    f32), each block's softmax from ``block_softmax(logits [block, V] f32)``:
    (weights, row sums or None, logsumexp [block]); the softmax is the weights
    divided by the row sums (None: the weights are the softmax)."""
    (tokens, hidden), vocab = h.shape, w.shape[1]
    block = token_block(tokens, hidden, vocab)
    count = -(-tokens // block)

    def products(i):
        """Block ``i``'s (first row, logsumexp, rows of softmax·wᵀ, its hᵀ·softmax)."""
        first = i * block
        start = jnp.minimum(first, tokens - block)
        h_block = lax.dynamic_slice_in_dim(h, start, block, axis=0)
        # Rows shared with the block before: written again, added to dw once.
        new = (start + lax.broadcasted_iota(jnp.int32, (block, 1), 0)) >= first
        weights, total, lse_block = block_softmax(_logits(h_block, w))
        dh_block = _dot(weights, w, ((1,), (1,)), h.dtype)
        h_rows = h_block.astype(F32)
        if total is not None:
            dh_block, h_rows = dh_block / total[:, None], h_rows / total[:, None]
        dw_block = _dot(jnp.where(new, h_rows, 0.0), weights, ((0,), (0,)), h.dtype)
        return start, lse_block, dh_block, dw_block

    def write(carry, block_products):
        lse, dh_unit = carry
        start, lse_block, dh_block, _ = block_products
        return (lax.dynamic_update_slice_in_dim(lse, lse_block, start, axis=0),
                lax.dynamic_update_slice_in_dim(dh_unit, dh_block, start, axis=0))

    def step(i, carry):
        block_products = products(i)
        return (*write(carry[:2], block_products), carry[2] + block_products[3])

    # The first block's dw starts the sum (no zeros to add it to).
    first = products(0)
    init = (*write((jnp.zeros((tokens,), F32), jnp.zeros((tokens, hidden), F32)), first),
            first[3])
    lse, dh_unit, dw_unit = lax.fori_loop(1, count, step, varying_like(init, h, w, labels))
    return jnp.stack([lse, label_logits(h, w, labels)]), dh_unit, dw_unit


# Jitted: the primitive's JVP and transpose call these directly, and an eager
# jvp / jacfwd / hessian would otherwise dispatch their ops one at a time.
@jax.jit
def forward_with_grads(h, w, labels):
    """(stats [2, T] as ``forward``, softmax·wᵀ [T, H] f32, hᵀ·softmax [H, V] f32)."""
    return forward_with_grads_by(h, w, labels, exp_rows)


@functools.partial(jax.jit, static_argnames=("size", "need_dh", "need_dw"))
def backward_from_stored(h, w, labels, lse, g, dh_unit, dw_unit, size: int,
                         need_dh: bool = True, need_dw: bool = True):
    """(dh, dw) for the cotangent ``g`` [2, T] from ``forward_with_grads``'s
    products (dw by chunks, recomputed, where the logsumexp's cotangent is
    not one number over the tokens that reach dw)."""
    g_lse, g_picked = g[0], g[1]
    vocab = w.shape[1]
    live = _live_rows(g_lse, g_picked)
    own = (labels >= 0) & (labels < vocab)
    label_column = jnp.where(own, labels, 0)
    g_label = jnp.where(own & live, g_picked, 0.0)
    dh = dw = None
    if need_dh:
        label_rows = jnp.take(w, label_column, axis=1).T.astype(F32)   # [T, H]
        dh = g_lse[:, None] * dh_unit + g_label[:, None] * label_rows
        dh = jnp.where(live[:, None], dh, 0.0).astype(h.dtype)
    if need_dw:
        reaches = jnp.any(h != 0, axis=1)
        c = g_lse[jnp.argmax(reaches)]
        uniform = jnp.all(jnp.where(reaches, g_lse == c, True))

        def scaled():
            label_part = (g_label[:, None] * h.astype(F32)).T           # [H, T]
            return (c * dw_unit).at[:, label_column].add(label_part).astype(w.dtype)

        def recomputed():
            return _backward(h, w, labels, lse, g_lse, g_picked, size, need_dh=False)[1]

        # Both branches typed alike (check_vma): each may read fewer operands.
        operands = (h, w, labels, lse, g, dh_unit, dw_unit)
        dw = lax.cond(uniform, lambda: varying_like(scaled(), *operands),
                      lambda: varying_like(recomputed(), *operands))
    return dh, dw


def cross_entropy(h: jax.Array, w: jax.Array, labels: jax.Array, *, chunk: int | None = None,
                  backward: str = "auto", platform: str = "cpu") -> jax.Array:
    """[2, T] f32: the logsumexp of ``h @ w`` over its V columns, and the
    logit at ``labels`` (0 where a label is outside [0, V)). Not
    differentiable by itself: ``nx.cross_entropy``'s primitive gives the
    derivatives (``tangent``, ``backward``, ``forward_with_grads``).
    ``chunk``: columns per step (None: see ``chunk_size``); ``backward``
    is the primitive's, not this function's."""
    del platform, backward
    if w.shape[1] == 0:
        raise ValueError("cross_entropy over an empty vocabulary")   # checked by nx.cross_entropy
    size = chunk_size(h.shape[0], w.shape[1], chunk)
    return forward(h, w, labels.astype(jnp.int32), size)


KERNEL = register(Kernel(
    op="cross_entropy", backend="xla", platforms=PLATFORMS, fn=cross_entropy,
    description="lax.fori_loop over vocab chunks, online logsumexp (the derivatives are "
                "nx.cross_entropy's primitive's)",
))
