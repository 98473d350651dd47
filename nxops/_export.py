"""``nx.export``: ``jax.export`` for nx programs, with their kernels."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
from jax import export as jax_export
from jax.sharding import AxisType, Mesh

from nxops._jax import config as jax_config
from nxops.kernels import _autotune
from nxops._jax import mesh_lib
from nxops._platforms import normalize_platform
from nxops._traceback import api_boundary

# The custom calls nxops' own kernels lower to that jax.export does not allow
# by default: Pallas' Triton kernels on GPU and jax-triton's kernels. Mosaic
# (tpu_custom_call, mosaic_gpu_v2) is already on jax.export's stable list.
NXOPS_KERNEL_CUSTOM_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call")


@api_boundary
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

    ``platforms`` are lowering platforms ('cpu', 'cuda', 'rocm', 'tpu'); 'gpu'
    means 'cuda', as in ``nx.kernels.explain``.

    Examples:
        >>> exported = nx.export(lambda v: nx.sum(v, 0), jax.ShapeDtypeStruct((3,), jnp.float32))
        >>> print(exported.platforms, exported.call(jnp.arange(3.)))
        ('cpu',) 3.0
    """
    if platforms is not None:
        if isinstance(platforms, str):
            platforms = (platforms,)
        platforms = tuple(normalize_platform(p, "nx.export") for p in platforms)
    jitted = fn if hasattr(fn, "trace") else jax.jit(lambda *a: fn(*a))
    checks = tuple(export_kwargs.pop("disabled_checks", ())) + tuple(
        jax_export.DisabledSafetyCheck.custom_call(t) for t in NXOPS_KERNEL_CUSTOM_CALLS)
    # No autotuning: an artifact must not depend on this machine's timings.
    with _refinable_mesh(args), _autotune.suppressed():
        return jax_export.export(jitted, platforms=platforms, disabled_checks=checks,
                                 **export_kwargs)(*args)


def _refinable_mesh(args: Sequence[Any]) -> contextlib.ExitStack:
    """Under a mesh, with symbolic sizes: a lowering whose shapes ``.call`` can refine.

    JAX 0.10 fails ``.call`` with "Error refining shapes" twice over (plain
    jax.export + shard_map too): (1) under a mesh with Explicit axes
    (``jax.make_mesh``'s default) it constrains the sharding of the
    shape-assertion scalars: the same devices with Auto axes give the same
    program without them; (2) Shardy's manual computation hides the dimension
    variables from shape refinement wherever the body computes with a symbolic
    size (a broadcast): the GSPMD lowering of shard_map refines. The option
    is feature-detected (a JAX without it lowers with Shardy).
    """
    stack = contextlib.ExitStack()
    mesh = mesh_lib.get_concrete_mesh()
    symbolic = any(not isinstance(d, int) for a in jax.tree.leaves(args)
                   for d in getattr(a, "shape", ()))
    if not symbolic or mesh is None or mesh.empty:
        return stack
    if any(t != AxisType.Auto for t in mesh.axis_types):
        stack.enter_context(jax.set_mesh(Mesh(mesh.devices, mesh.axis_names,
                                              axis_types=(AxisType.Auto,) * len(mesh.axis_names))))
    use_shardy = getattr(jax_config, "use_shardy_partitioner", None)
    if use_shardy is not None:
        stack.enter_context(use_shardy(False))
    return stack
