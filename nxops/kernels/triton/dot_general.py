"""Triton contraction: any ``lax.dot_general`` as a batched, grouped, split-K matmul.

Reference: :func:`nxops.kernels.xla.dot_general.dot_general`.

The wrapper views the operands as ``[B, M, K] x [B, K, N]`` (shared with the
Pallas kernel: ``_layout.as_batched_matmul``). Program ``(t, b, s)``
computes output tile ``t`` (in grouped order: :data:`GROUP_M` row tiles per
column sweep, so a column of B tiles stays in L2) of batch ``b`` over K-split
``s``, accumulating ``tl.dot`` in f32. Its block shape, warps and pipeline
stages come from :data:`CONFIGS`, keyed by architecture, operand width and
shape class. When the tiles alone would leave the GPU idle (small ``M*N``,
long ``K``), K is split: each split writes an f32 partial and one XLA sum
adds them (deterministic, unlike atomics).

Precision: f32 operands use TF32 tensor cores unless ``precision`` (or
``jax.default_matmul_precision``) asks for ``HIGHEST``/``float32``, which is
IEEE f32. bf16/f16 use their tensor cores with f32 accumulation. Output dtype
as ``lax.dot_general`` with ``preferred_element_type``. Gradient: the
transpose contractions, computed by this kernel.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import triton
import triton.language as tl
from jax import lax

from nxops.kernels import _checks, _knobs, _layout, _vjp
from nxops.kernels._layout import cdiv
from nxops.kernels.triton import _batching, _common
from nxops.kernels.triton._launch import Target, launch, target_for

F32 = jnp.float32
GROUP_M = 8
MAX_BATCH = 65535          # grid axis 1 (CUDA's limit for y)
# Knobs (``nxops.kernels._knobs``; tests shrink them): the programs a launch
# wants (K is split below them), the K blocks a split keeps at least, and
# caps on the tile's sides (m, n, k).
_knobs.declare("triton.dot_general", programs=_layout.GPU_TARGET_PROGRAMS, min_k_steps=8,
               m=256, n=256, k=256)


class Config(NamedTuple):
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int


# (arch, operand bytes, shape class) -> configuration. Checked by compiling for
# H100/A100 (tests/static/test_triton_compile.py, bench/static/GPU.md): no
# spills, wgmma with N >= 128 on sm_90, mma.sync on sm_80, smem under the
# A100's 163 KiB for 3-stage 2-byte and f32 tiles.
CONFIGS: dict[tuple[str, int, str], Config] = {
    # 218 registers, 144 KiB (3 stages), wgmma m64n256k16 on H100.
    ("sm90", 2, "large"): Config(128, 256, 64, 8, 3),
    ("sm90", 4, "large"): Config(128, 128, 32, 8, 3),
    ("sm80", 2, "large"): Config(128, 128, 64, 8, 3),
    ("sm80", 4, "large"): Config(128, 128, 32, 8, 3),
}


def config_for(n_m: int, n_n: int, n_k: int, itemsize: int, arch: str,
               n_batch: int = 1) -> Config:
    """The configuration of a ``[B, M, K] x [B, K, N]`` matmul on ``arch``
    ("sm90", "sm80"): the table's large tile (256 wide only when that still
    gives half the target programs), shrunk to the next power of two (at least
    16) along a short dim and to the knobs' caps, with warps for the tile left."""
    large = CONFIGS[(arch, 2 if itemsize <= 2 else 4, "large")]
    programs = _knobs.value("triton.dot_general", "programs")
    if large.bn > 128 and n_batch * cdiv(n_m, large.bm) * cdiv(n_n, large.bn) < programs // 2:
        large = large._replace(bn=128)

    def side(table: int, dim: int, cap: str) -> int:
        return min(table, _knobs.value("triton.dot_general", cap),
                   max(16, _layout.next_power_of_2(dim)))

    bm, bn, bk = side(large.bm, n_m, "m"), side(large.bn, n_n, "n"), side(large.bk, n_k, "k")
    if (bm, bn) == (large.bm, large.bn):
        return large._replace(bk=bk)
    warps = 8 if bm * bn >= 128 * 128 else 4 if bm * bn >= 64 * 64 else 2
    return Config(bm, bn, bk, warps, large.stages)


