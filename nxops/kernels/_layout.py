"""How kernels of every backend view their operands and split their work:
the positional plumbing that is the same for Pallas and Triton kernels."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from nxops.kernels import _gpu_target


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_warps_for(elements: int) -> int:
    """GPU warps for a per-program tile of ``elements`` values: about 16-32
    values per thread, 1 to 8 warps."""
    return max(1, min(8, next_power_of_2(elements) // 512))


# ---------------------------------------------------------------------------
# Axes


def normalize_axes(axes, ndim: int) -> tuple[int, ...]:
    """``axes`` sorted and non-negative (a scalar's empty ``axes`` stay as they are)."""
    return tuple(sorted(a % ndim if ndim else a for a in axes))


def normalize_axis(axis: int, rank: int) -> int:
    """``axis`` of an array of ``rank`` dims, non-negative; out of range raises."""
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    return axis % rank


def reduce_via_view(x, axes: tuple[int, ...], rows: Callable, columns: Callable):
    """``x`` reduced over ``axes`` (sorted, non-negative) by ``rows(x2)`` on an
    ``[outer, reduced]`` view or ``columns(x3)`` on ``[outer, reduced, inner]``
    (see :func:`canonical_view`), reshaped to the kept dims."""
    out_shape = tuple(n for d, n in enumerate(x.shape) if d not in axes)
    permutation, (n_outer, n_reduced, n_inner) = canonical_view(x.shape, axes)
    if permutation is not None:
        x = jnp.transpose(x, permutation)
    if n_inner == 1:
        out = rows(x.reshape(n_outer, n_reduced))
    else:
        out = columns(x.reshape(n_outer, n_reduced, n_inner))
    return out.reshape(out_shape)


# ---------------------------------------------------------------------------
# Tiles


def clamp_index(index, count: int):
    """The tile ``dynamic_slice`` takes for ``index``: a negative start counts
    from the end (``index + count``), then the start is clamped into range
    (also inside kernels, on a loaded index)."""
    return jnp.clip(jnp.where(index < 0, index + count, index), 0, count - 1)


def effective_index(index, count: int) -> jax.Array:
    return clamp_index(jnp.asarray(index, jnp.int32), count)


def tile_view(x, dim: int, count: int):
    """(``x`` as ``[outer, count, tile_len]``, the tile's shape): the tile is
    ``view[:, index, :]`` (a free reshape)."""
    size = x.shape[dim] // count
    out_shape = x.shape[:dim] + (size,) + x.shape[dim + 1:]
    return x.reshape(math.prod(x.shape[:dim]), count, size * math.prod(x.shape[dim + 1:])), out_shape


# ---------------------------------------------------------------------------
# Contractions


def free_dims(ndim: int, contract, batch) -> list[int]:
    """The dims of an operand that are neither contracted nor batch, in order
    (they come out after the batch dims, lhs before rhs, as in dot_general)."""
    return [d for d in range(ndim) if d not in contract and d not in batch]


def canonical_dimension_numbers(dimension_numbers):
    """``dimension_numbers`` as hashable tuples of ints."""
    (a_contract, b_contract), (a_batch, b_batch) = dimension_numbers
    return ((tuple(map(int, a_contract)), tuple(map(int, b_contract))),
            (tuple(map(int, a_batch)), tuple(map(int, b_batch))))


def output_dtype(a, b, dimension_numbers, preferred_element_type):
    return jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=dimension_numbers,
                          preferred_element_type=preferred_element_type),
        jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(b.shape, b.dtype)).dtype


def _transpose_if_needed(x, permutation):
    permutation = tuple(permutation)
    return x if permutation == tuple(range(x.ndim)) else jnp.transpose(x, permutation)


