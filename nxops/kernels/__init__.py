"""Kernel selection and the registry of implementations (``nx.kernels``).

``NXOPS_KERNELS`` (read at import) or ``nx.kernels.use(...)`` selects, per op
family (reduce, einsum, tile, collective, cross_entropy, attention), the
backend: ``auto`` (default), ``xla``, ``pallas``, ``triton`` or ``cudnn``
(attention only). ``explain``
says which kernel each op of a program uses, and why.

The layers above (``nxops.ops``) use the private modules: ``_selection``
(what was asked for), ``_choice`` (the kernel for a case), ``_auto`` (`auto`'s
rule, from ``_measured``'s tables) and ``_reports`` (what was chosen).
"""
from nxops.kernels._explain import Explanation, explain
from nxops.kernels._registry import Kernel, register, registered
from nxops.kernels._selection import use
from nxops.kernels import xla  # noqa: F401  (registers the reference kernels)
from nxops.kernels import pallas  # noqa: F401  (registers the Pallas kernels)
from nxops.kernels import triton  # noqa: F401  (registers Triton kernels when jax-triton is installed)
from nxops.kernels import cudnn  # noqa: F401  (registers cuDNN's attention)

__all__ = ["Explanation", "Kernel", "explain", "register", "registered", "use"]
