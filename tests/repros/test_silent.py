"""Issue 20's silent wrong results: each repro file, run unchanged, prints its
expected result (the file's comments say what that is); beside each, a small
differential test of the general case."""
import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nxops as nx
from tests.repros._run import printed_lines

PLACEMENTS = [   # (id, mesh shape, axis_resources for the name 'a' of size 8)
    ("none", (8,), {}),
    ("mesh8", (8,), {"a": "x"}),
    ("mesh2", (2, 4), {"a": "x"}),
    ("loop2", (8,), {"a": nx.SerialLoop(2)}),
    ("mesh_then_loop", (2, 4), {"a": ("x", nx.SerialLoop(2))}),
]
PLACEMENT_IDS = [p[0] for p in PLACEMENTS]


def _mesh(shape):
    return jax.make_mesh(shape, ("x", "y")[:len(shape)])


# --- r01: grad inside through nx.tile ------------------------------------------


def test_r01_tile_grad_inside_is_per_position_on_every_placement():
    lines = printed_lines("r01_tile_grad_inside.py")
    assert lines[0] == "want row0 [1. 1. 0. 0. 0. 0. 0. 0.]"
    assert len(lines) == 5
    for line in lines[1:]:
        assert line.endswith("[1. 1. 0. 0. 0. 0. 0. 0.]"), line


@pytest.mark.parametrize("name,shape,resources", PLACEMENTS, ids=PLACEMENT_IDS)
def test_tile_grad_inside_matches_vmap_of_dynamic_slice(name, shape, resources):
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=(16, 3)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 2, 3)), jnp.float32)

    def loss(tile_of, w, x):
        return jnp.sum(jnp.sin(tile_of(w)) * x)

    def named(x, w):
        return jax.grad(lambda w: loss(lambda v: nx.tile(v, {"a": 0}), w, x))(w)

    def positional(x, w):
        return jax.grad(lambda w: loss(
            lambda v: lax.dynamic_slice_in_dim(v, lax.axis_index("a") * 2, 2), w, x))(w)

    with jax.set_mesh(_mesh(shape)):
        got = nx.xmap(named, (["a", ...], [...]), ["a", ...], axis_resources=resources)(x, w)
    want = jax.vmap(positional, in_axes=(0, None), axis_name="a")(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


# --- r18: forward-mode derivatives of named max/min -----------------------------


def test_r18_max_jvp_has_no_nan():
    assert printed_lines("r18_max_jvp_nan.py") == [
        "{} NaNs in jvp: 0", "{'a': 'x'} NaNs in jvp: 0", "jnp NaNs: 0"]


@pytest.mark.parametrize("op", ["max", "min"])
def test_extremum_tangent_never_divides_by_an_empty_tie_mask(op):
    # What XLA did in r18: the max is taken of x as one fusion rounded it, the
    # tie mask compares x as another fusion rounded it (1 ulp apart): no
    # element equals the max. The tangent is still the arg-max's, not 0/0.
    from nxops.ops._reduce import _extremum_tangent
    x = jnp.asarray([[1.0, 3.0], [2.0, 5.0], [1.5, 4.0]])
    t = jnp.asarray([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]])
    pick = jnp.max if op == "max" else jnp.min
    off_by_an_ulp = jnp.nextafter(pick(x, 0), jnp.inf)
    got = _extremum_tangent(x, t, off_by_an_ulp, (0,), (), op)
    want = jnp.asarray([30.0, 40.0]) if op == "max" else jnp.asarray([10.0, 20.0])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


EXTREMA = {"max": (nx.max, jnp.max), "min": (nx.min, jnp.min),
           "pmax": (nx.pmax, jnp.max), "pmin": (nx.pmin, jnp.min)}
EXTREMUM_PLACEMENTS = [   # 'a' (size 8) and the reduced 'b' (size 4), on a (2, 4) mesh
    {}, {"a": "x"}, {"b": "y"}, {"a": "x", "b": "y"}, {"a": nx.SerialLoop(2)},
    {"a": nx.SerialLoop(2), "b": "y"}]


