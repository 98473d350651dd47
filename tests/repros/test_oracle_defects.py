"""Regression tests of the defects the composed oracle found (o01-o10):
each is a small positional program with nxops, read with np.asarray, checked
against NumPy or the positional JAX program (jax.vmap with axis_name)."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nxops as nx


def _mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])


# --- o01: a result of per-position size 0 on a mesh ----------------------------


@pytest.mark.parametrize("with_data", [False, True])
def test_o01_result_of_per_position_size_0_on_a_mesh_reads(with_data):
    """PJRT hands back each shard of a zero-size result sharded over the mesh
    with the global shape ("could not broadcast (8,0) into (1,0)" on read, when
    no result holds data): nxops makes zero-size results outside its shard_map."""
    x = jnp.zeros((8, 0), jnp.float32)
    w = jnp.arange(3, dtype=jnp.float32)
    if with_data:
        body = lambda v, w: (v * 2, v.sum() + w)  # (0,) and (3,) per position
        out_axes = [["a", ...], ["a", ...]]
    else:
        body = lambda v, w: v
        out_axes = ["a", ...]
    want = jax.vmap(body, in_axes=(0, None), axis_name="a")(x, w)
    f = nx.xmap(body, [["a", ...], [...]], out_axes, axis_resources={"a": "x"})
    with jax.set_mesh(_mesh((8,), ("x",))):
        got = jax.tree.leaves(f(x, w)) + jax.tree.leaves(jax.jit(f)(x, w))
        grad = jax.grad(lambda w: jax.tree.leaves(f(x, w))[-1].sum())(w)
    for g, wanted in zip(got, jax.tree.leaves(want) * 2):
        assert np.asarray(g).shape == wanted.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(wanted))
    reference = jax.vmap(body, in_axes=(0, None), axis_name="a")
    want_grad = jax.grad(lambda w: jax.tree.leaves(reference(x, w))[-1].sum())(w)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(want_grad))


# --- o02: ppermute over a size-0 name on a mesh ---------------------------------


@pytest.mark.parametrize("perm", ["cycle", "partial"])
def test_o02_ppermute_over_a_size_0_name_on_a_mesh(perm):
    """No positions: nothing to send (the source table had no entry to index)."""
    def pairs(n):
        if perm == "cycle":
            return [(i, (i + 1) % n) for i in range(n)]
        return [(s, d) for s, d in [(0, 1), (1, 2), (5, 3)] if s < n and d < n]

    x = jnp.ones((0, 4), jnp.float32)
    body = lambda v: nx.ppermute(v, "a", pairs(nx.axis_size("a"))) + v
    want = jax.vmap(lambda v: lax.ppermute(v, "a", pairs(0)) + v, axis_name="a")(x)
    f = nx.xmap(body, [["a", ...]], ["a", ...], axis_resources={"a": "x"})
    with jax.set_mesh(_mesh((8,), ("x",))):
        got = np.asarray(f(x))
        grad = np.asarray(jax.grad(lambda x: f(x).sum())(x))
    assert got.shape == want.shape == grad.shape == (0, 4)


# --- o04: a nested xmap whose inner name is on a mesh axis ----------------------


def _nested(outer_resources, inner_resources, close_over: bool):
    def body(v, w):
        pair = jnp.stack([v, v[::-1]])
        if close_over:
            inner = nx.xmap(lambda u: jnp.sin(u) * v + nx.sum(u, "m") * w, [["m", ...]],
                            ["m", ...], axis_resources=inner_resources)
            out = inner(pair)
        else:
            inner = nx.xmap(lambda u, v, w: jnp.sin(u) * v + nx.sum(u, "m") * w,
                            [["m", ...], [...], [...]], ["m", ...], axis_resources=inner_resources)
            out = inner(pair, v, w)
        return out[0] + out[1]     # slices the inner name's dim
    return nx.xmap(body, [["a", ...], [...]], ["a", ...], axis_resources=outer_resources)


def _nested_reference(x, w):
    def body(v, w):
        pair = jnp.stack([v, v[::-1]])
        out = jax.vmap(lambda u: jnp.sin(u) * v + lax.psum(u, "m") * w, axis_name="m")(pair)
        return out[0] + out[1]
    return jax.vmap(body, in_axes=(0, None), axis_name="a")(x, w)


@pytest.mark.parametrize("outer", [{"a": "y"}, {}])
def test_o04_nested_xmap_on_a_mesh_axis_result_is_a_value(outer):
    """The nested result was typed sharded over the inner's (Explicit) mesh axis,
    so slicing its named dim raised ShardingTypeError: it is typed replicated."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(size=(8, 4)), jnp.float32)
    w = jnp.asarray(rng.uniform(size=(4,)), jnp.float32)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) ** 2)
    want = _nested_reference(x, w)
    want_grads = jax.grad(loss(_nested_reference), (0, 1))(x, w)
    f = _nested(outer, {"m": "x"}, close_over=False)
    with jax.set_mesh(_mesh((2, 4), ("x", "y"))):
        got = f(x, w)
        grads = jax.grad(loss(f), (0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    for g, wanted in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(wanted), rtol=1e-5, atol=1e-5)


def test_o04_nested_xmap_closing_over_an_outer_value_is_refused_clearly():
    """JAX cannot close over a value of the enclosing shard_map region (typed on
    its Explicit axes) inside the nested shard_map: an NxopsError saying to pass
    it as an argument, not JAX's NotImplementedError. Without the mesh the same
    program runs, and equals the reference."""
    x = jnp.ones((8, 4), jnp.float32)
    w = jnp.ones((4,), jnp.float32)
    np.testing.assert_allclose(np.asarray(_nested({}, {}, close_over=True)(x, w)),
                               np.asarray(_nested_reference(x, w)), rtol=1e-6)
    f = _nested({"a": "y"}, {"m": "x"}, close_over=True)
    with jax.set_mesh(_mesh((2, 4), ("x", "y"))):
        with pytest.raises(nx.NxopsError, match="closes over a value of the enclosing body.*"
                                                "as an argument"):
            np.asarray(f(x, w))


# --- o03: grad outside of a contraction over a size-0 name on a mesh ------------

_WRAPPERS = {
    "map": lambda g, v: lax.map(g, jnp.stack([v, v[::-1]])).sum(0),
    "cond": lambda g, v: lax.cond(nx.psum(jnp.int32(1), "a") >= 0, g, lambda u: u[::-1], v),
    "switch": lambda g, v: lax.switch(nx.psum(jnp.int32(1), "a") % 2, [g, lambda u: u[::-1]], v),
    "fori": lambda g, v: lax.fori_loop(0, 2, lambda i, c: g(c), v),
    "scan": lambda g, v: lax.scan(lambda c, _: (g(c), None), v, None, length=2)[0],
    "linear_solve": lambda g, v: lax.custom_linear_solve(
        lambda t: 2 * t, g(v), lambda matvec, rhs: rhs / 2, symmetric=True),
}


@pytest.mark.parametrize("wrapper", sorted(_WRAPPERS))
def test_o03_grad_outside_of_a_contraction_over_a_size_0_name_on_a_mesh(wrapper):
    """Before main's 2adec19, zero-size inputs were passed to the shard_map, and
    Shardy rejected the backward manual computation ("expected at least one
    operand ... produced by a xla.sdy.GlobalToLocalShape"). Now they are made
    inside its body: the gradient (of shape (0, 4)) reads."""
    x = jnp.ones((0, 4), jnp.float32)
    y = jnp.ones((0, 4), jnp.float32)
    contractions = [lambda u, y: u * nx.einsum("<a>i,<a>i->", u, y),
                    lambda u, y: u * nx.pdot(u, y, "a", pos_contract=((0,), (0,)))]
    with jax.set_mesh(_mesh((8,), ("x",))):
        for contraction in contractions:
            body = lambda v, y: _WRAPPERS[wrapper](lambda u: contraction(u, y), v)
            f = nx.xmap(body, [["a", ...], ["a", ...]], ["a", ...], axis_resources={"a": "x"})
            grad = jax.jit(jax.grad(lambda x: jnp.sum(f(x, y))))(x)
            assert np.asarray(grad).shape == (0, 4)


# --- o05: bool psum_scatter inside checkpoint(cond per position), no resources ---


def test_o05_bool_psum_scatter_in_checkpointed_per_position_cond():
    """Before main's 2adec19 the vmapped psum_scatter of bool was typed bool but
    lowered to int32 (the sum's dtype), and the `%` after it (a jitted jnp
    function, lowered for bool) failed the verifier ("func.call operand type
    mismatch: tensor<8x4xi1> vs tensor<8x4xi32>"). Checked against NumPy (JAX's
    own lax.psum_scatter refuses bool)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2, (8, 4)).astype(bool)
    y = rng.integers(0, 2, (8, 4)).astype(bool)

    def scatter(v, y):
        return nx.psum_scatter(nx.all_gather(v, "a") * y, "a", tiled=True)[0] % 2 == 1

    def body(v, y):
        return jax.checkpoint(lambda v, y: lax.cond(
            nx.axis_index("a") % 2 == 0, lambda u: scatter(u, y), lambda u: u[::-1], v))(v, y)

    got = np.asarray(nx.xmap(body, [["a", ...], ["a", ...]], ["a", ...])(x, y))
    # position i's tile of sum_p all_gather(x)[j] & y[p]: x[i] * (number of y[p] set)
    scattered = (x * y.sum(0)) % 2 == 1
    want = np.where((np.arange(8) % 2 == 0)[:, None], scattered, x[:, ::-1])
    np.testing.assert_array_equal(got, want)


# --- o06 (found here, in the composed oracle's n=8 group): a 16-bit replicated
# input differentiated on part of a mesh --------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_o06_grad_of_a_16_bit_replicated_input_on_part_of_a_mesh(dtype):
    """shard_map's transpose sums a replicated input's cotangent over the mesh
    axes, and XLA:CPU aborted the process compiling that bf16/f16 all-reduce
    over part of a mesh ("Invalid binary instruction opcode copy"; a plain
    shard_map aborts too): such inputs now enter the shard_map as f32."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(size=(8, 4)), dtype)
    w = jnp.asarray(rng.uniform(size=(32,)), dtype)
    body = lambda v, w: v * nx.tile(w, {"a": 0}) + w[:4]
    loss = lambda f: lambda x, w: jnp.sum(f(x, w).astype(jnp.float32))
    reference = jax.vmap(lambda v, w: v * w.reshape(8, 4)[lax.axis_index("a")] + w[:4],
                         in_axes=(0, None), axis_name="a")
    want = jax.grad(loss(reference), (0, 1))(x, w)
    f = nx.xmap(body, [["a", ...], [...]], ["a", ...], axis_resources={"a": "y"})
    with jax.set_mesh(_mesh((2, 4), ("x", "y"))):
        got = jax.jit(jax.grad(loss(f), (0, 1)))(x, w)
    for g, wanted in zip(got, want):
        assert g.dtype == dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(wanted, np.float32),
                                   rtol=2e-2, atol=2e-2)


