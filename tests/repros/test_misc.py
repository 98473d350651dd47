"""Issue 20 repros (helper misc): each file runs unchanged and prints its expected result."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import nxops as nx
from nxops._supported_jax import _release
from tests.repros._run import printed_lines


def test_g02_raw_lax_on_a_mesh_mapped_name_names_the_nx_op():
    lines = printed_lines("g02_raw_lax_on_logical_name.py")
    mapped, unmapped = lines[:3], lines[3:]
    assert mapped[0].startswith("{'shard': 'mp'}  lax.axis_index  NxopsError: jax.lax.axis_index "
                                "over 'shard'")
    assert "Use nx.axis_index" in mapped[0]
    assert mapped[1].startswith("{'shard': 'mp'}  lax.psum        NxopsError: jax.lax.psum over")
    assert "Use nx.psum" in mapped[1]
    assert mapped[2] == "{'shard': 'mp'}  nx.axis_index   ok [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]"
    assert unmapped == ["{}               lax.axis_index  ok [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]",
                        "{}               lax.psum        ok [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]",
                        "{}               nx.axis_index   ok [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]"]


def test_r16_mesh_only_bool_psum_scatter_and_complex_logsumexp():
    assert printed_lines("r16_bool_psum_scatter_complex_lse.py") == [
        "psum_scatter bool {} ok int32",
        "psum_scatter bool {'a': 'x'} ok int32",
        "logsumexp complex64 {} ok complex64",
        "logsumexp complex64 {'a': 'x'} ok complex64",
    ]


def _loss_for_five_ones():
    # s02's loss on x = ones((5, 8)), w = ones((8, 3)), in NumPy.
    logits = np.ones((5, 8)) @ np.ones((8, 3))
    return np.log(np.exp(logits).sum(1)).mean()


def test_s02_export_with_a_symbolic_batch():
    (line,) = printed_lines("s02_export_symbolic_batch.py")
    np.testing.assert_allclose(float(line), _loss_for_five_ones(), rtol=1e-6)


def test_r14_symbolic_export_with_xla_kernels():
    assert printed_lines("r14_export_symbolic_xla.py") == ["(ShapedArray(float32[8,b]),)"] * 2


def _s02_loss(x, w):
    logits = nx.einsum("<inputs>,<inputs>c->c", x, w)
    return nx.mean(nx.logsumexp(logits, 0), "batch")


@pytest.mark.parametrize("resources,batch", [({}, "b"), ({"batch": "x"}, "8*b")], ids=str)
def test_symbolic_export_over_a_mesh_calls_under_the_mesh(resources, batch):
    f = nx.xmap(_s02_loss, in_axes=(["batch", "inputs"], ["inputs", ...]), out_axes=[...],
                axis_resources=resources)
    sizes = (jax.ShapeDtypeStruct(export.symbolic_shape(f"{batch}, 8"), jnp.float32),
             jax.ShapeDtypeStruct((8, 3), jnp.float32))
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(8, 3)).astype(np.float32)
    logits = x @ w
    want = np.log(np.exp(logits).sum(1)).mean()
    with jax.set_mesh(jax.make_mesh((8,), ("x",))):
        got = nx.export(f, *sizes).call(x, w)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_symbolic_batch_not_provably_divisible_suggests_a_multiple():
    f = nx.xmap(_s02_loss, in_axes=(["batch", "inputs"], ["inputs", ...]), out_axes=[...],
                axis_resources={"batch": "x"})
    sizes = (jax.ShapeDtypeStruct(export.symbolic_shape("b, 8"), jnp.float32),
             jax.ShapeDtypeStruct((8, 3), jnp.float32))
    with jax.set_mesh(jax.make_mesh((8,), ("x",))):
        with pytest.raises(nx.NxopsError, match=r"symbolic b, which jax.export cannot prove "
                           r"divisible by the total size 8 .*symbolic_shape\('8\*b, \.\.\.'\)"):
            nx.export(f, *sizes)


def test_r09_ppermute_and_psum_scatter_over_a_tuple_of_names():
    assert printed_lines("r09_tuple_ppermute_psum_scatter.py") == [
        "ppermute {} ok", "ppermute {'b': 'y'} ok",
        "psum_scatter {} ok", "psum_scatter {'b': 'y'} ok"]


R09_PLACEMENTS = [{}, {"b": "y"}, {"a": "x"}, {"a": "x", "b": "y"}]


def _over_ab(body, x, resources):
    f = nx.xmap(body, [["a", "b", ...]], ["a", "b", ...], axis_resources=resources)
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        return np.asarray(f(x)).reshape(32, -1)


@pytest.mark.parametrize("resources", R09_PLACEMENTS, ids=str)
@pytest.mark.parametrize("perm", [[(i, (i + 1) % 32) for i in range(32)], [(3, 30), (30, 0)]],
                         ids=["cycle", "partial"])
def test_ppermute_over_a_tuple_of_names_matches_numpy(resources, perm):
    x = np.random.default_rng(0).normal(size=(8, 4, 5)).astype(np.float32)
    got = _over_ab(lambda v: nx.ppermute(v, ("a", "b"), perm), x, resources)
    flat, want = x.reshape(32, 5), np.zeros((32, 5), np.float32)
    for src, dst in perm:
        want[dst] = flat[src]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("resources", R09_PLACEMENTS, ids=str)
@pytest.mark.parametrize("tiled", [True, False])
def test_psum_scatter_over_a_tuple_of_names_matches_numpy(resources, tiled):
    x = np.random.default_rng(1).integers(-5, 5, size=(8, 4, 32, 3)).astype(np.float32)
    got = _over_ab(lambda v: nx.psum_scatter(v, ("a", "b"), tiled=tiled), x, resources)
    want = x.reshape(32, 32, 3).sum(0)
    np.testing.assert_array_equal(got.reshape(want.shape), want)


def test_r10_grad_inside_through_all_to_all_over_a_vmapped_name():
    lines = printed_lines("r10_all_to_all_grad_inside.py")
    values = np.array([float(v) for line in lines for v in line.strip("[] ").split()])
    np.testing.assert_array_equal(values, np.ones(4 * 4 * 2))   # d sum / d v: every entry once


@pytest.mark.parametrize("resources", [{}, {"b": "x"}], ids=str)
def test_grad_inside_through_all_to_all_is_its_transpose(resources):
    # d/dv_j sum(all_to_all(v)_i * w_i) summed over i: grad_j[i] = w_i[j].
    rng = np.random.default_rng(2)
    v, w = rng.normal(size=(2, 4, 4, 2)).astype(np.float32)
    body = jax.grad(lambda p, q: (nx.all_to_all(p, "b", 0, 0) * q).sum())
    f = nx.xmap(body, [["b", ...], ["b", ...]], ["b", ...], axis_resources=resources)
    with jax.set_mesh(jax.make_mesh((4,), ("x",))):
        got = np.asarray(f(v, w))
    np.testing.assert_allclose(got, w.transpose(1, 0, 2), rtol=1e-6)


def test_r11_nested_xmaps_grad_outside():
    assert printed_lines("r11_nested_grad.py") == ["(8, 4, 3)", "(8, 4, 3)"]


@pytest.mark.parametrize("axis_types", ["Explicit", "Auto"])
@pytest.mark.parametrize("outer_res,inner_res", [({"a": "x"}, {"b": "y"}), ({}, {"b": "y"}),
                                                  ({"a": "x"}, {})], ids=str)
def test_nested_xmaps_grad_outside_is_the_positional_grad(outer_res, inner_res, axis_types):
    x = np.random.default_rng(3).normal(size=(8, 4, 3)).astype(np.float32)
    inner = nx.xmap(lambda v: jnp.sin(v) * nx.axis_index("b"), [["b", ...]], ["b", ...],
                    axis_resources=inner_res)
    outer = nx.xmap(inner, [["a", ...]], ["a", ...], axis_resources=outer_res)
    types = (getattr(jax.sharding.AxisType, axis_types),) * 2
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"), axis_types=types)):
        value, grad = jax.value_and_grad(lambda v: (outer(v) ** 2).sum())(x)
    position = np.arange(4).reshape(1, 4, 1)
    np.testing.assert_allclose(value, ((np.sin(x) * position) ** 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), 2 * np.sin(x) * np.cos(x) * position ** 2,
                               rtol=1e-5, atol=1e-6)


def test_r12_jacrev_of_a_mesh_mapped_xmap_inputs_made_before_the_mesh():
    assert printed_lines("r12_jacrev_mesh.py") == ["(8, 2, 8, 2)"]


@pytest.mark.parametrize("made", ["before", "inside"])
def test_jacrev_and_hessian_of_a_mesh_mapped_xmap(made):
    f = nx.xmap(lambda v: jnp.sin(v) * 2, [["a", ...]], ["a", ...], axis_resources={"a": "x"})
    x_np = np.random.default_rng(4).normal(size=(8, 2)).astype(np.float32)
    x = jnp.asarray(x_np)
    with jax.set_mesh(jax.make_mesh((8,), ("x",))):
        if made == "inside":
            x = jnp.asarray(x_np)
        jac = np.asarray(jax.jacrev(f)(x))
        hess = np.asarray(jax.hessian(lambda v: f(v).sum())(x))
    eye = np.eye(16, dtype=np.float32).reshape(8, 2, 8, 2)
    np.testing.assert_allclose(jac, eye * (2 * np.cos(x_np))[:, :, None, None], rtol=1e-6)
    np.testing.assert_allclose(hess, eye * (-2 * np.sin(x_np))[:, :, None, None], rtol=1e-5,
                               atol=1e-6)


# JAX 0.12's shard_map batching rule under vmap(spmd_axis_name=...) builds a
# manual computation of mismatched shapes (0.10.2 lowers it): there nxops
# refuses with an NxopsError that says so and how to write it instead.
SPMD_VMAP_LOWERS = _release(jax.__version__) < (0, 11)


def test_r13_vmap_with_spmd_axis_name_of_an_xmap():
    if SPMD_VMAP_LOWERS:
        assert printed_lines("r13_vmap_spmd_axis_name.py") == ["(2, 8, 3)"]
    else:
        with pytest.raises(nx.NxopsError, match=r"spmd_axis_name=\['x'\].*named axis of the xmap"):
            printed_lines("r13_vmap_spmd_axis_name.py")


@pytest.mark.skipif(not SPMD_VMAP_LOWERS, reason="JAX 0.12 cannot lower it: "
                    "test_r13_vmap_with_spmd_axis_name_of_an_xmap checks the refusal")
@pytest.mark.parametrize("order", ["spmd first", "plain first"])
def test_vmap_with_spmd_axis_name_matches_plain_vmap(order):
    # jit caches per trace: the plain and the spmd vmap must not share a program.
    x = np.random.default_rng(5).normal(size=(2, 8, 3)).astype(np.float32)
    f = nx.xmap(lambda v: jnp.sin(v) * nx.axis_index("a"), [["a", ...]], ["a", ...],
                axis_resources={"a": "y"})
    want = np.sin(x) * np.arange(8).reshape(1, 8, 1)
    calls = [jax.vmap(f, spmd_axis_name="x"), jax.vmap(f)]
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        for call in calls if order == "spmd first" else calls[::-1]:
            np.testing.assert_allclose(np.asarray(call(x)), want, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(f(x[1])), want[1], rtol=1e-6)