def _extremum_xmap(op, resources):
    named = EXTREMA[op][0]
    return nx.xmap(lambda x, z: named(x + 0.1 * z, "b"), ({1: "a", 2: "b"}, ["b", ...]),
                   ["a", ...], axis_resources=resources)


def _extremum_reference(op):
    positional = EXTREMA[op][1]
    return lambda x, z: positional(x.transpose(1, 2, 0) + 0.1 * z[None], 1)


@pytest.mark.parametrize("resources", EXTREMUM_PLACEMENTS, ids=str)
@pytest.mark.parametrize("op", EXTREMA)
def test_extremum_jvp_matches_jnp_on_every_placement(op, resources):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.uniform(0.5, 1.5, (16, 8, 4)), jnp.float32)    # [P, a, b]
    z = jnp.asarray(rng.uniform(-1, 1, (4, 16)), jnp.float32)          # [b, P]
    t = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    with jax.set_mesh(_mesh((2, 4))):
        f = _extremum_xmap(op, resources)
        got = jax.jvp(lambda v: f(v, z), (x,), (t,))
    want = jax.jvp(lambda v: _extremum_reference(op)(v, z), (x,), (t,))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("resources", [{}, {"a": nx.SerialLoop(2)}], ids=str)
@pytest.mark.parametrize("op", ["max", "pmin"])
def test_extremum_jacfwd_and_hessian_match_jnp(op, resources):
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.uniform(0.5, 1.5, (1, 8, 4)), jnp.float32)
    z = jnp.asarray(rng.uniform(-1, 1, (4, 1)), jnp.float32)
    f = _extremum_xmap(op, resources)
    ref = _extremum_reference(op)
    np.testing.assert_allclose(np.asarray(jax.jacfwd(lambda v: f(v, z))(x)),
                               jax.jacfwd(lambda v: ref(v, z))(x), atol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.hessian(lambda v: jnp.sum(f(v, z) ** 2))(x)),
                               jax.hessian(lambda v: jnp.sum(ref(v, z) ** 2))(x), atol=1e-5)


@pytest.mark.parametrize("resources", [{"a": "x"}, {"a": "x", "b": "y"}], ids=str)
@pytest.mark.parametrize("op", ["min", "pmax"])
def test_extremum_forward_over_reverse_matches_jnp_on_a_mesh(op, resources):
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.uniform(0.5, 1.5, (4, 8, 4)), jnp.float32)
    z = jnp.asarray(rng.uniform(-1, 1, (4, 4)), jnp.float32)
    t = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    with jax.set_mesh(_mesh((2, 4))):
        f = _extremum_xmap(op, resources)
        got = jax.jvp(jax.grad(lambda v: jnp.sum(f(v, z) ** 2)), (x,), (t,))[1]
    ref = _extremum_reference(op)
    want = jax.jvp(jax.grad(lambda v: jnp.sum(ref(v, z) ** 2)), (x,), (t,))[1]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


# --- r02: gradient of the product at zeros ----------------------------------------


def test_r02_prod_grad_at_a_zero_matches_jnp():
    assert printed_lines("r02_prod_grad_zero.py") == [
        "nx   [6. 0. 0.]", "jnp  [6. 0. 0.]", "xmap [6. 0. 0.]"]


PROD_PLACEMENTS = [("none", (8,), {}), ("mesh8", (8,), {"a": "x"}),
                   ("mesh2", (2, 4), {"a": "x"})]


