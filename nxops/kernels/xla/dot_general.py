"""Reference contraction: ``lax.dot_general`` (what einsum and pdot reduce to)."""
from __future__ import annotations

import jax
from jax import lax

from nxops.kernels._registry import PLATFORMS, Kernel, register


def dot_general(a: jax.Array, b: jax.Array, *, dimension_numbers, precision=None,
                preferred_element_type=None, platform: str = "cpu") -> jax.Array:
    """``lax.dot_general`` with the output dtype of ``jnp.einsum``.

    ``dimension_numbers`` is ``((a_contract, b_contract), (a_batch, b_batch))``;
    the result's dims are batch dims, then a's free dims, then b's free dims.
    """
    del platform
    return lax.dot_general(a, b, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type)


KERNEL = register(Kernel(
    op="dot_general", backend="xla", platforms=PLATFORMS, fn=dot_general,
    description="lax.dot_general (cuBLAS / MXU via XLA)",
))
