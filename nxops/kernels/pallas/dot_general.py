"""Pallas contraction: any ``lax.dot_general`` as a blocked batched matmul.

Reference: :func:`nxops.kernels.xla.dot_general.dot_general`
(``lax.dot_general``; output dims: batch, a's free dims, b's free dims).

The wrapper normalises ``dimension_numbers`` to ``[B, M, K] x [B, K, N]``:
``a`` is transposed to (batch, free, contracting) and ``b`` to (batch,
contracting, free) -- each a no-op when the operand is already in that order
-- and reshaped. The kernel accumulates ``a_block @ b_block`` over K in f32:

- Triton (GPU): grid ``(B, M/bm, N/bn)``, a ``fori_loop`` over K with masked
  loads (zeros past the edges), ``tl.dot`` blocks of at least 16; tiles
  narrowed on skinny shapes so that one launch fills the SMs;
- Mosaic (TPU): grid ``(B, M/bm, N/bn, K/bk)`` with K last ("arbitrary"), an
  f32 VMEM accumulator, and the K tail of both operands zeroed (edge blocks
  hold garbage, and 0 * NaN is NaN); the tile is the chip's least-traffic one
  (:func:`mosaic_matmul_tiles`).

Output dtype as ``lax.dot_general`` with ``preferred_element_type``.
``precision`` goes to the in-kernel ``jnp.dot``: on Triton, ``DEFAULT``/``HIGH``
mean TF32 for f32 inputs and ``HIGHEST`` full-precision IEEE f32; on Mosaic
``DEFAULT`` is one bf16 MXU pass for f32 and ``HIGHEST`` is f32 contract
precision (``HIGH`` is not supported there). ``precision=None`` takes
``jax.default_matmul_precision`` in force when the kernel is traced.

Supported: float32/bfloat16/float16 operands of one dtype (no float16 on TPU),
float output, non-empty operands, ``precision`` as ``None``, a
``lax.Precision`` or a pair of them (not a ``DotAlgorithmPreset``).
The gradient (custom VJP) is the transpose of the contraction, computed with
this same kernel (as JAX's dot_general transpose rule does with XLA's).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from nxops.kernels import _checks, _gpu_target, _layout, _tpu_target, _vjp
from nxops.kernels._registry import Kernel, register
from nxops.kernels.pallas import _common
from nxops.kernels.pallas._common import Target

F32 = jnp.float32


# ---------------------------------------------------------------------------
# Kernels on [B, M, K] x [B, K, N] -> [B, M, N]


GROUP_M = 8   # programs walk GROUP_M row blocks per column sweep: B tiles stay in L2


def _grouped_tile(pid, n_tiles_m: int, n_tiles_n: int):
    """(row block, column block) of program ``pid`` in grouped order."""
    per_group = GROUP_M * n_tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = jnp.minimum(n_tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows_here, (pid % per_group) // rows_here


# (arch, operand bytes, shape class) -> (bm, bn, bk, warps, stages) for
# shapes whose M and N reach the tile ("large": M, N >= 128; "wide": also
# N >= 256 and enough 128x256 tiles to fill the GPU). H100 (sm90): 128x256
# bf16 tiles in one pass of wgmma m64n256 (8 warps = two warpgroups, 3
# stages: 144 KiB of its 227 KiB shared memory); f32 runs TF32 wgmma with K
# blocks of 32. A100 (sm80): mma.sync on 128x128 tiles, 3 stages within its
# 163 KiB. Smaller dims: see triton_matmul_config.
_TRITON_MATMUL_TABLE = {
    ("sm90", 2, "wide"): (128, 256, 64, 8, 3),
    ("sm90", 2, "large"): (128, 128, 64, 8, 3),
    ("sm90", 4, "large"): (128, 128, 32, 8, 3),
    ("sm80", 2, "large"): (128, 128, 64, 8, 3),
    ("sm80", 4, "large"): (128, 128, 32, 8, 3),
}


def _shape_class(n_m: int, n_n: int) -> str:
    """"wide" only when 128x256 tiles still give every SM a program (about
    half of ``_layout.GPU_TARGET_PROGRAMS``: 1024^2 would run 32 programs on 132 SMs)."""
    if n_m >= 128 and n_n >= 256 and -(-n_m // 128) * -(-n_n // 256) >= _layout.GPU_TARGET_PROGRAMS // 2:
        return "wide"
    return "large" if n_m >= 128 and n_n >= 128 else "small"


# The smallest tile side (``tl.dot`` takes blocks of at least 16).
MIN_TILE = 16
# K block of a narrowed (skinny) tile: up to 256 (a memory-bound program
# keeps more of B in flight than with 64), as long as its pipeline stages fit
# in 96 KiB of shared memory (two programs per SM on the A100's 163 KiB).
NARROW_BK = 256
NARROW_SMEM_BYTES = 96 * 1024


def triton_matmul_config(n_m: int, n_n: int, n_k: int, itemsize: int,
                         arch: str | None = None, n_batch: int = 1) -> tuple[int, ...]:
    """(bm, bn, bk, warps, stages) for the Triton matmul on ``arch`` (default:
    the architecture being lowered for, ``nxops.kernels._gpu_target``).

    Large shapes take the row of ``_TRITON_MATMUL_TABLE`` (a "wide" shape
    falls back to "large" where the arch has no wide row). Small or skinny
    dims take the next power of two (at least 16, at most 128), K blocks of
    64 (2-byte) or 32 (f32) within the dim: no 128-row tile on an 8-row
    matrix. Where ``n_batch`` x tiles would leave SMs idle (decode shapes:
    8x4096x4096 in 16x128 tiles is 32 programs on 132 SMs), the tile is
    narrowed (see :func:`_narrowed`). The ``pallas.triton`` caps in force bound all three.
    """
    arch = arch or _gpu_target.gpu_arch()
    size = 2 if itemsize <= 2 else 4
    shape_class = _shape_class(n_m, n_n)
    row = None
    if shape_class != "small":
        row = (_TRITON_MATMUL_TABLE.get((arch, size, shape_class))
               or _TRITON_MATMUL_TABLE[arch, size, "large"])
    else:
        bm, bn = _pow2_side(n_m), _pow2_side(n_n)
        row = (bm, bn, 64 if size == 2 else 32, _warps_for_tile(bm, bn), 3)
    bm, bn, bk, warps, stages = row
    bm = min(bm, _common.cap("triton", "m"))
    bn = min(bn, _common.cap("triton", "n"))
    narrow = _narrowed(n_m, n_n, bm, bn, n_batch, _gpu_target.sm_count(arch))
    if narrow != (bm, bn):
        (bm, bn), warps = narrow, _warps_for_tile(*narrow)
        fits = NARROW_SMEM_BYTES // (stages * (bm + bn) * size)
        bk = max(bk, min(NARROW_BK, 1 << (fits.bit_length() - 1)))
    bk = min(bk, _common.cap("triton", "k"), max(16, _layout.next_power_of_2(n_k)))
    return bm, bn, bk, warps, stages


def _pow2_side(n: int) -> int:
    """A small dim's tile side: its next power of two in [16, 128]."""
    return min(128, max(16, _layout.next_power_of_2(n)))


