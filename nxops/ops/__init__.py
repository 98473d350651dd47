"""Named-axis ops (the public ones are re-exported by ``nxops``)."""
from nxops.ops._collectives import all_gather, all_to_all, ppermute, psum_scatter
from nxops.ops._attention import attention
from nxops.ops._cross_entropy import cross_entropy
from nxops.ops._einsum import einsum, pdot
from nxops.ops._moments import std, var
from nxops.ops._positions import axis_index, axis_size, one_hot
from nxops.ops._sequence_layout import SequenceLayout
from nxops.ops._reduce import logsumexp, max, mean, min, pmax, pmean, pmin, prod, psum, sum
from nxops.ops._tiling import tile, untile

__all__ = [
    "all_gather", "all_to_all", "attention", "axis_index", "axis_size", "cross_entropy", "einsum",
    "logsumexp", "max", "mean", "min", "one_hot", "pdot", "pmax", "pmean", "pmin", "ppermute", "prod",
    "psum", "psum_scatter", "std", "sum", "tile", "untile", "var", "SequenceLayout",
]

# A user error's traceback ends at the user's line (nxops/_traceback.py).
from nxops._traceback import mark_boundaries

mark_boundaries(globals(), __all__)
