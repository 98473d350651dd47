"""Pallas tile: this position's tile of a replicated array (no communication).

Reference: :func:`nxops.kernels.xla.tile.tile`
(``lax.dynamic_slice_in_dim(x, index * size, size, dim)``, ``size = x.shape[dim] // count``).

The wrapper views ``x`` as ``[outer, count, tile_len]`` (a free reshape:
``outer`` is the product of the dims before ``dim`` and ``tile_len`` that of
the tile's part of ``dim`` and the dims after it), so the tile is
``x[:, index, :]``, a strided copy that reads exactly the tile's bytes.
``index`` is taken as ``dynamic_slice`` takes its start: negative counts from
the end, then clamped to ``[0, count)``.

- Mosaic (TPU): the block index comes from scalar prefetch
  (``PrefetchScalarGridSpec(num_scalar_prefetch=1)``): the index map reads
  it, so the pipeline DMAs only the chosen tile. The view keeps the array's
  last dim as lanes (a free reshape in TPU's tiled layout, see
  ``_tile_mosaic``); tiling the last dim itself, ``tile_len`` is laid out as
  ``[tile_len / 128, 128]`` when divisible, else ``[1, tile_len]``.
- Triton (GPU): Pallas Triton has no scalar prefetch, so the index is a
  one-element input the kernel loads and clamps before its masked block
  copy (no separate XLA kernel for the clamp).

Gradient (custom VJP): the cotangent placed at the tile, zeros elsewhere, as
the reference's. Any dtype that the platform can copy is supported.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from nxops.kernels import _checks, _layout, _vjp
from nxops.kernels._registry import Kernel, register
from nxops.kernels.pallas import _common
from nxops.kernels.pallas._common import Target


def _copy_kernel_mosaic(index_ref, x_ref, o_ref):
    del index_ref  # used by the index maps only
    o_ref[...] = x_ref[...]


def _tile_mosaic(x3, index, target: Target, lanes: int | None) -> jax.Array:
    """``lanes``: the array's last dim when the tile keeps it (``dim`` is not
    the last dim). Viewing ``[outer, count, rows, lanes]`` then splits only
    dims before the last, which TPU's tiled HBM layout does for free when the
    split falls on a sublane tile; changing the last dim would relayout (copy)
    the whole array before the kernel and the tile after it."""
    n_outer, count, tile_len = x3.shape
    if lanes is None:  # tiling the last dim: dense [tile_len / 128, 128] rows when possible
        lanes = 128 if tile_len % 128 == 0 else tile_len
    rows = tile_len // lanes
    x4 = x3.reshape(n_outer, count, rows, lanes)
    br = _common.block_size("mosaic", rows, "rows", align=8)
    bl = _common.block_size("mosaic", lanes, "cols", align=128)
    padded = -(-br // 8) * 8 * -(-bl // 128) * 128  # VMEM pads blocks to (8, 128) tiles
    bo = max(1, min(n_outer, _common.cap("mosaic", "tile") // padded))
    out = pl.pallas_call(
        _copy_kernel_mosaic,
        out_shape=jax.ShapeDtypeStruct((n_outer, rows, lanes), x3.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(pl.cdiv(n_outer, bo), pl.cdiv(rows, br), pl.cdiv(lanes, bl)),
            in_specs=[pl.BlockSpec((bo, None, br, bl), lambda o, r, l, idx: (o, idx[0], r, l))],
            out_specs=pl.BlockSpec((bo, br, bl), lambda o, r, l, idx: (o, r, l))),
        name="nxops_tile",
        cost_estimate=_common.copy_cost((x3.shape[0], x3.shape[2]), x3.dtype),
        **_common.call_kwargs(target, dimension_semantics=("parallel",) * 3),
    )(index.reshape(1), x4)
    return out.reshape(n_outer, tile_len)


def _copy_kernel_triton(index_ref, x_ref, o_ref, *, bo: int, bl: int):
    n_outer, count, tile_len = x_ref.shape
    o, l = pl.program_id(0), pl.program_id(1)
    # Clamped here, not by the wrapper: an XLA clamp would be a one-thread
    # kernel launched before this one.
    index = _layout.clamp_index(index_ref[0], count)
    rows = o * bo + lax.broadcasted_iota(jnp.int32, (bo, bl), 0)
    cols = l * bl + lax.broadcasted_iota(jnp.int32, (bo, bl), 1)
    mask = (rows < n_outer) & (cols < tile_len)
    block = plgpu.load(x_ref.at[pl.ds(o * bo, bo), index, pl.ds(l * bl, bl)], mask=mask)
    plgpu.store(o_ref.at[pl.ds(o * bo, bo), pl.ds(l * bl, bl)], block, mask=mask)


def _tile_triton(x3, index, target: Target) -> jax.Array:
    n_outer, _, tile_len = x3.shape
    bl = _common.block_size("triton", tile_len, "cols")
    bo = _common.block_size("triton", n_outer, "rows")
    bo = min(bo, max(1, _common.cap("triton", "tile") // bl))
    return pl.pallas_call(
        functools.partial(_copy_kernel_triton, bo=bo, bl=bl),
        out_shape=jax.ShapeDtypeStruct((n_outer, tile_len), x3.dtype),
        grid=(pl.cdiv(n_outer, bo), pl.cdiv(tile_len, bl)),
        name="nxops_tile",
        cost_estimate=_common.copy_cost((x3.shape[0], x3.shape[2]), x3.dtype),
        **_common.call_kwargs(target, num_warps=_layout.num_warps_for(bo * bl)),
    )(index.reshape(1), x3)


def tile_forward(x, index, *, dim: int, count: int, platform: str, style: str | None
                 ) -> jax.Array:
    """The kernel path of :func:`tile` (no custom VJP)."""
    target = _common.target_for(platform, style)
    x3, out_shape = _layout.tile_view(x, dim, count)
    if target.style == "triton":   # the kernel clamps the index itself
        tiled = _tile_triton(x3, jnp.asarray(index, jnp.int32), target)
    else:
        tiled = _tile_mosaic(x3, _layout.effective_index(index, count), target,
                             x.shape[-1] if dim < x.ndim - 1 else None)
    return tiled.reshape(out_shape)


_tile = _vjp.with_vjp(tile_forward, _vjp.tile_vjp)


def tile(x: jax.Array, index: jax.Array, *, dim: int, count: int, platform: str = "cpu") -> jax.Array:
    """Tile number ``index`` of ``count`` equal tiles of ``x`` along ``dim``, as
    a Pallas copy kernel (see the module docstring). Differentiable in ``x``."""
    return tile_in_style(x, index, dim=dim, count=count, platform=platform, style=None)


def tile_in_style(x, index, *, dim: int, count: int, platform: str = "cpu",
                  style: str | None = None) -> jax.Array:
    """:func:`tile` with the kernel ``style`` chosen (interpret mode on CPU runs
    either; the tests check both)."""
    return _tile(x, index, dim=dim % x.ndim, count=count, platform=platform, style=style)


def not_supported_reasons(x, index, *, platform: str, dim: int, count: int, **params) -> list[str]:
    """Why the Pallas tile cannot take this case (empty: it can)."""
    del index, params
    reasons = _checks.tile_reasons(x, dim, count, "the Pallas tile")
    if platform == "tpu" and jnp.dtype(x.dtype) == jnp.float16:
        reasons.append("float16 has no native TPU support")
    return reasons + _checks.too_large_reasons(x.shape)


KERNEL = register(Kernel(
    op="tile", backend="pallas", platforms=_common.PLATFORMS, fn=tile,
    not_supported_reasons=not_supported_reasons, manual_only_platforms=("tpu",),
    description="Pallas strided copy of one tile (scalar-prefetched index on TPU)",
))
