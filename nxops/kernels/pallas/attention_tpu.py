"""JAX's Pallas TPU flash attention (``jax.experimental.pallas.ops.tpu.
flash_attention``, Mosaic) as the ``pallas`` attention kernel on TPU, forward
and backward, for the cases whose meaning it gives exactly.

The op's semantics are :func:`nxops.kernels.xla.attention.attention`'s: q
[B, Tq, D], k [B, Tk, D], v [B, Tk, E], positions [B, Tq] and [B, Tk], result
f32 [B, Tq, E + 1] (output, logsumexp). Each batch member is one head of
JAX's [batch, heads, T, D] layout.

Why JAX's flash attention and not its splash attention
(``ops.tpu.splash_attention``): flash takes the softmax scale as a
parameter (applied to the f32 scores, as the op does; splash wants q
pre-scaled, rounded in q's dtype), and its backward is two functions
(``_flash_attention_bwd_dkv``, ``_flash_attention_bwd_dq``) that take the
saved softmax statistics ``l``, ``m`` and the row constant ``di``: exactly
the rows the op's own backward op receives (the logsumexp as ``m`` with
``l = 1``, and ``di = -row_term``), so the backward registers as
``attention_backward`` like the GPU kernel's. Splash's backward is reachable
only through its custom VJP, its mask is a static NumPy object, and it
returns the logsumexp only as a residual. What splash has that flash lacks
(a grouped-query kernel, finer block skipping) ``nx.attention`` does not
need here: it folds a key/value head's query heads into query rows.

What it cannot give exactly, and so declines (:func:`not_supported_reasons`):

- the causal mask compares block-local indices (row i sees column j <= i),
  so it takes causal only where the positions are known to be 0..Tq-1 and
  0..Tk-1 (the ``positions="iota"`` parameter, set by ``nx.attention`` when
  it builds them from an unmapped sequence itself);
- its bias is added before the scale and taken per head ([B, H, Tq, Tk]):
  no bias or mask;
- the values' head dim must equal the keys'; a head dim above 128 must be a
  multiple of 128; float32 and bfloat16 only;
- the keys' length must be a multiple of 128 (its key blocks tile the lanes
  of the softmax statistics); the queries' a multiple of 128, or at most 128
  and a multiple of 8 (one block of sublanes).

Its output comes back in q's dtype (the op's is f32): a bf16 call rounds
the output once there, where ``nx.attention`` rounds it anyway.

On ``platform="cpu"`` the same kernels run in Pallas's TPU interpret mode
(``pltpu.force_tpu_interpret_mode``), for tests.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

from nxops.kernels.xla.attention import IOTA_POSITIONS

F32 = jnp.float32
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# JAX's default block sizes (BlockSizes.get_default): 128 everywhere. Its
# key blocks must be multiples of the lanes (MIN_BLOCK_SIZE = 128).
BLOCK = jax_flash.MIN_BLOCK_SIZE
SUBLANES = jax_flash.NUM_SUBLANES
MAX_SMALL_HEAD_DIM = jax_flash.MIN_BLOCK_SIZE
# JAX names its backward kernels (flash_mha_bwd_dkv_..., flash_mha_bwd_dq_...)
# but not its forward: this scope names it in the compiled program.
FORWARD_NAME = "flash_mha_fwd"


def _interpreted(platform: str):
    """Pallas's TPU interpret mode on cpu (tests); nothing on tpu."""
    return pltpu.force_tpu_interpret_mode() if platform == "cpu" else contextlib.nullcontext()


def query_block(tq: int) -> int:
    return min(BLOCK, tq)


def _heads(x):
    """[B, T, D] -> JAX's [batch, heads, T, D]: one head per batch member."""
    return x[:, None]


def forward(q, k, v, q_pos, k_pos, bias=None, *, scale: float, causal: bool,
            platform: str = "tpu", need_lse: bool = True, **params) -> jax.Array:
    """[B, Tq, E + 1] f32: the output and the logsumexp (``m + log(l)`` of
    the kernel's softmax statistics, in the scaled scores' units). The
    kernel writes those statistics broadcast over 128 lanes (two f32 arrays
    of [B, Tq, 128]); with ``need_lse=False`` (nothing reads the logsumexp)
    it writes none and the column is NaN."""
    del q_pos, k_pos, params   # the causal mask is the kernel's own (see not_supported_reasons)
    if bias is not None:
        raise ValueError("the TPU flash attention takes no bias (see not_supported_reasons)")
    bq, bk = query_block(q.shape[1]), BLOCK
    with _interpreted(platform), jax.named_scope(FORWARD_NAME):
        result = jax_flash._flash_attention_impl(
            _heads(q), _heads(k), _heads(v), None, None, bool(need_lse), bool(causal),
            float(scale), 1, bq, bk, bk, False)
    if need_lse:
        o, l, m = result
        lse = m[:, 0] + jnp.log(l[:, 0])
    else:
        o, lse = result, jnp.full(q.shape[:2], jnp.nan, F32)
    return jnp.concatenate([o[:, 0].astype(F32), lse[..., None]], axis=-1)