@pytest.mark.parametrize("name,shape,resources", PROD_PLACEMENTS, ids=[p[0] for p in PROD_PLACEMENTS])
def test_prod_grad_and_hessian_vector_product_with_several_zeros_match_jnp(name, shape, resources):
    rng = np.random.default_rng(2)
    x = rng.uniform(0.5, 2.0, (8, 3)).astype(np.float32)
    x[[1, 5], 0] = 0.0      # two zeros in column 0, one in column 1, none in column 2
    x[3, 1] = 0.0
    x = jnp.asarray(x)
    w = jnp.arange(3.0) + 1
    t = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

    def loss(prod):
        return lambda v: jnp.sum(prod(v) * w)

    with jax.set_mesh(_mesh(shape)):
        f = nx.xmap(lambda v: nx.prod(v * 1.0, ("a", 0)) + nx.prod(v, "a"), [["a", ...]], [...],
                    axis_resources=resources)
        got_grad = jax.grad(loss(f))(x)
        got_hvp = jax.jvp(jax.grad(loss(f)), (x,), (t,))[1]   # (jax.hessian on a mesh: r12)
    ref = lambda v: jnp.prod(v) + jnp.prod(v, 0)
    np.testing.assert_allclose(np.asarray(got_grad), jax.grad(loss(ref))(x), rtol=1e-5)
    want_hvp = jax.jvp(jax.grad(loss(ref)), (x,), (t,))[1]
    np.testing.assert_allclose(np.asarray(got_hvp), np.asarray(want_hvp), rtol=1e-5, atol=1e-5)


@hypothesis.settings(max_examples=10, deadline=None, derandomize=True)
@hypothesis.given(values=hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, max_side=4),
                                    elements=st.sampled_from([0.0, 0.0, 0.5, -1.5, 2.0])))
def test_prod_grad_over_a_name_and_an_int_matches_jnp(values):
    # Gradient outside and forward mode of nx.prod over a vmapped name and a
    # positional axis, zeros frequent (several per product).
    x = jnp.asarray(values)
    named = jax.vmap(lambda v: nx.prod(v, ("i", 0)), axis_name="i")
    positional = lambda v: jnp.prod(v, axis=(0, 1)) * jnp.ones(v.shape[0])
    np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(named(v)))(x),
                               jax.grad(lambda v: jnp.sum(positional(v)))(x), rtol=1e-5)
    t = jnp.ones_like(x)
    np.testing.assert_allclose(jax.jvp(named, (x,), (t,))[1],
                               jax.jvp(positional, (x,), (t,))[1], rtol=1e-5)


# --- r03: bool einsum / pdot --------------------------------------------------------


def test_r03_bool_einsum_is_bool_on_every_placement():
    assert printed_lines("r03_bool_einsum.py") == [
        "jnp      [ True  True  True]", "none     [ True  True  True]",
        "a->x     [ True  True  True]"]


BOOL_CONTRACTIONS = {   # name: (nxops body of x [a, i, j] and y [a, j, k], jnp reference)
    "dot": (lambda x, y: nx.einsum("<a>ij,<a>jk->ik", x, y),
            lambda x, y: jnp.einsum("aij,ajk->ik", x, y)),
    "sum_name": (lambda x, y: nx.einsum("<a>ij->j", x), lambda x, y: jnp.einsum("aij->j", x)),
    "kept_name": (lambda x, y: nx.einsum("<a>ij,<a>jk-><a>ik", x, y),
                  lambda x, y: jnp.einsum("aij,ajk->aik", x, y)),
    "pdot": (lambda x, y: nx.pdot(x, y, "a"), lambda x, y: jnp.einsum("aij,alk->ijlk", x, y)),
}
BOOL_PLACEMENTS = [p for p in PLACEMENTS if "loop" not in p[0]]


@pytest.mark.parametrize("name,shape,resources", BOOL_PLACEMENTS, ids=[p[0] for p in BOOL_PLACEMENTS])
@pytest.mark.parametrize("op", BOOL_CONTRACTIONS)
def test_bool_contractions_match_jnp_einsum(op, name, shape, resources):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.random((8, 2, 3)) < 0.2)
    y = jnp.asarray(rng.random((8, 3, 2)) < 0.2)
    named, reference = BOOL_CONTRACTIONS[op]
    out_axes = ["a", ...] if op == "kept_name" else [...]
    with jax.set_mesh(_mesh(shape)):
        got = nx.xmap(named, (["a", ...], ["a", ...]), out_axes, axis_resources=resources)(x, y)
    want = reference(x, y)
    assert got.dtype == want.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- r05: the shared-resource check walks every sub-jaxpr --------------------------


