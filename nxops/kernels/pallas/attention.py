"""Pallas flash attention (Triton style) with the logsumexp, global positions
and an optional additive bias: forward and FlashAttention-2 backward.

Reference: :func:`nxops.kernels.xla.attention.attention` (the op's
semantics: ``q`` [B, Tq, D], ``k`` [B, Tk, D], ``v`` [B, Tk, E], int32
positions ``q_pos`` [B, Tq] and ``k_pos`` [B, Tk], the causal mask keeps key
j for query i where ``k_pos[j] <= q_pos[i]``, optional f32 ``bias``
[1 or B, Tq, Tk]; result f32 [B, Tq, E + 1]: the output, then the logsumexp).

Why not JAX's own op (``jax.experimental.pallas.ops.gpu.attention.mha``,
which this module follows: one program per query block walking the key
blocks with the online softmax in base 2; a backward that recomputes the
probabilities from the saved logsumexp): it cannot take what ``nx.attention``
needs. Its causal mask compares block-local indices (no global positions, so
a ring step whose keys come from another device's shard would be masked
wrongly), it takes no bias, it raises unless both sequence lengths are
multiples of its blocks, its logsumexp comes back only with
``return_residuals=True``, which then cannot be differentiated, and its
fused backward needs as many query blocks as key blocks. Grouped-query
attention needs nothing of a kernel here: ``nx.attention``'s batching puts a
key/value head's query heads into more query rows of one batch member.

Forward, grid ``(query blocks, B)``: program (i, b) holds ``bq`` queries in
registers and walks the ``bk``-key blocks (``fori_loop``); a key block the
causal mask hides wholly from the query block (the least key position above
the greatest query position) is skipped (``lax.cond``), so no assumption on
the positions' order is needed. Rows past the sequences are masked loads;
head dims that are not powers of two (>= 16, ``tl.dot``'s least) are
zero-padded by the wrapper (no out-of-bounds slice: JAX 0.12 rejects a
static one).

Backward (FlashAttention-2), from the cotangent rows of the reference
(``xla.attention.cotangent_rows``: the output's cotangent, the logsumexp and
the softmax's row constant): one kernel, grid ``(key blocks, B)``, holds a
key block's dk, dv in f32 and walks the query blocks; a second, grid
``(query blocks, B)``, holds a query block's dq and walks the key blocks
(and writes the bias's gradient, the scores' cotangent, where there is a
bias). Two kernels rather than JAX's one fused launch: no atomics and no
equal-block-count constraint.

Registered twice: the forward as ``attention``, the backward as
``attention_backward`` (``nx.attention``'s gradient runs it where the
selection takes it); called directly, :func:`attention` is differentiable
with the backward kernels (``_vjp.with_vjp``). Not chosen by ``auto`` until
a GPU (a TPU) has measured it (``kernels/measured``): select it with
``NXOPS_KERNELS=attention=pallas``. On CPU it runs in interpret mode.

On TPU the ``pallas`` kernels are JAX's own Pallas TPU flash attention,
forward and backward (:mod:`nxops.kernels.pallas.attention_tpu`, which says
why flash and not splash, and which cases it declines).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from nxops.kernels import _vjp
from nxops.kernels._registry import Kernel, register
from nxops.kernels.pallas import _common, attention_tpu
from nxops.kernels.xla import attention as reference

F32 = jnp.float32
LOG2E = math.log2(math.e)
# Masked positions: a padded query row sees no key, a padded key column is
# seen by no query (these never win a max or lose a min of real positions).
BELOW_ALL, ABOVE_ALL = -(2**31), 2**31 - 1
# Tiles. Forward: 64 queries x 64 keys per step with 4 warps; with head dims
# of 128 the f32 accumulator and the scores are 64 + 32 registers per thread
# (more warps only for larger heads). Backward, (queries, keys) per step, 8
# warps past head dims of 64: dk/dv holds two f32 accumulators of a key
# block (with 4 warps and 64 x 64 it spilled at head dim 128 on an H100
# compile; 64 x 64 with 8 warps took 255 registers under JAX 0.12's Triton:
# 32-query steps leave room); dq holds one of a query block.
FORWARD_BLOCKS, DKDV_BLOCKS, DQ_BLOCKS = (64, 64), (32, 64), (64, 64)
NUM_STAGES = 2


def head_padding(d: int) -> int:
    """The head dim as loaded: a power of two, at least 16 (``tl.dot``)."""
    return max(16, _common.next_power_of_2(d))


def blocks(tq: int, tk: int, caps: tuple[int, int]) -> tuple[int, int]:
    """(bq, bk): powers of two, at least 16, at most ``caps``."""
    return tuple(min(c, max(16, _common.next_power_of_2(n))) for n, c in zip((tq, tk), caps))


def num_warps(d: int, e: int, backward: bool = False) -> int:
    return 4 if max(d, e) <= (64 if backward else 128) else 8


def _dot(a, b, interpret: bool, trans_a: bool = False, trans_b: bool = False):
    """``a @ b`` in f32 (operands in their dtype on tensor cores). Interpreted
    (XLA:CPU) 16-bit operands are widened first: it has no 16-bit x 16-bit ->
    f32 dot, and the products are exact either way."""
    if interpret and jnp.dtype(a.dtype).itemsize < 4:
        a, b = a.astype(F32), b.astype(F32)
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=F32)


class _Tile:
    """The rows ``[start, start + size)`` of a sequence of ``length`` (the
    head dims are whole: the wrapper pads them to ``head_padding``)."""

    def __init__(self, start, size: int, length: int):
        self.start, self.size, self.length = start, size, length
        self.index = start + lax.broadcasted_iota(jnp.int32, (size,), 0)
        self.valid = self.index < length

    def load(self, ref, b):
        return plgpu.load(ref.at[b, pl.ds(self.start, self.size), :],
                          mask=self.valid[:, None], other=0.0)

    def load_rows(self, ref, b, other):
        return plgpu.load(ref.at[b, pl.ds(self.start, self.size)], mask=self.valid, other=other)

    def store(self, ref, b, value):
        plgpu.store(ref.at[b, pl.ds(self.start, self.size), :], value.astype(ref.dtype),
                    mask=self.valid[:, None])

    def store_rows(self, ref, b, value):
        plgpu.store(ref.at[b, pl.ds(self.start, self.size)], value.astype(ref.dtype),
                    mask=self.valid)


def _bias_block(bias_ref, b, rows: _Tile, cols: _Tile):
    bb = jnp.minimum(b, bias_ref.shape[0] - 1)   # a bias shared by the batch: row 0
    return plgpu.load(bias_ref.at[bb, pl.ds(rows.start, rows.size), pl.ds(cols.start, cols.size)],
                      mask=rows.valid[:, None] & cols.valid[None, :], other=0.0)


def _scores2(q, k, bias, qp, kp, rows: _Tile, cols: _Tile, *, scale: float, causal: bool,
             interpret: bool):
    """[bq, bk] f32 scores in base 2 (``log2(e)`` folded into the scale, as
    JAX's op: ``exp2`` is one instruction), -inf where masked."""
    s = _dot(q, k, interpret, trans_b=True) * (scale * LOG2E)
    if bias is not None:
        s = s + bias * LOG2E
    keep = rows.valid[:, None] & cols.valid[None, :]
    if causal:
        keep = keep & (kp[None, :] <= qp[:, None])
    return jnp.where(keep, s, -jnp.inf)


def _visible(qp, kp, causal: bool):
    """Whether any key of the block is visible to any query of the block."""
    return jnp.min(kp) <= jnp.max(qp) if causal else True


def _maybe(visible, compute, carry):
    """``compute(carry)`` where the block pair has a visible key, else ``carry``."""
    if visible is True:
        return compute(carry)
    return lax.cond(visible, compute, lambda c: c, carry)


# --- forward --------------------------------------------------------------------


def _forward_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, *refs, scale: float, causal: bool,
                    bq: int, bk: int, interpret: bool):
    bias_ref, (o_ref, lse_ref) = (refs[0], refs[1:]) if len(refs) == 3 else (None, refs)
    (_, tq, _), (tk, ep) = q_ref.shape, v_ref.shape[1:]
    i, b = pl.program_id(0), pl.program_id(1)
    rows = _Tile(i * bq, bq, tq)
    q = rows.load(q_ref, b)
    qp = rows.load_rows(qp_ref, b, BELOW_ALL)

    def key_block(j, carry):
        cols = _Tile(j * bk, bk, tk)
        kp = cols.load_rows(kp_ref, b, ABOVE_ALL)

        def compute(carry):
            top, total, acc = carry
            bias = None if bias_ref is None else _bias_block(bias_ref, b, rows, cols)
            s = _scores2(q, cols.load(k_ref, b), bias, qp, kp, rows, cols, scale=scale,
                         causal=causal, interpret=interpret)
            new_top = jnp.maximum(top, jnp.max(s, axis=1))
            shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)   # a row with no key yet
            rescale = jnp.exp2(top - shift)
            p = jnp.exp2(s - shift[:, None])
            v = cols.load(v_ref, b)
            acc = acc * rescale[:, None] + _dot(p.astype(v.dtype), v, interpret)
            return new_top, total * rescale + jnp.sum(p, axis=1), acc

        return _maybe(_visible(qp, kp, causal), compute, carry)

    init = (jnp.full((bq,), -jnp.inf, F32), jnp.zeros((bq,), F32), jnp.zeros((bq, ep), F32))
    top, total, acc = lax.fori_loop(0, pl.cdiv(tk, bk), key_block, init)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    rows.store(o_ref, b, jnp.where(seen[:, None], acc / safe[:, None], 0.0))
    lse = jnp.where(seen, (jnp.where(jnp.isfinite(top), top, 0.0) + jnp.log2(safe)) / LOG2E,
                    -jnp.inf)
    rows.store_rows(lse_ref, b, lse)


