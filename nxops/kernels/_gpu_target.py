"""Which GPU architecture the kernels are being built for, known at lowering
with or without a GPU attached.

``nxops.ops`` lowers each kernel inside ``target_devices(devices)``, the
devices of the lowering context (on a deviceless compile, those of the target
topology, which carry ``compute_capability``). Else the first local GPU tells,
else ``sm90`` (H100), the architecture Pallas' own Triton lowering assumes
when it finds no GPU.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Sequence

import jax

ARCHS = ("sm90", "sm80")   # wgmma (Hopper) | mma.sync (Ampere, Ada)
DEFAULT_ARCH = "sm90"

_TARGET_ARCH: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "nxops_gpu_target_arch", default=None)


def arch_of(device) -> str | None:
    """``sm90`` for compute capability 9.x and later, ``sm80`` for 8.x, else None."""
    capability = getattr(device, "compute_capability", None)
    if capability is None or getattr(device, "platform", "gpu") not in ("gpu", "cuda"):
        return None
    return "sm90" if float(capability) >= 9.0 else "sm80"


@contextlib.contextmanager
def target_devices(devices: Sequence) -> Iterator[None]:
    """Kernels built within this block target the first of ``devices`` (when
    it is a CUDA GPU; otherwise the enclosing choice stays)."""
    arch = arch_of(devices[0]) if devices else None
    token = _TARGET_ARCH.set(arch or _TARGET_ARCH.get())
    try:
        yield
    finally:
        _TARGET_ARCH.reset(token)


def gpu_arch() -> str:
    """The architecture that GPU kernels are being built for (see the module docstring)."""
    if (arch := _TARGET_ARCH.get()) is not None:
        return arch
    try:
        local = jax.local_devices(backend="gpu")
    except RuntimeError:
        local = []
    return (arch_of(local[0]) if local else None) or DEFAULT_ARCH