def as_batched_matmul(a, b, dimension_numbers, preferred_element_type, matmul) -> jax.Array:
    """``lax.dot_general(a, b, dimension_numbers)`` computed by ``matmul(a3, b3,
    out_dtype)`` on ``[B, M, K] x [B, K, N]`` views: ``a`` transposed to
    (batch, free, contracting) and ``b`` to (batch, contracting, free), each a
    no-op when the operand is already in that order."""
    (a_contract, b_contract), (a_batch, b_batch) = dimension_numbers
    a_free = free_dims(a.ndim, a_contract, a_batch)
    b_free = free_dims(b.ndim, b_contract, b_batch)
    out_dtype = output_dtype(a, b, dimension_numbers, preferred_element_type)
    batch_shape = [a.shape[d] for d in a_batch]
    a_free_shape = [a.shape[d] for d in a_free]
    b_free_shape = [b.shape[d] for d in b_free]
    n_batch, n_k = math.prod(batch_shape), math.prod(a.shape[d] for d in a_contract)
    a3 = _transpose_if_needed(a, [*a_batch, *a_free, *a_contract]).reshape(
        n_batch, math.prod(a_free_shape), n_k)
    b3 = _transpose_if_needed(b, [*b_batch, *b_contract, *b_free]).reshape(
        n_batch, n_k, math.prod(b_free_shape))
    out = matmul(a3, b3, out_dtype)
    return out.reshape(*batch_shape, *a_free_shape, *b_free_shape)


# ---------------------------------------------------------------------------
# Reductions


def canonical_view(shape: tuple[int, ...], axes: tuple[int, ...]):
    """``(permutation or None, (outer, reduced, inner))`` for reducing ``axes``
    (sorted, non-negative) of ``shape``: no permutation when they are
    contiguous, else the reduced axes are moved last (``inner == 1``)."""
    kept = [d for d in range(len(shape)) if d not in axes]

    def size(dims):
        return math.prod(shape[d] for d in dims)

    if not axes:
        return None, (size(kept), 1, 1)
    if list(axes) == list(range(axes[0], axes[-1] + 1)):
        return None, (size(range(axes[0])), size(axes), size(range(axes[-1] + 1, len(shape))))
    return tuple(kept) + tuple(axes), (size(kept), size(axes), 1)


# Programs a GPU launch should have: two per SM of the GPU the plans are
# sized for (an H100). Reductions and split-K matmuls split their long axis
# to get there.
GPU_SM_COUNT = _gpu_target.sm_count(_gpu_target.PLANNED_ARCH)
GPU_TARGET_PROGRAMS = 2 * GPU_SM_COUNT

# Programs a memory-bound launch wants (the one-pass reductions): eight CTAs
# of 128 threads per SM, whose loads in flight (64 bytes a thread) cover HBM
# latency at full bandwidth; two per SM keep only about a third of it busy.
GPU_FILL_PROGRAMS = 8 * GPU_SM_COUNT

# A split never leaves a program fewer than this many blocks to walk (the
# second pass and the launch must stay small next to the first).
MIN_STEPS_PER_PROGRAM = 4


