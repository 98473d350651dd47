"""The CUDA compute capability GPU kernels are built for.

It is the device's, unless :func:`compiling_for` names one: that is how the
deviceless compile harness (``bench/static/gpu.py``) builds for an H100 or an
A100 on a machine with no GPU. Kernels read it while they are traced or
lowered to pick per-architecture configurations.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import jax

from nxops._jax import config as _jax_config

# 0: ask the device. Part of the jit key: compiling for another GPU retraces.
_COMPUTE_CAPABILITY = _jax_config.int_state(
    "nxops_cuda_compute_capability", 0,
    "The CUDA compute capability nxops' GPU kernels are built for (0: the device's).",
    include_in_jit_key=True, include_in_trace_context=True)

DEFAULT_COMPUTE_CAPABILITY = 90   # with no device to ask: an H100


@contextlib.contextmanager
def compiling_for(compute_capability: int) -> Iterator[None]:
    """Builds the GPU kernels traced in the block for ``compute_capability``
    (e.g. 90 for H100, 80 for A100), with or without such a device."""
    with _COMPUTE_CAPABILITY(int(compute_capability)):
        yield


@functools.cache
def _device_compute_capability() -> int | None:
    try:
        device = jax.devices("cuda")[0]
    except RuntimeError:  # no cuda backend
        return None
    major, _, minor = str(getattr(device, "compute_capability", "")).partition(".")
    return int(major) * 10 + int(minor or 0) if major.isdigit() else None


def compute_capability() -> int:
    """The compute capability the kernels are being built for."""
    return (_COMPUTE_CAPABILITY.value or _device_compute_capability()
            or DEFAULT_COMPUTE_CAPABILITY)


def arch() -> str:
    """``"sm90"`` (Hopper and later) or ``"sm80"`` (Ampere): the rows of the
    kernels' configuration tables."""
    return "sm90" if compute_capability() >= 90 else "sm80"