# --- o07 (found here, in the composed oracle's n=8 group): a per-position
# cond/switch around a collective, the name on mesh axes alone ------------------


@pytest.mark.parametrize("wrapper", ["cond", "switch"])
def test_o07_per_position_branch_around_a_collective_on_mesh_axes_alone(wrapper):
    """A name carried by mesh axes alone ran without a vmap level, so each
    device took its own branch and the collective in one branch deadlocked
    (XLA:CPU aborts after a 40 s rendezvous; a hang on GPU/TPU). Such a body
    keeps a vmap level: the index is batched and every branch runs (a select)."""
    x = jnp.arange(32, dtype=jnp.float32).reshape(8, 4)
    branches = [lambda u: nx.psum(u, "a"), lambda u: u * 2, lambda u: nx.pmax(u, "a") - u]

    def body(v):
        if wrapper == "cond":
            return lax.cond(nx.axis_index("a") % 2 == 0, branches[0], branches[1], v)
        return lax.switch(nx.axis_index("a") % 3, branches, v)

    want = np.asarray(nx.xmap(body, [["a", ...]], ["a", ...])(x))
    reference = [np.where(np.arange(8)[:, None] % 2 == 0, x.sum(0), 2 * x),
                 np.stack([[x.sum(0), 2 * x[i], x.max(0) - x[i]][i % 3] for i in range(8)])]
    np.testing.assert_allclose(want, reference[wrapper == "switch"])
    for shape, names, resource in [((8,), ("x",), "x"), ((2, 4), ("x", "y"), ("x", "y"))]:
        with jax.set_mesh(_mesh(shape, names)):
            f = nx.xmap(body, [["a", ...]], ["a", ...], axis_resources={"a": resource})
            np.testing.assert_allclose(np.asarray(f(x)), want)
            grad = jax.grad(lambda x: jnp.sum(f(x) ** 2))(x)
        np.testing.assert_allclose(
            np.asarray(grad),
            np.asarray(jax.grad(lambda x: jnp.sum(nx.xmap(body, [["a", ...]], ["a", ...])(x) ** 2))(x)),
            rtol=1e-5)


