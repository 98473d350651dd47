"""Shared plumbing of the Pallas kernels: which lowering a platform gets, the
``pallas_call`` arguments that select it, and the block-size heuristic.

Two kernel *styles* exist because the two compiled Pallas backends want
different programs:

- ``"triton"`` (GPU): every grid point is an independent program running in
  parallel, refs are whole arrays in global memory, loads/stores are masked
  explicitly (``plgpu.load(..., mask=, other=)``) and a kernel loops over the
  reduced/contracted dimension itself (``fori_loop``). Triton has no scratch
  memory and no scalar prefetch. Every loaded block dim is a power of two.
- ``"mosaic"`` (TPU): the grid runs sequentially per core, BlockSpecs DMA
  blocks into VMEM, a reduction walks the last ("arbitrary") grid axis and
  accumulates in VMEM scratch. Block dims: last two multiples of (8, 128) or
  equal to the array's dims. Out-of-bounds parts of edge blocks hold garbage,
  so kernels mask them with the identity of the op.

``platform="cpu"`` runs a kernel in Pallas interpret mode, in the style given
by :data:`INTERPRET_STYLE` (both styles run interpreted; the tests run both).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from nxops.kernels import _knobs, _layout
from nxops.kernels._checks import FLOAT_DTYPES, too_large_reasons  # noqa: F401  (cross_entropy.py reads them here)
from nxops.kernels._layout import next_power_of_2

PLATFORMS = ("cpu", "cuda", "tpu")
STYLES = ("triton", "mosaic")

# The style that `platform="cpu"` (interpret mode) runs. Mosaic style checks
# more in interpret mode: edge blocks are padded with NaN, so a missing mask
# shows up as a wrong result.
INTERPRET_STYLE = "mosaic"


def cost_estimate(reads=(), writes=(), *, flops: int = 0, transcendentals: int = 0,
                  remote_bytes: int = 0) -> pl.CostEstimate:
    """What a kernel costs, for XLA's schedulers (a Pallas call is opaque to
    them otherwise): ``reads``/``writes`` are ``(shape, dtype)`` pairs or arrays
    (one pair per pass over an array: a matmul lists an operand once per sweep)."""
    def nbytes(x):
        shape, dtype = (x.shape, x.dtype) if hasattr(x, "shape") else x
        return math.prod(shape) * jnp.dtype(dtype).itemsize
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                           bytes_accessed=int(sum(map(nbytes, (*reads, *writes)))),
                           remote_bytes_transferred=int(remote_bytes))


def reduce_cost(x, out_shape, out_dtype, op: str) -> pl.CostEstimate:
    """One pass over ``x``; logsumexp adds an exp per element and a log per
    result (and a max, subtract and add per element)."""
    n, n_out = math.prod(x.shape), math.prod(out_shape)
    lse = op == "logsumexp"
    return cost_estimate([x], [(out_shape, out_dtype)], flops=4 * n if lse else n,
                         transcendentals=n + n_out if lse else 0)


def matmul_cost(a3, b3, out, bm: int, bn: int) -> pl.CostEstimate:
    """``[B, M, K] x [B, K, N]`` in ``bm x bn`` output tiles: each tile reads its
    rows of ``a`` and columns of ``b``, so ``a`` is read once per column of
    tiles and ``b`` once per row of tiles."""
    (n_batch, n_m, n_k), n_n = a3.shape, b3.shape[2]
    return cost_estimate([a3] * -(-n_n // bn) + [b3] * -(-n_m // bm), [out],
                         flops=2 * n_batch * n_m * n_n * n_k)


def copy_cost(shape, dtype) -> pl.CostEstimate:
    """Reads and writes ``shape`` once."""
    return cost_estimate([(shape, dtype)], [(shape, dtype)])


@dataclasses.dataclass(frozen=True)
class Target:
    """How a kernel is built: its program ``style`` and whether it runs in
    Pallas interpret mode (``platform="cpu"``)."""

    platform: str
    style: str
    interpret: bool


def target_for(platform: str, style: str | None = None) -> Target:
    """The target of ``platform``; ``style`` overrides it (for interpret-mode
    tests of the other style on CPU only)."""
    if platform not in PLATFORMS:
        raise ValueError(f"Pallas kernels run on {PLATFORMS}, not {platform!r}")
    native = {"cuda": "triton", "tpu": "mosaic", "cpu": INTERPRET_STYLE}[platform]
    if style is not None and style != native and platform != "cpu":
        raise ValueError(f"platform {platform!r} only lowers {native!r}-style kernels")
    return Target(platform, style or native, interpret=platform == "cpu")


def call_kwargs(target: Target, *, dimension_semantics: tuple[str, ...] = (),
                num_warps: int = 4, num_stages: int = 2,
                vmem_limit_bytes: int | None = None) -> dict:
    """The ``pallas_call`` keyword arguments that select ``target``'s backend.

    On cuda the Triton ``CompilerParams`` type is what makes Pallas lower via
    Triton (``__gpu$xla.gpu.triton``) instead of JAX 0.10's default Mosaic GPU.
    """
    if target.interpret:
        return {"interpret": True}
    if target.style == "triton":
        return {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
    return {"compiler_params": pltpu.CompilerParams(dimension_semantics=dimension_semantics,
                                                    vmem_limit_bytes=vmem_limit_bytes)}


# ---------------------------------------------------------------------------
# Block sizes
#
# Each kernel asks for a block along one dim with a *cap* (the largest block
# it wants there). The heuristic:
# - triton: the next power of two of the dim, clamped to [minimum, cap]
#   (Triton tensors have power-of-two sizes; `tl.dot` needs >= 16);
# - mosaic: the whole dim if it fits under the cap (always a legal block),
#   else the cap, which is a multiple of the dim's TPU tiling (8 sublanes or
#   128 lanes), so the block is legal and edge blocks are masked.
# Caps are kernel knobs (``nxops.kernels._knobs``), group ``pallas.<style>``:
# tests shrink them with ``_knobs.tuned`` to exercise many blocks with small arrays.

# triton: a (rows x cols) register tile of <= 4096 elements per program; the
# one-pass reductions' programs a launch wants and steps a piece keeps (see
# _layout.ReduceKnobs).
_knobs.declare("pallas.triton", rows=64, cols=1024, tile=4096,
               m=128, n=256, k=256,   # matmul: see dot_general.triton_matmul_config
               programs=_layout.GPU_FILL_PROGRAMS, min_steps=_layout.MIN_STEPS_PER_PROGRAM)
# mosaic: ~2 MiB f32 input blocks (double-buffered: well under the 16 MiB
# default scoped VMEM). Matmul tiles are chosen per TPU generation by their
# traffic (dot_general.mosaic_matmul_tiles) up to these caps; 512^3 where the
# chip is not known. Caps that are not multiples of (8, 128) only make sense
# in interpret mode.
_knobs.declare("pallas.mosaic", rows=256, cols=2048, tile=512 * 1024,
               m=4096, n=4096, k=4096)


def cap(style: str, name: str) -> int:
    return _knobs.value(f"pallas.{style}", name)


def block_size(style: str, dim: int, cap_name: str, *, minimum: int = 1,
               power_of_2: bool = False, align: int = 128) -> int:
    """The block along a dim of size ``dim`` (see the heuristic above).

    ``power_of_2`` asks mosaic for a power-of-two block too (at least
    ``align``, the dim's TPU tiling, so that it stays legal when larger than
    the dim): kernels that reduce a block by halving need one.
    """
    limit = cap(style, cap_name)
    if style == "triton" or power_of_2:
        block = min(next_power_of_2(dim), next_power_of_2(limit))
        return max(minimum, block if style == "triton" else max(block, min(align, limit)))
    return dim if dim <= limit else limit

