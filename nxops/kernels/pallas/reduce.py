"""Pallas reductions over positional axes: sum, max, min, prod, logsumexp.

Reference: :func:`nxops.kernels.xla.reduce.reduce` (``jnp.<op>(x, axis=axes)``).

The wrapper views ``x`` as ``[outer, reduced, inner]`` without moving data
when the reduced axes are contiguous, and transposes only for non-contiguous
axis sets (reduced axes moved last). Then one of two kernels reads the input
exactly once:

- *row* reduction (``inner == 1``): ``[outer, reduced] -> [outer]``;
- *column* reduction (``inner > 1``): ``[outer, reduced, inner] -> [outer, inner]``.

The Triton-style (GPU) kernels follow ``_layout.rows_plan`` /
``columns_plan``, as the Triton backend does (one pass at the bandwidth
floor): a tile of 16 bytes a thread (128-bit loads), ``unroll``
tiles loaded a loop step before any is used and folded elementwise into f32
per-lane accumulators (no cross-thread work in the loop), the lanes reduced
once at the end. When the kept dims give too few programs to fill a GPU
(columns, a few long rows), the reduced dim is cut into pieces run by
separate programs (at least ``_layout.GPU_FILL_PROGRAMS``, 8 CTAs per SM),
and a second, small call reduces the f32 partial results; the Mosaic row
kernel reshapes a few long rows into more rows.

Accumulation is in f32; edge blocks are masked with the identity of the op;
``max``/``min`` propagate NaN like ``jnp`` (Triton's own max drops NaN, so the
Triton kernels combine with an explicit NaN-propagating select);
``logsumexp`` is one pass: a running max and a sum rescaled when the max grows
(Triton style: per lane, once a step; one ``exp`` an element), with
``jax.nn.logsumexp``'s treatment of infinite maxima.

Supported: float32, bfloat16, float16 (not on TPU); zero-size inputs take the
reference. Integer
inputs are declared unsupported (``auto`` uses xla for them). The gradient
(custom VJP) is the reference's: written out for sum/max/min/logsumexp, and
the reference's own VJP for prod (which handles zeros).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

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
from nxops.kernels.xla import reduce as xla_reduce

F32 = jnp.float32


# ---------------------------------------------------------------------------
# The ops: identity, elementwise combine, and a reduction of one block axis


def _nan_max(a, b):
    return jnp.where((a > b) | (a != a), a, b)


def _nan_min(a, b):
    return jnp.where((a < b) | (a != a), a, b)


@dataclasses.dataclass(frozen=True)
class _Monoid:
    identity: float
    combine: Callable


_MONOIDS = {
    "sum": _Monoid(0.0, jnp.add),
    "max": _Monoid(-math.inf, _nan_max),
    "min": _Monoid(math.inf, _nan_min),
    "prod": _Monoid(1.0, jnp.multiply),
    # logsumexp's max pass; its sum pass is "sum".
    "logsumexp": _Monoid(-math.inf, _nan_max),
}


def _halving_reduce(v, axis: int, combine: Callable):
    """Reduces a power-of-two ``axis`` by combining halves (keepdims)."""
    while v.shape[axis] > 1:
        lo, hi = jnp.split(v, 2, axis=axis)
        v = combine(lo, hi)
    return v


def _reduce_block(v, axis: int, op: str, style: str):
    """Reduces ``v`` along ``axis`` (keepdims) with ``op``'s monoid.

    Triton lowers ``jnp.max`` with NaN-dropping ``maxnumf`` and has no product
    reduction, so it combines halves; Mosaic's max/min/sum reductions
    propagate NaN and are used directly (its prod halves too).
    """
    if op == "sum" or (style == "mosaic" and op in ("max", "min", "logsumexp")):
        fn = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "logsumexp": jnp.max}[op]
        return fn(v, axis=axis, keepdims=True)
    return _halving_reduce(v, axis, _MONOIDS[op].combine)


def _finite_or_zero(m):
    """``jax.nn.logsumexp`` shifts by the max only where it is finite."""
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _lse_update(m, s, x, axis: int, style: str):
    """One logsumexp step: running max ``m`` and sum ``s`` (scaled by
    ``exp(-finite(m))``) absorb block ``x`` reduced along ``axis``."""
    m_new = _nan_max(m, _reduce_block(x, axis, "logsumexp", style))
    shift, shift_new = _finite_or_zero(m), _finite_or_zero(m_new)
    # s == 0 (nothing but -inf so far) must stay 0 even if exp() overflows.
    s = jnp.where(s == 0, 0.0, s * jnp.exp(shift - shift_new))
    s = s + jnp.sum(jnp.exp(x - shift_new), axis=axis, keepdims=True)
    return m_new, s


def _lse_finish(m, s):
    return jnp.log(s) + _finite_or_zero(m)


LOG2E = math.log2(math.e)


def _knobs() -> _layout.ReduceKnobs:
    """The Triton-style plan's limits: the ``pallas.triton`` knobs (tests shrink them)."""
    return _layout.ReduceKnobs(tile=_common.cap("triton", "tile"),
                               max_reduced_block=_common.cap("triton", "cols"),
                               target_programs=_common.cap("triton", "programs"),
                               min_steps=_common.cap("triton", "min_steps"))


