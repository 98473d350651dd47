"""Per-dtype tolerances for comparing Pallas kernels with the xla reference and
NumPy, and the small-block settings that make small arrays span many blocks.

A kernel result in dtype ``d`` is compared, in float64, as
``|got - want| <= atol * scale + rtol * |want|``, where ``scale`` is the
magnitude of the terms that were summed (sqrt(K) for a K-long dot of unit
normals): f32 accumulates with ~1e-7 relative error; bf16/f16 results carry
one rounding of the output (2^-8 / 2^-11 relative) plus the reference's own.
"""
import contextlib

import jax.numpy as jnp
import numpy as np

from nxops.kernels.pallas import _common

TOLERANCES = {
    np.dtype(np.float32): dict(rtol=2e-5, atol=2e-5),
    np.dtype(jnp.bfloat16): dict(rtol=2e-2, atol=2e-2),
    np.dtype(np.float16): dict(rtol=4e-3, atol=4e-3),
}
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# Tiny blocks so that test arrays of a few hundred elements span several
# blocks in every dim. Mosaic-style caps stay legal TPU blocks (multiples of
# 8 sublanes / 128 lanes); Triton's matmul blocks are at least 16 (tl.dot).
SMALL_CAPS = {
    "triton": dict(rows=4, cols=8, tile=32, m=16, n=16, k=16),
    "mosaic": dict(rows=8, cols=128, tile=8 * 128, m=8, n=128, k=128),
}


@contextlib.contextmanager
def small_blocks(style):
    with _common.block_caps(style, **SMALL_CAPS[style]):
        yield


def assert_close(got, want, dtype, scale=1.0):
    """Compares in float64 with ``dtype``'s tolerance (see module docstring)."""
    tol = TOLERANCES[np.dtype(dtype)]
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=tol["rtol"], atol=tol["atol"] * scale)
