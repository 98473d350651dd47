"""The triton backend's kernels (``nxops/kernels/triton/``) run by Triton's
interpreter on CPU (compiled by jax-triton on a GPU: ``JAX_PLATFORMS=cuda,cpu``,
as ``ci/gpu.sh`` runs them), against the xla reference: random shapes that are not
multiples of the blocks (tiny blocks, so small arrays span many blocks and the
split passes run), f32/bf16/f16, NaN/inf, gradients, vmap and jit."""
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tests._extras import require_extra

require_extra("triton", "triton")

import nxops as nx
from nxops.kernels import _knobs
from nxops.kernels.triton import dot_general as triton_dot
from nxops.kernels.triton import reduce as triton_reduce
from nxops.kernels.triton import tile as triton_tile
from nxops.kernels.xla import reduce as xla_reduce
from nxops.kernels.xla import tile as xla_tile
from tests.kernels._tolerances import FLOAT_DTYPES, assert_close

OPS = xla_reduce.REDUCE_OPS
# Where the default device is a GPU the kernels run there, compiled (the
# interpreter path would only test the interpreter again, on the host).
PLATFORM = "cuda" if jax.default_backend() == "gpu" else "cpu"
reduce_kernel = functools.partial(triton_reduce.reduce, platform=PLATFORM)
dot_kernel = functools.partial(triton_dot.dot_general, platform=PLATFORM)
tile_kernel = functools.partial(triton_tile.tile, platform=PLATFORM)
SETTINGS = hypothesis.settings(max_examples=15, deadline=None, derandomize=True,
                               suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])


@pytest.fixture
def small_blocks():
    """Blocks of a few elements and a GPU of a few programs: every path (many
    blocks, masked edges, split reduced axis / split K) on small arrays."""
    with (_knobs.tuned("triton.reduce", tile=32, cols=8, programs=6, min_steps=1),
          _knobs.tuned("triton.dot_general", programs=6, min_k_steps=1, m=16, n=16, k=16),
          _knobs.tuned("triton.tile", tile=32, cols=8)):
        yield


def _values(rng, shape, op, dtype, specials: bool):
    if op == "prod":   # near +-1: products neither overflow nor vanish
        values = rng.uniform(0.9, 1.1, shape) * rng.choice([-1.0, 1.0], shape)
    else:
        values = rng.standard_normal(shape)
    if specials and values.size:
        flat = values.reshape(-1)
        picks = rng.choice(flat.size, size=min(3, flat.size), replace=False)
        flat[picks] = rng.choice([np.nan, np.inf, -np.inf], size=picks.size)
    return jnp.asarray(values, dtype)


