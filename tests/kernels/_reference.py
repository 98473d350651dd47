"""What the kernel tests share: the backends they run (each with the small
blocks that make small arrays span many), the float64 NumPy references, input
samples, and the comparisons (tolerances from ``tests/_tolerances.py``).

Backends: the Pallas kernels in interpret mode in both program styles
("pallas-triton", "pallas-mosaic"), and the Triton kernels ("triton"), run by
Triton's interpreter on CPU, or compiled where the default device is a GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import string
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nxops.kernels import _knobs
from tests._extras import skip_without_triton
from tests._tolerances import assert_close

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# Tiny blocks and a GPU of a few programs, so that test arrays of a few
# hundred elements span several blocks in every dim, and the split passes
# run. Mosaic-style caps stay legal TPU blocks (multiples of 8 sublanes / 128
# lanes); Triton's matmul blocks are at least 16 (tl.dot).
SMALL_KNOBS = {
    "pallas-triton": {"pallas.triton": dict(rows=4, cols=8, tile=32, m=16, n=16, k=16,
                                            programs=6, min_steps=1)},
    "pallas-mosaic": {"pallas.mosaic": dict(rows=8, cols=128, tile=8 * 128, m=8, n=128, k=128)},
    "triton": {"triton.reduce": dict(tile=32, cols=8, programs=6, min_steps=1),
               "triton.dot_general": dict(programs=6, min_k_steps=1, m=16, n=16, k=16),
               "triton.tile": dict(tile=32, cols=8)},
}

# Where the default device is a GPU the Triton kernels run there, compiled
# (the interpreter path would only test the interpreter again, on the host).
TRITON_PLATFORM = "cuda" if jax.default_backend() == "gpu" else "cpu"


@contextlib.contextmanager
def small_blocks(backend: str) -> Iterator[None]:
    """``backend``'s kernels with :data:`SMALL_KNOBS` within the block."""
    with contextlib.ExitStack() as stack:
        for group, values in SMALL_KNOBS[backend].items():
            stack.enter_context(_knobs.tuned(group, **values))
        yield


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend's kernels, called as the xla references are."""

    name: str

    def _pallas_style(self) -> str:
        return self.name.removeprefix("pallas-")

    def reduce(self, x, *, axes, op):
        if self.name == "triton":
            from nxops.kernels.triton import reduce as triton_reduce
            return triton_reduce.reduce(x, axes=axes, op=op, platform=TRITON_PLATFORM)
        from nxops.kernels.pallas import reduce as pallas_reduce
        return pallas_reduce.reduce_in_style(x, axes=axes, op=op, style=self._pallas_style())

    def tile(self, x, index, *, dim, count):
        if self.name == "triton":
            from nxops.kernels.triton import tile as triton_tile
            return triton_tile.tile(x, index, dim=dim, count=count, platform=TRITON_PLATFORM)
        from nxops.kernels.pallas import tile as pallas_tile
        return pallas_tile.tile_in_style(x, index, dim=dim, count=count, style=self._pallas_style())

    def dot_general(self, a, b, *, dimension_numbers, **params):
        if self.name == "triton":
            from nxops.kernels.triton import dot_general as triton_dot
            return triton_dot.dot_general(a, b, dimension_numbers=dimension_numbers,
                                          platform=TRITON_PLATFORM, **params)
        from nxops.kernels.pallas import dot_general as pallas_dot
        return pallas_dot.dot_general_in_style(a, b, dimension_numbers=dimension_numbers,
                                               style=self._pallas_style(), **params)


BACKEND_NAMES = ("pallas-triton", "pallas-mosaic", "triton")


def backends(*names: str) -> list:
    """pytest parameters for the named backends (all by default); Triton's
    skips where the triton extra is missing."""
    return [pytest.param(n, marks=skip_without_triton) if n == "triton" else n
            for n in names or BACKEND_NAMES]


# ---------------------------------------------------------------------------
# Inputs


def sample(shape, op: str, dtype, seed: int = 0, *, specials: bool = False):
    """Normal values (``prod``: near +-1, so that products neither overflow nor
    vanish); ``specials``: a few of them NaN or +-inf."""
    rng = np.random.default_rng(seed)
    if op == "prod":
        values = rng.uniform(0.9, 1.1, shape) * rng.choice([-1.0, 1.0], shape)
    else:
        values = rng.standard_normal(shape)
    if specials and values.size:
        flat = values.reshape(-1)
        picks = rng.choice(flat.size, size=min(3, flat.size), replace=False)
        flat[picks] = rng.choice([np.nan, np.inf, -np.inf], size=picks.size)
    return jnp.asarray(values, dtype)


def operands(shape_a, shape_b, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(shape_a), dtype),
            jnp.asarray(rng.standard_normal(shape_b), dtype))


# ---------------------------------------------------------------------------
# References in float64


def _as64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def numpy_reduce(x, axes, op: str) -> np.ndarray:
    """``jnp.<op>(x, axis=axes)`` in float64; logsumexp shifts by the max where
    it is finite, as ``jax.nn.logsumexp`` does (all -inf gives -inf, any +inf
    gives +inf)."""
    x = _as64(x)
    axes = tuple(a % x.ndim for a in axes) if x.ndim else tuple(axes)
    if op != "logsumexp":
        return getattr(np, op)(x, axis=axes)
    if any(x.shape[a] == 0 for a in axes):   # the logsumexp of nothing
        return np.full([n for d, n in enumerate(x.shape) if d not in axes], -np.inf)
    m = np.max(x, axis=axes, keepdims=True)
    shift = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return np.squeeze(np.log(np.sum(np.exp(x - shift), axis=axes, keepdims=True)) + shift,
                          axis=axes)


def numpy_dot_general(a, b, dimension_numbers) -> np.ndarray:
    """float64 einsum with the output order of lax.dot_general."""
    (ac, bc), (ab, bb) = dimension_numbers
    letters = iter(string.ascii_letters)
    a_sub = [next(letters) for _ in range(a.ndim)]
    b_sub = [next(letters) for _ in range(b.ndim)]
    for i, j in [*zip(ac, bc), *zip(ab, bb)]:
        b_sub[j] = a_sub[i]
    out = ([a_sub[i] for i in ab] + [a_sub[i] for i in range(a.ndim) if i not in ac + ab]
           + [b_sub[j] for j in range(b.ndim) if j not in bc + bb])
    return np.einsum(f"{''.join(a_sub)},{''.join(b_sub)}->{''.join(out)}", _as64(a), _as64(b))


def sum_scale(shape, axes) -> float:
    """Magnitude of an f32 sum's rounding error, relative to one term."""
    return math.sqrt(math.prod(shape[a] for a in axes) if axes else 1)


def assert_matches(got, want, dtype, scale: float = 1.0) -> None:
    """Within ``dtype``'s tolerance; NaN and infinities exactly where ``want``
    has them."""
    got, want = _as64(got), _as64(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    special = ~np.isfinite(want) & ~np.isnan(want)
    np.testing.assert_array_equal(got[special], want[special])
    finite = np.isfinite(want)
    assert_close(got[finite], want[finite], dtype, scale)
