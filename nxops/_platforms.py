"""Platform names: as users write them, and as jax.export and nxops' kernel
registry spell them. JAX calls NVIDIA devices "gpu" (``jax.devices()[0].platform``,
``jax.default_backend()``), while jax.export and the registry say "cuda"; every
nxops entry point that takes a platform name reads it here."""
from __future__ import annotations

from nxops._errors import NxopsError

PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu")


def platform_named(word: str) -> str | None:
    """The registry's (and jax.export's) name for the platform ``word``
    (lowercased, 'gpu' read as 'cuda'), or None when it names none."""
    name = str(word).lower()
    name = "cuda" if name == "gpu" else name
    return name if name in PLATFORMS else None


def normalize_platform(platform: str, where: str) -> str:
    """``platform_named(platform)``; an unknown name raises an NxopsError
    listing the known ones. ``where`` names the call, e.g. ``"nx.kernels.explain"``."""
    name = platform_named(platform)
    if name is None:
        raise NxopsError(
            f"{where}: unknown platform {platform!r}. Use one of "
            f"{', '.join(map(repr, PLATFORMS))} ('gpu' means 'cuda'; AMD GPUs are 'rocm').")
    return name
