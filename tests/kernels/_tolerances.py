"""The small-block settings that make small test arrays span many blocks, and
the shared tolerance table (``nxops.kernels._tolerances``) the kernel tests use."""
import contextlib

import jax.numpy as jnp

from nxops.kernels._tolerances import assert_close  # noqa: F401  (the tests import it from here)
from nxops.kernels import _knobs

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
    with _knobs.tuned(f"pallas.{style}", **SMALL_CAPS[style]):
        yield

