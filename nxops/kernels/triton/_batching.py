"""vmap for the Triton kernels: a bare ``triton_call`` (or the interpreter's
``pure_callback``) has no batching rule, so each kernel's forward is a
``jax.custom_batching.custom_vmap`` whose rule folds the vmapped dim into
the kernel's own batch (a reduction's extra outer axis, a matmul's batch)."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def vmappable(fn: Callable, batched: Callable) -> Callable:
    """``fn(*args)``, whose vmap calls ``batched(*args)`` with every argument
    carrying the vmapped dim first (unbatched ones are broadcast) and returns
    its result as batched along dim 0."""
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = [a if is_batched else jnp.broadcast_to(a, (axis_size, *jnp.shape(a)))
                for a, is_batched in zip(args, in_batched)]
        out = batched(*args)
        return out, jax.tree.map(lambda _: True, out)

    return wrapped
