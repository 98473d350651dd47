"""nx.pmax / nx.pmin over mesh axes: one collective per call (as lax.pmax in a
shard_map twin), with NaN propagating, signed zeros, infinities and every
float and integer dtype ordered exactly as jnp.max / jnp.min along the axis,
on every placement; their gradients are jnp.max's."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import nxops as nx

PLACEMENTS = [("none", {}), ("mesh_y", {"b": "y"}), ("mesh_xy", {"b": ("x", "y")}),
              ("mesh_x_and_tile", {"b": "x"})]   # on a (2, 4) mesh ('x', 'y'); 'b' has size 8
SPECIAL = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.5, -1.5, 1e-40, -1e-40,
                    3.0, -65504.0])
FLOATS = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64, jnp.float8_e4m3fn]
INTS = [jnp.int32, jnp.int8, jnp.uint32, jnp.int64]
OPS = {"pmax": (nx.pmax, np.max), "pmin": (nx.pmin, np.min)}


def _draw(dtype, rng, with_nan: bool) -> np.ndarray:
    if jnp.issubdtype(dtype, jnp.floating):
        values = rng.choice(SPECIAL, size=(8, 6))
        return values if with_nan else np.where(np.isnan(values), 2.0, values)
    info = jnp.iinfo(dtype)
    return rng.integers(info.min, info.max, size=(8, 6), endpoint=True)


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal, NaN where NaN, and zeros of the same sign."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    return (np.array_equal(got, want, equal_nan=True)
            and np.array_equal(np.signbit(got) | np.isnan(got), np.signbit(want) | np.isnan(want)))


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("op", OPS)
def test_extrema_over_mesh_axes_order_values_like_jnp_on_every_placement(op, dtype):
    named, reference = OPS[op]
    rng = np.random.default_rng(0)
    with jax.enable_x64(jnp.dtype(dtype).itemsize == 8):
        for with_nan in (True, False):
            x = jnp.asarray(_draw(dtype, rng, with_nan)).astype(dtype)
            want = reference(np.asarray(x.astype(jnp.float64 if jnp.issubdtype(dtype, jnp.floating)
                                                 else dtype)), axis=0)
            with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
                for name, resources in PLACEMENTS:
                    f = nx.xmap(lambda v: named(v, "b"), [["b", ...]], [...],
                                axis_resources=resources)
                    got = f(x)
                    assert got.dtype == x.dtype, (name, got.dtype)
                    assert _same(np.asarray(got), want), (name, with_nan, np.asarray(got), want)


def _all_reduces(compiled) -> int:
    return len(re.findall(r"\ball-reduce(?:-start)?\(", compiled.as_text()))


def _softmax_body(extremum, name):
    """A softmax stabilised by the global max (min) of the logits, as GPT-J's
    loss is: the extremum under stop_gradient, then a sum of exponentials."""
    def body(x):
        m = extremum(lax.stop_gradient(x.max(-1, keepdims=True)), name)
        return jnp.sum(jnp.exp(x - m))
    return body


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("transform", ["forward", "value_and_grad"])
def test_one_all_reduce_per_extremum_as_in_the_shard_map_twin(op, dtype, transform):
    named = OPS[op][0]
    twin_op = lax.pmax if op == "pmax" else lax.pmin
    if jnp.issubdtype(dtype, jnp.integer):   # no gradient: the extremum alone
        body_nx, body_lax = (lambda x: named(x, "shard").sum()), (lambda x: twin_op(x, "mp").sum())
        transform = "forward"
    else:
        body_nx, body_lax = _softmax_body(named, "shard"), _softmax_body(twin_op, "mp")
    wrap = ((lambda f: f) if transform == "forward" else
            lambda f: jax.value_and_grad(lambda v: f(v).astype(jnp.float32).sum()))
    mesh = jax.make_mesh((4,), ("mp",))
    x = (jnp.arange(4 * 16 * 8) % 7).reshape(4, 16, 8).astype(dtype)
    with jax.set_mesh(mesh):
        f = jax.jit(wrap(nx.xmap(body_nx, [["shard", ...]], ["shard"],
                                 axis_resources={"shard": "mp"})))
        twin = jax.jit(wrap(jax.shard_map(lambda v: body_lax(v[0])[None], mesh=mesh,
                                          in_specs=P("mp"), out_specs=P("mp"), check_vma=False)))
        placed = jax.device_put(x, NamedSharding(mesh, P("mp")))
        mine, theirs = f.lower(placed).compile(), twin.lower(placed).compile()
        assert _all_reduces(mine) == _all_reduces(theirs) >= 1
        for g, w in zip(jax.tree.leaves(f(placed)), jax.tree.leaves(twin(placed))):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                       rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6)


def _extremum_grad(op, resources, x):
    weights = jnp.asarray([1.0, 2.0, 3.0])
    f = nx.xmap(lambda v: OPS[op][0](v, "b"), [["b", ...]], [...], axis_resources=resources)
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        return np.asarray(jax.grad(lambda v: jnp.sum(f(v) * weights))(x))


# Three ties of the max in column 0 and of the min in column 1, at positions
# 0, 1 (one device's tile on mesh + tile placements) and 4 (another device's).
TIED = jnp.asarray([[5.0, -5.0, 0.5], [5.0, -5.0, 0.0], [1.0, 2.0, 0.0], [0.0, 1.0, 3.0],
                    [5.0, -5.0, 0.0], [2.0, 0.0, -1.0], [-1.0, 1.0, 0.0], [3.0, 2.0, 0.0]])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name,resources", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_gradient_of_an_extremum_is_jnps_on_every_placement(op, name, resources):
    """Ties share the gradient equally, as for jnp.max over the axis: also
    where the name is on mesh axes and a vmap tile, which reduce in two
    stages (the tile, then the devices); the devices' shares are in
    proportion to their tiles' ties."""
    jnp_op = jnp.max if op == "pmax" else jnp.min
    want = jax.grad(lambda v: jnp.sum(jnp_op(v, axis=0) * jnp.asarray([1.0, 2.0, 3.0])))(TIED)
    np.testing.assert_allclose(_extremum_grad(op, resources, TIED), np.asarray(want), rtol=1e-6)


@pytest.mark.parametrize("op", OPS)
def test_gradient_through_a_nan_extremum_is_the_same_on_every_placement(op):
    x = TIED.at[0, 2].set(jnp.nan)
    grads = {name: _extremum_grad(op, resources, x) for name, resources in PLACEMENTS}
    for name, grad in grads.items():
        np.testing.assert_array_equal(grad, grads["none"], err_msg=name)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("name,resources", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_gradient_of_an_extremum_over_a_name_and_a_dim_is_jnps(op, name, resources):
    """Over a positional dim too: ties within a position and across devices
    share the gradient equally."""
    x = jnp.stack([TIED, TIED[::-1] * 0.5], axis=-1)          # [8, 3, 2]: ties in dim 1 too
    named = nx.max if op == "max" else nx.min
    jnp_op = jnp.max if op == "max" else jnp.min
    weights = jnp.asarray([1.0, 2.0, 3.0])
    f = nx.xmap(lambda v: named(v, ("b", 1)), [["b", ...]], [...], axis_resources=resources)
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        got = jax.grad(lambda v: jnp.sum(f(v) * weights))(x)
    want = jax.grad(lambda v: jnp.sum(jnp_op(v, axis=(0, 2)) * weights))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
