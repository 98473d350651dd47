"""CUDA: JAX's Pallas Mosaic GPU collectives (``jax.experimental.pallas.ops.gpu.
all_gather_mgpu`` / ``reduce_scatter_mgpu``) behind nxops' collective signatures.

They use NVLink SHARP multicast (``multimem`` stores / load-reduces), which
needs Hopper or newer GPUs on an NVSwitch fabric and operands that XLA:GPU
places in symmetric memory. None of that can be checked from JAX, nor run on
CPU (Mosaic GPU interpret mode has no remote refs, semaphores or multimem):
what is verified here is that they lower for cuda. So they are opt-in:
``NXOPS_MGPU_COLLECTIVES=1`` (see ``COLLECTIVES.md``). Without it, cuda uses
XLA's NCCL collectives.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nxops.kernels import _gpu_target
from nxops import _config

OPT_IN_VARIABLE = "NXOPS_MGPU_COLLECTIVES"
DTYPES = frozenset(map(np.dtype, (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32)))


def enabled() -> bool:
    return _config.mgpu_collectives()


def _num_blocks() -> int:
    """A block (CTA) per SM: the device's own count, else (lowering for cuda on
    a CPU-only machine) that of the GPU being built for."""
    device = jax.devices()[0]
    if device.platform == "gpu" and getattr(device, "core_count", None):
        return device.core_count
    return _gpu_target.sm_count()


def _retype(out, x, *, invariant_over=None):
    """The kernels' results carry no varying axes; give them the reference's."""
    varying = tuple(a for a in jax.typeof(x).mat.varying if a != invariant_over)
    missing = tuple(a for a in varying if a not in jax.typeof(out).mat.varying)
    return lax.pcast(out, missing, to="varying") if missing else out


def all_gather(x, axis_name: str, *, axis: int, tiled: bool):
    from jax.experimental.pallas.ops.gpu import all_gather_mgpu
    if not tiled:
        x = jnp.expand_dims(x, axis)
    out = all_gather_mgpu.all_gather(x, axis_name=axis_name, gather_dimension=axis,
                                     num_blocks=_num_blocks())
    return _retype(out, x, invariant_over=axis_name)


def reduce_scatter(x, axis_name: str, *, scatter_dimension: int, tiled: bool):
    from jax.experimental.pallas.ops.gpu import reduce_scatter_mgpu
    out = reduce_scatter_mgpu.reduce_scatter(x, axis_name=axis_name,
                                             scatter_dimension=scatter_dimension,
                                             num_blocks=_num_blocks())
    out = _retype(out, x)
    return out if tiled else jnp.squeeze(out, scatter_dimension)


def _other_mesh_axes(axis_name) -> tuple[str, ...]:
    """Axes of the current mesh other than ``axis_name`` (none outside shard_map)."""
    names = set(axis_name) if isinstance(axis_name, (tuple, list)) else {axis_name}
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(a for a in mesh.axis_names if a not in names)


def not_supported_reasons(x, axis_name=None, *, op: str, **params) -> list[str]:
    """The opt-in, one axis, dtypes, and the main size rule of the JAX kernels
    (each device's piece: a multiple of 128 elements, at least one 32-bit
    vector per lane). Rarer tiling limits raise from the JAX kernels themselves."""
    reasons = []
    if not enabled():
        reasons.append(f"the Mosaic GPU (multimem) collectives need NVSwitch multicast and "
                       f"are unverified on hardware; set {OPT_IN_VARIABLE}=1 to use them")
    if isinstance(axis_name, (tuple, list)) and len(axis_name) != 1:
        reasons.append(f"they run over one mesh axis, not {tuple(axis_name)}")
    other_axes = _other_mesh_axes(axis_name)
    if other_axes:
        reasons.append(f"multimem collectives must span every mesh axis (JAX 0.10), but the mesh "
                       f"also has {other_axes}")
    dtype = np.dtype(x.dtype)
    if dtype not in DTYPES:
        reasons.append(f"dtype {dtype} is not one of {', '.join(sorted(map(str, DTYPES)))}")
        return reasons
    piece = math.prod(x.shape)  # all-gather: the input; reduce-scatter: the output
    if op == "reduce_scatter" and axis_name is not None:
        try:
            piece //= lax.axis_size(axis_name if isinstance(axis_name, str) else axis_name[0])
        except NameError:  # asked outside the shard_map body: check the input
            pass
    minimum = 128 * (1 if jnp.issubdtype(dtype, jnp.integer) else max(1, 32 // (8 * dtype.itemsize)))
    if piece % 128 or piece < minimum:
        reasons.append(f"each device's piece has {piece} elements; the kernels need a multiple "
                       f"of 128 and at least {minimum}")
    return reasons
