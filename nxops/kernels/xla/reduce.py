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


def reduce_vjp(x: jax.Array, out: jax.Array, g: jax.Array, *, axes: tuple[int, ...],
               op: str) -> jax.Array:
    """The cotangent of ``x`` in ``out = reduce(x, axes=axes, op=op)``, as JAX
    differentiates the ``jnp`` reductions (kernels reuse it as their VJP).
    ``axes`` are sorted and non-negative."""
    expand = lambda v: jnp.expand_dims(v, axes)  # noqa: E731
    if op == "sum":
        dx = jnp.broadcast_to(expand(g), x.shape)
    elif op in ("max", "min"):
        # As JAX's reduce_max/min JVP: ties share the cotangent equally.
        hits = (x == expand(out)).astype(g.dtype)
        dx = hits * expand(g / jnp.sum(hits, axis=axes))
    elif op == "logsumexp":
        dx = expand(g) * jnp.exp(x - expand(out))
    else:  # prod: the reference's own VJP handles zeros exactly
        _, vjp = jax.vjp(lambda v: reduce(v, axes=axes, op=op), x)
        (dx,) = vjp(g)
    return dx.astype(x.dtype)