# --- o10: the max/min tangent where the result has size 0 ---------------------


@pytest.mark.parametrize("op", ["pmax", "max"])
@pytest.mark.parametrize("resources", [{}, {"a": "x"}])
def test_o10_extremum_grad_inside_of_a_per_position_size_0_value(op, resources):
    """The tie-mask tangent reshaped to (-1, *result shape): -1 cannot be
    inferred when the result has size 0 (ZeroDivisionError, found by the
    composed oracle: checkpoint[pmax, all_to_all] at per-position size 0)."""
    reduce = (lambda u: nx.pmax(u, "a")) if op == "pmax" else (lambda u: nx.max(u, "a"))

    def body(v):
        return jax.grad(lambda v: jnp.sum(reduce(v) * 3.0))(v)
    x = jnp.zeros((8, 0), jnp.float32)
    with jax.set_mesh(_mesh((8,), ("x",))):
        got = np.asarray(nx.xmap(body, [["a", ...]], ["a", ...], axis_resources=resources)(x))
    assert got.shape == (8, 0) and got.dtype == np.float32


# --- z_gather: all_gather / untile over a size-0 name, grad inside the body --------


@pytest.mark.parametrize("op", ["all_gather", "untile", "gather_twice"])
@pytest.mark.parametrize("mesh_shape,resources", [((8,), {}), ((8,), {"a": "x"}),
                                                  ((2, 4), {"a": "x"})],
                         ids=["none", "mesh8", "part_of_mesh"])
