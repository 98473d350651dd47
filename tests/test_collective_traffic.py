"""nxops' collectives move the least data: each compiles to the one XLA
collective that does the job (read back from the compiled HLO with
``nxops.hlo``), over 8 simulated devices, in ``jax.shard_map`` bodies and in
``nx.xmap`` programs; ``collective=pallas`` runs the Pallas ring kernels."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import nxops as nx
from nxops import hlo
from nxops._errors import NxopsError

SHARD = (16, 4)          # f32 per device
SHARD_BYTES = 16 * 4 * 4


def make_mesh(shape, names, axis_type=AxisType.Explicit):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def data(global_shape, m, spec):
    x = jnp.arange(np.prod(global_shape), dtype=jnp.float32).reshape(global_shape) % 7
    return jax.device_put(x, jax.NamedSharding(m, spec))


def shard_mapped(body, m, spec, out_spec=None):
    return jax.jit(jax.shard_map(body, mesh=m, in_specs=spec,
                                 out_specs=spec if out_spec is None else out_spec))


def only_collective(fn, x, m):
    """The one collective of ``fn``. Traced under ``jax.set_mesh``: nxops picks
    a collective's kernel from the mesh's platform."""
    with jax.set_mesh(m):
        (c,) = hlo.collectives(fn.lower(x).compile())
    return c


# ---------------------------------------------------------------------------
# shard_map bodies over 8 devices


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("body", [
    lambda s: nx.untile(s, {"x": 0}),
    lambda s: nx.all_gather(s, "x", axis=1, tiled=True),
    lambda s: nx.all_gather(s, "x", axis=0, tiled=False),
], ids=["untile", "all_gather_tiled", "all_gather_stacked"])
def test_untile_and_all_gather_are_one_all_gather(body, axis_type):
    m = make_mesh((8,), ("x",), axis_type)
    c = only_collective(shard_mapped(body, m, P("x"), P()), data((128, 4), m, P("x")), m)
    assert (c.kind, c.logical_kind, c.group_size) == ("all-gather", "all-gather", 8)
    assert c.bytes_per_device == 7 * SHARD_BYTES
    assert c.ratio == 1.0


def test_psum_scatter_is_one_reduce_scatter():
    m = make_mesh((8,), ("x",))
    body = lambda s: nx.psum_scatter(s, "x", scatter_dimension=0, tiled=True)
    c = only_collective(shard_mapped(body, m, P("x")), data((128, 4), m, P("x")), m)
    assert (c.kind, c.group_size, c.buffer_bytes) == ("reduce-scatter", 8, SHARD_BYTES)
    assert c.bytes_per_device == 7 / 8 * SHARD_BYTES and c.ratio == 1.0


def test_psum_over_a_mesh_axis_is_one_all_reduce():
    m = make_mesh((8,), ("x",))
    c = only_collective(shard_mapped(lambda s: nx.psum(s, "x"), m, P("x")),
                        data((128, 4), m, P("x")), m)
    assert (c.kind, c.group_size) == ("all-reduce", 8) and c.ratio == 1.0


def test_two_mesh_axes_make_one_collective_not_one_per_axis():
    m = make_mesh((4, 2), ("x", "y"))
    spec = P(("x", "y"))
    x = data((128, 4), m, spec)
    gather = only_collective(shard_mapped(lambda s: nx.untile(s, {("x", "y"): 0}), m, spec, P()),
                             x, m)
    assert (gather.kind, gather.group_size, gather.ratio) == ("all-gather", 8, 1.0)
    scatter = only_collective(shard_mapped(
        lambda s: nx.psum_scatter(s, ("x", "y"), scatter_dimension=0, tiled=True), m, spec), x, m)
    assert (scatter.kind, scatter.group_size, scatter.ratio) == ("reduce-scatter", 8, 1.0)


# ---------------------------------------------------------------------------
# nx.xmap programs: a name mapped to mesh axes


@pytest.mark.parametrize("program,out_axes,kind", [
    (lambda v: nx.untile(v, {"a": 0}), [None, None], "all-gather"),
    (lambda v: nx.all_gather(v, "a", axis=0, tiled=False), [None, None, None], "all-gather"),
    (lambda v: nx.psum_scatter(v, "a", scatter_dimension=0, tiled=True), ["a", None, None],
     "reduce-scatter"),
    (lambda v: nx.sum(v, "a"), [None, None], "all-reduce"),
])
def test_xmap_collectives(program, out_axes, kind):
    m = make_mesh((4, 2), ("x", "y"))
    x = jnp.arange(8 * 16 * 4, dtype=jnp.float32).reshape((8,) + SHARD) % 5
    f = nx.xmap(program, ["a", None, None], out_axes, axis_resources={"a": ("x", "y")})
    c = only_collective(f, x, m)
    with jax.set_mesh(m):
        got = f(x)
    assert (c.kind, c.group_size, c.ratio) == (kind, 8, 1.0)
    if kind == "all-gather":
        want = np.asarray(x).reshape(got.shape)                 # every position's tile
    else:
        want = np.asarray(x).sum(0).reshape(got.shape)          # summed over "a" (and scattered)
    np.testing.assert_allclose(np.asarray(got), want)


# ---------------------------------------------------------------------------
# collective=pallas on CPU: the Pallas ring kernels in TPU interpret mode


@pytest.mark.parametrize("body", [
    lambda s: nx.untile(s, {"x": 1}),
    lambda s: nx.psum_scatter(s, "x", scatter_dimension=0, tiled=True),
], ids=["untile", "psum_scatter"])
def test_pallas_selection_runs_the_ring_kernels(body):
    m = make_mesh((8,), ("x",))
    x = data((128, 4), m, P("x"))
    with jax.set_mesh(m), nx.kernels.use("xla"):
        reference = shard_mapped(body, m, P("x"))
        want = reference(x)
        assert len(hlo.collectives(reference.lower(x).compile())) == 1
    with jax.set_mesh(m), nx.kernels.use("collective=pallas"):
        ours = shard_mapped(body, m, P("x"))
        got = ours(x)
        # The interpreted kernel replaces XLA's collective.
        assert hlo.collectives(ours.lower(x).compile()) == []
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_pallas_selection_over_two_mesh_axes_says_why_not():
    m = make_mesh((4, 2), ("x", "y"))
    spec = P(("x", "y"))
    with jax.set_mesh(m), nx.kernels.use("collective=pallas"):
        with pytest.raises(NxopsError, match="one mesh axis"):
            shard_mapped(lambda s: nx.untile(s, {("x", "y"): 0}), m, spec, P()).lower(
                data((128, 4), m, spec))


def test_collectives_in_a_shard_map_body_without_set_mesh():
    m = make_mesh((8,), ("x",))
    fn = shard_mapped(lambda s: nx.untile(s, {"x": 0}), m, P("x"), P())
    (c,) = hlo.collectives(fn.lower(data((128, 4), m, P("x"))).compile())
    assert c.kind == "all-gather"


# ---------------------------------------------------------------------------
# Sum-then-tile over the same mesh axes fuses into one reduce-scatter


@pytest.mark.parametrize("body,spec", [
    (lambda s: nx.tile(nx.psum(s, "x"), {"x": 0}), P()),
    (lambda s: nx.tile(nx.sum(s, ("x", 1)), {"x": 0}), P()),
], ids=["psum_then_tile", "sum_then_tile"])
def test_sum_then_tile_is_one_reduce_scatter(body, spec):
    m = make_mesh((8,), ("x",))
    x = data((128, 4), m, spec)
    fn = shard_mapped(body, m, spec, P("x"))
    c = only_collective(fn, x, m)
    assert (c.kind, c.group_size, c.ratio) == ("reduce-scatter", 8, 1.0)
    with jax.set_mesh(m):
        got = np.asarray(fn(x))
    want = np.asarray(x) * 8
    want = want if want.ndim == got.ndim else want.sum(1)
    np.testing.assert_allclose(got, want.reshape(got.shape))


def test_named_contraction_then_tile_is_one_reduce_scatter():
    m = make_mesh((8,), ("x",))
    a, b = data((16, 8), m, P(None, "x")), data((8, 3), m, P("x"))
    fn = jax.jit(jax.shard_map(lambda v, w: nx.tile(nx.einsum("ik<x>,kj<x>->ij", v, w), {"x": 0}),
                               mesh=m, in_specs=(P(None, "x"), P("x")), out_specs=P("x")))
    with jax.set_mesh(m):
        (c,) = hlo.collectives(fn.lower(a, b).compile())
        got = fn(a, b)
        grad = jax.grad(lambda v: (fn(v, b) ** 2).sum())(a)
    assert (c.kind, c.ratio) == ("reduce-scatter", 1.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(a) @ np.asarray(b), rtol=1e-5)
    want = jax.grad(lambda v: ((v @ np.asarray(b)) ** 2).sum())(np.asarray(a))
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-4)


def test_tile_over_other_axes_does_not_fuse():
    # psum over 'x' then tile over 'y': a real all-reduce is needed.
    m = make_mesh((2, 4), ("x", "y"))
    fn = shard_mapped(lambda s: nx.tile(nx.psum(s, "x"), {"y": 0}), m, P(), P("y"))
    with jax.set_mesh(m):
        kinds = [c.kind for c in hlo.collectives(fn.lower(data((16, 4), m, P())).compile())]
        got = fn(data((16, 4), m, P()))
    assert kinds == ["all-reduce"]
    np.testing.assert_allclose(np.asarray(got), 2 * (np.arange(64).reshape(16, 4) % 7))
