"""nxops: named-axis ops for JAX.

``nx.xmap`` with logical axis names, mesh tiling and serial loops; named
reductions, einsum/pdot and collectives that run in Pallas/Triton/XLA kernels
chosen by ``nx.kernels`` (``NXOPS_KERNELS``).
"""
from nxops._supported_jax import check_jax_version

check_jax_version()   # before the rest: outside the range, their imports fail obscurely

from nxops._errors import NxopsError  # noqa: E402  (after the version check)
from nxops._version import __version__ as __version__  # noqa: E402  (after the version check)
from nxops import _config  # noqa: E402,F401  (after the version check; validates every NXOPS_* variable)
from nxops import hlo, kernels, random  # noqa: E402  (after the version check)
from nxops._export import export  # noqa: E402  (after the version check)
from nxops.ops import SequenceLayout, attention  # noqa: E402  (after the version check)
from nxops.ops import (  # noqa: E402  (after the version check)
    all_gather, all_to_all, axis_index, axis_size, cross_entropy, einsum, logsumexp, max, mean, min, one_hot,
    pdot, pmax, pmean, pmin, ppermute, prod, psum, psum_scatter, std, sum, tile, untile, var,
)

# Import the frontend package fully, then bind the *function*: importing the
# package `nxops.xmap` set the attribute `nxops.xmap` to the module.
import nxops.xmap as _xmap_package  # noqa: E402, F401  (imports the package first, as said)
from nxops.xmap import SerialLoop, axis_rules, serial_loop, xmap  # noqa: E402  (after it)


__all__ = [
    "attention", "SequenceLayout",
    "NxopsError", "SerialLoop", "axis_rules", "export", "serial_loop", "xmap", "hlo", "random",
    "all_gather", "all_to_all", "axis_index", "axis_size", "cross_entropy", "einsum", "kernels",
    "logsumexp", "max", "mean", "min", "one_hot", "pdot", "pmax", "pmean", "pmin", "ppermute",
    "prod", "psum", "psum_scatter", "std", "sum", "tile", "untile", "var",
]
