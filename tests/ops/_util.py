"""Helpers shared by the named-op tests."""
import numpy as np

from tests import _tolerances


def assert_close(actual, expected, dtype=np.float32, scale=1.0):
    """The shared per-dtype tolerance, ``scale`` times looser in both terms."""
    _tolerances.assert_close(actual, expected, dtype, scale=scale, relative_scale=scale)
