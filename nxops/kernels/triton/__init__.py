"""The ``triton`` backend: Triton kernels, compiled through jax-triton on cuda
and run by Triton's interpreter on cpu (see README.md here).

With triton missing, the ops are still registered, with the install hint as
the reason they cannot run: ``explain`` and an explicit ``NXOPS_KERNELS=triton``
then say what to install instead of "none is registered"."""
import os

# Triton 3.9 warns that its FP-fusion default flips in 3.10; these kernels are
# written and checked with fusion on (a user's own setting wins).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from nxops.kernels.triton._common import PLATFORMS, missing_packages  # noqa: E402

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
