"""Helpers shared by the named-op tests."""
import jax
import numpy as np

TOLERANCE = {np.dtype("float32"): 1e-5, np.dtype(jax.numpy.bfloat16): 2e-2,
             np.dtype("float16"): 2e-3}


def assert_close(actual, expected, dtype=np.float32, scale=1.0):
    tol = TOLERANCE.get(np.dtype(dtype), 1e-5) * scale
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=tol, atol=tol)
