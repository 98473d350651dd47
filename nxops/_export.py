"""``nx.export``: ``jax.export`` for nx programs, with their kernels."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax import export as jax_export

# The custom calls nxops' own kernels lower to that jax.export does not allow
# by default: Pallas' Triton kernels on GPU and jax-triton's kernels. Mosaic
# (tpu_custom_call, mosaic_gpu_v2) is already on jax.export's stable list.
NXOPS_KERNEL_CUSTOM_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call")


def export(fn: Callable, *args: Any, platforms: Sequence[str] | None = None,
           **export_kwargs: Any) -> jax_export.Exported:
    """``jax.export.export(jax.jit(fn), platforms=...)(*args)`` for nx programs.

    ``fn`` may be an ``nx.xmap`` object, a jitted function or any function
    using nx ops; ``args`` are arrays or ``jax.ShapeDtypeStruct`` (symbolic
    dims from ``jax.export.symbolic_shape`` work: kernels decline symbolic
    sizes, so ``auto`` takes the XLA implementation there). Call it under the
    mesh the program runs on (``jax.set_mesh``).

    Only nxops' own kernel custom calls (``NXOPS_KERNEL_CUSTOM_CALLS``) are
    allowed beyond jax.export's stable set, no other. Stability: Triton
    kernels are serialized as Triton IR, which the jaxlib that lowered them
    reads; an export containing them is guaranteed to load with that jaxlib
    version only (JAX's compatibility window does not cover it). Mosaic (TPU)
    kernels and XLA ops get jax.export's usual guarantees. Export with
    ``NXOPS_KERNELS=xla`` for an artifact with no kernel custom calls at all.
    """
    jitted = fn if hasattr(fn, "trace") else jax.jit(lambda *a: fn(*a))
    checks = tuple(export_kwargs.pop("disabled_checks", ())) + tuple(
        jax_export.DisabledSafetyCheck.custom_call(t) for t in NXOPS_KERNEL_CUSTOM_CALLS)
    return jax_export.export(jitted, platforms=platforms, disabled_checks=checks,
                             **export_kwargs)(*args)
