"""Pallas fused cross-entropy forward (Triton style, CCE-like): the matmul
and the online logsumexp in one kernel, each logits tile only in registers.

Reference: :func:`nxops.kernels.xla.cross_entropy.cross_entropy` ([2, T]: the
logsumexp of ``h @ w`` over the vocab and the label's logit). Derivatives: the
recompute backward is the reference's (it recomputes the logits chunk by
chunk); the stored one (``backward="in_forward"``) makes the gradients in
the forward pass with ``softmax_in_place`` below between XLA's matmuls.

Grid ``(token blocks, vocab splits)``: program (i, s) walks the vocab tiles of
split ``s`` for ``bt`` tokens; per tile it accumulates ``h[bt, bk] @ w[bk, bv]``
over the hidden dim in f32 (``tl.dot``: tensor cores), masks the columns past
the vocab, and updates a running (max, sum of exp) and the label's logit.
The splits fill the SMs when there are few token blocks; their partial
(max, sum, logit), each [splits, T], are combined by a small XLA epilogue.

Not chosen by ``auto`` (no GPU measurement of it exists): select it with
``NXOPS_KERNELS=cross_entropy=pallas``. On CPU it runs in interpret mode.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from nxops.kernels._registry import Kernel, register
from nxops.kernels.pallas import _common
from nxops.kernels.xla import cross_entropy as xla_cross_entropy

F32 = jnp.float32
# Tiles: 64 tokens x 128 vocab columns, 64-wide hidden steps (a wgmma m64n128
# per step; 4 warps keep the f32 accumulator at 64 registers per thread).
BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_HIDDEN = 64, 128, 64
NUM_WARPS, NUM_STAGES = 4, 3
# Programs to aim for: two per SM of the largest GPU nxops compiles for (H100: 132).
TARGET_PROGRAMS = 264


def tiles(tokens: int, hidden: int, vocab: int) -> tuple[int, int, int]:
    """(bt, bk, bv): powers of two, at least 16 (``tl.dot``), at most the defaults."""
    def fit(n, top):
        return min(top, max(16, _common.next_power_of_2(n)))
    return fit(tokens, BLOCK_TOKENS), fit(hidden, BLOCK_HIDDEN), fit(vocab, BLOCK_VOCAB)


def vocab_splits(tokens: int, vocab: int, bt: int, bv: int) -> tuple[int, int]:
    """(splits, vocab tiles per split): enough splits for ``TARGET_PROGRAMS``."""
    token_blocks, vocab_tiles = pl.cdiv(tokens, bt), pl.cdiv(vocab, bv)
    splits = max(1, min(vocab_tiles, -(-TARGET_PROGRAMS // token_blocks)))
    per_split = pl.cdiv(vocab_tiles, splits)
    return pl.cdiv(vocab_tiles, per_split), per_split


def _dot(a, b, interpret: bool):
    """``a @ b`` in f32; interpreted (XLA:CPU) 16-bit blocks are upcast first
    (no bf16 x bf16 -> f32 dot there; the products are exact either way)."""
    if interpret and jnp.dtype(a.dtype).itemsize < 4:
        a, b = a.astype(F32), b.astype(F32)
    return jnp.dot(a, b, preferred_element_type=F32)


def _kernel(h_ref, w_ref, labels_ref, top_ref, total_ref, picked_ref, *, bt: int, bk: int, bv: int,
            per_split: int, interpret: bool):
    tokens, hidden = h_ref.shape
    vocab = w_ref.shape[1]
    i, split = pl.program_id(0), pl.program_id(1)
    rows = i * bt + lax.broadcasted_iota(jnp.int32, (bt,), 0)
    labels = plgpu.load(labels_ref.at[pl.ds(i * bt, bt)], mask=rows < tokens, other=-1)
    h_rows = i * bt + lax.broadcasted_iota(jnp.int32, (bt, bk), 0)

    def vocab_tile(jj, carry):
        top, total, picked = carry
        first = (split * per_split + jj) * bv
        w_cols = first + lax.broadcasted_iota(jnp.int32, (bk, bv), 1)

        def hidden_step(kk, acc):
            h_k = kk * bk + lax.broadcasted_iota(jnp.int32, (bt, bk), 1)
            w_k = kk * bk + lax.broadcasted_iota(jnp.int32, (bk, bv), 0)
            h = plgpu.load(h_ref.at[pl.ds(i * bt, bt), pl.ds(kk * bk, bk)],
                           mask=(h_rows < tokens) & (h_k < hidden), other=0.0)
            w = plgpu.load(w_ref.at[pl.ds(kk * bk, bk), pl.ds(first, bv)],
                           mask=(w_k < hidden) & (w_cols < vocab), other=0.0)
            return acc + _dot(h, w, interpret)

        logits = lax.fori_loop(0, pl.cdiv(hidden, bk), hidden_step, jnp.zeros((bt, bv), F32))
        cols = first + lax.broadcasted_iota(jnp.int32, (bt, bv), 1)
        logits = jnp.where(cols < vocab, logits, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(logits, axis=1))
        # A tile wholly past the vocab (-inf), or a +inf logit: shift by 0.
        shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        total = total * jnp.exp(top - shift) + jnp.sum(jnp.exp(logits - shift[:, None]), axis=1)
        # The padded columns past the vocab are no label's (a label there is another shard's).
        hit = (cols == labels[:, None]) & (cols < vocab)
        picked = picked + jnp.sum(jnp.where(hit, logits, 0.0), axis=1)
        return new_top, total, picked

    init = (jnp.full((bt,), -jnp.inf, F32), jnp.zeros((bt,), F32), jnp.zeros((bt,), F32))
    stats = lax.fori_loop(0, per_split, vocab_tile, init)
    for ref, value in zip((top_ref, total_ref, picked_ref), stats):
        plgpu.store(ref.at[split, pl.ds(i * bt, bt)], value, mask=rows < tokens)


def _combine_splits(top, total, picked):
    """[splits, T] partial (max, sum of exp, logit) -> [2, T] (lse, logit)."""
    best = jnp.max(top, axis=0)
    shift = jnp.where(jnp.isfinite(best), best, 0.0)
    lse = shift + jnp.log(jnp.sum(total * jnp.exp(top - shift), axis=0))
    return jnp.stack([lse, jnp.sum(picked, axis=0)])


def cross_entropy(h: jax.Array, w: jax.Array, labels: jax.Array, *, chunk: int | None = None,
                  backward: str = "auto", platform: str = "cuda") -> jax.Array:
    """[2, T] f32 as the reference (``chunk`` is the reference's; the kernel
    tiles itself; ``backward`` is the primitive's)."""
    del chunk, backward
    target = _common.target_for(platform, "triton")
    (tokens, hidden), vocab = h.shape, w.shape[1]
    bt, bk, bv = tiles(tokens, hidden, vocab)
    splits, per_split = vocab_splits(tokens, vocab, bt, bv)
    partial = pl.pallas_call(
        functools.partial(_kernel, bt=bt, bk=bk, bv=bv, per_split=per_split,
                          interpret=target.interpret),
        out_shape=[jax.ShapeDtypeStruct((splits, tokens), F32)] * 3,
        grid=(pl.cdiv(tokens, bt), splits),
        name="nxops_cross_entropy",
        cost_estimate=_common.cost_estimate(
            [h] * splits + [w] * pl.cdiv(tokens, bt), [((3, splits, tokens), F32)],
            flops=2 * tokens * hidden * vocab, transcendentals=tokens * vocab),
        **_common.call_kwargs(target, num_warps=NUM_WARPS, num_stages=NUM_STAGES),
    )(h, w, labels.astype(jnp.int32))
    return _combine_splits(*partial)


# --- the gradients in the forward pass (three matmuls) -------------------------
#
# As Liger-Kernel's fused linear cross-entropy: per token block, XLA's matmul
# makes the block's logits [block, V] (f32), a kernel turns them in place
# into the softmax (``input_output_aliases``: no second [block, V] array;
# for 16-bit inputs the softmax is written in their dtype instead, the
# matmuls' operand) and gives each row's logsumexp, and XLA's matmuls make softmax·wᵀ and
# hᵀ·softmax from it. The loop over the blocks, the label's part (a gather)
# and the backward are the reference's (``xla.cross_entropy
# .forward_with_grads_by`` and ``backward_from_stored``): only the pass over
# each row's logits is a kernel here.

# Rows per program and columns per step of the softmax kernel: a [4, 1024]
# f32 tile is 32 values per thread at 4 warps.
SOFTMAX_ROWS, SOFTMAX_COLUMNS = 4, 1024
# Where the stored path runs the kernel (CPU: interpreted); elsewhere the reference's.
STORED_PLATFORMS = ("cpu", "cuda")


def _softmax_kernel(logits_ref, softmax_ref, lse_ref, *, rows: int, columns: int):
    tokens, vocab = logits_ref.shape
    i = pl.program_id(0)
    row_ids = i * rows + lax.broadcasted_iota(jnp.int32, (rows, columns), 0)
    steps = pl.cdiv(vocab, columns)

    def tile(j):
        cols = j * columns + lax.broadcasted_iota(jnp.int32, (rows, columns), 1)
        return pl.ds(j * columns, columns), (row_ids < tokens) & (cols < vocab)

    def online(j, carry):
        top, total = carry
        cols, mask = tile(j)
        logits = plgpu.load(logits_ref.at[pl.ds(i * rows, rows), cols], mask=mask,
                            other=-jnp.inf)
        new_top = jnp.maximum(top, jnp.max(logits, axis=1))
        # A row whose logits are all -inf so far (or one +inf): shift by 0.
        shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        total = total * jnp.exp(top - shift) + jnp.sum(jnp.exp(logits - shift[:, None]), axis=1)
        return new_top, total

    init = (jnp.full((rows,), -jnp.inf, F32), jnp.zeros((rows,), F32))
    top, total = lax.fori_loop(0, steps, online, init)
    lse = jnp.where(jnp.isfinite(top), top, 0.0) + jnp.log(total)

    def normalize(j, _):
        cols, mask = tile(j)
        block = logits_ref.at[pl.ds(i * rows, rows), cols]
        logits = plgpu.load(block, mask=mask, other=-jnp.inf)
        plgpu.store(softmax_ref.at[pl.ds(i * rows, rows), cols],
                    jnp.exp(logits - lse[:, None]).astype(softmax_ref.dtype), mask=mask)
        return 0

    lax.fori_loop(0, steps, normalize, 0)
    first_rows = i * rows + lax.broadcasted_iota(jnp.int32, (rows,), 0)
    plgpu.store(lse_ref.at[pl.ds(i * rows, rows)], lse, mask=first_rows < tokens)


def softmax_in_place(logits: jax.Array, *, dtype, platform: str):
    """(softmax of each row of ``logits`` [T, V] f32 in ``dtype``, the
    matmuls' operand dtype; its logsumexp [T] f32), the form
    ``forward_with_grads_by`` takes (no row sums). An f32 softmax is written
    over the logits; a 16-bit one is a new array of half their size, which
    spares XLA's casts of an f32 softmax for the two matmuls."""
    target = _common.target_for(platform, "triton")
    tokens, vocab = logits.shape
    columns = min(SOFTMAX_COLUMNS, max(16, _common.next_power_of_2(vocab)))
    dtype = jnp.dtype(dtype)
    softmax, lse = pl.pallas_call(
        functools.partial(_softmax_kernel, rows=SOFTMAX_ROWS, columns=columns),
        out_shape=[jax.ShapeDtypeStruct(logits.shape, dtype),
                   jax.ShapeDtypeStruct((tokens,), F32)],
        grid=(pl.cdiv(tokens, SOFTMAX_ROWS),),
        input_output_aliases={0: 0} if dtype == F32 else {},
        name="nxops_cross_entropy_softmax",
        cost_estimate=_common.cost_estimate([logits, logits], [((tokens, vocab), dtype),
                                                               ((tokens,), F32)],
                                            flops=4 * tokens * vocab,
                                            transcendentals=2 * tokens * vocab),
        **_common.call_kwargs(target, num_warps=NUM_WARPS, num_stages=1),
    )(logits)
    return softmax, None, lse


@functools.partial(jax.jit, static_argnames=("platform",))
def forward_with_grads(h, w, labels, *, platform: str):
    """The reference's ``forward_with_grads`` with each block's softmax made
    by the kernel (in place over the logits)."""
    return xla_cross_entropy.forward_with_grads_by(
        h, w, labels, functools.partial(softmax_in_place, dtype=h.dtype, platform=platform))


def not_supported_reasons(h, w, labels, *, platform: str, **params) -> list[str]:
    del labels, params
    reasons = []
    if platform == "tpu":
        reasons.append("no Mosaic (TPU) version of the fused cross-entropy kernel")
    if jnp.dtype(h.dtype) not in _common.FLOAT_DTYPES:
        reasons.append(f"dtype {h.dtype} (the kernel takes float32, bfloat16, float16)")
    return reasons + _common.too_large_reasons(h.shape, w.shape)


KERNEL = register(Kernel(
    op="cross_entropy", backend="pallas", platforms=("cpu", "cuda"), fn=cross_entropy,
    not_supported_reasons=not_supported_reasons,
    description="Pallas (Triton) matmul + online logsumexp per token block and vocab split "
                "(forward; the stored backward's softmax in place between XLA matmuls)",
))