def _pad_heads(x, width: int):
    """``x`` with its head dim zero-padded to ``width`` (the dots' sums are
    unchanged; a copy only where the head dim is not a power of two >= 16)."""
    extra = width - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, ((0, 0), (0, 0), (0, extra)))


def forward(q, k, v, q_pos, k_pos, bias=None, *, scale: float, causal: bool,
            platform: str = "cuda", **params) -> jax.Array:
    """[B, Tq, E + 1] f32 as the reference (``params``: the reference's block
    size and the like, unused: the kernel tiles itself)."""
    if platform == "tpu":
        return attention_tpu.forward(q, k, v, q_pos, k_pos, bias, scale=scale, causal=causal)
    del params
    target = _common.target_for(platform, "triton")
    (batch, tq, d), (tk, e) = q.shape, v.shape[1:]
    bq, bk = blocks(tq, tk, FORWARD_BLOCKS)
    dp, ep = head_padding(d), head_padding(e)
    operands = (_pad_heads(q, dp), _pad_heads(k, dp), _pad_heads(v, ep),
                q_pos.astype(jnp.int32), k_pos.astype(jnp.int32))
    operands += () if bias is None else (bias.astype(F32),)
    o, lse = pl.pallas_call(
        functools.partial(_forward_kernel, scale=float(scale), causal=bool(causal), bq=bq, bk=bk,
                          interpret=target.interpret),
        out_shape=[jax.ShapeDtypeStruct((batch, tq, ep), F32),
                   jax.ShapeDtypeStruct((batch, tq), F32)],
        grid=(pl.cdiv(tq, bq), batch),
        name="nxops_attention_forward",
        cost_estimate=_common.cost_estimate(
            [q, v] + [k, v] * pl.cdiv(tq, bq), [((batch, tq, e + 1), F32)],
            flops=2 * batch * tq * tk * (d + e), transcendentals=batch * tq * tk),
        **_common.call_kwargs(target, num_warps=num_warps(d, e), num_stages=NUM_STAGES),
    )(*operands)
    return jnp.concatenate([o[..., :e], lse[..., None]], axis=-1)


