"""Triton reductions over positional axes: sum, max, min, prod, logsumexp.

Reference: :func:`nxops.kernels.xla.reduce.reduce` (``jnp.<op>(x, axis=axes)``).

The wrapper views ``x`` as ``[outer, reduced, inner]`` (as the Pallas
kernel does: no data moves when the reduced axes are contiguous), then

- *rows* (``inner == 1``): program ``(i, p)`` reduces ``BO`` rows over piece
  ``p`` of the reduced axis;
- *columns* (``inner > 1``): program ``(o, k, p)`` reduces ``BI`` columns of
  slab ``o`` over piece ``p``.

Kernel parameters follow jax-triton's order: inputs and scalars, outputs,
constexprs. Sizes are constexprs (one compile per shape, as everywhere in
JAX): known divisibility lets Triton issue 16-byte vector loads, which it
cannot prove for runtime sizes (scalar loads only). Each program keeps one f32 accumulator *per lane* of its ``[BO, BR]`` /
``[BR, BI]`` block and combines elementwise on every step; the lanes are
reduced once, at the end. logsumexp keeps a per-lane running max and a sum
scaled to it, with one ``exp`` per element. When the programs would not cover
the GPU (fewer than :data:`TARGET_PROGRAMS`), the reduced axis is cut into
pieces, each program writes an f32 partial result, and a second launch
reduces the partials (logsumexp of partial logsumexps is the logsumexp).
No atomics: results are deterministic.

NaN propagates like ``jnp`` (max/min combine with an explicit NaN test:
Triton's own max drops NaN); logsumexp treats infinite maxima as
``jax.nn.logsumexp`` does. Gradient: the reference's (``xla.reduce.reduce_vjp``).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from nxops.kernels._registry import Kernel, register
from nxops.kernels import _layout
from nxops.kernels._layout import canonical_view
from nxops.kernels.triton import _batching, _common
from nxops.kernels.triton._common import cdiv
from nxops.kernels.triton._launch import Target, launch, target_for
from nxops.kernels.xla import reduce as xla_reduce

OPS = {"sum": 0, "max": 1, "min": 2, "prod": 3, "logsumexp": 4}
IDENTITY = {"sum": 0.0, "max": -math.inf, "min": math.inf, "prod": 1.0, "logsumexp": -math.inf}

# Programs wanted per launch (two per SM on an H100).
TARGET_PROGRAMS = _layout.GPU_TARGET_PROGRAMS
# A program's block holds at most this many elements (per-lane accumulators in
# registers); logsumexp keeps two per element, so it takes half.
MAX_BLOCK = 4096
MAX_REDUCED_BLOCK = 1024
# A piece of a split reduced axis spans at least this many blocks.
MIN_STEPS_PER_PIECE = 4


# ---------------------------------------------------------------------------
# Device functions


@triton.jit
def _nan_max(a, b):
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def _nan_min(a, b):
    return tl.where((a < b) | (a != a), a, b)


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _finite_or_zero(v):
    return tl.where(v - v == 0, v, 0.0)   # inf - inf and NaN - NaN are NaN


@triton.jit
def _accumulate(acc, s, x, OP: tl.constexpr):
    """One step: per-lane accumulator ``acc`` (and logsumexp's scaled sum
    ``s``) absorb ``x`` elementwise."""
    if OP == 0:
        acc = acc + x
    elif OP == 1:
        acc = _nan_max(acc, x)
    elif OP == 2:
        acc = _nan_min(acc, x)
    elif OP == 3:
        acc = acc * x
    else:
        # s is relative to exp(finite(acc)). A new max rescales the old sum
        # and adds exp(0) = 1; otherwise add exp(x - max). One exp either way.
        grows = x > acc
        new = _nan_max(acc, x)
        shift = _finite_or_zero(new)
        e = tl.exp(tl.where(grows, _finite_or_zero(acc) - shift, x - shift))
        s = tl.where(grows, tl.where(s == 0, 0.0, s * e) + 1.0, s + e)
        acc = new
    return acc, s


@triton.jit
def _finish(acc, s, OP: tl.constexpr, AXIS: tl.constexpr):
    """Reduces the lanes along ``AXIS``: the block's result."""
    if OP == 0:
        result = tl.sum(acc, AXIS)
    elif OP == 1:
        result = tl.reduce(acc, AXIS, _nan_max)
    elif OP == 2:
        result = tl.reduce(acc, AXIS, _nan_min)
    elif OP == 3:
        result = tl.reduce(acc, AXIS, _mul)
    else:
        peak = tl.reduce(acc, AXIS, _nan_max, keep_dims=True)
        shift = _finite_or_zero(peak)
        scaled = tl.where(s == 0, 0.0, s * tl.exp(_finite_or_zero(acc) - shift))
        peak = tl.reduce(acc, AXIS, _nan_max)
        result = tl.log(tl.sum(scaled, AXIS)) + _finite_or_zero(peak)
        result = tl.where(peak == float("inf"), peak, result)
        result = tl.where(peak != peak, peak, result)
    return result


