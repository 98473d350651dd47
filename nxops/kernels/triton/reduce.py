"""Triton reductions over positional axes: sum, max, min, prod, logsumexp.

Reference: :func:`nxops.kernels.xla.reduce.reduce` (``jnp.<op>(x, axis=axes)``).

The wrapper views ``x`` as ``[outer, reduced, inner]`` (as the Pallas
kernel does: no data moves when the reduced axes are contiguous), then

- *rows* (``inner == 1``): program ``(i, p)`` reduces ``BO`` rows over piece
  ``p`` of the reduced axis;
- *columns* (``inner > 1``): program ``(o, k, p)`` reduces ``BI`` columns of
  slab ``o`` over piece ``p``.

One pass at the bandwidth floor: each loop step loads ``UNROLL``
tiles of ``[BO, BR]`` / ``[BR, BI]`` as one ``[UNROLL, ...]`` block, 16
bytes per thread per tile (128-bit loads: sizes are constexprs, so Triton
knows the alignment), all issued before any is used. Each program keeps an
f32 accumulator *per lane* of its tile; the ``UNROLL`` tiles of a step sit
in the same thread, so folding them into the lanes is thread-local and the
lanes are reduced across threads once, at the end. logsumexp keeps a per-lane
running max and a sum of ``exp(x - max)``, rescaled once a step (not once an
element), so that an element costs a max, a subtract, an ``exp`` and an add.
When the programs would not fill the GPU (fewer than the ``reduce_programs``
knob, several CTAs per SM), the reduced axis is cut into pieces, each program
writes an f32 partial result, and a second launch reduces the partials
(logsumexp of partial logsumexps is the logsumexp). No atomics: results are
deterministic. Kernel parameters follow jax-triton's order: inputs and
scalars, outputs, constexprs.

NaN propagates like ``jnp`` (max/min combine with an explicit NaN test:
Triton's own max drops NaN; logsumexp's NaN reaches its sum through ``exp``);
logsumexp treats infinite maxima as ``jax.nn.logsumexp`` does. Zero-size
inputs take the reference. Gradient: the reference's (``xla.reduce.reduce_vjp``).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from nxops.kernels import _checks, _knobs, _layout, _vjp
from nxops.kernels.triton import _batching, _common
from nxops.kernels.triton._launch import Target, launch, target_for
from nxops.kernels.xla import reduce as xla_reduce

OPS = {"sum": 0, "max": 1, "min": 2, "prod": 3, "logsumexp": 4}
IDENTITY = {"sum": 0.0, "max": -math.inf, "min": math.inf, "prod": 1.0, "logsumexp": -math.inf}

# Knobs (``nxops.kernels._knobs``; tests shrink them):
# - programs: the programs a launch wants: several CTAs per SM, so that
#   enough loads are in flight to cover HBM latency (two CTAs of 128 threads
#   per SM, at 64 bytes in flight per thread, keep only a third of an H100's
#   bandwidth busy);
# - tile / cols: a program's tile, 16 bytes per thread (one 128-bit load) per
#   unrolled step, at most this many elements / columns;
# - min_steps: a piece of a split reduced axis spans at least this many steps.
_knobs.declare("triton.reduce", programs=_layout.GPU_FILL_PROGRAMS, tile=4096, cols=1024,
               min_steps=4)
# Tiles loaded per loop step before any is used: loads in flight per thread.
UNROLL = 4
NUM_WARPS = 4


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


LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))


@triton.jit
def _exp(v, FAST_EXP: tl.constexpr):
    """``exp(v)``. Compiled: one MUFU.EX2 (``ex2.approx.ftz``: results under
    2**-126 flush to 0, nothing next to the sum); ``tl.exp`` adds a denormal
    fix-up of four instructions an element. The interpreter has no PTX."""
    if FAST_EXP:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [v * LOG2E],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp(v)


@triton.jit
def _absorb(acc, s, x, OP: tl.constexpr, FAST_EXP: tl.constexpr):
    """One step: the per-lane accumulator ``acc`` (and logsumexp's sum ``s``)
    absorbs ``x``, ``UNROLL`` tiles stacked on axis 0 (held by the same
    thread: the reductions over axis 0 here are thread-local)."""
    if OP == 0:
        acc = acc + tl.sum(x, 0)
    elif OP == 1:
        acc = _nan_max(acc, tl.reduce(x, 0, _nan_max))
    elif OP == 2:
        acc = _nan_min(acc, tl.reduce(x, 0, _nan_min))
    elif OP == 3:
        acc = acc * tl.reduce(x, 0, _mul)
    else:
        # acc: the lane's running max (compiled, tl.maximum drops NaN, which
        # reaches the sum through exp instead; the interpreter keeps it in
        # the max too: NaN either way); s: its sum of exp(x - shift),
        # shift = finite_or_zero(acc). The old sum is rescaled by
        # exp(old max - new shift): 0 for an old max of -inf, whatever s was.
        new = tl.maximum(acc, tl.max(x, 0))
        shift = _finite_or_zero(new)
        s = s * _exp(acc - shift, FAST_EXP) + tl.sum(_exp(x - shift[None], FAST_EXP), 0)
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
        peak = tl.max(acc, AXIS)
        shift = _finite_or_zero(peak)
        total = tl.sum(s * tl.exp(acc - tl.expand_dims(shift, AXIS)), AXIS)
        result = tl.log(total) + shift
    return result


@triton.jit
def _rows_kernel(x_ptr, o_ptr, n_rows: tl.constexpr, n_cols: tl.constexpr,
                 piece_len: tl.constexpr, n_pieces: tl.constexpr, OP: tl.constexpr,
                 IDENTITY: tl.constexpr, BO: tl.constexpr, BR: tl.constexpr,
                 UNROLL: tl.constexpr, FAST_EXP: tl.constexpr, EXACT: tl.constexpr):
    """``[n_rows, n_cols] -> [n_rows, n_pieces]``: program (i, p) reduces rows
    ``i*BO ...`` over columns ``[p*piece_len, (p+1)*piece_len)``, ``UNROLL``
    tiles of ``[BO, BR]`` a step. Bounds are constexprs: the masks are
    constant over a thread's 16 bytes where ``n_cols`` allows it (128-bit
    loads), and absent where the plan tiles the operand exactly (``EXACT``)."""
    i, p = tl.program_id(0), tl.program_id(1)
    rows = i * BO + tl.arange(0, BO)
    row_ok = (rows < n_rows)[None, :, None]
    base = x_ptr + rows[None, :, None] * n_cols   # < 2**31 elements: int32
    steps = BR * tl.arange(0, UNROLL)[:, None, None] + tl.arange(0, BR)[None, None, :]
    acc = tl.full((BO, BR), IDENTITY, tl.float32)
    s = tl.zeros((BO, BR), tl.float32)
    for start in range(p * piece_len, (p + 1) * piece_len, UNROLL * BR):
        cols = start + steps
        if EXACT:
            x = tl.load(base + cols)
        else:
            x = tl.load(base + cols, mask=row_ok & (cols < n_cols), other=IDENTITY)
        acc, s = _absorb(acc, s, x.to(tl.float32), OP, FAST_EXP)
    result = _finish(acc, s, OP, 1)
    tl.store(o_ptr + rows * n_pieces + p, result.to(o_ptr.dtype.element_ty), mask=rows < n_rows)


@triton.jit
def _columns_kernel(x_ptr, o_ptr, n_reduced: tl.constexpr, n_inner: tl.constexpr,
                    piece_len: tl.constexpr, n_pieces: tl.constexpr, OP: tl.constexpr,
                    IDENTITY: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr,
                    UNROLL: tl.constexpr, FAST_EXP: tl.constexpr, EXACT: tl.constexpr):
    """``[outer, n_reduced, n_inner] -> [outer, n_pieces, n_inner]``: program
    (o, k, p) reduces columns ``k*BI ...`` of slab ``o`` over rows
    ``[p*piece_len, (p+1)*piece_len)``, ``UNROLL`` tiles of ``[BR, BI]`` a step."""
    o, k, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = k * BI + tl.arange(0, BI)
    col_ok = (cols < n_inner)[None, None, :]
    base = x_ptr + o * (n_reduced * n_inner) + cols[None, None, :]
    steps = BR * tl.arange(0, UNROLL)[:, None, None] + tl.arange(0, BR)[None, :, None]
    acc = tl.full((BR, BI), IDENTITY, tl.float32)
    s = tl.zeros((BR, BI), tl.float32)
    for start in range(p * piece_len, (p + 1) * piece_len, UNROLL * BR):
        rows = start + steps
        if EXACT:
            x = tl.load(base + rows * n_inner)
        else:
            x = tl.load(base + rows * n_inner, mask=(rows < n_reduced) & col_ok, other=IDENTITY)
        acc, s = _absorb(acc, s, x.to(tl.float32), OP, FAST_EXP)
    result = _finish(acc, s, OP, 0)
    out = o_ptr + (o * n_pieces + p) * n_inner + cols
    tl.store(out, result.to(o_ptr.dtype.element_ty), mask=cols < n_inner)


# ---------------------------------------------------------------------------
# Launch configuration (``_layout.rows_plan`` / ``columns_plan``)


def knobs() -> _layout.ReduceKnobs:
    """The plan's limits: the knobs in force."""
    def knob(name):
        return _knobs.value("triton.reduce", name)
    return _layout.ReduceKnobs(tile=knob("tile"), max_reduced_block=knob("cols"),
                               target_programs=knob("programs"), min_steps=knob("min_steps"),
                               unroll=UNROLL, warps=NUM_WARPS, sm_count=_layout.GPU_SM_COUNT)