# --- backward -------------------------------------------------------------------


def _recompute(q, k, g_o, v, bias, qp, kp, lse, row_term, rows, cols, *, scale, causal,
               interpret):
    """(p, ds) of a block pair: the probabilities from the saved logsumexp and
    the scores' cotangent ``p * (g_o·v + row_term)`` (the reference's)."""
    s = _scores2(q, k, bias, qp, kp, rows, cols, scale=scale, causal=causal, interpret=interpret)
    p = jnp.exp2(s - lse[:, None] * LOG2E)
    dp = _dot(g_o, v, interpret, trans_b=True)
    return p, p * (dp + row_term[:, None])


def _dkdv_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, g_ref, lse_ref, rt_ref, *refs,
                 scale: float, causal: bool, bq: int, bk: int, interpret: bool):
    bias_ref, (dk_ref, dv_ref) = (refs[0], refs[1:]) if len(refs) == 3 else (None, refs)
    (_, tq, dp), (tk, ep) = q_ref.shape, v_ref.shape[1:]
    j, b = pl.program_id(0), pl.program_id(1)
    cols = _Tile(j * bk, bk, tk)
    k, v = cols.load(k_ref, b), cols.load(v_ref, b)
    kp = cols.load_rows(kp_ref, b, ABOVE_ALL)

    def query_block(i, carry):
        rows = _Tile(i * bq, bq, tq)
        qp = rows.load_rows(qp_ref, b, BELOW_ALL)

        def compute(carry):
            dk, dv = carry
            q, g_o = rows.load(q_ref, b), rows.load(g_ref, b)
            bias = None if bias_ref is None else _bias_block(bias_ref, b, rows, cols)
            p, ds = _recompute(q, k, g_o, v, bias, qp, kp, rows.load_rows(lse_ref, b, jnp.inf),
                               rows.load_rows(rt_ref, b, 0.0), rows, cols, scale=scale,
                               causal=causal, interpret=interpret)
            dv = dv + _dot(p.astype(g_o.dtype), g_o, interpret, trans_a=True)
            dk = dk + _dot(ds.astype(q.dtype), q, interpret, trans_a=True)
            return dk, dv

        return _maybe(_visible(qp, kp, causal), compute, carry)

    dk, dv = lax.fori_loop(0, pl.cdiv(tq, bq), query_block,
                           (jnp.zeros((bk, dp), F32), jnp.zeros((bk, ep), F32)))
    cols.store(dk_ref, b, dk * scale)
    cols.store(dv_ref, b, dv)


