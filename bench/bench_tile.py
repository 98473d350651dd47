"""``nx.tile``: each device's tile of a replicated matrix, along one mesh axis.

Runs on the default devices when there are several, else on 8 simulated CPU
devices (``bench/conftest.py`` sets ``XLA_FLAGS``). Each group (dtype, size)
holds the hand-written baseline (``lax.dynamic_slice_in_dim`` at
``lax.axis_index`` in ``jax.shard_map``) and every nxops backend. No
communication: a tile is a strided copy, memory bound; bytes moved = the tile
read + the tile written. Sizes are the bytes of one device's tile.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import nxops as nx
from bench._backends import (BASELINE, IMPLEMENTATIONS, compile_for, interpreted, mesh_devices,
                             mesh_platform, skip_reason)
from bench._measure import Work, measure

COLUMNS = 1024
# f32 tiles of 256 KiB, 16 MiB, 128 MiB (the replicated matrix is as many
# tiles as there are devices, on every device).
TILE_ROWS = {"small": 64, "medium": 4096, "large": 32768}
DTYPES = (jnp.float32, jnp.bfloat16)


def baseline(x):
    rows = x.shape[0] // lax.axis_size("x")
    return lax.dynamic_slice_in_dim(x, lax.axis_index("x") * rows, rows, axis=0)


def nxops_tile(x):
    """The nxops function under test: ``nx.tile`` over the mesh axis."""
    return nx.tile(x, {"x": 0})


def cases():
    for dtype in DTYPES:
        for size in TILE_ROWS:
            for impl in IMPLEMENTATIONS:
                quick = (size == "small" and dtype == jnp.float32
                         and not interpreted(impl, mesh_platform()))
                yield pytest.param(dtype, size, impl,
                                   id=f"tile-{jnp.dtype(dtype).name}-{size}-{impl}",
                                   marks=[pytest.mark.quick] if quick else [])


@pytest.mark.parametrize("dtype,size,impl", list(cases()))
def test_tile(benchmark, peak, platform, dtype, size, impl):
    devices = mesh_devices()
    n = len(devices)
    platform = mesh_platform()
    rows = TILE_ROWS[size]
    full = jax.ShapeDtypeStruct((n * rows, COLUMNS), dtype)
    index = jax.ShapeDtypeStruct((), jnp.int32)
    reason = skip_reason("tile", impl, size, platform, (full, index), dict(dim=0, count=n))
    if reason:
        pytest.skip(reason)

    mesh = Mesh(np.array(devices), ("x",))
    x = jax.device_put(jax.random.uniform(jax.random.key(0), full.shape, dtype),
                       jax.NamedSharding(mesh, P()))
    body = baseline if impl == BASELINE else nxops_tile
    fn = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("x"))
    with jax.set_mesh(mesh):
        compiled = compile_for(impl, fn, x)

    tile_bytes = rows * COLUMNS * jnp.dtype(dtype).itemsize
    result = measure(benchmark, compiled, x, work=Work(bytes_moved=2 * tile_bytes), peak=peak,
                     dtype=dtype, group=f"tile-{jnp.dtype(dtype).name}-{size}",
                     info=dict(op=f"tile over {n} devices", backend=impl, platform=platform,
                               size=f"{size} {tile_bytes // 1024} KiB/tile",
                               baseline=impl == BASELINE))
    # Tile i of the replicated matrix on device i: together, the matrix itself
    # (a copy: exactly).
    np.testing.assert_array_equal(np.asarray(result, np.float32), np.asarray(x, np.float32))
