"""Reference reductions over positional axes (pure JAX)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from nxops.kernels._registry import PLATFORMS, Kernel, register

REDUCE_OPS = ("sum", "max", "min", "prod", "logsumexp")

_JNP_REDUCERS = {
    "sum": jnp.sum,
    "max": jnp.max,
    "min": jnp.min,
    "prod": jnp.prod,
    "logsumexp": jax.nn.logsumexp,
}


def reduce(x: jax.Array, *, axes: tuple[int, ...], op: str, platform: str = "cpu") -> jax.Array:
    """Reduces ``x`` over positional ``axes`` with ``op``, exactly as ``jnp`` does.

    Integer inputs follow ``jnp`` (``sum`` promotes small ints; ``logsumexp``
    returns floats). ``logsumexp`` is stable: it subtracts the running max.
    """
    del platform
    if op == "logsumexp" and not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.result_type(float))
    return _JNP_REDUCERS[op](x, axis=axes)


KERNEL = register(Kernel(
    op="reduce", backend="xla", platforms=PLATFORMS, fn=reduce,
    description="jnp reductions (XLA reduce)",
))

