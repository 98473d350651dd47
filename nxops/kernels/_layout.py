"""How kernels of every backend view their operands and split their work:
the positional plumbing that is the same for Pallas and Triton kernels."""
from __future__ import annotations

import math


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def canonical_view(shape: tuple[int, ...], axes: tuple[int, ...]):
    """``(permutation or None, (outer, reduced, inner))`` for reducing ``axes``
    (sorted, non-negative) of ``shape``: no permutation when they are
    contiguous, else the reduced axes are moved last (``inner == 1``)."""
    kept = [d for d in range(len(shape)) if d not in axes]
    size = lambda dims: math.prod(shape[d] for d in dims)  # noqa: E731
    if not axes:
        return None, (size(kept), 1, 1)
    if list(axes) == list(range(axes[0], axes[-1] + 1)):
        return None, (size(range(axes[0])), size(axes), size(range(axes[-1] + 1, len(shape))))
    return tuple(kept) + tuple(axes), (size(kept), size(axes), 1)


# Programs a GPU launch should have: two per SM on an H100 (132 SMs; an A100
# has 108). Reductions and split-K matmuls split their long axis to get there.
GPU_TARGET_PROGRAMS = 2 * 132

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
