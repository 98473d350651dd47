"""The ``triton`` backend: Triton kernels, compiled through jax-triton on cuda
and run by Triton's interpreter on cpu (see README.md here).

With triton missing, the ops are still registered, with the install hint as
the reason they cannot run: ``explain`` and an explicit ``NXOPS_KERNELS=triton``
then say what to install instead of "none is registered". With versions that
do not work together (``_versions``), the kernels cannot run on cuda and say
which versions and the pip command that fixes them."""
from nxops.kernels._registry import register_load_check
from nxops.kernels.triton import _versions
from nxops.kernels.triton._common import PLATFORMS, missing_packages

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
