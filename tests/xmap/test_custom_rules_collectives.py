"""Custom rules over every named collective (docs/xmap.md, "Custom rules with
named collectives"): sequence-parallel gather/scatter pairs (all_gather one way,
psum_scatter the other), an all_to_all exchange, a hand-written ring step
(ppermute forward, the inverse ppermute backward) and untile/tile mean the same
on every placement. Gradients inside the body equal jax.vmap's of the same
body with lax collectives; gradients outside equal the no-resources program's,
which for the rules whose bwd is the collective's own transpose and whose
results vary along the name is jax.grad of the positional program."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nxops as nx
from tests._sequence_parallel import LAX, ring, sequence_parallel_operators

B, S = 2, 4   # sizes of 'b' (batch) and 's' (the sequence-parallel name)
RING = ring(S)


class _Nx:
    all_gather = staticmethod(nx.all_gather)
    psum_scatter = staticmethod(nx.psum_scatter)
    all_to_all = staticmethod(lambda x, name, split, concat, tiled: nx.all_to_all(
        x, name, split, concat, tiled=tiled))
    ppermute = staticmethod(nx.ppermute)
    untile = staticmethod(nx.untile)
    tile = staticmethod(nx.tile)
    axis_size = staticmethod(nx.axis_size)


def operators(c) -> dict:
    """The rules, written with the collectives of ``c`` (_Nx or LAX) over 's'."""
    return sequence_parallel_operators(c, "s")


OPS = list(operators(_Nx))
# Rules whose bwd is JAX's own transpose of the forward, with results that vary
# along 's': jax.grad of the positional program (no custom rule) is theirs.
TRANSPOSED = {"scatter": lambda x: lax.psum_scatter(x, "s", scatter_dimension=0, tiled=True),
              "all_to_all": lambda x: lax.all_to_all(x, "s", 0, 1, tiled=True),
              "ring": lambda x: lax.ppermute(x, "s", RING)}

PLACEMENTS = [   # on a (2, 4) mesh ('x', 'y')
    ("none", {}),
    ("s_mesh", {"s": "y"}),
    ("s_part_of_mesh", {"s": "x"}),                 # 2 devices and a vmap tile of 2
    ("both_mesh", {"b": "x", "s": "y"}),
    ("s_mesh_b_loop", {"b": nx.SerialLoop(2), "s": "y"}),
    ("b_loop", {"b": nx.SerialLoop(2)}),
    ("s_part_of_mesh_b_loop", {"b": nx.SerialLoop(2), "s": "x"}),
]


def _loss(op):
    def per_position(x, w):   # x [8, 4] (this position's), w [4] (replicated)
        y = op(jnp.tanh(x * w))
        return jnp.sum(jnp.sin(y) * jnp.linspace(0.5, 2.0, y.size).reshape(y.shape))
    return per_position


def _args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B, S, 8, 4)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(4), jnp.float32)
    c = jnp.asarray(rng.standard_normal((B, S)), jnp.float32)
    return x, w, c


def _positional(fun, in_axes, out_axes=0):
    """``fun`` under jax.vmap over 's' (inner) then 'b' (outer)."""
    over_s = jax.vmap(fun, in_axes=in_axes, out_axes=out_axes, axis_name="s")
    return jax.vmap(over_s, in_axes=in_axes, out_axes=out_axes, axis_name="b")


def _grads_outside(op_name, resources):
    x, w, c = _args()
    f = nx.xmap(_loss(operators(_Nx)[op_name]), [["b", "s", ...], [...]], ["b", "s"],
                axis_resources=resources)
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        return jax.grad(lambda x, w: jnp.sum(f(x, w) * c), argnums=(0, 1))(x, w)


@pytest.mark.parametrize("op_name", OPS)
@pytest.mark.parametrize("name,resources", PLACEMENTS[1:], ids=[p[0] for p in PLACEMENTS[1:]])
def test_gradient_outside_is_the_no_resources_one_on_every_placement(op_name, name, resources):
    want = _grads_outside(op_name, {})
    got = _grads_outside(op_name, resources)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op_name", sorted(TRANSPOSED))
def test_no_resources_gradient_outside_is_the_positional_programs(op_name):
    """The anchor of the test above: where the rule's bwd is the transpose JAX
    would take, the no-resources gradient is jax.grad of the plain program."""
    x, w, c = _args()
    plain = _positional(_loss(TRANSPOSED[op_name]), (0, None))
    want = jax.grad(lambda x, w: jnp.sum(plain(x, w) * c), argnums=(0, 1))(x, w)
    for g, r in zip(_grads_outside(op_name, {}), want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_no_resources_gather_gradient_outside_sums_a_whole_cotangent():
    """The gather's result does not vary along 's': its bwd gets the whole
    cotangent (docs/xmap.md), and psum_scatter sums it over the S positions."""
    x, w, c = _args()
    plain = _positional(_loss(lambda v: lax.all_gather(v, "s", axis=0, tiled=True)), (0, None))
    summed_c = jnp.broadcast_to(c.sum(1, keepdims=True), c.shape)   # the whole cotangent
    want = jax.grad(lambda x: jnp.sum(plain(x, w) * summed_c))(x)
    np.testing.assert_allclose(np.asarray(_grads_outside("gather", {})[0]), np.asarray(want),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op_name", OPS)
@pytest.mark.parametrize("name,resources", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_gradient_inside_the_body_is_jax_vmaps_on_every_placement(op_name, name, resources):
    x, w, _ = _args()

    def body(c):
        loss = _loss(operators(c)[op_name])
        return lambda x, w: jax.grad(loss, argnums=(0, 1))(x, w)

    want = _positional(body(LAX), (0, None))(x, w)
    f = nx.xmap(body(_Nx), [["b", "s", ...], [...]], (["b", "s", ...], ["b", "s", ...]),
                axis_resources=resources)
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        got = f(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)
