"""Reference blockwise attention (FlashAttention-2's algorithm in pure JAX):
never holds the queries x keys scores, forward or backward.

Positional: ``q`` [B, Tq, D], ``k`` [B, Tk, D], ``v`` [B, Tk, E], the global
positions ``q_pos`` [B, Tq] and ``k_pos`` [B, Tk] (int32; the causal mask
keeps key j for query i where ``k_pos[j] <= q_pos[i]``), and optionally an
additive ``bias`` [1 or B, Tq, Tk] (f32; -inf masks). The result is one f32
array [B, Tq, E + 1]: the normalized output, then the logsumexp of the
scaled, masked scores (-inf, with output 0, for a query that sees no key).
One result, so that the op is one kernel primitive with one output.

The forward loops over query blocks and, inside, over key blocks with the
online (max, sum of exp, weighted sum of values) carry; a block pair that the
causal mask hides wholly is skipped (``lax.cond``). The backward
(``jax.custom_vjp``) recomputes each block's probabilities from the saved
logsumexp, as FlashAttention-2 does, and accumulates dq, dk, dv (and the
bias's gradient) in f32: dq whole, dk and dv one key block at a time. Dots
take the inputs' dtype and accumulate in f32; the probabilities (and their
gradients) meet ``v`` (``q``, ``k``) in the inputs' dtype, as the
materialized program's dots would take them.

A last block that would run past the end starts earlier instead (no padded
copy of the operands), and masks the rows/columns it shares with the block
before.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from nxops._jax import varying_like
from nxops.kernels._registry import PLATFORMS, Kernel, register

# Default block (queries and keys per step): one step's f32 scores for 16
# heads of 512 x 512 are 16 MiB.
DEFAULT_BLOCK = 512
# The ``positions`` parameter's one value: ``q_pos[b, i] == i`` and
# ``k_pos[b, j] == j``, known statically (nx.attention built them from an
# iota), so a kernel whose causal mask compares local indices may take causal.
IOTA_POSITIONS = "iota"


def block_size(length: int, block: int | None) -> int:
    """Rows per block: ``block`` (default ``DEFAULT_BLOCK``), at most ``length``."""
    return max(1, min(block or DEFAULT_BLOCK, length))


class _Blocks:
    """Blocks of ``size`` along an axis of ``length``: the last one starts at
    ``length - size``; ``new`` marks the rows not in the block before."""

    def __init__(self, length: int, size: int):
        self.length, self.size = length, size
        self.count = -(-length // size)

    def start(self, step):
        return jnp.minimum(step * self.size, self.length - self.size)

    def new(self, step):
        rows = self.start(step) + lax.broadcasted_iota(jnp.int32, (self.size,), 0)
        return rows >= step * self.size

    def take(self, x, step, axis: int = 1):
        return lax.dynamic_slice_in_dim(x, self.start(step), self.size, axis=axis)

    def operand(self, x, step, dtype):
        """``take`` for a dot's operand in ``dtype``; ``x`` may hold its bits
        (a ring's shards travel as unsigned ints of the same width). XLA:CPU
        widens 16-bit dot operands to float32 and moves the widening out of
        the loop, onto the whole array where it can (an f32 copy of the
        operand, live throughout); from the bits it stays on the block."""
        block = self.take(x, step)
        return block if block.dtype == dtype else lax.bitcast_convert_type(block, dtype)


def _scores(q_blk, k_blk, q_pos, k_pos, bias_blk, *, scale: float, causal: bool):
    """[B, bq, bk] f32: scaled scores plus bias, -inf where causally masked."""
    s = lax.dot_general(q_blk, k_blk, (((2,), (2,)), ((0,), (0,))),
                        preferred_element_type=jnp.float32) * scale
    if bias_blk is not None:
        s = s + bias_blk
    if causal:
        s = jnp.where(k_pos[:, None, :] <= q_pos[:, :, None], s, -jnp.inf)
    return s


def _visible(q_pos, k_pos, causal: bool):
    """Whether any key of the block is visible to any query of the block."""
    if not causal:
        return jnp.bool_(True)
    return jnp.min(k_pos) <= jnp.max(q_pos)


def _finite_or_zero(x):
    return jnp.where(jnp.isfinite(x), x, 0.0)


def _forward(q, k, v, q_pos, k_pos, bias, *, scale, causal, block, into=None):
    """[B, Tq, E + 1]; with ``into`` (such rows from other keys: output and
    logsumexp) the online softmax continues from those rows, and the result,
    over both sets of keys, is written over them (no second buffer)."""
    batch, tq, _ = q.shape
    tk, e = v.shape[1], v.shape[2]
    qb, kb = _Blocks(tq, block_size(tq, block)), _Blocks(tk, block_size(tk, block))
    operands = (q, k, v, q_pos, k_pos, bias, into)

    def initial(i, out):
        """(max, sum of exp, weighted sum) of a query block before these keys."""
        if into is None:
            return varying_like((jnp.full((batch, qb.size), -jnp.inf, jnp.float32),
                                 jnp.zeros((batch, qb.size), jnp.float32),
                                 jnp.zeros((batch, qb.size, e), jnp.float32)), *operands)
        rows = qb.take(out, i)
        lse = rows[..., -1]
        seen = jnp.isfinite(lse)
        return lse, seen.astype(jnp.float32), jnp.where(seen[..., None], rows[..., :-1], 0.0)

    def query_block(i, out):
        q_blk, qp = qb.operand(q, i, q.dtype), qb.take(q_pos, i)
        bias_rows = None if bias is None else qb.take(bias, i)

        def key_block(j, carry):
            kp = kb.take(k_pos, j)

            def compute(carry):
                top, total, acc = carry
                bias_blk = None if bias_rows is None else kb.take(bias_rows, j, axis=2)
                s = _scores(q_blk, kb.operand(k, j, q.dtype), qp, kp, bias_blk, scale=scale, causal=causal)
                s = jnp.where(kb.new(j)[None, None, :], s, -jnp.inf)
                new_top = jnp.maximum(top, jnp.max(s, axis=2))
                shift = _finite_or_zero(new_top)
                rescale = jnp.exp(top - shift)
                p = jnp.exp(s - shift[..., None])
                total = total * rescale + jnp.sum(p, axis=2)
                pv = lax.dot_general(p.astype(q.dtype), kb.operand(v, j, q.dtype),
                                     (((2,), (1,)), ((0,), (0,))),
                                     preferred_element_type=jnp.float32)
                return new_top, total, acc * rescale[..., None] + pv

            return lax.cond(_visible(qp, kp, causal), compute, lambda c: c, carry)

        top, total, acc = lax.fori_loop(0, kb.count, key_block, initial(i, out))
        seen = total > 0
        o = jnp.where(seen[..., None], acc / jnp.where(seen, total, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, _finite_or_zero(top) + jnp.log(jnp.where(seen, total, 1.0)),
                        -jnp.inf)
        rows = jnp.concatenate([o, lse[..., None]], axis=2)
        if into is not None:
            # A last block that starts earlier continued rows the block
            # before had already taken these keys into: keep those.
            rows = jnp.where(qb.new(i)[None, :, None], rows, qb.take(out, i))
        return lax.dynamic_update_slice_in_dim(out, rows, qb.start(i), axis=1)

    out = jnp.zeros((batch, tq, e + 1), jnp.float32) if into is None else into
    return lax.fori_loop(0, qb.count, query_block, varying_like(out, *operands))


def continued(q, k, v, q_pos, k_pos, into, *, scale, causal, block):
    """``into`` ([B, Tq, E + 1] f32: output and logsumexp of the queries over
    other keys) updated to cover these keys too (ring attention's step)."""
    if q.shape[1] == 0 or k.shape[1] == 0:
        return into
    q_pos, k_pos = q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)
    return unless_hidden(
        lambda into: _forward(q, k, v, q_pos, k_pos, None, scale=float(scale),
                              causal=bool(causal), block=block, into=into),
        into, q_pos, k_pos, causal, q, k, v)


def unless_hidden(update, accumulators, q_pos, k_pos, causal, *operands):
    """``update(accumulators)``, or the accumulators as they are where the
    causal mask hides every key from every query (a ring's shard of later
    keys: one branch, not a loop over empty blocks). ``operands``: the arrays
    ``update`` reads, whose varying mesh axes (inside a ``check_vma``
    shard_map) the accumulators take, so that both branches agree."""
    accumulators = varying_like(accumulators, q_pos, k_pos, *operands)
    if not causal:
        return update(accumulators)
    return lax.cond(_visible(q_pos, k_pos, True), update, lambda x: x, accumulators)


def cotangent_rows(o, lse, g_o, g_lse, dtype):
    """What the backward reads of the output ``o``, its logsumexp and their
    cotangents: the output's cotangent in ``dtype`` (v's), and per query the
    logsumexp (+inf for a query that sees no key: exp(s - inf) = 0, no
    gradient) and the softmax's row constant ``d(lse) - rowsum(d(o) * o)``
    (d(score) = p * (d(p) + that): the softmax's Jacobian with the
    logsumexp's own cotangent folded in)."""
    row_term = g_lse - jnp.sum(g_o.astype(jnp.float32) * o.astype(jnp.float32), axis=2)
    return g_o.astype(dtype), jnp.where(jnp.isfinite(lse), lse, jnp.inf), row_term


def backward(q, k, v, q_pos, k_pos, bias, out, g, *, scale, causal, block):
    """(dq, dk, dv, dbias) for the cotangent ``g`` [B, Tq, E + 1] of ``out``,
    in the dtypes of q, k, v."""
    rows = cotangent_rows(out[..., :-1], out[..., -1], g[..., :-1], g[..., -1], v.dtype)
    return _backward_rows(q, k, v, q_pos, k_pos, bias, *rows,
                          scale=scale, causal=causal, block=block)


def _backward_rows(q, k, v, q_pos, k_pos, bias, g_o, lse, row_term, *, scale, causal, block,
                   into=None):
    """``backward`` from ``cotangent_rows``; with ``into`` (float32 dq, dk,
    dv) the gradients are added to those, in float32.

    FlashAttention-2's order: the outer loop over key blocks holds one block's
    dk, dv in f32 and writes them out once; the inner loop over query blocks
    adds each block's share into dq, the only whole f32 accumulator."""
    tq, tk = q.shape[1], k.shape[1]
    qb, kb = _Blocks(tq, block_size(tq, block)), _Blocks(tk, block_size(tk, block))
    operands = (q, k, v, q_pos, k_pos, bias, g_o, lse, row_term, into)

    def key_block(j, carry):
        dk, dv, dq, dbias = carry
        k_blk, v_blk = kb.operand(k, j, q.dtype), kb.operand(v, j, q.dtype)
        kp = kb.take(k_pos, j)
        new_cols = kb.new(j)[None, None, :]
        bias_cols = None if bias is None else kb.take(bias, j, axis=2)

        def query_block(i, inner):
            qp = qb.take(q_pos, i)

            def compute(inner):
                dk_blk, dv_blk, dq, dbias = inner
                q_blk, g_blk = qb.operand(q, i, q.dtype), qb.operand(g_o, i, q.dtype)
                bias_blk = None if bias_cols is None else qb.take(bias_cols, i)
                s = _scores(q_blk, k_blk, qp, kp, bias_blk, scale=scale, causal=causal)
                p = jnp.exp(s - qb.take(lse, i)[..., None])
                dp = lax.dot_general(g_blk, v_blk, (((2,), (2,)), ((0,), (0,))),
                                     preferred_element_type=jnp.float32)
                ds = p * (dp + qb.take(row_term, i)[..., None])
                if dbias is not None:   # overlapping blocks write the same values again
                    db = ds if dbias.shape[0] == ds.shape[0] else jnp.sum(ds, 0, keepdims=True)
                    dbias = lax.dynamic_update_slice(dbias, db, (0, qb.start(i), kb.start(j)))
                # Each pair counts once: a query row the block before took adds
                # nothing here. dk, dv take every column of this key block (only
                # the new ones are added, see _add_columns); dq, summed over key
                # blocks, only the columns the block before did not take.
                new_rows = qb.new(i)[None, :, None]
                ds_rows = jnp.where(new_rows, ds, 0.0).astype(q.dtype)
                p_rows = jnp.where(new_rows, p, 0.0).astype(q.dtype)
                dk_blk = dk_blk + lax.dot_general(ds_rows, q_blk, (((1,), (1,)), ((0,), (0,))),
                                                  preferred_element_type=jnp.float32)
                dv_blk = dv_blk + lax.dot_general(p_rows, g_blk, (((1,), (1,)), ((0,), (0,))),
                                                  preferred_element_type=jnp.float32)
                ds_pairs = jnp.where(new_cols, ds_rows, 0)
                dq_blk = lax.dot_general(ds_pairs, k_blk, (((2,), (1,)), ((0,), (0,))),
                                         preferred_element_type=jnp.float32)
                return dk_blk, dv_blk, _add_rows(dq, dq_blk * scale, qb.start(i)), dbias

            return lax.cond(_visible(qp, kp, causal), compute, lambda c: c, inner)

        init = (jnp.zeros(k_blk.shape, jnp.float32), jnp.zeros(v_blk.shape, jnp.float32), dq,
                dbias)
        dk_blk, dv_blk, dq, dbias = lax.fori_loop(0, qb.count, query_block,
                                                  varying_like(init, *operands))
        return _add_columns(dk, dk_blk * scale, kb, j), _add_columns(dv, dv_blk, kb, j), dq, dbias

    dq, dk, dv = into or (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, k.dtype),
                          jnp.zeros(v.shape, v.dtype))
    dbias = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
    dk, dv, dq, dbias = lax.fori_loop(0, kb.count, key_block,
                                      varying_like((dk, dv, dq, dbias), *operands))
    return (dq if into else dq.astype(q.dtype)), dk, dv, dbias


