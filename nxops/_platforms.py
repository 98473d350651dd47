"""Platform names as users write them, for nx.export, nx.kernels.explain and
xmap: JAX says "gpu" for CUDA devices (``jax.default_backend()`` on an NVIDIA
machine), while lowering (jax.export, the kernel registry) says "cuda"."""
from __future__ import annotations

from nxops._errors import NxopsError
from nxops.kernels._registry import PLATFORMS


def canonical_platform(name: str, *, where: str) -> str:
    """The lowering platform for ``name`` ('gpu' means 'cuda'); an NxopsError
    naming ``where`` (the call that took it) for a name no platform has."""
    canonical = str(name).lower()
    canonical = "cuda" if canonical == "gpu" else canonical
    if canonical not in PLATFORMS:
        raise NxopsError(
            f"{where}: unknown platform {name!r}. Use one of "
            f"{', '.join(map(repr, PLATFORMS))} ('gpu' means 'cuda'; AMD GPUs are 'rocm').")
    return canonical