def rows_plan(n_rows: int, n_cols: int, dtype, *, split: bool = True) -> _layout.ReducePlan:
    return _layout.rows_plan(n_rows, n_cols, jnp.dtype(dtype).itemsize, knobs(), split=split)


def columns_plan(n_outer: int, n_reduced: int, n_inner: int, dtype, *,
                 split: bool = True) -> _layout.ReducePlan:
    return _layout.columns_plan(n_outer, n_reduced, n_inner, jnp.dtype(dtype).itemsize, knobs(),
                                split=split)


def _rows(x2, op: str, target: Target, out_dtype, *, split: bool = True) -> jax.Array:
    n_rows, n_cols = x2.shape
    plan = rows_plan(n_rows, n_cols, x2.dtype, split=split)
    partial_dtype = out_dtype if plan.n_pieces == 1 else jnp.float32
    (bo, br) = plan.block
    (out,) = launch(
        _rows_kernel, x2,
        out_shape=[jax.ShapeDtypeStruct((n_rows, plan.n_pieces), partial_dtype)],
        grid=plan.grid, target=target, name=f"nxops_triton_reduce_rows_{op}",
        num_warps=plan.warps, n_rows=n_rows, n_cols=n_cols, piece_len=plan.piece_len,
        n_pieces=plan.n_pieces, OP=OPS[op], IDENTITY=IDENTITY[op], BO=bo, BR=br,
        UNROLL=plan.unroll, FAST_EXP=target.platform == "cuda", EXACT=plan.exact)
    if plan.n_pieces == 1:
        return out[:, 0]
    return _rows(out, op, target, out_dtype, split=False)