def _assert_matches(got, want, dtype, scale=1.0):
    """Close within ``dtype``'s tolerance; NaN and infinities exactly where
    the reference has them."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)])
    assert_close(got[finite], want[finite], dtype, scale)


@st.composite
def reductions(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 19), min_size=ndim, max_size=ndim)))
    axes = tuple(sorted(draw(st.sets(st.integers(0, ndim - 1), min_size=1))))
    return shape, axes, draw(st.sampled_from(OPS)), draw(st.sampled_from(FLOAT_DTYPES)), \
        draw(st.booleans()), draw(st.integers(0, 2**16))


@SETTINGS
@hypothesis.given(case=reductions())
def test_reduce_matches_the_reference(small_blocks, case):
    shape, axes, op, dtype, specials, seed = case
    x = _values(np.random.default_rng(seed), shape, op, dtype, specials)
    got = reduce_kernel(x, axes=axes, op=op)
    want = xla_reduce.reduce(x.astype(jnp.float32), axes=axes, op=op)
    assert got.dtype == x.dtype
    scale = float(np.sqrt(np.prod([shape[a] for a in axes]))) if op == "sum" else 1.0
    _assert_matches(got, want, dtype, scale)


@pytest.mark.parametrize("shape, axes", [((5, 70), (1,)), ((70, 3), (0,)), ((1, 200), (1,))])
def test_reduced_axis_is_split_across_programs_and_the_partials_recombine(
        small_blocks, shape, axes):
    """Few programs on a long reduced axis: the wrapper cuts it into pieces."""
    x = _values(np.random.default_rng(1), shape, "logsumexp", jnp.float32, specials=False)
    plan = (triton_reduce.rows_plan(*shape, jnp.float32) if axes == (1,)
            else triton_reduce.columns_plan(1, *shape, jnp.float32))
    assert plan.n_pieces > 1, plan
    for op in OPS:
        _assert_matches(reduce_kernel(x, axes=axes, op=op),
                        xla_reduce.reduce(x, axes=axes, op=op), jnp.float32, scale=10.0)


@pytest.mark.parametrize("op", OPS)
def test_reduce_gradient_vmap_and_jit(small_blocks, op):
    x = _values(np.random.default_rng(2), (3, 6, 5), op, jnp.float32, specials=False)

    def loss(reduce_fn, v):
        return jnp.sum(jnp.sin(reduce_fn(v, axes=(1,), op=op)))

    got = jax.jit(jax.grad(lambda v: loss(reduce_kernel, v)))(x)
    want = jax.grad(lambda v: loss(xla_reduce.reduce, v))(x)
    assert_close(got, want, jnp.float32)
    batched = jax.vmap(lambda v: reduce_kernel(v, axes=(0,), op=op), in_axes=2)(x)
    assert_close(batched, xla_reduce.reduce(x, axes=(0,), op=op).T, jnp.float32)


@st.composite
def contractions(draw):
    """dot_generals with batch, free and contracted dims in random orders."""
    n_batch, n_free_a, n_free_b, n_contract = (draw(st.integers(lo, 2)) for lo in (0, 0, 0, 1))
    # Few batch elements: the interpreter runs every program in Python.
    sizes = [draw(st.integers(1, 3 if i < n_batch else 37)) for i in range(8)]
    a_kinds = ["b"] * n_batch + ["fa"] * n_free_a + ["c"] * n_contract
    b_kinds = ["b"] * n_batch + ["fb"] * n_free_b + ["c"] * n_contract
    a_order = draw(st.permutations(range(len(a_kinds))))
    b_order = draw(st.permutations(range(len(b_kinds))))

    def layout(kinds, order):
        dims = {kind: [] for kind in ("b", "fa", "fb", "c")}
        shape = [0] * len(kinds)
        for position, source in enumerate(order):
            dims[kinds[source]].append(position)
            shape[position] = sizes[source]   # the i-th batch/contract dim has one size
        return dims, shape

    a_dims, a_shape = layout(a_kinds, a_order)
    b_dims, b_shape = layout(b_kinds, b_order)
    for kind in ("b", "c"):   # matching sizes along paired dims
        for da, db in zip(a_dims[kind], b_dims[kind]):
            b_shape[db] = a_shape[da]
    dims = ((tuple(a_dims["c"]), tuple(b_dims["c"])), (tuple(a_dims["b"]), tuple(b_dims["b"])))
    return tuple(a_shape), tuple(b_shape), dims, draw(st.sampled_from(FLOAT_DTYPES)), \
        draw(st.integers(0, 2**16))


@SETTINGS
@hypothesis.given(case=contractions())
def test_dot_general_matches_the_reference(small_blocks, case):
    a_shape, b_shape, dims, dtype, seed = case
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal(a_shape), dtype)
    b = jnp.asarray(rng.standard_normal(b_shape), dtype)
    got = dot_kernel(a, b, dimension_numbers=dims, precision=lax.Precision.HIGHEST)
    want = lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
    assert got.dtype == lax.dot_general(a, b, dims).dtype
    k = int(np.prod([a_shape[d] for d in dims[0][0]]))
    assert_close(got, want, dtype, scale=np.sqrt(k))


def test_dot_general_nan_inf_and_preferred_element_type(small_blocks):
    a = jnp.asarray(np.random.default_rng(3).standard_normal((20, 40)), jnp.bfloat16)
    a = a.at[3, 7].set(jnp.nan).at[5, 1].set(jnp.inf)
    b = jnp.ones((40, 18), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    got = dot_kernel(a, b, dimension_numbers=dims, preferred_element_type=jnp.float32)
    want = lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32
    _assert_matches(got, want, jnp.bfloat16, scale=8.0)


def test_dot_general_gradient_vmap_and_jit(small_blocks):
    rng = np.random.default_rng(4)
    a = jnp.asarray(rng.standard_normal((2, 19, 23)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((23, 2, 17)), jnp.float32)
    dims = (((2,), (0,)), ((0,), (1,)))

    def loss(fn, a, b):
        return jnp.sum(jnp.tanh(fn(a, b)))

    kernel = lambda a, b: dot_kernel(
        a, b, dimension_numbers=dims, precision=lax.Precision.HIGHEST)
    reference = lambda a, b: lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST)
    got = jax.jit(jax.grad(lambda a, b: loss(kernel, a, b), argnums=(0, 1)))(a, b)
    want = jax.grad(lambda a, b: loss(reference, a, b), argnums=(0, 1))(a, b)
    for g, w in zip(got, want):
        assert_close(g, w, jnp.float32, scale=5.0)
    stacked = jnp.stack([a, 2 * a])
    assert_close(jax.vmap(kernel, in_axes=(0, None))(stacked, b),
                 jax.vmap(reference, in_axes=(0, None))(stacked, b), jnp.float32, scale=5.0)


def test_f32_precision_follows_the_argument_and_the_default(monkeypatch):
    assert triton_dot.input_precision(None, jnp.float32) == "tf32"
    assert triton_dot.input_precision(lax.Precision.HIGHEST, jnp.float32) == "ieee"
    assert triton_dot.input_precision((lax.Precision.DEFAULT,) * 2, jnp.float32) == "tf32"
    with jax.default_matmul_precision("float32"):
        assert triton_dot.input_precision(None, jnp.float32) == "ieee"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("index", [0, 2, -1, 7, -9])
def test_tile_matches_dynamic_slice_and_clamps_in_the_kernel(small_blocks, dtype, index):
    x = jnp.arange(5 * 12 * 3).reshape(5, 12, 3).astype(dtype)
    got = tile_kernel(x, jnp.int32(index), dim=1, count=3)
    np.testing.assert_array_equal(got, xla_tile.tile(x, jnp.int32(index), dim=1, count=3))


def test_tile_gradient_and_vmap_over_arrays_and_indices(small_blocks):
    x = jnp.asarray(np.random.default_rng(5).standard_normal((6, 10)), jnp.float32)
    grad = jax.grad(lambda v: jnp.sum(tile_kernel(v, jnp.int32(1), dim=0, count=3) ** 2))(x)
    np.testing.assert_allclose(grad, jax.grad(
        lambda v: jnp.sum(xla_tile.tile(v, jnp.int32(1), dim=0, count=3) ** 2))(x))
    xs, indices = jnp.stack([x, -x, 2 * x]), jnp.array([0, 2, 1])
    per_example = jax.vmap(lambda v, i: tile_kernel(v, i, dim=1, count=2))(xs, indices)
    want = jax.vmap(lambda v, i: xla_tile.tile(v, i, dim=1, count=2))(xs, indices)
    np.testing.assert_array_equal(per_example, want)
    shared = jax.vmap(lambda v: tile_kernel(v, jnp.int32(1), dim=1, count=2))(xs)
    np.testing.assert_array_equal(shared, xs[:, :, 5:])


def test_selected_through_nxops_kernels_and_reported_by_explain():
    x = jnp.asarray(np.random.default_rng(6).standard_normal((4, 9)), jnp.float32)
    with nx.kernels.use("triton"):
        got = nx.logsumexp(x, 1)
        text = str(nx.kernels.explain(lambda v: nx.logsumexp(v, 1), x))
    assert_close(got, jax.nn.logsumexp(x, axis=1), jnp.float32)
    assert "triton:reduce" in text, text


def test_unsupported_cases_say_why():
    ints = jax.ShapeDtypeStruct((4, 4), jnp.int32)
    reasons = triton_reduce.not_supported_reasons(ints, platform="cuda", axes=(0,), op="sum")
    assert any("int32" in r for r in reasons), reasons
    reasons = triton_dot.not_supported_reasons(
        jax.ShapeDtypeStruct((4, 4), jnp.float32), jax.ShapeDtypeStruct((4, 4), jnp.bfloat16),
        platform="cuda", dimension_numbers=(((1,), (0,)), ((), ())))
    assert any("different dtypes" in r for r in reasons), reasons
    with nx.kernels.use("reduce=triton"), pytest.raises(nx.NxopsError, match="int32"):
        nx.sum(jnp.ones((3, 4), jnp.int32), 0)
