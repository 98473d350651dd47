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


def free_dims(ndim: int, contract, batch) -> list[int]:
    """The dims of an operand that are neither contracted nor batch, in order
    (they come out after the batch dims, lhs before rhs, as in dot_general)."""
    return [d for d in range(ndim) if d not in contract and d not in batch]


KERNEL = register(Kernel(
    op="dot_general", backend="xla", platforms=PLATFORMS, fn=dot_general,
    description="lax.dot_general (cuBLAS / MXU via XLA)",
))
