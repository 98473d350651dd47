"""Kernels are local computations: whatever the selection, named ops give the
same results inside shard_map (check_vma on), under Explicit meshes at top
level, and in vmap. Runs the Pallas kernels in interpret mode on CPU."""
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import nxops as nx
from tests.ops._util import assert_close

SELECTIONS = ["xla", "pallas"]


@pytest.fixture
def mesh():
    return jax.make_mesh((4, 2), ("x", "y"))  # Explicit axes (JAX >= 0.9 default)


def data(*shape):
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("selection", SELECTIONS)
def test_top_level_jit_under_explicit_mesh(selection, mesh):
    x = data(8, 6)
    with nx.kernels.use(selection), jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("x")))
        assert_close(jax.jit(lambda a: nx.sum(a, 0))(x), x.sum(0))
        assert_close(jax.jit(lambda a: nx.logsumexp(a, 1))(xs),
                     np.log(np.exp(x).sum(1)), scale=10)
        w = data(6, 3)
        assert_close(jax.jit(lambda a: nx.einsum("ij,jk->ik", a, w))(xs), x @ w, scale=10)


@pytest.mark.parametrize("selection", SELECTIONS)
def test_inside_shard_map_with_check_vma(selection, mesh):
    x, w = data(8, 6), data(6, 5)
    with nx.kernels.use(selection), jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("x")))
        reduce = jax.jit(jax.shard_map(lambda v: nx.max(v, ("x", 0)), mesh=mesh,
                                       in_specs=P("x"), out_specs=P()))
        assert_close(reduce(xs), x.max(0))
        matmul = jax.jit(jax.shard_map(lambda v, m: nx.einsum("ij,jk->ik", v, m), mesh=mesh,
                                       in_specs=(P("x"), P()), out_specs=P("x")))
        assert_close(matmul(xs, w), x @ w, scale=10)
        tile = jax.jit(jax.shard_map(lambda v: nx.tile(v, {"x": 0}), mesh=mesh,
                                     in_specs=P(), out_specs=P("x")))
        assert_close(tile(x), x)
        grad = jax.grad(lambda v: (reduce(v) ** 2).sum())(xs)
    assert_close(grad, jax.grad(lambda v: (v.max(0) ** 2).sum())(x))


@pytest.mark.parametrize("selection", SELECTIONS)
def test_named_ops_in_vmap(selection):
    x, w = data(5, 7), data(7, 3)
    with nx.kernels.use(selection):
        out = jax.vmap(lambda r: nx.einsum("<b>k,km->m<b>", r, w), axis_name="b")(x)
        total = jax.vmap(lambda r: nx.mean(r, ("b", 0)), axis_name="b", out_axes=None)(x)
    assert_close(out, x @ w, scale=10)
    assert_close(total, x.mean())