def _exp(v):
    """``exp`` in interpret mode (and the reference of :func:`_fast_exp`)."""
    return jnp.exp(v)


def _fast_exp(v):
    """``exp`` compiled for a GPU: one MUFU.EX2 an element (``ex2.approx.ftz``:
    results under 2**-126 flush to 0, nothing next to a sum); ``jnp.exp``
    lowers to ``__nv_expf`` and ``jnp.exp2`` to a denormal fix-up around it,
    four to six instructions more an element."""
    (out,) = plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;", args=[v * LOG2E], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, F32)])
    return out


def _absorb(carry, tiles, op: str, exp: Callable):
    """One step of a Triton-style kernel: the per-lane accumulator (and
    logsumexp's sum) absorbs ``tiles``, equal-shaped blocks that the same
    threads hold, so folding them is elementwise (no cross-thread reduction).
    logsumexp: ``m`` is the lane's running max, ``s`` its sum of
    ``exp(x - finite(m))``, rescaled once a step by ``exp(old m - finite(new
    m))`` (0 for an old max of -inf, whatever the sum); NaN reaches the sum
    through ``exp`` (Triton's max drops it); one ``exp`` an element."""
    if op == "logsumexp":
        m, s = carry
        m_new = functools.reduce(jnp.maximum, tiles, m)
        shift = _finite_or_zero(m_new)
        s = s * exp(m - shift) + functools.reduce(jnp.add, [exp(t - shift) for t in tiles])
        return m_new, s
    combine = _MONOIDS[op].combine
    return combine(carry, functools.reduce(combine, tiles))


def _finish_lanes(carry, op: str, axis: int, exp: Callable):
    """Reduces the lanes along ``axis`` once (keepdims): the block's result."""
    if op != "logsumexp":
        return _reduce_block(carry, axis, op, "triton")
    m, s = carry
    shift = _finite_or_zero(jnp.max(m, axis=axis, keepdims=True))
    return jnp.log(jnp.sum(s * exp(m - shift), axis=axis, keepdims=True)) + shift


def _accumulate_triton(load, plan: _layout.ReducePlan, op: str, axis: int, fast_exp: bool):
    """Loops over the program's piece inside a Triton kernel (no scratch
    memory there): step ``j`` loads ``plan.unroll`` tiles (``load(j, u)``)
    before using any, accumulated per lane in f32; the lanes are reduced once
    at the end. The result keeps ``axis`` as size 1. ``fast_exp``: compiled
    (inline PTX), not interpreted."""
    exp = _fast_exp if fast_exp else _exp
    lanes = jnp.full(plan.block, _MONOIDS[op].identity, F32)
    init = (lanes, jnp.zeros(plan.block, F32)) if op == "logsumexp" else lanes
    carry = lax.fori_loop(
        0, plan.piece_len // plan.step,
        lambda j, carry: _absorb(carry, [load(j, u) for u in range(plan.unroll)], op, exp), init)
    return _finish_lanes(carry, op, axis, exp)


# ---------------------------------------------------------------------------
# Row reduction [outer, reduced] -> [outer]


