"""The Megatron-style training block in nx.xmap and its hand-written
``jax.shard_map`` twin, with the placements both run under: one definition,
shared by tests/xmap/test_training_step.py (same program, same values) and
bench/bench_training.py (which times them)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

import nxops as nx

DP, MP = 2, 4   # the (dp, mp) mesh
IN_AXES = (["shard", ...], ["shard", ...], [...], ["batch", ...], ["batch", ...])
PLACEMENTS = {
    "dp": {"batch": "dp"},
    "mp": {"shard": "mp"},
    "mixed": {"batch": "dp", "shard": "mp"},
}


def block_loss(w1, w2, wv, x, y, psum_shard, pmean_batch):
    h = jax.nn.relu(x @ w1)
    logits = psum_shard(h @ w2) @ wv
    picked = jnp.take_along_axis(logits, y[:, None], 1)[:, 0]
    return pmean_batch(jnp.mean(nx.logsumexp(logits, 1) - picked))


def named_block(w1, w2, wv, x, y):
    return block_loss(w1, w2, wv, x, y, lambda v: nx.psum(v, "shard"),
                      lambda v: nx.pmean(v, "batch"))


def shard_map_twin(resources, mesh):
    """The step as written by hand; returns it and its operands' partition specs."""
    batch_axis, shard_axis = resources.get("batch"), resources.get("shard")

    def local(w1, w2, wv, x, y):
        def step(w1, w2, x, y):
            return block_loss(w1, w2, wv, x, y, lambda v: lax.psum(v, shard_axis or "shard"),
                              lambda v: lax.pmean(v, batch_axis or "batch"))
        if shard_axis is None:
            over_shard = jax.vmap(step, in_axes=(0, 0, None, None), out_axes=None,
                                  axis_name="shard")
        else:
            over_shard = lambda w1, w2, x, y: step(w1[0], w2[0], x, y)
        if batch_axis is None:
            return jax.vmap(over_shard, in_axes=(None, None, 0, 0), out_axes=None,
                            axis_name="batch")(w1, w2, x, y)
        return over_shard(w1, w2, x[0], y[0])

    specs = (P(shard_axis), P(shard_axis), P(), P(batch_axis), P(batch_axis))
    used = frozenset(a for a in (batch_axis, shard_axis) if a)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), axis_names=used,
                         check_vma=False), specs


def training_mesh():
    """The (dp, mp) mesh, Auto axes: on an Explicit mesh JAX 0.12 cannot lower
    the hand-written twin itself (a vmapped lax.pmean inside a shard_map that
    leaves an Explicit axis automatic: docs/jax-versions.md), so both run on
    Auto axes, as a shard_map user on JAX 0.12 would."""
    return jax.make_mesh((DP, MP), ("dp", "mp"), axis_types=(AxisType.Auto,) * 2)
