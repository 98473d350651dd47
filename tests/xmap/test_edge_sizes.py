"""Sizes 0 and dtypes at the edges (bool, complex), on every placement: the result
matches NumPy, or the op refuses with an NxopsError on every placement."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx

PLACEMENTS_8 = [{}, {"a": "x"}]


def _on_mesh(shape, names, f, *args):
    with jax.set_mesh(jax.make_mesh(shape, names)):
        return np.asarray(f(*args))


@pytest.mark.parametrize("resources", PLACEMENTS_8, ids=str)
def test_complex_sum_over_a_size_0_name(resources):
    x = np.ones((0, 3), np.complex64)
    f = nx.xmap(lambda v: nx.sum(v, "a"), ["a", ...], [...], axis_resources=resources)
    got = _on_mesh((8,), ("x",), f, x)
    assert got.dtype == np.complex64
    np.testing.assert_array_equal(got, x.sum(0))


@pytest.mark.parametrize("resources", PLACEMENTS_8, ids=str)
@pytest.mark.parametrize("shape", [(8, 0, 3), (8, 2, 0)], ids=str)
def test_untile_of_a_zero_size_value(resources, shape):
    x = np.ones(shape, np.float32)
    f = nx.xmap(lambda v: nx.untile(v, {"a": 0}), ["a", ...], [...], axis_resources=resources)
    got = _on_mesh((8,), ("x",), f, x)
    np.testing.assert_array_equal(got, np.concatenate(list(x)))


@pytest.mark.parametrize("resources", PLACEMENTS_8, ids=str)
@pytest.mark.parametrize("op,body", [
    ("tile", lambda v, w: nx.tile(v, {"a": 0})),
    ("psum_scatter", lambda v, w: nx.psum_scatter(v, "a", tiled=True)),
    ("all_to_all", lambda v, w: nx.all_to_all(v, "a", 0, 0, tiled=True)),
], ids=lambda p: p if isinstance(p, str) else "")
def test_splitting_among_a_size_0_name_is_refused(resources, op, body):
    f = nx.xmap(body, ([...], ["a", ...]), ["a", ...], axis_resources=resources)
    with pytest.raises(nx.NxopsError, match=rf"nx.{op} over 'a', a named axis of size 0"):
        _on_mesh((8,), ("x",), f, np.ones((4, 3), np.float32), np.ones((0,), np.float32))


@pytest.mark.parametrize("resources", [{}, {"a": "x"}, {"a": "x", "c": "y"}], ids=str)
def test_bf16_einsum_with_a_zero_contraction_dim(resources):
    u = np.ones((2, 4, 3, 0), jnp.bfloat16)
    v = np.ones((2, 4, 0, 5), jnp.bfloat16)
    f = nx.xmap(lambda p, q: nx.einsum("ik,kj->ij", p, q), (["a", "c", ...],) * 2,
                ["a", "c", ...], axis_resources=resources)
    got = _on_mesh((2, 4), ("x", "y"), f, u, v)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32),
                                  np.einsum("acik,ackj->acij", u.astype(np.float32),
                                            v.astype(np.float32)))


@pytest.mark.parametrize("resources", PLACEMENTS_8, ids=str)
def test_bool_psum_scatter_sums_like_numpy(resources):
    x = np.random.default_rng(0).random((8, 16)) < 0.5
    f = nx.xmap(lambda v: nx.psum_scatter(v, "a", tiled=True), ["a", ...], ["a", ...],
                axis_resources=resources)
    got = _on_mesh((8,), ("x",), f, x)
    want = x.sum(0, dtype=np.int32).reshape(8, 2)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("resources", PLACEMENTS_8, ids=str)
def test_complex_logsumexp_matches_numpy(resources):
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(8, 3)) + 1j * rng.normal(size=(8, 3))).astype(np.complex64)
    f = nx.xmap(lambda v: nx.logsumexp(v, "a"), ["a", ...], [...], axis_resources=resources)
    got = _on_mesh((8,), ("x",), f, x)
    assert got.dtype == np.complex64
    want = np.log(np.exp(x.astype(np.complex128)).sum(0))
    np.testing.assert_allclose(np.exp(got), np.exp(want), rtol=1e-5)