def _dq_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, g_ref, lse_ref, rt_ref, *refs,
               scale: float, causal: bool, bq: int, bk: int, interpret: bool):
    bias_ref, dq_ref, dbias_ref = refs if len(refs) == 3 else (None, refs[0], None)
    (_, tq, dp), (tk, _) = q_ref.shape, v_ref.shape[1:]
    i, b = pl.program_id(0), pl.program_id(1)
    rows = _Tile(i * bq, bq, tq)
    q, g_o = rows.load(q_ref, b), rows.load(g_ref, b)
    qp = rows.load_rows(qp_ref, b, BELOW_ALL)
    lse, row_term = rows.load_rows(lse_ref, b, jnp.inf), rows.load_rows(rt_ref, b, 0.0)

    def key_block(j, dq):
        cols = _Tile(j * bk, bk, tk)
        kp = cols.load_rows(kp_ref, b, ABOVE_ALL)

        def compute(dq):
            k, v = cols.load(k_ref, b), cols.load(v_ref, b)
            bias = None if bias_ref is None else _bias_block(bias_ref, b, rows, cols)
            _, ds = _recompute(q, k, g_o, v, bias, qp, kp, lse, row_term, rows, cols,
                               scale=scale, causal=causal, interpret=interpret)
            if dbias_ref is not None:
                plgpu.store(dbias_ref.at[b, pl.ds(rows.start, bq), pl.ds(cols.start, bk)], ds,
                            mask=rows.valid[:, None] & cols.valid[None, :])
            return dq + _dot(ds.astype(k.dtype), k, interpret)

        # With a bias every block is computed: a hidden block's bias gradient
        # (zeros) is written too.
        visible = True if dbias_ref is not None else _visible(qp, kp, causal)
        return _maybe(visible, compute, dq)

    dq = lax.fori_loop(0, pl.cdiv(tk, bk), key_block, jnp.zeros((bq, dp), F32))
    rows.store(dq_ref, b, dq * scale)