def test_r05_collective_inside_custom_linear_solve_is_refused():
    with pytest.raises(nx.NxopsError, match="'a' and 'b' are both mapped to the resource 'x'|"
                                            "'b' and 'a' are both mapped to the resource 'x'"):
        printed_lines("r05_custom_linear_solve_shared.py")


@jax.custom_jvp
def _custom_jvp_psum(u):
    return nx.psum(u, "b")


_custom_jvp_psum.defjvp(lambda primals, tangents: (_custom_jvp_psum(*primals), tangents[0]))


@jax.custom_vjp
def _custom_vjp_psum(u):
    return nx.psum(u, "b")


_custom_vjp_psum.defvjp(lambda u: (_custom_vjp_psum(u), None), lambda _, g: (g,))

# Each wraps `nx.psum(u, 'b')`, u varying along 'a', in one kind of sub-jaxpr.
WRAPPED_COLLECTIVES = {
    "plain": lambda u: nx.psum(u, "b"),
    "custom_linear_solve": lambda u: lax.custom_linear_solve(
        lambda t: 2.0 * t, u, lambda mv, rhs: rhs / 2.0 + nx.psum(u, "b")),
    "custom_root": lambda u: lax.custom_root(
        lambda t: t - u, u, lambda f, t: t + nx.psum(u, "b"), lambda f, t: t),
    "custom_jvp": _custom_jvp_psum,
    "custom_vjp": _custom_vjp_psum,
    "while": lambda u: lax.while_loop(lambda c: c[0] < 2,
                                      lambda c: (c[0] + 1, nx.psum(c[1], "b")), (0, u))[1],
    "fori": lambda u: lax.fori_loop(0, 2, lambda i, c: c + nx.psum(u, "b"), u * 0),
    "cond": lambda u: lax.cond(True, lambda v: nx.psum(v, "b"), lambda v: v, u),
    "switch": lambda u: lax.switch(1, [lambda v: v, lambda v: nx.psum(v, "b")], u),
    "scan": lambda u: lax.scan(lambda c, _: (c + nx.psum(u, "b"), None), u * 0, None, 2)[0],
    "map": lambda u: lax.map(lambda v: nx.psum(v, "b"), u[None])[0],
    "checkpoint": jax.checkpoint(lambda u: nx.psum(u, "b"),
                                 policy=jax.checkpoint_policies.nothing_saveable),
    "jit": jax.jit(lambda u: nx.psum(u, "b")),
}


@pytest.mark.parametrize("wrapper", WRAPPED_COLLECTIVES)
def test_collective_over_a_name_sharing_a_resource_is_refused_inside_every_wrapper(wrapper):
    wrapped = WRAPPED_COLLECTIVES[wrapper]
    f = nx.xmap(lambda u, v: (wrapped(u), v), (["a", ...], ["b", ...]), (["a", ...], ["b", ...]),
                axis_resources={"a": "x", "b": "x"})
    with jax.set_mesh(_mesh((4, 2))):
        with pytest.raises(nx.NxopsError, match="both mapped to the resource 'x'"):
            np.asarray(f(jnp.ones((4, 3)), jnp.ones((4, 3)))[0])


def test_a_collective_over_the_own_name_inside_custom_linear_solve_is_accepted():
    # No false refusal: a psum over 'b' of values varying only along 'b'.
    def body(u, v):
        x = lax.custom_linear_solve(lambda t: 2.0 * t, v,
                                    lambda mv, rhs: rhs / 2.0 + nx.psum(v, "b"))
        return u, x

    xa, xb = jnp.arange(12.0).reshape(4, 3), jnp.arange(12.0).reshape(4, 3) + 1
    with jax.set_mesh(_mesh((4, 2))):
        f = nx.xmap(body, (["a", ...], ["b", ...]), (["a", ...], ["b", ...]),
                    axis_resources={"a": "x", "b": "x"})
        _, got = f(xa, xb)
    np.testing.assert_allclose(np.asarray(got), xb / 2 + xb.sum(0), rtol=1e-6)