@triton.jit
def _rows_kernel(x_ptr, o_ptr, n_rows: tl.constexpr, n_cols: tl.constexpr,
                 piece_len: tl.constexpr, n_pieces: tl.constexpr, OP: tl.constexpr, IDENTITY: tl.constexpr, BO: tl.constexpr, BR: tl.constexpr):
    """``[n_rows, n_cols] -> [n_rows, n_pieces]``: program (i, p) reduces rows
    ``i*BO ...`` over columns ``[p*piece_len, (p+1)*piece_len)``."""
    i, p = tl.program_id(0), tl.program_id(1)
    rows = i * BO + tl.arange(0, BO)
    row_ok = rows[:, None] < n_rows
    base = x_ptr + rows[:, None].to(tl.int64) * n_cols
    begin = p * piece_len
    end = tl.minimum(begin + piece_len, n_cols)
    acc = tl.full((BO, BR), IDENTITY, tl.float32)
    s = tl.zeros((BO, BR), tl.float32)
    for start in range(begin, end, BR):
        cols = start + tl.arange(0, BR)
        x = tl.load(base + cols[None, :], mask=row_ok & (cols[None, :] < end), other=IDENTITY)
        acc, s = _accumulate(acc, s, x.to(tl.float32), OP)
    result = _finish(acc, s, OP, 1)
    tl.store(o_ptr + rows * n_pieces + p, result.to(o_ptr.dtype.element_ty), mask=rows < n_rows)


@triton.jit
def _columns_kernel(x_ptr, o_ptr, n_reduced: tl.constexpr, n_inner: tl.constexpr,
                    piece_len: tl.constexpr, n_pieces: tl.constexpr, OP: tl.constexpr, IDENTITY: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr):
    """``[outer, n_reduced, n_inner] -> [outer, n_pieces, n_inner]``: program
    (o, k, p) reduces columns ``k*BI ...`` of slab ``o`` over piece ``p``."""
    o, k, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = k * BI + tl.arange(0, BI)
    col_ok = cols[None, :] < n_inner
    base = x_ptr + o.to(tl.int64) * n_reduced * n_inner + cols[None, :]
    begin = p * piece_len
    end = tl.minimum(begin + piece_len, n_reduced)
    acc = tl.full((BR, BI), IDENTITY, tl.float32)
    s = tl.zeros((BR, BI), tl.float32)
    for start in range(begin, end, BR):
        rows = start + tl.arange(0, BR)
        x = tl.load(base + rows[:, None].to(tl.int64) * n_inner,
                    mask=(rows[:, None] < end) & col_ok, other=IDENTITY)
        acc, s = _accumulate(acc, s, x.to(tl.float32), OP)
    result = _finish(acc, s, OP, 0)
    out = o_ptr + (o.to(tl.int64) * n_pieces + p) * n_inner + cols
    tl.store(out, result.to(o_ptr.dtype.element_ty), mask=cols < n_inner)


# ---------------------------------------------------------------------------
# Launch configuration


def _max_block(op: str) -> int:
    return MAX_BLOCK // 2 if op == "logsumexp" else MAX_BLOCK


def pieces(n_reduced: int, block: int, programs: int) -> tuple[int, int]:
    """(piece length, number of pieces) of the reduced axis, whole blocks each
    (``_layout.split_count`` with this module's targets)."""
    split, per_piece = _layout.split_count(programs, cdiv(n_reduced, block),
                                           target=TARGET_PROGRAMS, min_steps=MIN_STEPS_PER_PIECE)
    return per_piece * block, split