def _add_columns(acc, block, blocks, step):
    """``acc`` with a key block's gradient added: only its columns that the
    block before did not take (a last block that starts earlier recomputes
    those whole, and they are already in)."""
    new = blocks.new(step)[None, :, None]
    current = blocks.take(acc, step)
    updated = current + jnp.where(new, block, 0.0).astype(acc.dtype)
    return lax.dynamic_update_slice_in_dim(acc, updated, blocks.start(step), axis=1)


def partial_gradients(q, k, v, q_pos, k_pos, g_o, lse, row_term, dq, dk, dv, *, scale,
                      causal, block):
    """The float32 accumulators dq, dk, dv plus one key shard's share of the
    gradient, from ``cotangent_rows`` of the output over every shard (the
    logsumexp is the whole softmax's, so each shard's probabilities are
    already normalized): the shares sum to the whole gradient (ring
    attention's backward)."""
    if q.shape[1] == 0 or k.shape[1] == 0:
        return dq, dk, dv
    q_pos, k_pos = q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)

    def update(accumulators):
        return _backward_rows(q, k, v, q_pos, k_pos, None, g_o, lse, row_term,
                              scale=float(scale), causal=bool(causal), block=block,
                              into=accumulators)[:3]
    return unless_hidden(update, (dq, dk, dv), q_pos, k_pos, causal, q, k, v, g_o, lse, row_term)


