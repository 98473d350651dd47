"""What the kernels of every backend decline alike: the checks their
``not_supported_reasons`` share (each returns a list of reasons, empty when
the case is fine)."""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

# Dtypes the kernels take (they accumulate in f32). f16 has no native TPU path.
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Kernels index elements with int32 (program ids, iotas, offsets).
MAX_ELEMENTS = 2**31 - 1


def too_large_reasons(*shapes) -> list[str]:
    """A reason for each array too large for int32 element indices."""
    return [f"shape {tuple(s)} has more than 2**31 - 1 elements (kernels index with int32)"
            for s in shapes if math.prod(s) > MAX_ELEMENTS]


def tile_reasons(x, dim: int, count: int, what: str) -> list[str]:
    """Why a tile kernel (``what``: "the Pallas tile", ...) that copies 16- and
    32-bit elements cannot take ``x``."""
    reasons = []
    if x.ndim == 0:
        reasons.append("a scalar has no dim to tile")
    elif x.shape[dim % x.ndim] % count:
        reasons.append(f"dim {dim} of size {x.shape[dim % x.ndim]} is not divisible into {count} tiles")
    dtype = jnp.dtype(x.dtype)
    if dtype.itemsize not in (2, 4) or dtype == jnp.bool_:
        reasons.append(f"dtype {dtype}: {what} copies 16- and 32-bit elements")
    return reasons


def precision_reasons(precision, platform: str) -> list[str]:
    """Why a matmul kernel cannot take ``precision`` (Mosaic on TPU takes fewer)."""
    if precision is None:
        return []
    if isinstance(precision, lax.DotAlgorithmPreset):
        return [f"precision={precision} (a DotAlgorithmPreset) is not supported by the "
                "kernel matmuls; pass None or lax.Precision"]
    pair = precision if isinstance(precision, (tuple, list)) else (precision, precision)
    try:
        pair = tuple(lax.Precision(p) if not isinstance(p, lax.Precision) else p for p in pair)
    except (ValueError, TypeError):
        return [f"unrecognised precision {precision!r}"]
    if platform == "tpu":
        if pair[0] != pair[1]:
            return [f"per-operand precisions {pair} are not supported by Pallas on TPU"]
        if pair[0] == lax.Precision.HIGH:
            return ["precision HIGH (bf16_3x) is not supported by Pallas on TPU; use DEFAULT or HIGHEST"]
    return []
