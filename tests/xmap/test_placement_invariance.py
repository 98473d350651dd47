"""Resources never change results: values, gradients (outside and inside the
body) and position queries under every placement, against NumPy or a
positional JAX program written without nxops."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nxops as nx

MESH_SHAPES = {"x": (8,), "xy": (2, 4)}


def _placements():
    """(id, mesh shape, axis_resources for the logical name 'a' of size 8)."""
    return [
        ("none", "x", {}),
        ("mesh8", "x", {"a": "x"}),
        ("mesh_y", "xy", {"a": "y"}),
        ("mesh_xy", "xy", {"a": ("x", "y")}),
        ("loop", "x", {"a": nx.SerialLoop(2)}),
        ("loop4", "x", {"a": nx.SerialLoop(4)}),
        ("mesh_then_loop", "xy", {"a": ("y", nx.SerialLoop(2))}),
        ("mesh_x_loop", "xy", {"a": ("x", nx.SerialLoop(2))}),
    ]


PLACEMENTS = _placements()
NO_LOOP = [p for p in PLACEMENTS if "loop" not in p[0]]


def _run(body, in_axes, out_axes, resources, mesh_key, *args, **kw):
    mesh = jax.make_mesh(MESH_SHAPES[mesh_key], tuple(mesh_key))
    with jax.set_mesh(mesh):
        return nx.xmap(body, in_axes, out_axes, axis_resources=resources, **kw)(*args)


@pytest.mark.parametrize("name,mesh,resources", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_position_queries_are_global_under_every_placement(name, mesh, resources):
    key = jax.random.key(3)

    def body(v):
        i = nx.axis_index("a")
        bits = jax.random.bits(jax.random.fold_in(key, i))
        return (v + i, v * 0 + nx.axis_size("a"), nx.one_hot(5, axis="a"),
                v * 0 + nx.psum(1, "a"), nx.tile(jnp.arange(16.0), {"a": 0}), bits)

    got = _run(body, ["a"], (["a"], ["a"], ["a"], ["a"], ["a", ...], ["a"]),
               resources, mesh, jnp.zeros(8))
    positions = np.arange(8)
    want_bits = [np.asarray(jax.random.bits(jax.random.fold_in(key, i))) for i in range(8)]
    np.testing.assert_array_equal(got[0], positions)
    np.testing.assert_array_equal(got[1], np.full(8, 8))
    np.testing.assert_array_equal(got[2], positions == 5)
    np.testing.assert_array_equal(got[3], np.full(8, 8))
    np.testing.assert_array_equal(got[4], np.arange(16.0).reshape(8, 2))
    np.testing.assert_array_equal(got[5], want_bits)


GATHERING_BODIES = {
    "all_gather": (lambda w: nx.all_gather(w, "a"), lambda w: w),
    "untile": (lambda w: nx.untile(w[None], {"a": 0}), lambda w: w),
    "prod": (lambda w: nx.prod(w, "a"), lambda w: jnp.prod(w)),
    "sum": (lambda w: nx.sum(w, "a"), lambda w: jnp.sum(w)),
    "max": (lambda w: nx.max(w, "a"), lambda w: jnp.max(w)),
    "logsumexp": (lambda w: nx.logsumexp(w, "a"), lambda w: jax.nn.logsumexp(w)),
}


@pytest.mark.parametrize("op", GATHERING_BODIES)
@pytest.mark.parametrize("name,mesh,resources", NO_LOOP, ids=[p[0] for p in NO_LOOP])
def test_grad_outside_through_named_gathers_and_reductions_matches_positional(
        op, name, mesh, resources):
    named, positional = GATHERING_BODIES[op]
    w = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, 8), jnp.float32)
    c = jnp.arange(8.0) + 1

    def loss(f):
        return lambda w: jnp.sum(f(w) * c[: jnp.size(f(w))].reshape(jnp.shape(f(w))))

    mesh_obj = jax.make_mesh(MESH_SHAPES[mesh], tuple(mesh))
    with jax.set_mesh(mesh_obj):
        f = nx.xmap(named, (["a", ...],), [...], axis_resources=resources)
        got = jax.grad(loss(f))(w)
    want = jax.grad(loss(positional))(w)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def _vmap_grad_reference(fn):
    """JAX's own convention: jax.grad inside jax.vmap(axis_name='a')."""
    return jax.vmap(jax.grad(fn), axis_name="a")


