"""Triton tile: this position's tile of a replicated array (no communication).

Reference: :func:`nxops.kernels.xla.tile.tile`
(``lax.dynamic_slice_in_dim(x, index * size, size, dim)``, ``size = x.shape[dim] // count``).

As the Pallas kernel, the wrapper views ``x`` as ``[outer, count, tile_len]``
(a free reshape) and copies ``x[:, index, :]``: program ``(o, l)`` copies a
``[BO, BL]`` block. The index arrives as a one-element array (it is traced:
``axis_index``), and the kernel itself takes it as ``dynamic_slice`` takes a
start (negative from the end, then clamped), so no XLA op runs before it.
Gradient: the cotangent placed at the tile (``_vjp.tile_vjp``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from nxops.kernels import _checks, _knobs, _layout, _vjp
from nxops.kernels._layout import cdiv
from nxops.kernels.triton import _batching, _common
from nxops.kernels.triton._launch import Target, launch, target_for

# Knobs (``nxops.kernels._knobs``; tests shrink them): a program copies a
# block of at most ``tile`` elements, at most ``cols`` of them along the tile.
_knobs.declare("triton.tile", tile=4096, cols=1024)


@triton.jit
def _tile_kernel(x_ptr, index_ptr, o_ptr, n_outer: tl.constexpr, count: tl.constexpr,
                 tile_len: tl.constexpr, BO: tl.constexpr, BL: tl.constexpr):
    o, l = tl.program_id(0), tl.program_id(1)
    index = tl.load(index_ptr)
    index = tl.where(index < 0, index + count, index)
    index = tl.minimum(tl.maximum(index, 0), count - 1)
    rows = o * BO + tl.arange(0, BO)
    cols = l * BL + tl.arange(0, BL)
    mask = (rows[:, None] < n_outer) & (cols[None, :] < tile_len)
    src = x_ptr + (rows[:, None].to(tl.int64) * count + index) * tile_len + cols[None, :]
    dst = o_ptr + rows[:, None].to(tl.int64) * tile_len + cols[None, :]
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


def _tile3(x3, index, target: Target) -> jax.Array:
    n_outer, count, tile_len = x3.shape
    bl = min(_layout.next_power_of_2(tile_len), _knobs.value("triton.tile", "cols"))
    bo = max(1, min(_layout.next_power_of_2(n_outer), _knobs.value("triton.tile", "tile") // bl))
    (out,) = launch(
        _tile_kernel, x3, jnp.asarray(index, jnp.int32).reshape(1),
        out_shape=[jax.ShapeDtypeStruct((n_outer, tile_len), x3.dtype)],
        grid=(cdiv(n_outer, bo), cdiv(tile_len, bl)), target=target, name="nxops_triton_tile",
        num_warps=_layout.num_warps_for(bo * bl),
        n_outer=n_outer, count=count, tile_len=tile_len, BO=bo, BL=bl)
    return out


def tile_forward(x, index, *, dim: int, count: int, target: Target) -> jax.Array:
    """The kernel path of :func:`tile` (no custom rules)."""
    x3, out_shape = _layout.tile_view(x, dim, count)
    return _tile3(x3, index, target).reshape(out_shape)


def _batched_forward(x, index, *, dim, count, target):
    """``tile_forward`` under vmap: a batched ``x`` with one index folds the
    vmapped dim into ``outer``; per-example indices take one launch each."""
    def one(x, index):
        return _batched_forward(x, index, dim=dim, count=count, target=target)

    def batched(xs, indices):
        return jax.lax.map(lambda xi: one(*xi), (xs, indices))

    return _batching.vmappable(
        lambda v, i: tile_forward(v, i, dim=dim, count=count, target=target), batched)(x, index)


_tile = _vjp.with_vjp(_batched_forward, _vjp.tile_vjp)


def tile(x: jax.Array, index: jax.Array, *, dim: int, count: int, platform: str = "cpu") -> jax.Array:
    """Tile number ``index`` of ``count`` equal tiles of ``x`` along ``dim``, as
    a Triton copy kernel (see the module docstring). Differentiable in ``x``."""
    return _tile(x, index, dim=dim % x.ndim, count=count, target=target_for(platform))


def not_supported_reasons(x, index, *, platform: str, dim: int, count: int, **params) -> list[str]:
    """Why the Triton tile cannot take this case (empty: it can)."""
    del index, params
    return (_common.missing_packages(platform)
            + _checks.tile_reasons(x, dim, count, "the Triton tile")
            + _checks.too_large_reasons(x.shape))


KERNEL = _common.register_kernel(
    "tile", tile, not_supported_reasons,
    description="Triton strided copy of one tile, index clamped in the kernel")
