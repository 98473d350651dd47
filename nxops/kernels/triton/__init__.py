"""The ``triton`` backend: Triton kernels, compiled through jax-triton on cuda
and run by Triton's interpreter on cpu (see README.md here).

With triton missing, the ops are still registered, with the install hint as
the reason they cannot run: ``explain`` and an explicit ``NXOPS_KERNELS=triton``
then say what to install instead of "none is registered". With versions that
do not work together (``_versions``), the kernels cannot run on cuda and say
which versions and the pip command that fixes them."""
import os

# Triton 3.9 warns that its FP-fusion default flips in 3.10; these kernels are
# written and checked with fusion on (a user's own setting wins).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from nxops.kernels.triton import _versions  # noqa: E402
from nxops.kernels.triton._common import PLATFORMS, missing_packages  # noqa: E402
from nxops.kernels._registry import register_load_check  # noqa: E402

# Before anything imports jax-triton: lets jax-triton 0.4 load with triton 3.6.
_versions.provide_tma_tf32()
# An incompatible jax-triton / triton / JAX set: unavailable on cuda, saying why.
register_load_check("triton", _versions.reasons)

if missing_packages("cpu"):
    from nxops.kernels._registry import Kernel, register

    def _unavailable(*avals, platform, **params):
        del avals, params
        return missing_packages(platform)

    for _op in ("reduce", "dot_general", "tile"):
        register(Kernel(op=_op, backend="triton", platforms=PLATFORMS, fn=None,
                        not_supported_reasons=_unavailable,
                        description="Triton kernel (not installed)"))
else:
    from nxops.kernels.triton import dot_general, reduce, tile  # noqa: F401  (registers)
