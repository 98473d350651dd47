"""Kernel selection and the registry of implementations (``nx.kernels``).

``NXOPS_KERNELS`` (read at import) or ``nx.kernels.use(...)`` selects, per op
family (reduce, einsum, tile, collective, cross_entropy, attention), the backend: ``auto`` (default),
``xla``, ``pallas`` or ``triton``.

The contract with ``nxops.ops`` (the only layer above) is this module's names:
``choose`` (the kernel for an op, platform, selection and avals), ``report``
(tell ``explain`` what was chosen), ``current_selection`` / ``parse_selection``
``target_platform`` (the platform ``explain`` traces for, if any) and
``target_devices`` (the devices kernels are lowered for: their GPU architecture).
"""
from nxops.kernels._explain import Explanation, explain
from nxops.kernels._gpu_target import kernel_mesh, target_devices
from nxops.kernels._registry import (
    ARGUMENT, UNKNOWN, BACKENDS, CHOICES, FAMILIES, OP_FAMILY, PLATFORMS, Choice, Kernel, Selection,
    choose, collect_reports, current_selection, parse_selection, register, registered, report,
    target_platform, use,
)
from nxops.kernels import xla  # noqa: F401  (registers the reference kernels)
from nxops.kernels import pallas  # noqa: F401  (registers the Pallas kernels)
from nxops.kernels import triton  # noqa: F401  (registers Triton kernels when jax-triton is installed)

__all__ = [
    "BACKENDS", "CHOICES", "FAMILIES", "OP_FAMILY", "PLATFORMS", "Choice", "Explanation",
    "Kernel", "Selection", "choose", "collect_reports", "current_selection", "explain",
    "kernel_mesh", "parse_selection", "register", "registered", "report", "target_devices", "target_platform",
    "use",
]
