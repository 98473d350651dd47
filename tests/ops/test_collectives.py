"""Named collectives, tile/untile and axis queries against NumPy, in vmap and
in shard_map over 8 simulated devices, forward and gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import nxops as nx
from tests.ops._util import assert_close


def arange(*shape, dtype=np.float32):
    return np.arange(np.prod(shape), dtype=dtype).reshape(shape)


def shard_map(f, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


# --- vmap names (local work) -------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1])
def test_untile_then_tile_in_vmap(dim):
    x = arange(8, 12)
    tiles = np.stack(np.split(x, 4, axis=dim))
    untiled = jax.vmap(lambda t: nx.untile(t, {"i": dim}), axis_name="i", out_axes=None)(tiles)
    assert_close(untiled, x)
    retiled = jax.vmap(lambda _: nx.tile(jnp.asarray(x), {"i": dim}), axis_name="i")(np.zeros(4))
    assert_close(retiled, tiles)


def test_all_gather_and_psum_scatter_in_vmap():
    x = arange(4, 8)
    gathered = jax.vmap(lambda r: nx.all_gather(r, "i"), axis_name="i", out_axes=None)(x)
    assert_close(gathered, x)
    scattered = jax.vmap(lambda r: nx.psum_scatter(r, "i", tiled=True), axis_name="i")(x)
    assert_close(scattered, x.sum(0).reshape(4, 2))
    untiled_scatter = jax.vmap(lambda r: nx.psum_scatter(r[:4], "i"), axis_name="i")(x)
    assert_close(untiled_scatter, x[:, :4].sum(0))


def test_axis_index_size_and_one_hot_in_vmap():
    idx = jax.vmap(lambda _: nx.axis_index("i"), axis_name="i")(np.zeros(5))
    np.testing.assert_array_equal(idx, np.arange(5))
    assert jax.vmap(lambda _: nx.axis_size("i") * 1.0, axis_name="i", out_axes=None)(np.zeros(5)) == 5
    labels = np.array([0, 3, 1])
    hot = jax.vmap(lambda _: nx.one_hot(labels, axis="c"), axis_name="c", out_axes=1)(np.zeros(4))
    np.testing.assert_array_equal(hot, np.eye(4)[labels])


def test_ppermute_and_all_to_all_in_vmap():
    x = arange(4, 3)
    shifted = jax.vmap(lambda r: nx.ppermute(r, "i", [(j, (j + 1) % 4) for j in range(4)]),
                       axis_name="i")(x)
    assert_close(shifted, np.roll(x, 1, axis=0))
    y = arange(4, 4, 2)
    out = jax.vmap(lambda r: nx.all_to_all(r, "i", 0, 0), axis_name="i")(y)
    ref = jax.vmap(lambda r: lax.all_to_all(r, "i", 0, 0), axis_name="i")(y)
    assert_close(out, ref)


# --- mesh names (one collective) ---------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1])
def test_untile_over_mesh_is_replicated(mesh8, dim):
    x = arange(16, 8)
    spec = P("x") if dim == 0 else P(None, "x")
    with jax.set_mesh(mesh8):
        f = shard_map(lambda v: nx.untile(v, {"x": dim}), mesh8, spec, P())
        assert_close(f(jax.device_put(x, NamedSharding(mesh8, spec))), x)


def test_tile_over_mesh_and_its_gradient(mesh8):
    x = arange(16, 3)
    with jax.set_mesh(mesh8):
        xr = jax.device_put(x, NamedSharding(mesh8, P()))
        f = shard_map(lambda v: nx.tile(v, {"x": 0}), mesh8, P(), P("x"))
        assert_close(f(xr), x)
        g = jax.grad(lambda v: (f(v) ** 2).sum())(xr)
    assert_close(g, 2 * x)


def test_untile_gradient_is_the_tile(mesh8):
    x = arange(16, 3)
    w = arange(16, 3) / 7
    with jax.set_mesh(mesh8):
        f = shard_map(lambda v: nx.untile(v, {"x": 0}), mesh8, P("x"), P())
        g = jax.grad(lambda v: (f(v) * w).sum())(jax.device_put(x, NamedSharding(mesh8, P("x"))))
    assert_close(g, w)


def test_psum_scatter_over_mesh(mesh8):
    x = arange(16, 2)
    with jax.set_mesh(mesh8):
        xr = jax.device_put(x, NamedSharding(mesh8, P()))
        f = shard_map(lambda v: nx.psum_scatter(v, "x", tiled=True), mesh8, P(), P("x"))
        assert_close(f(xr), 8 * x)


def test_all_gather_untiled_over_two_mesh_axes(mesh2x4):
    x = arange(8, 3)
    with jax.set_mesh(mesh2x4):
        f = shard_map(lambda v: nx.all_gather(v, ("x", "y"), axis=1), mesh2x4, P(("x", "y")), P())
        out = f(jax.device_put(x, NamedSharding(mesh2x4, P(("x", "y")))))
    assert_close(out, x.reshape(8, 1, 3).transpose(1, 0, 2))


def test_mesh_and_vmap_parts_of_one_name(mesh8):
    # A logical axis of 16 = 8 devices (major) x 2 local rows (minor).
    x = arange(16, 3)
    with jax.set_mesh(mesh8):
        def body(v):
            return jax.vmap(lambda r: nx.untile(r[None], {("x", "t"): 0}), axis_name="t",
                            out_axes=None)(v)
        f = shard_map(body, mesh8, P("x"), P())
        assert_close(f(jax.device_put(x, NamedSharding(mesh8, P("x")))), x)


def test_axis_index_over_mesh(mesh2x4):
    with jax.set_mesh(mesh2x4):
        f = shard_map(lambda: nx.axis_index(("x", "y"))[None], mesh2x4, (), P(("x", "y")))
        np.testing.assert_array_equal(f(), np.arange(8))


# --- errors ----------------------------------------------------------------------


def test_collective_errors():
    with pytest.raises(nx.NxopsError, match="not divisible by the size 4"):
        jax.vmap(lambda _: nx.tile(jnp.ones(6), {"i": 0}), axis_name="i")(np.zeros(4))
    with pytest.raises(nx.NxopsError, match="must be a non-empty dict"):
        nx.untile(np.ones(3), {})
    with pytest.raises(nx.NxopsError, match="is not a dim of x"):
        jax.vmap(lambda r: nx.untile(r, {"i": 3}), axis_name="i")(np.ones((4, 2)))
    with pytest.raises(nx.NxopsError, match="repeats a destination"):
        jax.vmap(lambda r: nx.ppermute(r, "i", [(0, 1), (1, 1)]), axis_name="i")(np.ones(4))
    with pytest.raises(nx.NxopsError, match="out of range"):
        jax.vmap(lambda r: nx.ppermute(r, "i", [(0, 9)]), axis_name="i")(np.ones(4))
    with pytest.raises(nx.NxopsError, match="differs from the size 4"):
        jax.vmap(lambda _: nx.one_hot(0, 3, axis="c"), axis_name="c")(np.zeros(4))
    with pytest.raises(nx.NxopsError, match="with tiled=False"):
        jax.vmap(lambda r: nx.psum_scatter(r, "i"), axis_name="i")(np.ones((4, 8)))
    with pytest.raises(nx.NxopsError, match="is not bound"):
        nx.axis_index("nope")


def test_tile_of_a_value_varying_along_the_name():
    # Position i takes tile i of its own value.
    x = arange(4, 8)
    out = jax.vmap(lambda r: nx.tile(r, {"i": 0}), axis_name="i")(x)
    assert_close(out, np.stack([x[i].reshape(4, 2)[i] for i in range(4)]))


def test_gradients_of_vmap_untile_and_psum_scatter_match_lax():
    x = arange(4, 6) / 10
    w = arange(24) / 5

    def named(x):
        return (jax.vmap(lambda r: nx.untile(r, {"i": 0}), axis_name="i", out_axes=None)(x) * w).sum()

    def ref(x):
        gathered = jax.vmap(lambda r: lax.all_gather(r, "i", tiled=True), axis_name="i", out_axes=None)
        return (gathered(x) * w).sum()
    assert_close(jax.grad(named)(x), jax.grad(ref)(x))
    s_named = jax.grad(lambda x: (jax.vmap(lambda r: nx.psum_scatter(r, "i", tiled=True),
                                           axis_name="i")(x) ** 2).sum())(arange(4, 8))
    s_ref = jax.grad(lambda x: (jax.vmap(lambda r: lax.psum_scatter(r, "i", tiled=True),
                                         axis_name="i")(x) ** 2).sum())(arange(4, 8))
    assert_close(s_named, s_ref)