INSIDE_BODIES = {
    # name: (nxops body, reference written with lax collectives under vmap)
    "psum": (lambda x, y: nx.psum(x * y, "a"), lambda x, y: lax.psum(x * y, "a")),
    "sum": (lambda x, y: nx.sum(x * y, "a"), lambda x, y: lax.psum(x * y, "a")),
    "pmean": (lambda x, y: nx.pmean(x * y, "a"), lambda x, y: lax.pmean(x * y, "a")),
    "pdot": (lambda x, y: nx.pdot(x, y, "a"), lambda x, y: lax.psum(x * y, "a")),
    "einsum": (lambda x, y: nx.einsum("{a},{a}->", x, y), lambda x, y: lax.psum(x * y, "a")),
    "einsum_angle": (lambda x, y: nx.einsum("<a>,<a>-><>", x, y),
                     lambda x, y: lax.psum(x * y, "a")),
    "all_gather": (lambda x, y: nx.all_gather(x, "a") @ jnp.arange(8.0),
                   lambda x, y: lax.all_gather(x, "a") @ jnp.arange(8.0)),
    "per_example": (lambda x, y: x * x * y, lambda x, y: x * x * y),
}


@pytest.mark.parametrize("op", INSIDE_BODIES)
@pytest.mark.parametrize("name,mesh,resources", NO_LOOP, ids=[p[0] for p in NO_LOOP])
def test_grad_inside_the_body_is_the_same_under_every_placement(op, name, mesh, resources):
    named, reference = INSIDE_BODIES[op]
    x = jnp.arange(8.0) + 1
    y = jnp.arange(8.0) * 10
    got = _run(lambda x, y: jax.grad(named)(x, y), (["a"], ["a"]), ["a"], resources, mesh, x, y)
    want = _vmap_grad_reference(reference)(x, y)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("name,mesh,resources", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_per_example_grads_wrt_a_replicated_input_stay_per_position(name, mesh, resources):
    w = jnp.float32(2.0)
    a = jnp.arange(8.0)
    got = _run(lambda w, a: jax.grad(lambda w: w * w * a)(w), ([...], ["a"]), ["a"],
               resources, mesh, w, a)
    np.testing.assert_allclose(got, 2 * 2.0 * np.arange(8.0))


@pytest.mark.parametrize("resources", [{"a": "x", "x": "y"}, {"a": "x"}], ids=str)
def test_logical_name_spelled_like_a_mesh_axis_does_not_change_tile(resources):
    got = _run(lambda v, w: nx.tile(v, {"a": 0}), ([...], ["x"]), ["a", ...], resources, "xy",
               jnp.arange(4.0), jnp.zeros(4), axis_sizes={"a": 2})
    np.testing.assert_array_equal(got, np.arange(4.0).reshape(2, 2))


@pytest.mark.parametrize("op,reference", [("max", np.max), ("min", np.min),
                                          ("pmax", np.max), ("pmin", np.min)])
@pytest.mark.parametrize("name,mesh,resources", NO_LOOP, ids=[p[0] for p in NO_LOOP])
def test_nan_propagates_through_named_extrema_on_every_placement(op, reference, name, mesh,
                                                                 resources):
    v = jnp.arange(8.0).at[3].set(jnp.nan)
    got = _run(lambda v: getattr(nx, op)(v, "a"), ["a"], [...], resources, mesh, v)
    assert np.isnan(got) and np.isnan(reference(np.asarray(v)))
    finite = jnp.arange(8.0) - 3
    got = _run(lambda v: getattr(nx, op)(v, "a"), ["a"], [...], resources, mesh, finite)
    assert got == reference(np.asarray(finite))


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto],
                         ids=["explicit", "auto"])
def test_closed_over_prng_key_works_under_explicit_and_auto_meshes(axis_type):
    key = jax.random.key(0)

    def body(v):
        return v + jax.random.uniform(jax.random.fold_in(key, nx.axis_index("b")))

    want = np.stack([jax.random.uniform(jax.random.fold_in(key, i)) for i in range(8)])
    mesh = jax.make_mesh((8,), ("x",), axis_types=(axis_type,))
    with jax.set_mesh(mesh):
        got = nx.xmap(body, ["b"], ["b"], axis_resources={"b": "x"})(jnp.zeros(8))
    np.testing.assert_allclose(got, want)


@pytest.mark.parametrize("name,mesh,resources", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_nx_random_is_per_position_and_the_same_under_every_placement(name, mesh, resources):
    key = jax.random.key(7)

    def body(v, k):
        return (nx.random.uniform(key, (3,)), nx.random.normal(k, (2,), names="a"),
                nx.random.bits(key, (), names=("a",)) + 0 * v.astype(jnp.uint32))

    got = _run(body, (["a"], [...]), (["a", ...], ["a", ...], ["a"]), resources, mesh,
               jnp.zeros(8), key)
    here = [jax.random.fold_in(key, i) for i in range(8)]
    np.testing.assert_array_equal(got[0], np.stack([jax.random.uniform(k, (3,)) for k in here]))
    np.testing.assert_array_equal(got[1], np.stack([jax.random.normal(k, (2,)) for k in here]))
    np.testing.assert_array_equal(got[2], np.stack([jax.random.bits(k, ()) for k in here]))
    assert len(np.unique(np.asarray(got[2]))) == 8   # positions differ
