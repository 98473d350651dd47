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
GPU_TARGET_PROGRAMS = 264


def pieces(n_reduced: int, block: int, programs: int, *, target: int = GPU_TARGET_PROGRAMS,
           min_blocks: int = 4) -> tuple[int, int]:
    """(piece length, number of pieces) cutting a reduced axis of
    ``n_reduced`` so that ``programs`` programs per piece reach ``target``,
    with pieces of whole ``block`` s and at least ``min_blocks`` of them."""
    wanted = cdiv(target, programs)
    affordable = max(1, n_reduced // (block * min_blocks))
    piece_len = cdiv(cdiv(n_reduced, min(wanted, affordable)), block) * block
    return piece_len, cdiv(n_reduced, piece_len)
