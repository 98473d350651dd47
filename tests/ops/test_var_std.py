"""nx.var / nx.std against NumPy (and jnp for dtypes and gradients):
positional, named and mixed axes, ddof, every placement, gradients outside
and inside the body, and the error for a bad ddof."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from tests.ops._util import assert_close

PLACEMENTS = [   # (id, mesh shape, axis_resources for 'a' (size 8) and 'b' (size 4))
    ("none", (8,), {}),
    ("mesh8", (8,), {"a": "x"}),
    ("mesh_part", (2, 4), {"a": "x"}),                # mesh 2 x local tile 4
    ("mesh_both", (2, 4), {"a": "x", "b": "y"}),
    ("loop_b", (8,), {"a": "x", "b": nx.SerialLoop(2)}),   # b looped, reduced over a only
]
IDS = [p[0] for p in PLACEMENTS]


def _mesh(shape):
    return jax.make_mesh(shape, ("x", "y")[:len(shape)])


def _data(shape, seed=0, dtype=np.float32):
    # A large mean: a one-pass E[x^2] - E[x]^2 would lose the variance.
    return (100 + np.random.default_rng(seed).standard_normal(shape)).astype(dtype)


@pytest.mark.parametrize("op", ["var", "std"])
@pytest.mark.parametrize("axis", [0, (0, 2), -1, (0, 1, 2)])
@pytest.mark.parametrize("ddof", [0, 1])
def test_positional_matches_numpy(op, axis, ddof):
    x = _data((3, 5, 7))
    got = getattr(nx, op)(x, axis, ddof=ddof)
    assert got.dtype == getattr(jnp, op)(x, axis, ddof=ddof).dtype
    assert_close(got, getattr(np, op)(np.float64(x), axis, ddof=ddof))


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, jnp.bfloat16, np.complex64])
def test_dtypes_match_jnp(dtype):
    x = np.asarray(_data((6, 4)) - 100, np.float32)
    if dtype == np.complex64:
        x = x + 1j * x[::-1]
    elif dtype == np.bool_:
        x = x > 0
    x = x.astype(dtype)
    for op in ("var", "std"):
        got = getattr(nx, op)(x, 0)
        want = getattr(jnp, op)(x, 0)
        assert got.dtype == want.dtype
        assert_close(np.float32(got), np.float32(want), np.float32 if dtype != jnp.bfloat16 else dtype)


@pytest.mark.parametrize("op", ["var", "std"])
def test_names_and_ints_in_vmap(op):
    x = _data((4, 3, 5))
    inner = jax.vmap(lambda r: getattr(nx, op)(r, ("a", "b", 0), ddof=1), axis_name="b",
                     out_axes=None)
    got = jax.vmap(inner, axis_name="a", out_axes=None)(x)
    assert_close(got, getattr(np, op)(np.float64(x), ddof=1))


@pytest.mark.parametrize("name,shape,resources", PLACEMENTS, ids=IDS)
def test_every_placement_matches_numpy_with_gradients(name, shape, resources):
    x = _data((8, 4, 3), seed=1)          # [a, b, 3]
    w = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)

    def body(v):   # per b: var over a and the last dim; std over a only
        return nx.var(v, ("a", 0), ddof=1), nx.std(v, "a")

    def loss(f):
        return lambda v: jnp.sum(f(v)[0] * w[:, 0]) + jnp.sum(f(v)[1] * w)

    def positional(v):
        return jnp.var(v, (0, 2), ddof=1), jnp.std(v, 0)

    with jax.set_mesh(_mesh(shape)):
        f = nx.xmap(body, [["a", "b", ...]], (["b"], ["b", ...]), axis_resources=resources)
        got = f(x)
        got_grad = jax.grad(loss(f))(x)
    assert_close(got[0], np.var(np.float64(x), (0, 2), ddof=1))
    assert_close(got[1], np.std(np.float64(x), 0))
    assert_close(got_grad, jax.grad(loss(positional))(x), scale=10)


@pytest.mark.parametrize("name,shape,resources", PLACEMENTS[:3], ids=IDS[:3])
def test_grad_inside_the_body_is_the_same_under_every_placement(name, shape, resources):
    # The named sums transpose like lax.psum (docs/xmap.md): the reference is
    # jax.grad inside jax.vmap of the same two-pass formula written with lax.psum.
    x = _data((8, 4), seed=3)

    def reference(v):
        mean = jax.lax.psum(v, "a") / 8
        return jax.lax.psum((v - mean) ** 2, "a") / 7

    with jax.set_mesh(_mesh(shape)):
        got = nx.xmap(lambda v: jax.grad(lambda u: jnp.sum(nx.var(u, "a", ddof=1)))(v),
                      [["a", ...]], ["a", ...], axis_resources=resources)(x)
    want = jax.vmap(jax.grad(lambda u: jnp.sum(reference(u))), axis_name="a")(x)
    assert_close(got, want, scale=10)


def test_bad_ddof_is_an_nxops_error():
    with pytest.raises(nx.NxopsError, match="ddof='1'"):
        nx.var(jnp.ones(3), 0, ddof="1")