def _add_rows(acc, rows, start):
    current = lax.dynamic_slice_in_dim(acc, start, rows.shape[1], axis=1)
    return lax.dynamic_update_slice_in_dim(acc, current + rows, start, axis=1)


def _empty_result(q, v):
    """No queries or no keys: output 0, logsumexp -inf (a softmax over nothing)."""
    out = jnp.zeros((*q.shape[:2], v.shape[2] + 1), jnp.float32)
    return out.at[..., -1].set(-jnp.inf)


def differentiable(forward_fn):
    """``forward_fn(q, k, v, q_pos, k_pos, bias, config)`` with this module's
    backward as its VJP (every forward kernel shares the backward). ``config``
    is the static (scale, causal, block)."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
    def fused(q, k, v, q_pos, k_pos, bias, config):
        return forward_fn(q, k, v, q_pos, k_pos, bias, config)

    def fwd(q, k, v, q_pos, k_pos, bias, config):
        out = forward_fn(q, k, v, q_pos, k_pos, bias, config)
        return out, (q, k, v, q_pos, k_pos, bias, out)

    def bwd(config, residuals, g):
        q, k, v, q_pos, k_pos, bias, out = residuals
        scale, causal, block = config
        dq, dk, dv, dbias = backward(q, k, v, q_pos, k_pos, bias, out, g, scale=scale,
                                      causal=causal, block=block)
        return dq, dk, dv, None, None, dbias

    fused.defvjp(fwd, bwd)
    return fused


def forward(q, k, v, q_pos, k_pos, bias, config) -> jax.Array:
    """[B, Tq, E + 1] (no derivative: see ``attention``)."""
    scale, causal, block = config
    return _forward(q, k, v, q_pos, k_pos, bias, scale=scale, causal=causal, block=block)


_fused = differentiable(forward)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
              bias: jax.Array | None = None, *, scale: float, causal: bool,
              block: int | None = None, platform: str = "cpu",
              need_lse: bool = True, positions: str | None = None) -> jax.Array:
    """[B, Tq, E + 1] f32: ``softmax(q·k * scale + bias, masked) · v`` and the
    logsumexp, differentiable in q, k, v and bias without materializing
    [Tq, Tk]. ``block``: queries and keys per step (None: ``DEFAULT_BLOCK``);
    ``need_lse``: whether anything reads the logsumexp (it is computed either
    way); ``positions``: ``"iota"`` where ``q_pos[b, i] == i`` and ``k_pos[b,
    j] == j`` are known statically (kernels whose causal mask is on local
    indices may then take causal), else None (the arrays say)."""
    del platform, need_lse, positions
    if q.shape[1] == 0 or k.shape[1] == 0:
        return _empty_result(q, v)
    return _fused(q, k, v, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32),
                  None if bias is None else bias.astype(jnp.float32),
                  (float(scale), bool(causal), block))


KERNEL = register(Kernel(
    op="attention", backend="xla", platforms=PLATFORMS, fn=attention,
    description="fori_loops over query and key blocks, online softmax, causal blocks skipped; "
                "custom_vjp recomputes from the saved logsumexp (FlashAttention-2)",
))