def k_splits(tiles: int, n_k: int, bk: int) -> tuple[int, int]:
    """(K per split, splits): split K when ``tiles`` programs are too few for
    the GPU, keeping at least the ``min_k_steps`` knob's blocks per split."""
    splits, per_split = _layout.split_count(
        tiles, cdiv(n_k, bk), target=_knobs.value("triton.dot_general", "programs"),
        min_steps=_knobs.value("triton.dot_general", "min_k_steps"))
    return per_split * bk, splits


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, o_ptr, n_m: tl.constexpr, n_n: tl.constexpr,
                   n_k: tl.constexpr, k_per_split: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr,
                   GROUP: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
    """``o[s, b] = a[b, :, K_s] @ b[b, K_s, :]`` for program (tile, b, s).

    As Triton's matmul tutorial: rows/columns past the edge wrap around (their
    results are never stored), so only K is masked; pointers advance by one
    block per step; offsets within one operand are int32 (the registry
    declines operands over 2**31 elements), the batch offset int64. The sizes
    are constexprs: with their divisibility known, Triton vectorizes the
    loads and pipelines them (bf16 on H100: 3 stages; as runtime scalars it
    could not prove 16-byte alignment and kept one).
    """
    tile, batch, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tiles_m, tiles_n = tl.cdiv(n_m, BM), tl.cdiv(n_n, BN)
    per_group = GROUP * tiles_n
    first_m = (tile // per_group) * GROUP
    rows_here = tl.minimum(tiles_m - first_m, GROUP)
    tile_m = first_m + (tile % per_group) % rows_here
    tile_n = (tile % per_group) // rows_here

    rows = (tile_m * BM + tl.arange(0, BM)) % n_m
    cols = (tile_n * BN + tl.arange(0, BN)) % n_n
    begin = split * k_per_split
    k_len = tl.minimum(k_per_split, n_k - begin)
    ks = tl.arange(0, BK)
    a_ptrs = (a_ptr + batch.to(tl.int64) * n_m * n_k + begin
              + (rows[:, None] * n_k + ks[None, :]))
    b_ptrs = (b_ptr + batch.to(tl.int64) * n_k * n_n + begin.to(tl.int64) * n_n
              + (ks[:, None] * n_n + cols[None, :]))
    acc = tl.zeros((BM, BN), tl.float32)
    for step in range(0, tl.cdiv(k_len, BK)):
        if EVEN_K:   # every split is whole blocks: no mask (keeps loads pipelined)
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = k_len - step * BK
            a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=ks[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BK
        b_ptrs += BK * n_n
    out_rows = tile_m * BM + tl.arange(0, BM)
    out_cols = tile_n * BN + tl.arange(0, BN)
    n_batch = tl.num_programs(1)
    out = (o_ptr + (split * n_batch + batch).to(tl.int64) * n_m * n_n
           + (out_rows[:, None] * n_n + out_cols[None, :]))
    tl.store(out, acc.to(o_ptr.dtype.element_ty),
             mask=(out_rows[:, None] < n_m) & (out_cols[None, :] < n_n))


def input_precision(precision, dtype) -> str:
    """``tl.dot``'s input precision for f32 operands: IEEE for HIGHEST (or
    ``jax.default_matmul_precision`` float32/highest), TF32 otherwise."""
    if jnp.dtype(dtype) != F32:
        return "tf32"   # unused for bf16/f16 (exact products, f32 accumulation)
    if precision is None:
        default = str(jax.config.jax_default_matmul_precision or "").lower()
        return "ieee" if default in ("highest", "float32", "fp32") else "tf32"
    pair = precision if isinstance(precision, (tuple, list)) else (precision, precision)
    highest = all(lax.Precision(p) == lax.Precision.HIGHEST for p in pair)
    return "ieee" if highest else "tf32"


def batched_matmul(a3, b3, out_dtype, precision, target: Target) -> jax.Array:
    """``[B, M, K] x [B, K, N] -> [B, M, N]`` with an f32 accumulator."""
    (n_batch, n_m, n_k), n_n = a3.shape, b3.shape[2]
    config = config_for(n_m, n_n, n_k, jnp.dtype(a3.dtype).itemsize, target.arch, n_batch)
    tiles = cdiv(n_m, config.bm) * cdiv(n_n, config.bn)
    k_per_split, splits = k_splits(tiles * n_batch, n_k, config.bk)
    partial_dtype = out_dtype if splits == 1 else F32
    (out,) = launch(
        _matmul_kernel, a3, b3,
        out_shape=[jax.ShapeDtypeStruct((splits, n_batch, n_m, n_n), partial_dtype)],
        grid=(tiles, n_batch, splits), target=target, name="nxops_triton_matmul",
        num_warps=config.warps, num_stages=config.stages,
        n_m=n_m, n_n=n_n, n_k=n_k, k_per_split=k_per_split,
        BM=config.bm, BN=config.bn, BK=config.bk, GROUP=GROUP_M,
        PRECISION=input_precision(precision, a3.dtype), EVEN_K=n_k % config.bk == 0)
    return out[0] if splits == 1 else jnp.sum(out, axis=0).astype(out_dtype)


def dot_general_forward(a, b, *, dimension_numbers, precision, preferred_element_type,
                        target: Target) -> jax.Array:
    """The kernel path of :func:`dot_general` (no custom rules)."""
    return _layout.as_batched_matmul(
        a, b, dimension_numbers, preferred_element_type,
        lambda a3, b3, out_dtype: _batched_forward(a3, b3, out_dtype, precision, target))


def _batched_forward(a3, b3, out_dtype, precision, target):
    """``batched_matmul`` whose vmap folds the vmapped dim into the batch."""
    def folded(a4, b4):
        n = a4.shape[0]
        out = _batched_forward(a4.reshape(-1, *a4.shape[2:]), b4.reshape(-1, *b4.shape[2:]),
                               out_dtype, precision, target)
        return out.reshape(n, -1, *out.shape[1:])

    return _batching.vmappable(
        lambda x, y: batched_matmul(x, y, out_dtype, precision, target), folded)(a3, b3)


_dot_general = _vjp.with_vjp(dot_general_forward, _vjp.dot_general_vjp(dot_general_forward))


def dot_general(a: jax.Array, b: jax.Array, *, dimension_numbers, precision=None,
                preferred_element_type=None, platform: str = "cpu") -> jax.Array:
    """``lax.dot_general`` as a Triton matmul (see the module docstring).

    ``platform``: ``"cuda"`` (jax-triton) or ``"cpu"`` (Triton's interpreter).
    Differentiable (the cotangents use this kernel too) and batchable.
    """
    return _dot_general(a, b, dimension_numbers=_layout.canonical_dimension_numbers(dimension_numbers),
                        precision=precision, preferred_element_type=preferred_element_type,
                        target=target_for(platform))


def not_supported_reasons(a, b, *, platform: str, dimension_numbers, precision=None,
                          preferred_element_type=None, **params) -> list[str]:
    """Why the Triton matmul cannot take this case (empty: it can)."""
    del params
    reasons = _common.missing_packages(platform)
    if jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
        reasons.append(f"operands of different dtypes ({jnp.dtype(a.dtype)}, "
                       f"{jnp.dtype(b.dtype)}); the Triton matmul takes one dtype")
    reasons += _common.float_dtype_reasons("Triton matmuls", a.dtype)
    if (preferred_element_type is not None
            and jnp.dtype(preferred_element_type) not in _checks.FLOAT_DTYPES):
        reasons.append(f"preferred_element_type={jnp.dtype(preferred_element_type)} (the "
                       "kernel writes float32/bfloat16/float16)")
    (_, _), (a_batch, _) = dimension_numbers
    n_batch = 1
    for d in a_batch:
        n_batch *= a.shape[d]
    if n_batch > MAX_BATCH:
        reasons.append(f"{n_batch} batch elements (the kernel's grid takes up to {MAX_BATCH})")
    return (reasons + _checks.precision_reasons(precision, platform)
            + _checks.too_large_reasons(a.shape, b.shape))


KERNEL = _common.register_kernel(
    "dot_general", dot_general, not_supported_reasons,
    description="Triton batched matmul: per-arch tiles, grouped order, split-K "
                "(jax-triton on GPU, Triton's interpreter on CPU)")
