"""Shared pieces of the Triton kernels: platforms, registration, dtype and
package checks."""
from __future__ import annotations

import functools
import importlib.util

import jax.numpy as jnp

from nxops._install import install_command
from nxops.kernels._checks import FLOAT_DTYPES
from nxops.kernels._registry import Kernel, register

# cuda: compiled through jax-triton; cpu: Triton's interpreter (for tests).
PLATFORMS = ("cpu", "cuda")


def register_kernel(op: str, fn, not_supported_reasons, *, description: str) -> Kernel:
    """Registers the Triton kernel of ``op``."""
    return register(Kernel(
        op=op, backend="triton", platforms=PLATFORMS, fn=fn,
        not_supported_reasons=not_supported_reasons,
        # The interpreter runs in a pure_callback, which XLA cannot partition.
        manual_only_platforms=("cpu",), description=description))


def float_dtype_reasons(what: str, *dtypes) -> list[str]:
    """A reason for each dtype the kernels do not take (they accumulate in f32)."""
    return [f"{what} take float32/bfloat16/float16, not {jnp.dtype(d)}: they accumulate in "
            "float32, exact for neither integer sums beyond 2**24 nor float64 (integer and "
            "float64 cases use xla)" for d in dict.fromkeys(jnp.dtype(d) for d in dtypes)
            if d not in FLOAT_DTYPES]


@functools.cache   # asked on every lowering; installs do not change in a process
def _importable(module: str) -> bool:
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
