"""Issue 27's fuzzing defects, in general: named collectives, integer sums,
nx.var/std with any ddof and nx.random under x64, each on every placement
(none, whole mesh in and out of mesh order, part of a mesh, SerialLoop,
mixed) against the positional program (``jax.vmap`` with ``axis_name``) or
jnp. The t04-t10 repro files are the exact cases; these are the families."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

import nxops as nx

# 'a' has 8 positions, 'b' 4; the mesh is ('x': 4, 'y': 2).
PLACEMENTS = [
    ("none", {}),
    ("mesh_xy", {"a": ("x", "y")}),
    ("mesh_yx", {"a": ("y", "x")}),            # mesh axes out of mesh order (t04)
    ("part_x", {"a": "x"}),                    # 4 devices x a local tile of 2
    ("part_y", {"a": "y"}),
    ("loop_b", {"a": ("y", "x"), "b": nx.SerialLoop(2)}),
    ("mixed", {"a": "y", "b": "x"}),
]
IDS = [p[0] for p in PLACEMENTS]
AB = ["a", "b", ...]


def _run(body, resources, x, *, in_axes=AB, out_axes=AB, **kw):
    with jax.set_mesh(jax.make_mesh((4, 2), ("x", "y"))):
        return nx.xmap(body, [in_axes], out_axes, axis_resources=resources, **kw)(x)


def _positional(body, *args):
    """The body as JAX runs it: vmapped over 'b', then 'a', with axis names."""
    return jax.vmap(jax.vmap(body, axis_name="b"), axis_name="a")(*args)


@st.composite
def partial_perms(draw, size=8):
    """(source, destination) pairs: a partial permutation of ``size`` positions."""
    sources = draw(st.lists(st.integers(0, size - 1), unique=True, max_size=size))
    destinations = draw(st.permutations(range(size)))
    return [(s, d) for s, d in zip(sources, destinations)]


@pytest.mark.parametrize("name,resources", PLACEMENTS, ids=IDS)
@settings(max_examples=4, deadline=None)
@given(perm=partial_perms())
def test_ppermute_sends_to_the_positions_of_the_perm(name, resources, perm):
    x = jnp.arange(8 * 4 * 3, dtype=jnp.float32).reshape(8, 4, 3) + 1
    got = _run(lambda v: nx.ppermute(v, "a", perm), resources, x)
    want = np.zeros_like(x)
    for src, dst in perm:
        want[dst] = x[src]
    np.testing.assert_array_equal(got, want)


COLLECTIVES = {   # name: (nxops body, the same with lax collectives)
    "axis_index": (lambda v: v * 0 + nx.axis_index("a"),
                   lambda v: v * 0 + lax.axis_index("a")),
    "all_gather": (lambda v: nx.all_gather(v, "a", axis=1) + v[:, None],
                   lambda v: lax.all_gather(v, "a", axis=1) + v[:, None]),
    "psum_scatter": (lambda v: nx.psum_scatter(jnp.tile(v, 8), "a", scatter_dimension=0,
                                               tiled=True),
                     lambda v: lax.psum_scatter(jnp.tile(v, 8), "a", scatter_dimension=0,
                                                tiled=True)),
    "all_to_all": (lambda v: nx.all_to_all(jnp.tile(v, 8), "a", 0, 0, tiled=True),
                   lambda v: lax.all_to_all(jnp.tile(v, 8), "a", 0, 0, tiled=True)),
    "psum": (lambda v: nx.psum(v, "a") + v, lambda v: lax.psum(v, "a") + v),
    "pmax": (lambda v: nx.pmax(v, "a") - v, lambda v: lax.pmax(v, "a") - v),
}
# Collectives over 'a' and 'b' together go through the same code; over a looped
# name they are refused, so 'loop_b' (b looped) reduces over 'a' only.


@pytest.mark.parametrize("op", COLLECTIVES)
@pytest.mark.parametrize("name,resources", PLACEMENTS, ids=IDS)
def test_collectives_over_a_match_the_positional_program(op, name, resources):
    named, reference = COLLECTIVES[op]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4, 3)), jnp.float32)
    np.testing.assert_allclose(_run(named, resources, x), _positional(reference, x),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("key", [("a", "b"), ("b", "a")], ids=str)
@pytest.mark.parametrize("name,resources", PLACEMENTS, ids=IDS)
def test_tile_over_a_tuple_of_names_inverts_untile(name, resources, key):
    w = jnp.arange(32 * 3, dtype=jnp.float32).reshape(32, 3)
    tiled = _run(lambda w: nx.tile(w, {key: 0}), resources, w, in_axes=[...],
                 axis_sizes={"a": 8, "b": 4})
    # Position (i, j) holds tile i*4 + j for ('a', 'b'), j*8 + i for ('b', 'a').
    order = np.arange(32).reshape(8, 4) if key == ("a", "b") else np.arange(32).reshape(4, 8).T
    np.testing.assert_array_equal(tiled[:, :, 0], np.asarray(w)[order])
    if name != "loop_b":   # (untile gathers: refused over a looped name)
        back = _run(lambda t: nx.untile(t, {key: 0}), resources, tiled, out_axes=[...])
        np.testing.assert_array_equal(back, w)


SMALL_INTS = [np.int8, np.uint8, np.int16, np.uint16, np.bool_, np.int32]


@pytest.mark.parametrize("name,resources", PLACEMENTS, ids=IDS)
@settings(max_examples=6, deadline=None)
@given(dtype=st.sampled_from(SMALL_INTS), op=st.sampled_from(["sum", "psum", "prod", "mixed"]),
       seed=st.integers(0, 2**16))
def test_integer_sums_promote_like_jnp_on_every_placement(name, resources, dtype, op, seed):
    x = np.random.default_rng(seed).integers(0, 120, (8, 4, 3)).astype(dtype)
    named = {"sum": lambda v: nx.sum(v, "a"), "psum": lambda v: nx.psum(v, ("a",)),
             "prod": lambda v: nx.prod(v, "a"), "mixed": lambda v: nx.sum(v, ("a", 0))}[op]
    positional = {"sum": lambda v: jnp.sum(v, 0), "psum": lambda v: jnp.sum(v, 0),
                  "prod": lambda v: jnp.prod(v, 0), "mixed": lambda v: jnp.sum(v, (0, 1))}[op]
    got = _run(named, resources, x, out_axes=["b", ...])
    want = jax.vmap(positional, in_axes=1)(x)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name,resources", [PLACEMENTS[0], PLACEMENTS[2]], ids=IDS[:3:2])
def test_integer_sums_promote_to_64_bits_under_x64(name, resources):
    with jax.enable_x64(True):
        x = np.full((8, 4, 3), 100, np.int8)
        got = _run(lambda v: nx.sum(v, "a"), resources, x, out_axes=["b", ...])
        assert got.dtype == jnp.sum(x, 0).dtype == np.int64
        np.testing.assert_array_equal(got, np.full((4, 3), 800))


@pytest.mark.parametrize("name,resources", PLACEMENTS, ids=IDS)
@settings(max_examples=5, deadline=None)
@given(ddof=st.sampled_from([0, 1, 7, 8, 9, 23, 24, 30]), op=st.sampled_from(["var", "std"]),
       mixed=st.booleans())
def test_var_and_std_follow_jnp_for_every_ddof(name, resources, ddof, op, mixed):
    # N is 8 over 'a', 24 over ('a', 0): ddof >= N gives nan, as in jnp.
    x = jnp.asarray(np.random.default_rng(ddof).normal(size=(8, 4, 3)), jnp.float32)
    got = _run(lambda v: getattr(nx, op)(v, ("a", 0) if mixed else "a", ddof=ddof), resources,
               x, out_axes=["b", ...])
    want = jax.vmap(lambda v: getattr(jnp, op)(v, (0, 1) if mixed else 0, ddof=ddof),
                    in_axes=1)(x)
    np.testing.assert_allclose(got, want, rtol=2e-5, equal_nan=True)


SAMPLERS = {
    "normal": (lambda k: nx.random.normal(k, (3,)), lambda k: jax.random.normal(k, (3,))),
    "uniform": (lambda k: nx.random.uniform(k, (3,)), lambda k: jax.random.uniform(k, (3,))),
    "bits": (lambda k: nx.random.bits(k, (3,)), lambda k: jax.random.bits(k, (3,))),
}


RANDOM_CASES = [("normal", True, PLACEMENTS[0]), ("normal", True, PLACEMENTS[2]),
                ("normal", True, PLACEMENTS[5]), ("uniform", True, PLACEMENTS[6]),
                ("bits", True, PLACEMENTS[0]), ("normal", False, PLACEMENTS[2])]


@pytest.mark.parametrize("sampler,x64,placement", RANDOM_CASES,
                         ids=[f"{s}-{'x64' if x else 'x32'}-{p[0]}" for s, x, p in RANDOM_CASES])
def test_random_defaults_follow_jax_random(sampler, x64, placement):
    named, reference = SAMPLERS[sampler]
    resources = placement[1]
    key = jax.random.key(11)
    with jax.enable_x64(x64):
        got = _run(lambda v: named(key), resources, jnp.zeros((8, 4)))
        want = _positional(lambda v: reference(
            jax.random.fold_in(jax.random.fold_in(key, lax.axis_index("a")),
                               lax.axis_index("b"))), jnp.zeros((8, 4)))
        assert got.dtype == want.dtype == reference(key).dtype
    np.testing.assert_array_equal(got, want)