def _warps_for_tile(bm: int, bn: int) -> int:
    return 8 if bm * bn >= 128 * 128 else 4 if bm * bn >= 64 * 64 else 2


def _narrowed(n_m: int, n_n: int, bm: int, bn: int, n_batch: int, sms: int) -> tuple[int, int]:
    """(bm, bn) halved, the longer side first (bn on a tie: B, the big operand
    of a decode GEMM, stays read once per row of tiles), until ``n_batch`` x
    tiles fills ``sms`` or both sides are :data:`MIN_TILE`. Instead of
    split-K: its partial sums need a second launch (the Triton kernel's
    split-K models 1.22 of cuBLAS at 8x4096x4096 on H100; narrowed tiles, one
    launch, tie cuBLAS' bytes)."""
    def programs(bm, bn):
        return n_batch * -(-n_m // bm) * -(-n_n // bn)

    while programs(bm, bn) < sms and max(bm, bn) > MIN_TILE:
        if bn >= bm and bn > MIN_TILE and bn // 2 < n_n:
            bn //= 2
        elif bm > MIN_TILE and bm // 2 < n_m:
            bm //= 2
        elif bn > MIN_TILE and bn // 2 < n_n:
            bn //= 2
        else:
            break
    return bm, bn


def _block_dot(a, b, precision, interpret: bool):
    """``a @ b`` accumulated in f32. In interpret mode (XLA:CPU) 16-bit blocks
    are upcast first: XLA:CPU has no bf16 x bf16 -> f32 dot (DotThunk), and
    the exact f32 products of 16-bit values summed in f32 are what the GPU/TPU
    kernels compute. The compiled kernels keep the native 16-bit dot."""
    if interpret and jnp.dtype(a.dtype).itemsize < 4:
        a, b = a.astype(F32), b.astype(F32)
    return jnp.dot(a, b, precision=precision, preferred_element_type=F32)


def _matmul_kernel_triton(a_ref, b_ref, o_ref, *, bm: int, bn: int, bk: int, precision,
                          interpret: bool):
    _, n_m, n_k = a_ref.shape
    n_n = b_ref.shape[2]
    batch = pl.program_id(0)
    i, j = _grouped_tile(pl.program_id(1), pl.cdiv(n_m, bm), pl.cdiv(n_n, bn))
    a_rows = i * bm + lax.broadcasted_iota(jnp.int32, (bm, bk), 0)
    b_cols = j * bn + lax.broadcasted_iota(jnp.int32, (bk, bn), 1)

    def step(kk, acc):
        a_k = kk * bk + lax.broadcasted_iota(jnp.int32, (bm, bk), 1)
        b_k = kk * bk + lax.broadcasted_iota(jnp.int32, (bk, bn), 0)
        a = plgpu.load(a_ref.at[batch, pl.ds(i * bm, bm), pl.ds(kk * bk, bk)],
                       mask=(a_rows < n_m) & (a_k < n_k), other=0.0)
        b = plgpu.load(b_ref.at[batch, pl.ds(kk * bk, bk), pl.ds(j * bn, bn)],
                       mask=(b_k < n_k) & (b_cols < n_n), other=0.0)
        return acc + _block_dot(a, b, precision, interpret)

    acc = lax.fori_loop(0, pl.cdiv(n_k, bk), step, jnp.zeros((bm, bn), F32))
    out_rows = i * bm + lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
    out_cols = j * bn + lax.broadcasted_iota(jnp.int32, (bm, bn), 1)
    plgpu.store(o_ref.at[batch, pl.ds(i * bm, bm), pl.ds(j * bn, bn)], acc.astype(o_ref.dtype),
                mask=(out_rows < n_m) & (out_cols < n_n))


def _matmul_kernel_mosaic(a_ref, b_ref, o_ref, acc_ref, *, n_k: int, precision,
                          interpret: bool):
    kk = pl.program_id(3)
    a, b = a_ref[...], b_ref[...]
    bk = a.shape[1]
    if n_k % bk:  # zero the K tail of both operands (garbage past the end)
        a_k = kk * bk + lax.broadcasted_iota(jnp.int32, a.shape, 1)
        b_k = kk * bk + lax.broadcasted_iota(jnp.int32, b.shape, 0)
        a = jnp.where(a_k < n_k, a, jnp.zeros_like(a))
        b = jnp.where(b_k < n_k, b, jnp.zeros_like(b))

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

    acc_ref[...] += _block_dot(a, b, precision, interpret)

    @pl.when(kk == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def batched_matmul(a3, b3, out_dtype, precision, target: Target) -> jax.Array:
    """``[B, M, K] x [B, K, N] -> [B, M, N]`` with an f32 accumulator."""
    (n_batch, n_m, n_k), n_n = a3.shape, b3.shape[2]
    style = target.style
    out_shape = jax.ShapeDtypeStruct((n_batch, n_m, n_n), out_dtype)
    if style == "triton":
        itemsize = max(jnp.dtype(a3.dtype).itemsize, jnp.dtype(b3.dtype).itemsize)
        bm, bn, bk, warps, stages = triton_matmul_config(n_m, n_n, n_k, itemsize,
                                                           n_batch=n_batch)
        return pl.pallas_call(
            functools.partial(_matmul_kernel_triton, bm=bm, bn=bn, bk=bk, precision=precision,
                              interpret=target.interpret),
            out_shape=out_shape,
            grid=(n_batch, pl.cdiv(n_m, bm) * pl.cdiv(n_n, bn)),   # tiles in grouped order
            name="nxops_dot_general",
            cost_estimate=_common.matmul_cost(a3, b3, out_shape, bm, bn),
            **_common.call_kwargs(target, num_warps=warps, num_stages=stages),
        )(a3, b3)
    chip = _tpu_target.tpu_chip()   # None: unknown (e.g. interpret mode on CPU)
    itemsize, out_itemsize = jnp.dtype(a3.dtype).itemsize, jnp.dtype(out_dtype).itemsize
    bm, bn, bk, vmem_limit = mosaic_matmul_tiles(n_batch, n_m, n_n, n_k, itemsize, out_itemsize,
                                                 chip)
    traffic = matmul_tile_traffic(n_batch, n_m, n_n, n_k, bm, bn, bk, itemsize, out_itemsize)
    return pl.pallas_call(
        functools.partial(_matmul_kernel_mosaic, n_k=n_k, precision=precision,
                          interpret=target.interpret),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(n_batch, pl.cdiv(n_m, bm), pl.cdiv(n_n, bn), pl.cdiv(n_k, bk)),
            in_specs=[pl.BlockSpec((None, bm, bk), lambda b, i, j, k: (b, i, k)),
                      pl.BlockSpec((None, bk, bn), lambda b, i, j, k: (b, k, j))],
            out_specs=pl.BlockSpec((None, bm, bn), lambda b, i, j, k: (b, i, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), F32)]),
        name="nxops_dot_general",
        cost_estimate=pl.CostEstimate(flops=2 * n_batch * n_m * n_n * n_k, transcendentals=0,
                                      bytes_accessed=traffic),
        **_common.call_kwargs(
            target, dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit),
    )(a3, b3)


