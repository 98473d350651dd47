"""``nx.xmap`` traces the user's Python body once per ``lower``, whatever the
placement (no resources, mesh axes, mesh axes with f/g custom rules, serial
loops, mixtures of mesh axes, loops and vmap levels; a body closing over
arrays made under an Explicit mesh), and a second call that
jit has cached traces nothing. Every later pass (the variance walk, the typed
custom rules, the loop step) reads the body's jaxpr instead of calling it.
The counted programs are also checked against the positional program, so a
count of one cannot come from skipping the body."""
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import nxops as nx
from tests._megatron import fg_operators

B, S = 4, 4   # sizes of the names 'b' (batch) and 's' (model shard)

PLACEMENTS = [   # (id, axis_resources) on a (2, 4) mesh ('x', 'y')
    ("none", {}),
    ("s_mesh", {"s": "y"}),
    ("both_mesh", {"b": "x", "s": "y"}),
    ("s_part_of_mesh", {"s": "x"}),                  # mesh axis of 2, vmap tile of 2
    ("b_loop", {"b": nx.SerialLoop(4)}),
    ("b_mesh_and_loop", {"b": ("x", nx.SerialLoop(2))}),
    ("s_mesh_b_loop", {"b": nx.SerialLoop(2), "s": "y"}),
    ("b_mesh_and_loop_s_mesh", {"b": ("x", nx.SerialLoop(2)), "s": "y"}),
]


def _counted(body):
    calls = []

    def counted(*args):
        calls.append(1)
        return body(*args)
    return counted, calls


def _plain(x, w1, w2):
    h = jax.nn.gelu(x @ w1)
    return nx.psum(h @ w2, "s")


def _fg(x, w1, w2):
    f, g = fg_operators(nx.psum, "s")
    return g(jax.nn.gelu(f(x) @ w1) @ w2)


def _positional(x, w1, w2):
    h = jax.nn.gelu(jnp.einsum("btd,sdh->bsth", x, w1))
    return jnp.einsum("bsth,shd->btd", h, w2)


def _args():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((B, 8, 16)), jnp.float32),
            jnp.asarray(rng.standard_normal((S, 16, 12)) / 4, jnp.float32),
            jnp.asarray(rng.standard_normal((S, 12, 16)) / 4, jnp.float32))


IN_AXES = (["b", ...], ["s", ...], ["s", ...])


@pytest.mark.parametrize("body", [_plain, _fg], ids=["psum", "fg"])
@pytest.mark.parametrize("name,resources", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_body_traced_once_per_lower_and_not_on_a_cached_call(name, resources, body):
    args = _args()
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        counted, calls = _counted(body)
        nx.xmap(counted, IN_AXES, ["b", ...], axis_resources=resources).lower(*args)
        assert len(calls) == 1, f"traced {len(calls)} times by one lower"
        counted, calls = _counted(body)   # a new function: nothing cached
        f = nx.xmap(counted, IN_AXES, ["b", ...], axis_resources=resources)
        got = f(*args)
        assert len(calls) == 1, f"traced {len(calls)} times by the first call"
        calls.clear()
        again = f(*args)
        assert len(calls) == 0, f"a cached call traced {len(calls)} times"
    want = _positional(*args)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(got))


@pytest.mark.parametrize("name,resources", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_body_traced_once_under_grad_outside_the_xmap(name, resources):
    """jax.grad of the xmap (f/g custom rules, whose bwd is typed on mesh
    axes) still traces the body once per lower."""
    counted, calls = _counted(_fg)
    f = nx.xmap(counted, IN_AXES, ["b", ...], axis_resources=resources)
    loss = jax.jit(jax.grad(lambda x, w1, w2: jnp.sum(f(x, w1, w2) ** 2), argnums=(1, 2)))
    args = _args()
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        got = loss(*args)
    assert len(calls) == 1, f"traced {len(calls)} times"
    want = jax.grad(lambda x, w1, w2: jnp.sum(_positional(x, w1, w2) ** 2), argnums=(1, 2))(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-4)


def test_body_traced_once_under_jax_vmap_of_the_xmap():
    """A jax.vmap around an xmap over mesh axes and a loop: one trace."""
    counted, calls = _counted(_plain)
    f = nx.xmap(counted, IN_AXES, ["b", ...],
                axis_resources={"b": nx.SerialLoop(2), "s": "y"})
    args = _args()
    stacked = [jnp.stack([a, 2 * a]) for a in args]
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        got = jax.jit(jax.vmap(f))(*stacked)
    assert len(calls) == 1, f"traced {len(calls)} times"
    want = jax.vmap(_positional)(*stacked)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)


BODY_ONLY_NAME = [   # placements of a name 'n' that only axis_sizes gives
    ("none", {}),
    ("s_mesh", {"s": "y"}),
    ("n_mesh", {"n": "x", "s": "y"}),
    ("n_mesh_b_loop", {"b": nx.SerialLoop(2), "n": "x", "s": "y"}),
]


@pytest.mark.parametrize("name,resources", BODY_ONLY_NAME, ids=[p[0] for p in BODY_ONLY_NAME])
def test_body_traced_once_with_a_name_only_axis_sizes_gives(name, resources):
    """A name that no in_axes or out_axes names must be used by the body (else
    it is likely misspelled): the named ops of the program's one trace tell."""
    counted, calls = _counted(lambda x, w1, w2: nx.psum(_plain(x, w1, w2), "n") / 2)
    f = nx.xmap(counted, IN_AXES, ["b", ...], axis_sizes={"n": 2}, axis_resources=resources)
    args = _args()
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        got = f(*args)
    assert len(calls) == 1, f"traced {len(calls)} times"
    np.testing.assert_allclose(np.asarray(got), _positional(*args), rtol=2e-5, atol=2e-5)


EXPLICIT_PLACEMENTS = [   # (id, axis_resources) on a (2, 4) mesh of Explicit axes
    ("b_mesh", {"b": "x"}),
    ("s_mesh", {"s": "y"}),
    ("b_mesh_and_loop", {"b": ("y", nx.SerialLoop(2))}),
    ("b_loop_s_mesh", {"b": nx.SerialLoop(2), "s": "x"}),
    ("b_mesh_and_loop_s_loop", {"b": ("x", nx.SerialLoop(2)), "s": nx.SerialLoop(2)}),
]


@pytest.mark.parametrize("name,resources", EXPLICIT_PLACEMENTS,
                         ids=[p[0] for p in EXPLICIT_PLACEMENTS])
def test_body_closing_over_arrays_made_under_an_explicit_mesh_traced_once(name, resources):
    """A PRNG key and a scale made under a mesh of Explicit axes and closed
    over by the body, which JAX refuses to mix with the body's partly Manual
    mesh inside the shard_map: xmap types them on the body's mesh as its one
    trace meets them, so the body is traced once, with the positional values."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((16, S)), jnp.float32)
    with jax.set_mesh(mesh):
        key, scale = jax.random.key(7), jnp.float32(3.0)

        def body(v):
            noise = jax.random.uniform(jax.random.fold_in(key, nx.axis_index("b")), v.shape)
            return lax.mul(v, scale) + noise

        counted, calls = _counted(body)
        f = nx.xmap(counted, [["b", "s"]], ["b", "s"], axis_resources=resources)
        f.lower(x)
        assert len(calls) == 1, f"traced {len(calls)} times by one lower"
        got = f(x)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(16))
    noise = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys)   # one value per position of 'b'
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) * 3 + np.asarray(noise)[:, None],
                               rtol=1e-6, atol=1e-6)
