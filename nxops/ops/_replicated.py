"""``replicated_over(x, mesh_names)``: ``x`` as it is, for a value that is
the same on every device of ``mesh_names`` and that each device then uses
for its own shard of a sum (the queries of attention over key shards, the
hidden states of cross-entropy over vocab shards). Its transpose sums the
shards' cotangents, so that the gradient is the whole one on every device
(where the shards were a local tile, the same sum would be in the body):
one mesh sum, divided by the shard count (the division undoes the psum that
transposes the shards' combining psum; a gradient taken outside the xmap
then psums the replicated value's cotangent once more, over the cotangent
shard_map divided by the shard count).

A primitive linear in ``x`` rather than a ``custom_vjp``: forward mode
(``jax.jvp``, ``jax.jacfwd``) passes its tangent through, as the identity.
"""
from __future__ import annotations

import math

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from nxops.ops import _axis_env, _sum_then_tile
from nxops.ops._axis_env import mesh_platform

replicated_p = Primitive("nx_replicated_over")
replicated_p.def_impl(lambda x, *, mesh_names: x)
replicated_p.def_abstract_eval(lambda aval, *, mesh_names: aval)
mlir.register_lowering(replicated_p, mlir.lower_fun(lambda x, *, mesh_names: x,
                                                   multiple_results=False))


def replicated_over(x, mesh_names: tuple[str, ...]):
    return replicated_p.bind(x, mesh_names=tuple(mesh_names))


def _transpose(ct, x, *, mesh_names):
    if type(ct) is ad.Zero:
        return [None]
    count = math.prod(_axis_env.physical_axis_size(n) for n in mesh_names)
    return [_sum_then_tile.mesh_sum(ct, mesh_names, platform=mesh_platform()) / count]


ad.deflinear2(replicated_p, _transpose)
batching.primitive_batchers[replicated_p] = lambda args, dims, **params: (
    replicated_p.bind(*args, **params), dims[0])
