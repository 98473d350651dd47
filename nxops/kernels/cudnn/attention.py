"""cuDNN's fused flash attention (``jax.nn.dot_product_attention(
implementation="cudnn")``) as an implementation of the attention op, for the
cases whose meaning it can give exactly.

The op's result is [B, Tq, E + 1] f32: the output and the logsumexp. cuDNN
returns its softmax statistics only in the output's dtype
(``return_residual=True`` casts them to bf16/f16), so it takes a case only
where nothing reads the logsumexp (``need_lse=False``: ``nx.attention``
without ``return_lse``, not differentiated, keys not combined across
shards); its logsumexp column is NaN, which nothing reads. Its constraints
(JAX's ``check_is_flash_attention`` and the layout checks of
``jax._src.cudnn.fused_attention_stablehlo``) and the op's meaning decide the
rest (:func:`not_supported_reasons`).

Causal: cuDNN's causal mask (``is_causal=True``, mask type CAUSAL) is on
local indices, so it is taken only where ``nx.attention`` knows the
positions are 0..T-1 (``positions="iota"``: it built them from an unmapped
sequence), and only for as many queries as keys, where a mask aligned at the
first query and one aligned at the last agree.

Not chosen by ``auto`` until a GPU has measured it (``kernels/measured``):
select it with ``NXOPS_KERNELS=attention=cudnn``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from nxops.kernels._registry import Kernel, register
from nxops.kernels.xla.attention import IOTA_POSITIONS

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# cuDNN's flash attention head dims on Hopper and later (128 before): at
# most this, and a multiple of 8.
MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 256, 8


def attention(q, k, v, q_pos, k_pos, bias=None, *, scale: float, causal: bool,
              platform: str = "cuda", positions: str | None = None, **params) -> jax.Array:
    """[B, Tq, E + 1] f32: cuDNN's output (one head per batch member) and a
    NaN logsumexp column (taken only where nothing reads it)."""
    del q_pos, k_pos, params
    if bias is not None or (causal and positions != IOTA_POSITIONS) or platform != "cuda":
        raise ValueError("the cuDNN attention takes no bias, a causal mask only on positions "
                         "0..T-1, cuda only (see not_supported_reasons)")
    out = jax.nn.dot_product_attention(q[:, :, None], k[:, :, None], v[:, :, None],
                                       scale=float(scale), is_causal=bool(causal),
                                       implementation="cudnn")[:, :, 0]
    lse = jnp.full((*out.shape[:2], 1), jnp.nan, jnp.float32)
    return jnp.concatenate([out.astype(jnp.float32), lse], axis=-1)


def not_supported_reasons(q, k, v, q_pos, k_pos, bias=None, *, platform: str,
                          causal: bool = False, need_lse: bool = True,
                          positions: str | None = None, **params) -> list[str]:
    """Why cuDNN cannot give this case's result exactly (empty: it can)."""
    del q_pos, k_pos, params
    reasons = []
    if platform != "cuda":
        reasons.append(f"cuDNN runs on cuda, not {platform}")
    if need_lse:
        reasons.append("the logsumexp is read (return_lse=True, a gradient, whose backward "
                       "recomputes from it, or key shards combined by it); cuDNN gives its "
                       "softmax statistics only in the output dtype")
    if causal and positions != IOTA_POSITIONS:
        reasons.append("causal with positions given as arrays: cuDNN's causal mask is on local "
                       "indices, so it needs query i at position i and key j at j, which "
                       "nx.attention knows only where it builds the positions itself (an "
                       "unmapped sequence, no SequenceLayout, one query row per position: not "
                       "a ring step, user positions, or query heads folded into rows)")
    elif causal and q.shape[1] != k.shape[1]:
        reasons.append(f"causal with {q.shape[1]} queries and {k.shape[1]} keys: taken only "
                       f"for as many queries as keys (where cuDNN's mask alignment cannot "
                       f"differ from the op's)")
    if bias is not None:
        reasons.append("a bias or mask: the op's is float32, cuDNN takes it in the inputs' "
                       "dtype (rounded)")
    if jnp.dtype(q.dtype) not in DTYPES:
        reasons.append(f"dtype {jnp.dtype(q.dtype)}: cuDNN flash attention takes float16 and "
                       f"bfloat16")
    d, e = q.shape[-1], v.shape[-1]
    if d != e:
        reasons.append(f"query/key head dim {d} differs from the values' {e} (cuDNN's "
                       f"multi-latent path needs cuDNN 9.10 and is not taken)")
    if d > MAX_HEAD_DIM or d % HEAD_DIM_MULTIPLE:
        reasons.append(f"head dim {d}: cuDNN needs at most {MAX_HEAD_DIM} (Hopper and later) "
                       f"and a multiple of {HEAD_DIM_MULTIPLE}")
    return reasons


KERNEL = register(Kernel(
    op="attention", backend="cudnn", platforms=("cuda",), fn=attention,
    not_supported_reasons=not_supported_reasons,
    description="cuDNN flash attention (jax.nn.dot_product_attention, implementation='cudnn'): "
                "no logsumexp, no bias, causal only on positions 0..T-1; forward only",
))
