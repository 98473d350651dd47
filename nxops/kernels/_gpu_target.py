"""Which GPU the kernels are being built for, known at lowering with or
without a GPU attached.

``nxops.ops`` lowers each kernel inside ``target_devices(devices)``, the
devices of the lowering context (on a deviceless compile, those of the target
topology, which carry ``compute_capability``). Else the first local GPU tells,
else compute capability 9.0 (H100), which Pallas' own Triton lowering also
assumes when it finds no GPU. The Pallas matmul picks its configuration row
by :func:`gpu_arch`; jax-triton compiles for :func:`compute_capability`.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Sequence

import jax

from nxops.kernels import _tpu_target

ARCHS = ("sm90", "sm80")   # wgmma (Hopper) | mma.sync (Ampere, Ada)
DEFAULT_COMPUTE_CAPABILITY = 90

# Streaming multiprocessors of each architecture's reference part (H100 SXM,
# A100): a launch with fewer programs leaves SMs idle.
SM_COUNT = {"sm90": 132, "sm80": 108}
# The architecture whose SM count sizes the launch plans that do not ask for
# the target's (the one-pass reductions, split-K).
PLANNED_ARCH = "sm90"

_TARGET: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "nxops_gpu_target_compute_capability", default=None)


def capability_of(device) -> int | None:
    """A CUDA device's compute capability as an int (``"9.0"`` -> 90), else None."""
    capability = getattr(device, "compute_capability", None)
    if capability is None or getattr(device, "platform", "gpu") not in ("gpu", "cuda"):
        return None
    major, _, minor = str(capability).partition(".")
    return int(major) * 10 + int(minor or 0)


def arch_for(capability: int) -> str:
    """``sm90`` for compute capability 9.x and later, else ``sm80``."""
    return "sm90" if capability >= 90 else "sm80"


def sm_count(arch: str | None = None) -> int:
    """SMs of ``arch`` (default: the architecture being built for)."""
    return SM_COUNT.get(arch or gpu_arch(), SM_COUNT[PLANNED_ARCH])


@contextlib.contextmanager
def target_devices(devices: Sequence) -> Iterator[None]:
    """Kernels built within this block target the first of ``devices`` (when
    it is a CUDA GPU; otherwise the enclosing choice stays)."""
    capability = capability_of(devices[0]) if devices else None
    token = _TARGET.set(capability or _TARGET.get())
    tpu_token = _tpu_target.set_kind(devices)   # the TPU generation, likewise
    try:
        yield
    finally:
        _tpu_target.reset(tpu_token)
        _TARGET.reset(token)


def compute_capability() -> int:
    """The compute capability GPU kernels are being built for (see the module docstring)."""
    if (capability := _TARGET.get()) is not None:
        return capability
    try:
        local = jax.local_devices(backend="gpu")
    except RuntimeError:
        local = []
    return (capability_of(local[0]) if local else None) or DEFAULT_COMPUTE_CAPABILITY


# A device kind per compute capability, for Pallas' Triton lowering with no
# GPU attached: JAX >= 0.11 reads the target from the abstract mesh's
# AbstractDevice (0.10 assumed sm_90). Kinds as JAX's gpu_info names them.
_DEVICE_KIND_BY_CAPABILITY = {80: "NVIDIA A100", 86: "NVIDIA A10", 89: "NVIDIA L4",
                              90: "NVIDIA H100", 100: "NVIDIA B200", 103: "NVIDIA B300",
                              120: "NVIDIA RTX PRO 6000"}


def kernel_mesh(platform: str) -> jax.sharding.AbstractMesh:
    """The empty abstract mesh kernels are traced in; for cuda it names the
    target GPU (an ``AbstractDevice``), so Pallas lowers with or without one."""
    if platform != "cuda":
        return _NO_MESH
    kind = _DEVICE_KIND_BY_CAPABILITY.get(compute_capability(), "NVIDIA H100")
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
    return jax.sharding.AbstractMesh((), (), abstract_device=device)


_NO_MESH = jax.sharding.AbstractMesh((), ())


def gpu_arch() -> str:
    """The architecture GPU kernels are being built for: a row of their tables."""
    return arch_for(compute_capability())