# --- r04: all_to_all of a value that does not vary along the name -----------------


def test_r04_all_to_all_of_a_replicated_value_has_the_mesh_shape():
    assert printed_lines("r04_all_to_all_replicated.py") == ["none  (8, 8, 2)", "a->x  (8, 8, 2)"]


@pytest.mark.parametrize("name,shape,resources", BOOL_PLACEMENTS, ids=[p[0] for p in BOOL_PLACEMENTS])
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("replicated", [True, False], ids=["replicated", "varying"])
def test_all_to_all_matches_numpy(replicated, tiled, name, shape, resources):
    rows = 16 if tiled else 8
    w = jnp.arange(8.0 * rows * 2).reshape(8, rows, 2)       # [a, rows, 2]
    w_spec = [...] if replicated else ["a", ...]
    arg = w[0] if replicated else w
    with jax.set_mesh(_mesh(shape)):
        f = nx.xmap(lambda i, v: nx.all_to_all(v, "a", 0, 1, tiled=tiled), (["a"], w_spec),
                    ["a", ...], axis_resources=resources)
        got = np.asarray(f(jnp.arange(8), arg))
    per_position = np.broadcast_to(np.asarray(arg), w.shape)       # [j, rows, 2]
    if tiled:   # position i: chunk i of every j's rows, concatenated along dim 1
        chunks = per_position.reshape(8, 8, 2, 2)                   # [j, i, chunk, 2]
        want = chunks.transpose(1, 2, 0, 3).reshape(8, 2, 16)
    else:       # split dim 0 removed, every j's row i stacked as a new dim 1
        want = per_position.transpose(1, 2, 0)                      # [i, 2, j]
    np.testing.assert_array_equal(got, want)


# --- r17: user names cannot collide with nxops' internal axis names ---------------


def test_r17_a_user_name_spelled_like_an_internal_name_is_its_own_axis():
    assert printed_lines("r17_name_collision.py") == [
        "{} [True, True, True]", "{'a': 'x'} [True, True, True]"]


@pytest.mark.parametrize("resources", [{"a": "x"}, {"a": "x", "a#tile": "y"}], ids=str)
def test_user_names_spelled_like_internal_ones_do_not_collide(resources):
    # 'a' on mesh axis 'x' of size 2 keeps a local tile of 4 (nxops' own vmap
    # name for it reads 'a#tile'); all_to_all over it computes positionally
    # under nxops' vmap named 'nxops#positions'. Users name axes so too.
    x = jnp.arange(8.0 * 2 * 4 * 8).reshape(8, 2, 4, 8)   # [a, nxops#positions, a#tile, 8]
    names = ["a", "nxops#positions", "a#tile", ...]

    def body(v):
        return (nx.psum(v, "a#tile"), nx.axis_index("a#tile") + 0 * v,
                nx.psum(v, "nxops#positions"), nx.all_to_all(v, "a", 0, 0))

    with jax.set_mesh(_mesh((2, 4))):
        got = nx.xmap(body, [names], [["a", "nxops#positions", ...], names,
                                      ["a", "a#tile", ...], names],
                      axis_resources=resources)(x)
    np.testing.assert_array_equal(np.asarray(got[0]), x.sum(2))
    np.testing.assert_array_equal(np.asarray(got[1]),
                                  np.broadcast_to(np.arange(4.0)[:, None], x.shape))
    np.testing.assert_array_equal(np.asarray(got[2]), x.sum(1))
    np.testing.assert_array_equal(np.asarray(got[3]), x.transpose(3, 1, 2, 0))