def test_z_gather_grad_inside_over_a_size_0_name(op, mesh_shape, resources):
    """The layout primitive's transpose (a scatter) recovered the per-position
    size as gathered // size, which a size-0 name cannot give back
    (ZeroDivisionError; found by the composed oracle: cond[all_gather, untile],
    n=0). It now carries the size. No positions: an empty result per shape."""
    gathers = {"all_gather": lambda u: nx.all_gather(u, "a", axis=1),
               "untile": lambda u: nx.untile(u, {"a": 0}),
               "gather_twice": lambda u: nx.all_gather(nx.untile(u, {"a": 1}), "a")}

    def body(v):
        return jax.grad(lambda v: jnp.sum(jnp.sin(gathers[op](v))))(v)
    x = jnp.zeros((0, 3, 4), jnp.float32)
    with jax.set_mesh(_mesh(mesh_shape, ("x", "y")[:len(mesh_shape)])):
        f = nx.xmap(body, [["a", ...]], ["a", ...], axis_resources=resources)
        got = np.asarray(f(x))
        jitted = np.asarray(jax.jit(f)(x))
    assert got.shape == jitted.shape == (0, 3, 4) and got.dtype == np.float32


# --- o08, o09: named ops inside a jax.custom_jvp, grad outside or jvp ---------
# JAX traces the custom rule lazily, under the outer grad/jvp, after xmap's
# context is gone: the rule's ops find the names only from xmap's vmap levels.