def backward(q, k, v, q_pos, k_pos, g_o, lse, row_term, bias=None, *, scale: float,
             causal: bool, platform: str = "tpu", **params) -> tuple[jax.Array, ...]:
    """(dq, dk, dv) from the op's cotangent rows: the kernels recompute
    ``exp(s - m) / l`` with ``m`` the logsumexp and ``l = 1``, and take
    ``ds = p * (dp - di)`` with ``di = -row_term``."""
    del q_pos, k_pos, params
    if bias is not None:
        raise ValueError("the TPU flash attention takes no bias (see not_supported_reasons)")
    bq, bk = query_block(q.shape[1]), BLOCK
    operands = (_heads(q), _heads(k), _heads(v), None, None)
    rows = (jnp.ones(lse.shape, F32)[:, None], lse.astype(F32)[:, None],
            _heads(g_o.astype(q.dtype)), -row_term.astype(F32)[:, None])
    static = dict(sm_scale=float(scale), causal=bool(causal),
                  mask_value=jax_flash.DEFAULT_MASK_VALUE, debug=False)
    with _interpreted(platform):
        dk, dv = jax_flash._flash_attention_bwd_dkv(
            *operands, *rows, block_q_major=bq, block_q=bq, block_k_major=bk, block_k=bk,
            **static)
        dq, _ = jax_flash._flash_attention_bwd_dq(
            *operands, *rows, block_q_major=bq, block_k_major=bk, block_k=bk, **static)
    return dq[:, 0].astype(q.dtype), dk[:, 0].astype(k.dtype), dv[:, 0].astype(v.dtype)


def not_supported_reasons(q, k, v, q_pos, k_pos, bias=None, *, causal: bool = False,
                          positions: str | None = None, **params) -> list[str]:
    """Why JAX's TPU flash attention cannot give this case exactly (empty: it can)."""
    del q_pos, k_pos, params
    reasons = []
    if causal and positions != IOTA_POSITIONS:
        reasons.append(
            "causal with positions given as arrays: the TPU kernel's causal mask compares "
            "block-local indices, so it needs query i at position i and key j at j, which "
            "nx.attention knows only where it builds the positions itself (an unmapped "
            "sequence, no SequenceLayout, one query row per position: not a ring step, "
            "user positions, or query heads folded into rows)")
    if bias is not None:
        reasons.append("a bias or mask: the TPU kernel adds its bias before the scale and per "
                       "head ([B, H, Tq, Tk])")
    if jnp.dtype(q.dtype) not in DTYPES:
        reasons.append(f"dtype {jnp.dtype(q.dtype)}: the TPU kernel takes float32 and bfloat16")
    (tq, d), (tk, e) = q.shape[1:], v.shape[1:]
    if d != e:
        reasons.append(f"query/key head dim {d} differs from the values' {e} (the TPU kernel "
                       f"needs them equal)")
    if d > MAX_SMALL_HEAD_DIM and d % BLOCK:
        reasons.append(f"head dim {d}: above {MAX_SMALL_HEAD_DIM} the TPU kernel needs a "
                       f"multiple of {BLOCK}")
    if tk % BLOCK:
        reasons.append(f"key length {tk}: the TPU kernel needs a multiple of {BLOCK} (its key "
                       f"blocks)")
    if (tq % BLOCK) if tq > BLOCK else (tq % SUBLANES):
        reasons.append(f"query length {tq}: the TPU kernel needs a multiple of {BLOCK}, or at "
                       f"most {BLOCK} and a multiple of {SUBLANES}")
    return reasons


def backward_not_supported_reasons(q, k, v, q_pos, k_pos, g_o, lse, row_term, bias=None,
                                   **params) -> list[str]:
    del g_o, lse, row_term
    return not_supported_reasons(q, k, v, q_pos, k_pos, bias, **params)