# ---------------------------------------------------------------------------
# Mosaic tiles per TPU generation, by the traffic count
#
# With the grid (b, i, j, k), K innermost, the pipeline fetches a block only
# when its index changes between steps: A's block (i, k) is re-read for every
# column block j unless K is one block (then it stays in VMEM while j moves),
# B's block (k, j) for every row block i; each output block is written once.
# So a tile bm x bn x bk moves
#     A: M K (1 if bk == K else ceil(N / bn)),  B: K N ceil(M / bm),  out: M N
# bytes, and runs ceil(M/bm) ceil(N/bn) ceil(K/bk) grid steps of ~0.35 µs. Its
# time on a chip is max(bytes / HBM bandwidth, padded FLOPs / MXU peak) + the
# steps and the first fetch and last write, which the pipeline cannot overlap;
# the tile of least time whose VMEM (double-buffered blocks, the f32
# accumulator, Mosaic's temporaries) fits half the chip's VMEM wins; N sides
# are multiples of the MXU width (256 on v6e). One 512^3 tile for every chip
# was 3.45x the roofline on v6e at 8192^3 bf16 by this count (HBM-bound: A and
# B read 16 times each); v6e takes 1024x2048x1024 there, 1.08x
# (bench/static/TPU.md has the table per chip and dtype).

