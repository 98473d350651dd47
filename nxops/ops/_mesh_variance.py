"""A marker on the result of a collective over mesh axes: whether it varies
along them (a reduce-scatter's) or is the same on every device (an
all-gather's), whatever kernel computed it.

xmap reads which mesh axes each value of a body varies along from its jaxpr
(``xmap/_variance.py``), to give a custom rule's ``bwd`` the cotangents it
gets with no resources (``xmap/_custom_rules.py``). A kernel's own equations
do not say it: an all-gather written as an all-to-all of copies (the XLA
kernel on Explicit meshes), or a Pallas call, looks like a value that varies.
The marker is the identity: it lowers to nothing, and transposes to the
identity on the cotangent.
"""
from __future__ import annotations

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

mesh_variance_p = Primitive("nx_mesh_variance")
# Parameters: axes (the collective's mesh axes), varies (whether the result
# varies along them).


def mark_mesh_variance(x, axes: tuple, *, varies: bool):
    """``x``, marked as varying along mesh ``axes`` or as the same along them."""
    return mesh_variance_p.bind(x, axes=tuple(axes), varies=varies)


def _batcher(vals_in, dims_in, *, axes, varies):
    (x,), (d,) = vals_in, dims_in
    return mesh_variance_p.bind(x, axes=axes, varies=varies), d


def _transpose(ct, x, *, axes, varies):
    del axes, varies
    return (ad.Zero(x.aval),) if type(ct) is ad.Zero else (ct,)


mesh_variance_p.def_impl(lambda x, **_: x)
mesh_variance_p.def_abstract_eval(lambda aval, **_: aval)
batching.primitive_batchers[mesh_variance_p] = _batcher
ad.deflinear2(mesh_variance_p, _transpose)
mlir.register_lowering(mesh_variance_p, lambda ctx, x, **_: [x])
