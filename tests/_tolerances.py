"""The one per-dtype tolerance table for comparing a result with its
reference: the kernel tests, the op tests and the benchmarks all use it.

A result in dtype ``d`` is compared in float64 as
``|got - want| <= atol + rtol * |want|`` with ``atol = tol * scale`` and
``rtol = tol * relative_scale``, ``tol`` from the table:

- ``rounding``: one rounding of the output plus the reference's own (f32
  accumulates with ~1e-7 relative error; bf16/f16 results carry 2^-8 /
  2^-11 relative). ``scale`` is the magnitude of the summed terms (sqrt(K)
  for a K-long dot of unit normals).
- ``long_sum``: results accumulated over 10^5-10^7 terms (the benchmarks'
  sizes), where the order of a blocked sum changes f32 results by ~1e-3.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np


class Tolerance(NamedTuple):
    rounding: float
    long_sum: float


TOLERANCES = {
    np.dtype(np.float32): Tolerance(rounding=2e-5, long_sum=2e-3),
    np.dtype(jnp.bfloat16): Tolerance(rounding=2e-2, long_sum=3e-2),
    np.dtype(np.float16): Tolerance(rounding=4e-3, long_sum=3e-2),
}


def tolerance(dtype, *, long_sum: bool = False) -> float:
    """``dtype``'s tolerance; other dtypes (f64, ints) take float32's."""
    row = TOLERANCES.get(np.dtype(dtype), TOLERANCES[np.dtype(np.float32)])
    return row.long_sum if long_sum else row.rounding


def assert_close(got, want, dtype=np.float32, scale: float = 1.0, *,
                 relative_scale: float = 1.0, long_sum: bool = False) -> None:
    """Compares in float64 with ``dtype``'s tolerance (see the module docstring)."""
    tol = tolerance(dtype, long_sum=long_sum)
    got, want = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=tol * relative_scale, atol=tol * scale)



def max_abs(x) -> float:
    """The largest magnitude in ``x`` (a tolerance's scale), in NumPy: an eager
    jnp op would compile a program for every shape it meets."""
    return float(np.max(np.abs(np.asarray(x))))
