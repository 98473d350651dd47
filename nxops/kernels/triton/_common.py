"""Shared pieces of the Triton kernels: platforms, sizes, dtype checks."""
from __future__ import annotations

import jax.numpy as jnp

import functools

from nxops._install import install_command
from nxops.kernels._layout import cdiv  # noqa: F401  (re-exported)
from nxops.kernels.pallas._common import (  # noqa: F401  (re-exported)
    FLOAT_DTYPES, next_power_of_2, num_warps_for, too_large_reasons)

# cuda: compiled through jax-triton; cpu: Triton's interpreter (for tests).
PLATFORMS = ("cpu", "cuda")


def float_dtype_reasons(what: str, *dtypes) -> list[str]:
    """A reason for each dtype the kernels do not take (they accumulate in f32)."""
    return [f"{what} take float32/bfloat16/float16, not {jnp.dtype(d)}: they accumulate in "
            "float32, exact for neither integer sums beyond 2**24 nor float64 (integer and "
            "float64 cases use xla)" for d in dict.fromkeys(jnp.dtype(d) for d in dtypes)
            if d not in FLOAT_DTYPES]


@functools.cache   # asked on every lowering; installs do not change in a process
def _importable(module: str) -> bool:
    import importlib.util  # noqa: PLC0415
    return importlib.util.find_spec(module) is not None


def missing_packages(platform: str) -> list[str]:
    """Why the backend cannot run on ``platform`` for lack of a package
    (triton everywhere; jax-triton to compile on cuda)."""
    if not _importable("triton"):
        return [f"triton is not installed: {install_command('triton')} (nxops' triton extra)"]
    if platform == "cuda" and not _importable("jax_triton"):
        return [f"jax-triton is not installed: {install_command('triton')} "
                "(nxops' triton extra)"]
    return []