def _row_kernel_triton(x_ref, o_ref, *, op: str, plan: _layout.ReducePlan, fast_exp: bool):
    """Program (i, p) reduces rows block i over piece p of the row into
    ``o[rows, p]``. Bounds are static: a mask is constant over a thread's 16
    bytes where the row length allows (128-bit loads)."""
    n_outer, n_reduced = x_ref.shape
    bo, br = plan.block
    i, piece = pl.program_id(0), pl.program_id(1)
    rows = i * bo + lax.broadcasted_iota(jnp.int32, (bo, br), 0)
    identity = _MONOIDS[op].identity

    def load(j, u):
        start = piece * plan.piece_len + j * plan.step + u * br
        cols = start + lax.broadcasted_iota(jnp.int32, (bo, br), 1)
        block = x_ref.at[pl.ds(i * bo, bo), pl.ds(start, br)]
        if plan.exact:   # no masks where the plan tiles the operand exactly
            return plgpu.load(block).astype(F32)
        mask = (rows < n_outer) & (cols < n_reduced)
        return plgpu.load(block, mask=mask, other=identity).astype(F32)

    result = _accumulate_triton(load, plan, op, 1, fast_exp)
    out_rows = i * bo + jnp.arange(bo)
    plgpu.store(o_ref.at[pl.ds(i * bo, bo), piece], result[:, 0].astype(o_ref.dtype),
                mask=out_rows < n_outer)


def _accumulate_kernel_mosaic(x_ref, o_ref, acc_ref, sum_ref=None, *, op: str, n_reduced: int,
                              reduce_axis: int, step_axis: int):
    """One block of a row (reduce_axis=1) or column (reduce_axis=0) reduction:
    grid axis ``step_axis`` walks the reduced dim, accumulating in f32 scratch."""
    j = pl.program_id(step_axis)
    block = x_ref.shape[reduce_axis]
    monoid = _MONOIDS[op]
    x = x_ref[...].astype(F32)
    if n_reduced % block:  # mask the tail of the last block (garbage past the end)
        idx = j * block + lax.broadcasted_iota(jnp.int32, x_ref.shape, reduce_axis)
        x = jnp.where(idx < n_reduced, x, monoid.identity)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.full(acc_ref.shape, monoid.identity, F32)
        if sum_ref is not None:
            sum_ref[...] = jnp.zeros(sum_ref.shape, F32)

    if op == "logsumexp":
        acc_ref[...], sum_ref[...] = _lse_update(acc_ref[...], sum_ref[...], x, reduce_axis, "mosaic")
    else:
        acc_ref[...] = monoid.combine(acc_ref[...], _reduce_block(x, reduce_axis, op, "mosaic"))

    @pl.when(j == pl.num_programs(step_axis) - 1)
    def _finish():
        result = acc_ref[...] if op != "logsumexp" else _lse_finish(acc_ref[...], sum_ref[...])
        o_ref[...] = result.astype(o_ref.dtype)


_row_kernel_mosaic = functools.partial(_accumulate_kernel_mosaic, reduce_axis=1, step_axis=1)
_column_kernel_mosaic = functools.partial(_accumulate_kernel_mosaic, reduce_axis=0, step_axis=2)


def _row_reduce_call(x2, op: str, target: Target, out_dtype, *, may_split: bool = False
                     ) -> jax.Array:
    """One kernel call: ``[outer, reduced] -> [outer]`` in ``out_dtype``; with
    ``may_split`` (Triton) ``[outer, split]`` partial results in f32 instead,
    the reduced dim cut into ``split`` pieces run by separate programs."""
    n_outer, n_reduced = x2.shape
    style = target.style
    pow2 = op == "prod"
    if style == "triton":
        plan = _layout.rows_plan(n_outer, n_reduced, x2.dtype.itemsize, _knobs(), split=may_split)
        split = plan.n_pieces
        out = pl.pallas_call(
            functools.partial(_row_kernel_triton, op=op, plan=plan,
                              fast_exp=not target.interpret),
            out_shape=jax.ShapeDtypeStruct((n_outer, split), F32 if split > 1 else out_dtype),
            grid=plan.grid, name=f"nxops_reduce_rows_{op}",
            cost_estimate=_common.reduce_cost(x2, (n_outer, split), out_dtype, op),
            **_common.call_kwargs(target, num_warps=plan.warps),
        )(x2)
        return out if split > 1 else out[:, 0]
    br = _common.block_size(style, n_reduced, "cols", power_of_2=pow2, align=128)
    bo = _common.block_size(style, n_outer, "rows", align=8)
    scratch = [pltpu.VMEM((bo, 1), F32)] * (2 if op == "logsumexp" else 1)
    out = pl.pallas_call(
        functools.partial(_row_kernel_mosaic, op=op, n_reduced=n_reduced),
        out_shape=jax.ShapeDtypeStruct((n_outer, 1), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(pl.cdiv(n_outer, bo), pl.cdiv(n_reduced, br)),
            in_specs=[pl.BlockSpec((bo, br), lambda i, j: (i, j))],
            out_specs=pl.BlockSpec((bo, 1), lambda i, j: (i, 0)),
            scratch_shapes=scratch),
        name=f"nxops_reduce_rows_{op}",
        cost_estimate=_common.reduce_cost(x2, (n_outer,), out_dtype, op),
        **_common.call_kwargs(target, dimension_semantics=("parallel", "arbitrary")),
    )(x2)
    return out[:, 0]


