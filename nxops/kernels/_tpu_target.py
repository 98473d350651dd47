"""Which TPU generation the kernels are being built for, known at lowering
with or without a TPU attached (a deviceless compile's topology devices carry
their ``device_kind``: "TPU v5 lite" is a v5e).

``nxops.ops`` lowers each kernel inside ``_gpu_target.target_devices(devices)``,
which records the TPU kind here too. The Mosaic matmul picks its tiles per
generation (:data:`CHIPS`); an unknown chip keeps the generic 512 tile.
"""
from __future__ import annotations

import contextvars
import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation's public figures (per chip / TensorCore)."""

    name: str
    bandwidth: float      # HBM bytes/s
    bf16_flops: float     # dense MXU peak, FLOP/s
    vmem_bytes: int       # physical VMEM
    mxu: int = 128        # MXU width: tile sides along N are multiples of it


MIB = 1 << 20
CHIPS = {
    "v4": Chip("v4", 1.2e12, 275e12, 32 * MIB),   # per TensorCore of the megacore
    "v5e": Chip("v5e", 819e9, 197e12, 128 * MIB),
    "v5p": Chip("v5p", 2765e9, 459e12, 95 * MIB),
    "v6e": Chip("v6e", 1640e9, 918e12, 128 * MIB, mxu=256),
}

_TPU_KIND: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "nxops_tpu_target_kind", default=None)


def chip_for_kind(kind: str | None) -> str | None:
    """``"TPU v5 lite"`` -> ``"v5e"``, ``"TPU v6 lite"`` -> ``"v6e"``, ``"TPU v5"``
    / ``"TPU v5p"`` -> ``"v5p"``, ``"TPU v4"`` -> ``"v4"``; else None."""
    text = (kind or "").lower()
    if "v6" in text:
        return "v6e"
    if "v5" in text:
        return "v5e" if ("lite" in text or "v5e" in text) else "v5p"
    if "v4" in text:
        return "v4"
    return None


def set_kind(devices) -> contextvars.Token:
    """Records the TPU kind of ``devices[0]`` (when a TPU; else the enclosing
    choice stays); ``_TPU_KIND.reset(token)`` undoes it."""
    device = devices[0] if devices else None
    kind = getattr(device, "device_kind", None) if getattr(device, "platform", "") == "tpu" else None
    return _TPU_KIND.set(kind or _TPU_KIND.get())


def reset(token: contextvars.Token) -> None:
    _TPU_KIND.reset(token)


def tpu_chip() -> Chip | None:
    """The TPU generation kernels are being built for, if known."""
    name = chip_for_kind(_TPU_KIND.get())
    return CHIPS.get(name) if name else None
