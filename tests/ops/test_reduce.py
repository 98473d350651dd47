"""Named reductions against NumPy: positional, in vmap, in shard_map, mixed,
forward and gradient, f32/bf16/int, and every error path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import nxops as nx
from tests.ops._util import assert_close

OPS = ["sum", "max", "min", "prod", "mean", "logsumexp"]


def np_reduce(op, x, axes):
    x = np.asarray(x, np.float64)
    if op == "logsumexp":
        top = np.max(x, axis=axes, keepdims=True)
        return np.log(np.sum(np.exp(x - top), axis=axes)) + np.squeeze(top, axes)
    return getattr(np, op)(x, axis=axes)


def data(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    # Values near 1 keep prod well conditioned.
    return (1 + 0.2 * rng.standard_normal(shape)).astype(dtype)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("axes", [(0,), (1,), (0, 2), (-1,), (0, 1, 2)])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_positional_matches_numpy(op, axes, dtype):
    x = data((3, 5, 7), dtype)
    out = getattr(nx, op)(x, axes)
    assert out.dtype == getattr(jnp, op if op != "logsumexp" else "sum")(x, axes).dtype
    assert_close(out, np_reduce(op, np.asarray(x, np.float32), axes), dtype)


@pytest.mark.parametrize("op", OPS)
def test_named_axis_in_vmap(op):
    x = data((6, 5, 7))
    f = jax.vmap(lambda r: getattr(nx, op)(r, ("i", 1)), axis_name="i", out_axes=None)
    assert_close(f(x), np_reduce(op, x, (0, 2)))


@pytest.mark.parametrize("op", OPS)
def test_two_vmapped_names_and_a_position(op):
    x = data((4, 3, 5))
    inner = jax.vmap(lambda r: getattr(nx, op)(r, ("a", "b", 0)), axis_name="b", out_axes=None)
    f = jax.vmap(inner, axis_name="a", out_axes=None)
    assert_close(f(x), np_reduce(op, x, (0, 1, 2)))


def test_reduce_over_one_of_two_names_keeps_the_other():
    x = data((4, 3, 5))
    inner = jax.vmap(lambda r: nx.sum(r, "a"), axis_name="b")
    f = jax.vmap(inner, axis_name="a", out_axes=None)
    assert_close(f(x), x.sum(0))


def test_value_replicated_along_the_name():
    # x does not vary along 'i': the reduction sees `size` equal copies.
    x = data((5,))
    f = jax.vmap(lambda _, v: nx.sum(v, "i"), in_axes=(0, None), axis_name="i", out_axes=None)
    assert_close(f(np.zeros(4), x), 4 * x)
    g = jax.vmap(lambda _, v: nx.max(v, ("i", 0)), in_axes=(0, None), axis_name="i", out_axes=None)
    assert_close(g(np.zeros(4), x), x.max())
    for op in ("prod", "logsumexp", "mean"):
        h = jax.vmap(lambda _, v: getattr(nx, op)(v, ("i", 0)), in_axes=(0, None), axis_name="i",
                     out_axes=None)
        assert_close(h(np.zeros(4), x), np_reduce(op, np.tile(x, 4), (0,)), scale=10)


@pytest.mark.parametrize("op", OPS)
def test_mesh_axis_in_shard_map(op, mesh2x4):
    x = data((8, 6))
    with jax.set_mesh(mesh2x4):
        xs = jax.device_put(x, NamedSharding(mesh2x4, P(("x", "y"))))
        f = jax.jit(jax.shard_map(lambda v: getattr(nx, op)(v, ("x", "y", 0)), mesh=mesh2x4,
                                  in_specs=P(("x", "y")), out_specs=P()))
        assert_close(f(xs), np_reduce(op, x, (0,)))


def test_mesh_and_vmap_names_together(mesh8):
    x = data((16, 3))
    with jax.set_mesh(mesh8):
        xs = jax.device_put(x, NamedSharding(mesh8, P("x")))

        def body(v):  # v: (2, 3) per device; vmap its rows as 't'
            return jax.vmap(lambda r: nx.logsumexp(r, ("x", "t")), axis_name="t", out_axes=None)(v)
        f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P()))
        assert_close(f(xs), np_reduce("logsumexp", x, (0,)))


def test_mesh_reduction_unsharded_input_auto_mesh():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    x = data((8, 2))
    f = jax.jit(jax.shard_map(lambda v: nx.sum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
    assert_close(f(x), x.reshape(8, 1, 2).sum(0))


@pytest.mark.parametrize("op", ["sum", "max", "mean", "logsumexp", "prod"])
def test_gradient_matches_positional_program(op):
    x = data((4, 3, 5))

    def named(x):
        return jax.vmap(lambda r: getattr(nx, op)(r, ("i", 1)), axis_name="i", out_axes=None)(x)

    def positional(x):
        return getattr(jnp, op if op != "logsumexp" else "sum")(x, (0, 2)) if op != "logsumexp" \
            else jax.nn.logsumexp(x, (0, 2))

    weights = np.arange(3, dtype=np.float32)
    g = jax.grad(lambda x: (named(x) * weights).sum())(x)
    g_ref = jax.grad(lambda x: (positional(x) * weights).sum())(x)
    assert_close(g, g_ref, scale=10)


def test_gradient_through_shard_map(mesh8):
    x = data((16, 3))
    with jax.set_mesh(mesh8):
        xs = jax.device_put(x, NamedSharding(mesh8, P("x")))
        f = jax.shard_map(lambda v: nx.logsumexp(v, ("x", 0)), mesh=mesh8, in_specs=P("x"), out_specs=P())
        g = jax.grad(lambda v: f(v).sum())(xs)
    assert_close(g, jax.grad(lambda v: jax.nn.logsumexp(v, 0).sum())(x))


def test_vmap_of_grad_follows_lax_psum():
    x = data((3, 4))
    named = jax.vmap(jax.grad(lambda r: (nx.sum(r, "i") ** 2).sum()), axis_name="i")(x)
    ref = jax.vmap(jax.grad(lambda r: (lax.psum(r, "i") ** 2).sum()), axis_name="i")(x)
    assert_close(named, ref)


def test_max_gradient_splits_ties_like_jnp():
    x = np.array([[1.0, 3.0, 3.0], [0.0, 2.0, 1.0]], np.float32)
    g = jax.grad(lambda x: jax.vmap(lambda r: nx.max(r, ("i", 0)), axis_name="i", out_axes=None)(x))(x)
    assert_close(g, jax.grad(lambda x: jnp.max(x))(x))


def test_integer_inputs_follow_jnp():
    x = np.arange(12, dtype=np.int8).reshape(3, 4)
    assert nx.sum(x, 0).dtype == jnp.sum(x, 0).dtype
    np.testing.assert_array_equal(nx.sum(x, 0), x.sum(0))
    np.testing.assert_array_equal(nx.max(x, 1), x.max(1))
    assert jnp.issubdtype(nx.mean(x, 0).dtype, jnp.floating)
    assert_close(nx.mean(x, 0), x.mean(0))
    assert_close(nx.logsumexp(x, 1), np_reduce("logsumexp", x, (1,)))


def test_logsumexp_is_stable_and_propagates_inf_and_nan():
    x = np.array([1000.0, 1000.0], np.float32)
    assert_close(nx.logsumexp(x, 0), 1000 + np.log(2))
    assert nx.logsumexp(np.array([-np.inf, -np.inf], np.float32), 0) == -np.inf
    assert np.isnan(nx.logsumexp(np.array([1.0, np.nan], np.float32), 0))
    assert np.isnan(nx.max(np.array([1.0, np.nan], np.float32), 0))


def test_psum_family_on_pytrees():
    tree = {"a": data((4, 2)), "b": data((4,), seed=1)}
    f = jax.vmap(lambda t: (nx.psum(t, "i"), nx.pmean(t, "i"), nx.pmax(t, "i"), nx.pmin(t, "i")),
                 axis_name="i", out_axes=None)
    s, m, hi, lo = f(tree)
    for k in tree:
        assert_close(s[k], tree[k].sum(0))
        assert_close(m[k], tree[k].mean(0))
        assert_close(hi[k], tree[k].max(0))
        assert_close(lo[k], tree[k].min(0))


def test_named_ops_inside_scan_cond_and_checkpoint():
    x = data((4, 3))

    def body(r):
        def step(c, _):
            return c + nx.sum(r, "i"), None
        total, _ = lax.scan(step, jnp.zeros(3), None, length=2)
        pos = lax.cond(nx.sum(r, ("i", 0)) > 0, lambda: nx.max(r, "i"), lambda: nx.min(r, "i"))
        return total + jax.checkpoint(lambda r: nx.mean(r, "i"))(r) + pos
    out = jax.jit(jax.vmap(body, axis_name="i", out_axes=None))(x)
    assert_close(out, 2 * x.sum(0) + x.mean(0) + x.max(0))


def test_empty_axis_tuple_is_identity():
    x = data((2, 3))
    assert_close(nx.sum(x, ()), x)


def test_bfloat16_named_sum_accumulates_accurately():
    x = np.full((256,), 0.01, np.float32).astype(jnp.bfloat16)
    out = jax.vmap(lambda r: nx.sum(r, "i"), axis_name="i", out_axes=None)(x)
    assert out.dtype == jnp.bfloat16
    assert_close(out, 2.56, jnp.bfloat16)


# --- errors -------------------------------------------------------------------


def test_unbound_name_says_where_names_come_from():
    with pytest.raises(nx.NxopsError, match=r"axis name 'q' is not bound.*vmap"):
        nx.sum(np.ones(3), "q")


def test_out_of_range_axis():
    with pytest.raises(nx.NxopsError, match=r"positional axis 2 is out of range.*\(2, 3\)"):
        nx.max(np.ones((2, 3)), 2)


def test_duplicate_axes():
    with pytest.raises(nx.NxopsError, match="twice"):
        nx.sum(np.ones((2, 3)), (0, -2))
    with pytest.raises(nx.NxopsError, match="twice"):
        jax.vmap(lambda r: nx.sum(r, ("i", "i")), axis_name="i")(np.ones((2, 3)))


def test_bad_axis_types():
    with pytest.raises(nx.NxopsError, match="use ints for positional axes"):
        nx.sum(np.ones(3), None)
    with pytest.raises(nx.NxopsError, match="reduces named axes only"):
        nx.psum(np.ones(3), 0)


def test_errors_are_value_errors():
    assert issubclass(nx.NxopsError, ValueError)


def test_psum_of_a_static_value_is_static():
    # The old xmap tutorial: `lax.psum(1, 'classes')` is the axis size, an int.
    seen = []
    jax.vmap(lambda _: seen.append(nx.psum(1, "c")) or 0, axis_name="c")(np.zeros(3))
    assert seen == [3] and isinstance(seen[0], int)
    hot = jax.vmap(lambda _: nx.one_hot(np.array([1, 0]), nx.psum(1, "c"), axis=0), axis_name="c",
                   out_axes=None)(np.zeros(3))
    np.testing.assert_array_equal(hot, np.eye(3)[:, [1, 0]])


FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"] + [
    name for name in dir(jnp) if name.startswith(("float8_", "float4_"))]
JNP_REDUCERS = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "prod": jnp.prod,
                "logsumexp": jax.nn.logsumexp}


@pytest.mark.parametrize("x64", [False, True])
def test_local_dtype_of_a_mesh_reduction_of_floats_is_jnps(x64):
    """The dtype a reduction of a float over mesh names alone casts to (known
    without a trace) is the one jnp's reduction of that dtype gives."""
    from nxops.ops._reduce import _reduced_dtype
    with jax.enable_x64(x64):
        for name in FLOAT_DTYPES:
            for op, reducer in JNP_REDUCERS.items():
                try:
                    expected = jax.eval_shape(lambda x: reducer(x, axis=0),
                                              jax.ShapeDtypeStruct((1,), jnp.dtype(name))).dtype
                except Exception:   # jnp refuses this dtype for this op
                    continue
                assert _reduced_dtype(jnp.dtype(name), op) == expected, (name, op)