def _row_split(n_outer: int, n_reduced: int, style: str) -> int:
    """How many rows to cut each row into, so that a few long rows spread over
    many programs (GPU) / full sublanes (TPU): a power of two dividing the row,
    keeping pieces at least a block long, up to ~256 rows in all."""
    split, piece_floor = 1, _common.cap(style, "cols")
    while (n_outer * split * 2 <= 256 and n_reduced % (split * 2) == 0
           and n_reduced // (split * 2) >= piece_floor):
        split *= 2
    return split


def _row_reduce(x2, op: str, target: Target) -> jax.Array:
    """Rows too few to fill the GPU are cut along the reduced dim (Triton: a
    second grid axis over pieces; Mosaic: reshaped into more rows); the f32
    partial results are reduced by a second, tiny call: logsumexp of partial
    logsumexps is the logsumexp of the row."""
    n_outer, n_reduced = x2.shape
    if target.style == "triton":
        partial = _row_reduce_call(x2, op, target, x2.dtype, may_split=True)
        if partial.ndim == 1:
            return partial
        return _row_reduce_call(partial, op, target, x2.dtype)
    split = _row_split(n_outer, n_reduced, target.style)
    if split == 1:
        return _row_reduce_call(x2, op, target, x2.dtype)
    partial = _row_reduce_call(x2.reshape(n_outer * split, n_reduced // split), op, target, F32)
    return _row_reduce_call(partial.reshape(n_outer, split), op, target, x2.dtype)


# ---------------------------------------------------------------------------
# Column reduction [outer, reduced, inner] -> [outer, inner]


def _column_kernel_triton(x_ref, o_ref, *, op: str, plan: _layout.ReducePlan,
                          fast_exp: bool):
    """Program (o, k, p) reduces columns block k of slab o over piece p of
    the reduced dim into ``o[o, p, cols]``."""
    _, n_reduced, n_inner = x_ref.shape
    br, bi = plan.block
    o, k, piece = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = k * bi + lax.broadcasted_iota(jnp.int32, (br, bi), 1)
    identity = _MONOIDS[op].identity

    def load(j, u):
        start = piece * plan.piece_len + j * plan.step + u * br
        rows = start + lax.broadcasted_iota(jnp.int32, (br, bi), 0)
        block = x_ref.at[o, pl.ds(start, br), pl.ds(k * bi, bi)]
        if plan.exact:
            return plgpu.load(block).astype(F32)
        return plgpu.load(block, mask=(rows < n_reduced) & (cols < n_inner),
                          other=identity).astype(F32)

    result = _accumulate_triton(load, plan, op, 0, fast_exp)
    out_cols = k * bi + jnp.arange(bi)
    plgpu.store(o_ref.at[o, piece, pl.ds(k * bi, bi)], result[0].astype(o_ref.dtype),
                mask=out_cols < n_inner)


def _column_reduce_triton(x3, op: str, target: Target, out_dtype, *, may_split: bool
                          ) -> jax.Array:
    """``[outer, reduced, inner] -> [outer, split, inner]``: f32 partial
    results of ``split`` pieces of the reduced dim (``out_dtype`` when
    ``split == 1``). Without ``may_split``, ``x3`` holds a first pass's
    partials: narrower column blocks give that pass more programs."""
    n_outer, n_reduced, n_inner = x3.shape
    plan = _layout.columns_plan(n_outer, n_reduced, n_inner, x3.dtype.itemsize, _knobs(),
                                split=may_split)
    split = plan.n_pieces
    return pl.pallas_call(
        functools.partial(_column_kernel_triton, op=op, plan=plan, fast_exp=not target.interpret),
        out_shape=jax.ShapeDtypeStruct((n_outer, split, n_inner), F32 if split > 1 else out_dtype),
        grid=plan.grid, name=f"nxops_reduce_columns_{op}",
        cost_estimate=_common.reduce_cost(x3, (n_outer, split, n_inner), out_dtype, op),
        **_common.call_kwargs(target, num_warps=plan.warps),
    )(x3)


def _column_reduce(x3, op: str, target: Target) -> jax.Array:
    n_outer, n_reduced, n_inner = x3.shape
    style = target.style
    if style == "triton":
        # Few column blocks (e.g. 4 on 4096x4096) cannot fill the GPU: the
        # reduced dim is cut into pieces, whose f32 partials a second call reduces.
        partial = _column_reduce_triton(x3, op, target, x3.dtype, may_split=True)
        if partial.shape[1] > 1:
            partial = _column_reduce_triton(partial, op, target, x3.dtype, may_split=False)
        return partial[:, 0, :]
    br = _common.block_size(style, n_reduced, "rows", power_of_2=op == "prod", align=8)
    bi = _common.block_size(style, n_inner, "cols", align=128)
    scratch = [pltpu.VMEM((1, bi), F32)] * (2 if op == "logsumexp" else 1)
    out = pl.pallas_call(
        functools.partial(_column_kernel_mosaic, op=op, n_reduced=n_reduced),
        out_shape=jax.ShapeDtypeStruct((n_outer, 1, n_inner), x3.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(n_outer, pl.cdiv(n_inner, bi), pl.cdiv(n_reduced, br)),
            in_specs=[pl.BlockSpec((None, br, bi), lambda o, k, j: (o, j, k))],
            out_specs=pl.BlockSpec((None, 1, bi), lambda o, k, j: (o, 0, k)),
            scratch_shapes=scratch),
        name=f"nxops_reduce_columns_{op}",
        cost_estimate=_common.reduce_cost(x3, (n_outer, n_inner), x3.dtype, op),
        **_common.call_kwargs(target, dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(x3)
    return out[:, 0, :]


# ---------------------------------------------------------------------------
# The wrapper: canonical view, then the row or column kernel


def reduce_forward(x: jax.Array, *, axes: tuple[int, ...], op: str, platform: str,
                   style: str | None) -> jax.Array:
    """The kernel path of :func:`reduce` (no custom VJP)."""
    if x.size == 0:   # nothing to launch: the reference's -inf, 0, or error
        return xla_reduce.reduce(x, axes=axes, op=op)
    target = _common.target_for(platform, style)
    return _layout.reduce_via_view(x, axes, lambda x2: _row_reduce(x2, op, target),
                                   lambda x3: _column_reduce(x3, op, target))


_reduce = _vjp.with_vjp(reduce_forward, _vjp.reduce_vjp)


def reduce(x: jax.Array, *, axes: tuple[int, ...], op: str, platform: str = "cpu") -> jax.Array:
    """``jnp.<op>(x, axis=axes)`` as a Pallas kernel (see the module docstring).

    ``platform``: ``"cpu"`` (interpret mode), ``"cuda"`` (Triton), ``"tpu"``
    (Mosaic). Differentiable (custom VJP matching the reference's gradient).
    """
    return reduce_in_style(x, axes=axes, op=op, platform=platform, style=None)


def reduce_in_style(x: jax.Array, *, axes: tuple[int, ...], op: str, platform: str = "cpu",
                    style: str | None = None) -> jax.Array:
    """:func:`reduce` with the kernel ``style`` chosen: interpret mode on CPU
    runs either ("triton" or "mosaic"); the tests check both."""
    if op not in xla_reduce.REDUCE_OPS:
        raise ValueError(f"unknown reduction {op!r}; known: {xla_reduce.REDUCE_OPS}")
    return _reduce(x, axes=_layout.normalize_axes(axes, x.ndim), op=op, platform=platform,
                   style=style)


def not_supported_reasons(x, *, platform: str, axes, op: str, **params) -> list[str]:
    """Why the Pallas reduction cannot take this case (empty: it can)."""
    del params
    reasons = []
    dtype = jnp.dtype(x.dtype)
    if dtype not in _checks.FLOAT_DTYPES:
        reasons.append(f"Pallas reductions take float32/bfloat16/float16 inputs, not {dtype}: "
                       "they accumulate in float32, exact for neither integer sums beyond 2**24 "
                       "nor float64 (integer and float64 reductions use xla)")
    elif platform == "tpu" and dtype == jnp.float16:
        reasons.append("float16 has no native TPU support; Pallas TPU reductions take f32/bf16")
    if op not in xla_reduce.REDUCE_OPS:
        reasons.append(f"unknown reduction {op!r}")
    del axes
    return reasons + _checks.too_large_reasons(x.shape)


KERNEL = register(Kernel(
    op="reduce", backend="pallas", platforms=_common.PLATFORMS, fn=reduce,
    not_supported_reasons=not_supported_reasons, manual_only_platforms=("tpu",),
    description="Pallas row/column reduction (Triton on GPU, Mosaic on TPU, interpret on CPU)",
))