def _columns(x3, op: str, target: Target, out_dtype, *, split: bool = True) -> jax.Array:
    n_outer, n_reduced, n_inner = x3.shape
    plan = columns_plan(n_outer, n_reduced, n_inner, x3.dtype, split=split)
    partial_dtype = out_dtype if plan.n_pieces == 1 else jnp.float32
    (br, bi) = plan.block
    (out,) = launch(
        _columns_kernel, x3,
        out_shape=[jax.ShapeDtypeStruct((n_outer, plan.n_pieces, n_inner), partial_dtype)],
        grid=plan.grid, target=target, name=f"nxops_triton_reduce_columns_{op}",
        num_warps=plan.warps, n_reduced=n_reduced, n_inner=n_inner, piece_len=plan.piece_len,
        n_pieces=plan.n_pieces, OP=OPS[op], IDENTITY=IDENTITY[op], BR=br, BI=bi,
        UNROLL=plan.unroll, FAST_EXP=target.platform == "cuda", EXACT=plan.exact)
    if plan.n_pieces == 1:
        return out[:, 0, :]
    return _columns(out, op, target, out_dtype, split=False)


def reduce_forward(x: jax.Array, *, axes: tuple[int, ...], op: str, target: Target) -> jax.Array:
    """The kernel path of :func:`reduce` (no custom rules)."""
    if x.size == 0:   # nothing to launch: the reference's -inf, 0, or error
        return xla_reduce.reduce(x, axes=axes, op=op)
    return _layout.reduce_via_view(x, axes, lambda x2: _rows(x2, op, target, x.dtype),
                                   lambda x3: _columns(x3, op, target, x.dtype))


# ---------------------------------------------------------------------------
# Public kernel: batching (custom_vmap) and the reference's gradient (custom_vjp)


def _batched_forward(x, *, axes, op, target):
    """``reduce_forward`` whose vmap moves the batch dim into the kernel."""
    return _batching.vmappable(
        lambda v: reduce_forward(v, axes=axes, op=op, target=target),
        lambda v: _batched_forward(v, axes=tuple(a + 1 for a in axes), op=op, target=target))(x)


_reduce = _vjp.with_vjp(_batched_forward, _vjp.reduce_vjp)


def reduce(x: jax.Array, *, axes: tuple[int, ...], op: str, platform: str = "cpu") -> jax.Array:
    """``jnp.<op>(x, axis=axes)`` as a Triton kernel (see the module docstring).

    ``platform``: ``"cuda"`` (compiled through jax-triton) or ``"cpu"``
    (Triton's interpreter). Differentiable and batchable.
    """
    if op not in OPS:
        raise ValueError(f"unknown reduction {op!r}; known: {tuple(OPS)}")
    return _reduce(x, axes=_layout.normalize_axes(axes, x.ndim), op=op, target=target_for(platform))


def not_supported_reasons(x, *, platform: str, axes, op: str, **params) -> list[str]:
    """Why the Triton reduction cannot take this case (empty: it can)."""
    del params, axes
    reasons = _common.missing_packages(platform)
    reasons += _common.float_dtype_reasons("Triton reductions", x.dtype)
    if op not in OPS:
        reasons.append(f"unknown reduction {op!r}")
    return reasons + _checks.too_large_reasons(x.shape)


KERNEL = _common.register_kernel(
    "reduce", reduce, not_supported_reasons,
    description="Triton row/column reduction, per-lane f32 accumulators, split reduced axis "
                "(jax-triton on GPU, Triton's interpreter on CPU)")