_TILE_SIDES = (128, 256, 512, 1024, 2048, 4096)
_STEP_SECONDS = 0.35e-6
_GENERIC_TILE = 512        # an unknown chip (and interpret mode): 512^3, the old default


def _tile_candidates(dim: int, cap: int, align: int) -> list[int]:
    """Legal block sides for ``dim``: the whole dim when under ``cap``, else
    multiples of ``align`` among :data:`_TILE_SIDES` below the dim."""
    sides = [s for s in _TILE_SIDES if s < dim and s <= cap and s % align == 0]
    return sides + ([dim] if dim <= cap else []) or [min(cap, _TILE_SIDES[-1])]


def matmul_tile_traffic(n_batch: int, n_m: int, n_n: int, n_k: int, bm: int, bn: int, bk: int,
                        itemsize: int, out_itemsize: int) -> int:
    """HBM bytes the Mosaic matmul moves with ``bm x bn x bk`` tiles (above)."""
    a_reads = 1 if bk >= n_k else -(-n_n // bn)
    return n_batch * (n_m * n_k * itemsize * a_reads + n_k * n_n * itemsize * -(-n_m // bm)
                      + n_m * n_n * out_itemsize)


def matmul_tile_vmem(bm: int, bn: int, bk: int, itemsize: int, out_itemsize: int,
                     k_tail: bool) -> int:
    """VMEM of a tile: double-buffered A, B and output blocks, the f32
    accumulator, and Mosaic's temporaries: the loaded A and B blocks (again
    when K has a tail: the masked copies), the f32 product and sum (libtpu
    asked 39.8 MiB for 1024x1024x2048 bf16 on v5e: this count)."""
    blocks = (bm * bk + bk * bn) * itemsize
    return (3 * blocks + 2 * bm * bn * out_itemsize + 3 * 4 * bm * bn
            + (blocks if k_tail else 0))


def matmul_tile_seconds(n_batch, n_m, n_n, n_k, bm, bn, bk, itemsize, out_itemsize,
                        chip: _tpu_target.Chip) -> float:
    """The tile's time on ``chip`` by the traffic count (above)."""
    steps = n_batch * -(-n_m // bm) * -(-n_n // bn) * -(-n_k // bk)
    padded = 2 * n_batch * -(-n_m // bm) * bm * -(-n_n // bn) * bn * -(-n_k // bk) * bk
    peak = chip.bf16_flops / (2 if itemsize >= 4 else 1)
    traffic = matmul_tile_traffic(n_batch, n_m, n_n, n_k, bm, bn, bk, itemsize, out_itemsize)
    # The pipeline does not overlap the first step's fetch nor the last write.
    exposed = ((bm * bk + bk * bn) * itemsize + bm * bn * out_itemsize) / chip.bandwidth
    return max(traffic / chip.bandwidth, padded / peak) + exposed + steps * _STEP_SECONDS


def mosaic_matmul_tiles(n_batch: int, n_m: int, n_n: int, n_k: int, itemsize: int,
                        out_itemsize: int, chip: "_tpu_target.Chip | None"
                        ) -> tuple[int, int, int, int | None]:
    """(bm, bn, bk, VMEM limit or None) of the Mosaic matmul on ``chip``: the
    tile of least modelled time (above) within half the chip's VMEM and the
    ``pallas.mosaic`` caps in force; with no chip, the generic 512^3 tile."""
    caps = {d: _common.cap("mosaic", d) for d in "mnk"}
    if chip is None:
        side = lambda dim, name: dim if dim <= min(caps[name], _GENERIC_TILE) \
            else min(caps[name], _GENERIC_TILE)
        return side(n_m, "m"), side(n_n, "n"), side(n_k, "k"), None
    budget = chip.vmem_bytes // 2
    best = None
    for bm in _tile_candidates(n_m, caps["m"], 8):
        for bn in _tile_candidates(n_n, caps["n"], chip.mxu):
            for bk in _tile_candidates(n_k, caps["k"], 128):
                vmem = matmul_tile_vmem(bm, bn, bk, itemsize, out_itemsize, n_k % bk != 0)
                if vmem > budget:
                    continue
                key = (matmul_tile_seconds(n_batch, n_m, n_n, n_k, bm, bn, bk, itemsize,
                                           out_itemsize, chip), vmem)
                if best is None or key < best[0]:
                    best = (key, (bm, bn, bk))
    if best is None:   # nothing fits (caps larger than VMEM allows): the generic tile
        return mosaic_matmul_tiles(n_batch, n_m, n_n, n_k, itemsize, out_itemsize, None)
    (_, vmem), (bm, bn, bk) = best
    # Mosaic's default scoped VMEM (16-32 MiB) is below what large tiles use.
    return bm, bn, bk, min(chip.vmem_bytes * 3 // 4, vmem + vmem // 4 + 4 * _tpu_target.MIB)


# ---------------------------------------------------------------------------
# The wrapper: any dimension_numbers -> batched matmul; the gradient is the
# transpose of the contraction, computed by the same kernel


def dot_general_forward(a, b, *, dimension_numbers, precision, preferred_element_type,
                        platform: str, style: str | None) -> jax.Array:
    """The kernel path of :func:`dot_general` (no custom VJP)."""
    target = _common.target_for(platform, style)
    return _layout.as_batched_matmul(
        a, b, dimension_numbers, preferred_element_type,
        lambda a3, b3, out_dtype: batched_matmul(a3, b3, out_dtype, precision, target))


_dot_general = _vjp.with_vjp(dot_general_forward, _vjp.dot_general_vjp(dot_general_forward))


def dot_general(a: jax.Array, b: jax.Array, *, dimension_numbers, precision=None,
                preferred_element_type=None, platform: str = "cpu") -> jax.Array:
    """``lax.dot_general`` as a blocked Pallas matmul (see the module docstring).

    ``platform``: ``"cpu"`` (interpret mode), ``"cuda"`` (Triton), ``"tpu"``
    (Mosaic). Differentiable (custom VJP; the cotangents use this kernel too).
    """
    return dot_general_in_style(a, b, dimension_numbers=dimension_numbers, precision=precision,
                                preferred_element_type=preferred_element_type,
                                platform=platform, style=None)


def dot_general_in_style(a, b, *, dimension_numbers, precision=None, preferred_element_type=None,
                         platform: str = "cpu", style: str | None = None) -> jax.Array:
    """:func:`dot_general` with the kernel ``style`` chosen: interpret mode on
    CPU runs either ("triton" or "mosaic"); the tests check both."""
    return _dot_general(a, b, dimension_numbers=_layout.canonical_dimension_numbers(dimension_numbers),
                        precision=precision, preferred_element_type=preferred_element_type,
                        platform=platform, style=style)


# ---------------------------------------------------------------------------
# What the kernel takes


def not_supported_reasons(a, b, *, platform: str, dimension_numbers, precision=None,
                          preferred_element_type=None, **params) -> list[str]:
    """Why the Pallas matmul cannot take this case (empty: it can)."""
    del params
    reasons = []
    a_dtype, b_dtype = jnp.dtype(a.dtype), jnp.dtype(b.dtype)
    if a_dtype != b_dtype:
        reasons.append(f"operands of different dtypes ({a_dtype}, {b_dtype}); the Pallas "
                       "matmul takes one dtype")
    if a_dtype not in _checks.FLOAT_DTYPES:
        reasons.append(f"operand dtype {a_dtype} (the Pallas matmul takes float32/bfloat16/"
                       "float16; integer and float64 contractions use xla)")
    elif platform == "tpu" and a_dtype == jnp.float16:
        reasons.append("float16 has no native TPU support; Pallas TPU matmul takes f32/bf16")
    if (preferred_element_type is not None
            and jnp.dtype(preferred_element_type) not in _checks.FLOAT_DTYPES):
        reasons.append(f"preferred_element_type={jnp.dtype(preferred_element_type)} (the kernel "
                       "writes float32/bfloat16/float16)")
    del dimension_numbers
    return (reasons + _checks.precision_reasons(precision, platform)
            + _checks.too_large_reasons(a.shape, b.shape))


KERNEL = register(Kernel(
    op="dot_general", backend="pallas", platforms=_common.PLATFORMS, fn=dot_general,
    not_supported_reasons=not_supported_reasons, manual_only_platforms=("tpu",),
    description="Pallas blocked batched matmul, f32 accumulator (Triton on GPU, Mosaic on TPU)",
))