def split_count(programs: int, n_blocks: int, *, target: int = GPU_TARGET_PROGRAMS,
                min_steps: int = MIN_STEPS_PER_PROGRAM) -> tuple[int, int]:
    """``(split, blocks per piece)`` cutting ``n_blocks`` consecutive blocks into
    pieces so that ``programs * split >= target`` when the blocks allow it
    (each piece at least ``min_steps`` blocks); ``(1, n_blocks)`` when
    ``programs`` are already enough or the axis is short."""
    want = cdiv(target, programs)
    split = min(want, n_blocks // min_steps)
    if split <= 1:
        return 1, n_blocks
    per_piece = n_blocks // split          # floor: at least `split` pieces
    return cdiv(n_blocks, per_piece), per_piece


# ---------------------------------------------------------------------------
# One-pass GPU reductions (Pallas and Triton kernels plan alike)


@dataclasses.dataclass(frozen=True)
class ReduceKnobs:
    """What a backend's one-pass reduction may use (tests shrink them)."""

    tile: int = 4096              # cap on a tile's elements
    max_reduced_block: int = 1024  # cap on a rows tile's width
    target_programs: int = GPU_FILL_PROGRAMS
    min_steps: int = MIN_STEPS_PER_PROGRAM
    unroll: int = 4               # tiles a loop step loads before using any
    warps: int = 4
    sm_count: int = GPU_SM_COUNT


@dataclasses.dataclass(frozen=True)
class ReducePlan:
    """How a kernel covers ``[outer, reduced, inner]``: each program loads
    ``unroll`` tiles of ``block`` a step (rows: ``(BO, BR)``; columns:
    ``(BR, BI)``), over ``piece_len`` of the reduced dim (a whole number of
    steps; piece ``p`` starts at ``p * piece_len``)."""

    block: tuple[int, int]
    unroll: int
    piece_len: int
    n_pieces: int
    grid: tuple[int, ...]
    warps: int
    exact: bool   # the blocks and pieces tile the operand exactly: no masks

    @property
    def step(self) -> int:
        """Elements of the reduced dim a step advances."""
        reduced = self.block[1] if len(self.grid) == 2 else self.block[0]
        return self.unroll * reduced


def vector(itemsize: int) -> int:
    """Elements of one 16-byte (128-bit) load."""
    return 16 // itemsize


def _tile(itemsize: int, knobs: ReduceKnobs) -> int:
    """A tile's elements: one 16-byte load per thread."""
    return min(knobs.tile, knobs.warps * 32 * vector(itemsize))


def _warps(elements: int, itemsize: int, knobs: ReduceKnobs) -> int:
    return max(1, min(knobs.warps, elements // (32 * vector(itemsize))))


def _pieces(n_reduced: int, step: int, programs: int, split: bool, knobs: ReduceKnobs):
    """(piece length, pieces): whole steps each; when the steps tile the axis,
    up to twice the pieces ``split_count`` asks for, to tile it exactly (a
    plan that tiles the operand loads without masks)."""
    n_steps = cdiv(n_reduced, step)
    if not split:
        return n_steps * step, 1
    n_pieces, per_piece = split_count(programs, n_steps, target=knobs.target_programs,
                                      min_steps=knobs.min_steps)
    if n_pieces > 1 and n_reduced % step == 0:
        for pieces in range(n_pieces, 2 * n_pieces + 1):
            if n_steps % pieces == 0 and n_steps // pieces >= knobs.min_steps:
                return n_steps // pieces * step, pieces
    return per_piece * step, n_pieces


def _unroll(n_reduced: int, block: int, knobs: ReduceKnobs) -> int:
    return min(knobs.unroll, next_power_of_2(cdiv(n_reduced, block)))


def rows_plan(n_rows: int, n_cols: int, itemsize: int, knobs: ReduceKnobs, *,
              split: bool = True) -> ReducePlan:
    """``[n_rows, n_cols] -> [n_rows, n_pieces]``: ``BO`` rows a program,
    long rows cut into pieces when the rows alone give too few programs."""
    tile = _tile(itemsize, knobs)
    br = min(next_power_of_2(n_cols), knobs.max_reduced_block, tile)
    bo = max(1, min(next_power_of_2(n_rows), tile // br))
    unroll = _unroll(n_cols, br, knobs)
    programs = cdiv(n_rows, bo)
    piece_len, n_pieces = _pieces(n_cols, unroll * br, programs, split, knobs)
    return ReducePlan((bo, br), unroll, piece_len, n_pieces, (programs, n_pieces),
                      _warps(bo * br, itemsize, knobs),
                      exact=n_rows % bo == 0 and piece_len * n_pieces == n_cols)


def columns_plan(n_outer: int, n_reduced: int, n_inner: int, itemsize: int, knobs: ReduceKnobs,
                 *, split: bool = True) -> ReducePlan:
    """``[outer, n_reduced, n_inner] -> [outer, n_pieces, n_inner]``: ``BI``
    columns a program, a warp's 16-byte loads side by side (512 contiguous
    bytes a tile row); the reduced dim cut into pieces when the columns give
    too few programs. A second pass (``split=False``, over partials) takes
    narrower blocks, down to 64 bytes (two 32-byte sectors), until it has a
    program per SM (4096^2's partials ran on 4 programs in 512-byte blocks)."""
    tile = _tile(itemsize, knobs)
    bi = min(next_power_of_2(n_inner), 32 * vector(itemsize), tile)
    while not split and n_outer * cdiv(n_inner, bi) < knobs.sm_count and bi > 4 * vector(itemsize):
        bi //= 2
    br = max(1, min(next_power_of_2(n_reduced), tile // bi))
    unroll = _unroll(n_reduced, br, knobs)
    programs = n_outer * cdiv(n_inner, bi)
    piece_len, n_pieces = _pieces(n_reduced, unroll * br, programs, split, knobs)
    return ReducePlan((br, bi), unroll, piece_len, n_pieces,
                      (n_outer, cdiv(n_inner, bi), n_pieces), _warps(br * bi, itemsize, knobs),
                      exact=n_inner % bi == 0 and piece_len * n_pieces == n_reduced)