_CUSTOM_JVP_PLACEMENTS = [(None, None), ((8,), {"a": "x"}), ((2, 4), {"a": ("x", "y")}),
                          ((4,), {"a": "x"})]   # (mesh shape, axis_resources); (4,): tile 2


def _as_custom_jvp(g):
    f = jax.custom_jvp(g)
    f.defjvp(lambda primals, tangents: jax.jvp(g, primals, tangents))
    return f


def _check_grad_outside_and_jvp(body, reference, args, mesh_shape, resources):
    """``body`` under nx.xmap (every arg and the result named 'a' on dim 0)
    against ``reference`` under jax.vmap(axis_name='a'): values, jax.grad of
    the sum (by the first arg) and jax.jvp."""
    specs = [["a", ...]] * len(args)
    loss = lambda f: lambda x, *rest: jnp.sum(jnp.sin(f(x, *rest)))
    tangents = tuple(jnp.cos(a) for a in args)
    ref = jax.vmap(reference, axis_name="a")
    want = [ref(*args), jax.grad(loss(ref))(*args), jax.jvp(ref, args, tangents)[1]]
    f = nx.xmap(body, specs, ["a", ...], axis_resources=resources or {})
    names = ("x", "y")[:len(mesh_shape)] if mesh_shape else None
    with jax.set_mesh(_mesh(mesh_shape, names)) if mesh_shape else contextlib.nullcontext():
        got = [np.asarray(f(*args)), np.asarray(jax.grad(loss(f))(*args)),
               np.asarray(jax.jvp(f, args, tangents)[1])]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh_shape,resources", _CUSTOM_JVP_PLACEMENTS)
def test_o09_custom_jvp_around_a_switch_whose_branch_asks_its_position(mesh_shape, resources):
    """The switch branch staged lax.axis_index into a jaxpr that JAX checked
    against an axis environment without xmap's names (NameError: unbound
    axis name 'a' / 'a#tile'); on mesh axes alone the name had no vmap level
    at all ("nx.psum: axis name 'a' is not bound here")."""
    x = (jnp.arange(16, dtype=jnp.float32).reshape(8, 2) + 1) / 8

    def branch(index, prod):
        return lambda u: u * prod(u * (index() != 0).astype(u.dtype)) + jnp.sin(u) * index()

    def program(index, prod, uniform_one):
        g = lambda v: lax.switch(uniform_one(), [lambda u: u[::-1], branch(index, prod)], v)
        return g

    body = _as_custom_jvp(program(lambda: nx.axis_index("a"), lambda u: nx.prod(u, "a"),
                                  lambda: nx.psum(jnp.int32(1), "a") // 8))
    reference = program(lambda: lax.axis_index("a"),
                        lambda u: jnp.prod(lax.all_gather(u, "a"), axis=0),
                        lambda: lax.psum(jnp.int32(1), "a") // 8)
    _check_grad_outside_and_jvp(body, reference, (x,), mesh_shape, resources)


@pytest.mark.parametrize("mesh_shape,resources", _CUSTOM_JVP_PLACEMENTS[1:])
def test_o08_custom_jvp_around_a_named_einsum_on_mesh_axes(mesh_shape, resources):
    """A name on mesh axes alone had no vmap level, so the lazily traced rule's
    einsum could not find it ("nx.einsum '{a}i,{a}i->i': axis name 'a' is not
    bound here"). A body holding a custom rule keeps a vmap level per name."""
    x = (jnp.arange(16, dtype=jnp.float32).reshape(8, 2) + 1) / 8
    y = jnp.cos(x)
    body = _as_custom_jvp(lambda x, y: nx.einsum("{a}i,{a}i->i", x, y) + x)
    reference = lambda x, y: lax.psum(x * y, "a") + x
    _check_grad_outside_and_jvp(body, reference, (x, y), mesh_shape, resources)