def _rows(x2, op: str, target: Target, out_dtype, *, split: bool = True) -> jax.Array:
    n_rows, n_cols = x2.shape
    br = min(_common.next_power_of_2(n_cols), MAX_REDUCED_BLOCK)
    bo = max(1, min(_common.next_power_of_2(n_rows), _max_block(op) // br))
    programs = cdiv(n_rows, bo)
    piece_len, n_pieces = pieces(n_cols, br, programs) if split else (n_cols, 1)
    partial_dtype = out_dtype if n_pieces == 1 else jnp.float32
    (out,) = launch(
        _rows_kernel, x2,
        out_shape=[jax.ShapeDtypeStruct((n_rows, n_pieces), partial_dtype)],
        grid=(programs, n_pieces), target=target, name=f"nxops_triton_reduce_rows_{op}",
        num_warps=_common.num_warps_for(bo * br),
        n_rows=n_rows, n_cols=n_cols, piece_len=piece_len, n_pieces=n_pieces,
        OP=OPS[op], IDENTITY=IDENTITY[op], BO=bo, BR=br)
    if n_pieces == 1:
        return out[:, 0]
    return _rows(out, op, target, out_dtype, split=False)


def _columns(x3, op: str, target: Target, out_dtype, *, split: bool = True) -> jax.Array:
    n_outer, n_reduced, n_inner = x3.shape
    bi = min(_common.next_power_of_2(n_inner), 128)
    br = max(1, min(_common.next_power_of_2(n_reduced), _max_block(op) // bi))
    programs = n_outer * cdiv(n_inner, bi)
    piece_len, n_pieces = pieces(n_reduced, br, programs) if split else (n_reduced, 1)
    partial_dtype = out_dtype if n_pieces == 1 else jnp.float32
    (out,) = launch(
        _columns_kernel, x3,
        out_shape=[jax.ShapeDtypeStruct((n_outer, n_pieces, n_inner), partial_dtype)],
        grid=(n_outer, cdiv(n_inner, bi), n_pieces), target=target,
        name=f"nxops_triton_reduce_columns_{op}", num_warps=_common.num_warps_for(br * bi),
        n_reduced=n_reduced, n_inner=n_inner, piece_len=piece_len, n_pieces=n_pieces,
        OP=OPS[op], IDENTITY=IDENTITY[op], BR=br, BI=bi)
    if n_pieces == 1:
        return out[:, 0, :]
    return _columns(out, op, target, out_dtype, split=False)


def reduce_forward(x: jax.Array, axes: tuple[int, ...], op: str, target: Target) -> jax.Array:
    """The kernel path of :func:`reduce` (no custom rules)."""
    out_shape = tuple(n for d, n in enumerate(x.shape) if d not in axes)
    permutation, (n_outer, n_reduced, n_inner) = canonical_view(x.shape, axes)
    if permutation is not None:
        x = jnp.transpose(x, permutation)
    if n_inner == 1:
        out = _rows(x.reshape(n_outer, n_reduced), op, target, x.dtype)
    else:
        out = _columns(x.reshape(n_outer, n_reduced, n_inner), op, target, x.dtype)
    return out.reshape(out_shape)


# ---------------------------------------------------------------------------
# Public kernel: batching (custom_vmap) and the reference's gradient (custom_vjp)


def _batched_forward(x, axes, op, target):
    """``reduce_forward`` whose vmap moves the batch dim into the kernel."""
    return _batching.vmappable(
        lambda v: reduce_forward(v, axes, op, target),
        lambda v: _batched_forward(v, tuple(a + 1 for a in axes), op, target))(x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _reduce(x, axes, op, target):
    return _batched_forward(x, axes, op, target)


def _reduce_fwd(x, axes, op, target):
    out = _reduce(x, axes, op, target)
    return out, (x, out)


def _reduce_bwd(axes, op, target, residuals, g):
    del target
    x, out = residuals
    return (xla_reduce.reduce_vjp(x, out, g, axes=axes, op=op),)


_reduce.defvjp(_reduce_fwd, _reduce_bwd)


def reduce(x: jax.Array, *, axes: tuple[int, ...], op: str, platform: str = "cpu") -> jax.Array:
    """``jnp.<op>(x, axis=axes)`` as a Triton kernel (see the module docstring).

    ``platform``: ``"cuda"`` (compiled through jax-triton) or ``"cpu"``
    (Triton's interpreter). Differentiable and batchable.
    """
    if op not in OPS:
        raise ValueError(f"unknown reduction {op!r}; known: {tuple(OPS)}")
    axes = tuple(sorted(a % x.ndim if x.ndim else a for a in axes))
    return _reduce(x, axes, op, target_for(platform))


def not_supported_reasons(x, *, platform: str, axes, op: str, **params) -> list[str]:
    """Why the Triton reduction cannot take this case (empty: it can)."""
    del params, axes
    reasons = _common.missing_packages(platform)
    reasons += _common.float_dtype_reasons("Triton reductions", x.dtype)
    if op not in OPS:
        reasons.append(f"unknown reduction {op!r}")
    return reasons + _common.too_large_reasons(x.shape)


KERNEL = register(Kernel(
    op="reduce", backend="triton", platforms=_common.PLATFORMS, fn=reduce,
    not_supported_reasons=not_supported_reasons,
    # The interpreter runs in a pure_callback, which XLA cannot partition.
    manual_only_platforms=("cpu",),
    description="Triton row/column reduction, per-lane f32 accumulators, split reduced axis "
                "(jax-triton on GPU, Triton's interpreter on CPU)",
))
