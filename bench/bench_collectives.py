"""Collectives over one mesh axis: tiled all-gather and reduce-scatter.

Runs on the default devices when there are several, else on 8 simulated CPU
devices (``bench/conftest.py`` sets ``XLA_FLAGS``). Each group (collective,
dtype, size) holds the baseline (``lax.all_gather`` / ``lax.psum_scatter``
written directly in ``jax.shard_map``) and every nxops backend. Sizes are the
bytes of one device's shard.

``extra_info`` records the ring lower bound of per-device traffic,
(n-1)·shard bytes for both collectives, and the per-device bytes of the
compiled program's collectives (read by ``nxops.hlo``) and their ratio to
that bound. "GB/s" for a collective is ring-bound bytes / time (bus bandwidth).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import nxops as nx
from nxops import hlo
from bench._backends import (BASELINE, IMPLEMENTATIONS, compile_for, interpreted, mesh_devices,
                             mesh_platform, skip_reason)
from bench._measure import Work, assert_close, measure

COLUMNS = 128
# f32 shards of 4 KiB, 1 MiB, 64 MiB. In TPU interpret mode on this 2-core CPU,
# the Pallas ring kernels over 8 devices hang from 16 KiB shards on (8 KiB ran).
SHARD_ROWS = {"small": 8, "medium": 2048, "large": 131072}
DTYPES = (jnp.float32, jnp.bfloat16)
COLLECTIVES = ("all_gather", "reduce_scatter")


def baseline(collective: str):
    if collective == "all_gather":
        return lambda x: lax.all_gather(x, "x", axis=0, tiled=True)
    return lambda x: lax.psum_scatter(x, "x", scatter_dimension=0, tiled=True)


def nxops_collective(collective: str):
    """The nxops function under test: ``nx.all_gather`` or ``nx.psum_scatter``."""
    if collective == "all_gather":
        return lambda x: nx.all_gather(x, "x", axis=0, tiled=True)
    return lambda x: nx.psum_scatter(x, "x", scatter_dimension=0, tiled=True)


def traffic_info(compiled, ring_bound: int) -> dict:
    """Per-device bytes the compiled program's XLA collectives move (read by
    ``nxops.hlo``), and their ratio to the ring bound of the operand's dtype
    (XLA:CPU moves bf16 collectives as f32: ratio 2). Kernels that move data
    themselves (Pallas remote DMAs) have no XLA collective to read."""
    found = hlo.collectives(compiled)
    if not found:
        return {"note": "no XLA collective in the HLO: the kernel moves the data itself"}
    total = sum(c.bytes_per_device for c in found)
    return {"bytes_per_device": total, "bytes_ratio_to_ring": total / ring_bound,
            "hlo_collectives": ", ".join(f"{c.kind} {c.dtype}" for c in found)}


def cases():
    for collective in COLLECTIVES:
        for dtype in DTYPES:
            for size in SHARD_ROWS:
                for impl in IMPLEMENTATIONS:
                    quick = (size == "small" and dtype == jnp.float32
                             and not interpreted(impl, mesh_platform()))
                    yield pytest.param(collective, dtype, size, impl,
                                       id=f"{collective}-{jnp.dtype(dtype).name}-{size}-{impl}",
                                       marks=[pytest.mark.quick] if quick else [])


@pytest.mark.parametrize("collective,dtype,size,impl", list(cases()))
def test_collective(benchmark, peak, platform, collective, dtype, size, impl):
    devices = mesh_devices()
    n = len(devices)
    platform = mesh_platform()
    rows = SHARD_ROWS[size]
    # The per-device operand: a shard for all_gather, n shards for reduce_scatter.
    local_rows = rows if collective == "all_gather" else n * rows
    local = jax.ShapeDtypeStruct((local_rows, COLUMNS), dtype)
    params = (dict(axis=0, tiled=True) if collective == "all_gather"
              else dict(scatter_dimension=0, tiled=True))
    reason = skip_reason(collective, impl, size, platform, (local,), dict(axis_name="x", **params))
    if reason:
        pytest.skip(reason)

    mesh = Mesh(np.array(devices), ("x",))
    x = jax.device_put(jax.random.uniform(jax.random.key(0), (n * local_rows, COLUMNS), dtype),
                       jax.NamedSharding(mesh, P("x")))
    body = baseline(collective) if impl == BASELINE else nxops_collective(collective)
    fn = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    with jax.set_mesh(mesh):
        compiled = compile_for(impl, fn, x)

    x32 = np.asarray(x, np.float32)
    if collective == "all_gather":   # every device holds the whole array
        expected = np.tile(x32, (n, 1))
    else:                            # device i holds row-block i summed over devices
        expected = x32.reshape(n, n * rows, COLUMNS).sum(axis=0)
    shard_bytes = rows * COLUMNS * jnp.dtype(dtype).itemsize
    ring_bound = (n - 1) * shard_bytes
    no_interconnect_peak = dataclasses.replace(peak, hbm_gbps=None,
                                               source="interconnect peaks not tabulated")
    info = dict(op=f"{collective} over {n} devices", backend=impl, platform=platform,
                size=f"{size} {shard_bytes // 1024} KiB/shard", baseline=impl == BASELINE,
                ring_bound_bytes=ring_bound, **traffic_info(compiled, ring_bound))
    result = measure(benchmark, compiled, x, work=Work(bytes_moved=ring_bound),
                     peak=no_interconnect_peak, dtype=dtype,
                     group=f"collective-{collective}-{jnp.dtype(dtype).name}-{size}", info=info)
    assert_close(result, expected, dtype)
