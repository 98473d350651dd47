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


def reduce_vjp(x: jax.Array, out: jax.Array, g: jax.Array, *, axes: tuple[int, ...],
               op: str) -> jax.Array:
    """The cotangent of ``x`` for ``out = reduce(x, axes=axes, op=op)`` and
    ``out``'s cotangent ``g``: the one gradient every backend's kernel uses.

    ``max``/``min`` ties share the cotangent equally (as JAX's reduce_max JVP);
    ``prod`` takes the reference's own VJP, exact where ``x`` has zeros.
    """
    axes = tuple(sorted(a % x.ndim if x.ndim else a for a in axes))
    expand = lambda v: jnp.expand_dims(v, axes)  # noqa: E731
    if op == "sum":
        dx = jnp.broadcast_to(expand(g), x.shape)
    elif op in ("max", "min"):
        hits = (x == expand(out)).astype(g.dtype)
        dx = hits * expand(g / jnp.sum(hits, axis=axes))
    elif op == "logsumexp":
        dx = expand(g) * jnp.exp(x - expand(out))
    elif op == "prod":
        _, vjp = jax.vjp(lambda v: reduce(v, axes=axes, op=op), x)
        (dx,) = vjp(g)
    else:
        raise ValueError(f"unknown reduction {op!r}; known: {REDUCE_OPS}")
    return dx.astype(x.dtype)


KERNEL = register(Kernel(
    op="reduce", backend="xla", platforms=PLATFORMS, fn=reduce,
    description="jnp reductions (XLA reduce)",
))