def backward_from_rows(q, k, v, q_pos, k_pos, bias, g_o, lse, row_term, *, scale: float,
                       causal: bool, platform: str = "cuda"):
    """(dq, dk, dv, dbias) from ``reference.cotangent_rows``, in the dtypes of
    q, k, v (dbias f32, None without a bias)."""
    if platform == "tpu":
        return (*attention_tpu.backward(q, k, v, q_pos, k_pos, g_o, lse, row_term, bias,
                                        scale=scale, causal=causal), None)
    target = _common.target_for(platform, "triton")
    (batch, tq, d), (tk, e) = q.shape, v.shape[1:]
    dp, ep = head_padding(d), head_padding(e)
    padded = (_pad_heads(q, dp), _pad_heads(k, dp), _pad_heads(v, ep))
    operands = (*padded, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32),
                _pad_heads(g_o.astype(v.dtype), ep), lse.astype(F32), row_term.astype(F32))
    operands += () if bias is None else (bias.astype(F32),)
    static = dict(scale=float(scale), causal=bool(causal), interpret=target.interpret)
    kwargs = _common.call_kwargs(target, num_warps=num_warps(d, e, backward=True),
                                 num_stages=NUM_STAGES)
    flops = 4 * batch * tq * tk * (d + e)
    bq, bk = blocks(tq, tk, DKDV_BLOCKS)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, bq=bq, bk=bk, **static),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in padded[1:]],
        grid=(pl.cdiv(tk, bk), batch), name="nxops_attention_dkdv",
        cost_estimate=_common.cost_estimate([k, v] + [q, g_o] * pl.cdiv(tk, bk), [k, v],
                                            flops=flops, transcendentals=batch * tq * tk),
        **kwargs)(*operands)
    out_shape = [jax.ShapeDtypeStruct(padded[0].shape, q.dtype)]
    if bias is not None:
        out_shape.append(jax.ShapeDtypeStruct((batch, tq, tk), F32))
    bq, bk = blocks(tq, tk, DQ_BLOCKS)
    results = pl.pallas_call(
        functools.partial(_dq_kernel, bq=bq, bk=bk, **static), out_shape=out_shape,
        grid=(pl.cdiv(tq, bq), batch), name="nxops_attention_dq",
        cost_estimate=_common.cost_estimate([q, g_o] + [k, v] * pl.cdiv(tq, bq), [q],
                                            flops=flops * 3 // 4, transcendentals=batch * tq * tk),
        **kwargs)(*operands)
    dq, dk, dv = results[0][..., :d], dk[..., :d], dv[..., :e]
    dbias = results[1] if bias is not None else None
    if dbias is not None and bias.shape[0] != batch:   # one bias shared by the batch
        dbias = jnp.sum(dbias, axis=0, keepdims=True)
    return dq, dk, dv, dbias


def attention_vjp(q, k, v, q_pos, k_pos, bias=None, *, out, g, scale: float, causal: bool,
                  platform: str = "cuda", **params):
    """The cotangents of (q, k, v, q_pos, k_pos[, bias]) for ``g`` [B, Tq, E + 1]."""
    del params
    rows = reference.cotangent_rows(out[..., :-1], out[..., -1], g[..., :-1], g[..., -1], v.dtype)
    dq, dk, dv, dbias = backward_from_rows(q, k, v, q_pos, k_pos, bias, *rows, scale=scale,
                                           causal=causal, platform=platform)
    return (dq, dk, dv, None, None) + (() if bias is None else (dbias,))


_attention = _vjp.with_vjp(forward, attention_vjp)


def attention(q, k, v, q_pos, k_pos, bias=None, *, scale: float, causal: bool,
              platform: str = "cuda", **params) -> jax.Array:
    """The registry's entry: the reference's signature; differentiable (the
    backward kernels above) where called directly. On tpu, where nothing
    reads the logsumexp (``need_lse=False``: not differentiated either), the
    kernel writes no softmax statistics."""
    if platform == "tpu" and not params.get("need_lse", True):
        return attention_tpu.forward(q, k, v, q_pos, k_pos, bias, scale=scale, causal=causal,
                                     need_lse=False)
    del params
    operands = (q, k, v, q_pos, k_pos) + (() if bias is None else (bias,))
    return _attention(*operands, scale=float(scale), causal=bool(causal), platform=platform)


def not_supported_reasons(q, k, v, q_pos, k_pos, bias=None, *, platform: str,
                          **params) -> list[str]:
    if platform == "tpu":
        return attention_tpu.not_supported_reasons(q, k, v, q_pos, k_pos, bias, **params)
    del q_pos, k_pos, params
    reasons = []
    if jnp.dtype(q.dtype) not in _common.FLOAT_DTYPES:
        reasons.append(f"dtype {q.dtype} (the kernel takes float32, bfloat16, float16)")
    if max(q.shape[-1], v.shape[-1]) > 256:
        reasons.append(f"head dims {q.shape[-1]}, {v.shape[-1]}: the kernel holds a block's "
                       f"heads in registers, up to 256")
    shapes = [q.shape, k.shape, v.shape] + ([] if bias is None else [bias.shape])
    return reasons + _common.too_large_reasons(*shapes)


KERNEL = register(Kernel(
    op="attention", backend="pallas", platforms=("cpu", "cuda", "tpu"), fn=attention,
    not_supported_reasons=not_supported_reasons, manual_only_platforms=("tpu",),
    description="Pallas flash attention with the logsumexp: on cuda/cpu per query block (Triton "
                "style) with global positions and bias; on tpu JAX's Pallas TPU flash attention",
))


def attention_backward(q, k, v, q_pos, k_pos, g_o, lse, row_term, bias=None, *, scale: float,
                       causal: bool, platform: str = "cuda", **params) -> tuple[jax.Array, ...]:
    """The registry's ``attention_backward``: the reference's signature and results."""
    del params
    dq, dk, dv, dbias = backward_from_rows(q, k, v, q_pos, k_pos, bias, g_o, lse, row_term,
                                           scale=scale, causal=causal, platform=platform)
    return (dq, dk, dv) + (() if bias is None else (dbias,))


def backward_not_supported_reasons(q, k, v, q_pos, k_pos, g_o, lse, row_term, bias=None, *,
                                   platform: str, **params) -> list[str]:
    del g_o, lse, row_term
    return not_supported_reasons(q, k, v, q_pos, k_pos, bias, platform=platform, **params)


BACKWARD_KERNEL = register(Kernel(
    op="attention_backward", backend="pallas", platforms=("cpu", "cuda", "tpu"),
    fn=attention_backward, not_supported_reasons=backward_not_supported_reasons,
    manual_only_platforms=("tpu",),
    description="Pallas FlashAttention-2 backward recomputed from the saved logsumexp: dk, dv "
                "per key block, dq (and the bias's gradient) per query block; on tpu JAX's "
                "Pallas TPU flash attention's backward",
))
