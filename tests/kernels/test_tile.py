"""The tile kernels of every backend (``nxops/kernels/{pallas,triton}/tile.py``)
against the xla reference (``lax.dynamic_slice_in_dim``) and NumPy slicing:
a copy, so results must match exactly; indices out of range clamp as
``dynamic_slice`` clamps them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nxops._errors import NxopsError
from nxops.kernels import _choice, _selection
from nxops.kernels.pallas import tile as pallas_tile
from nxops.kernels.xla import tile as xla_tile
from tests.kernels._reference import backends

# (shape, dim, count): tiles along the first, middle and last dim, a tile
# length that is a multiple of 128 (dense TPU layout) and one that is not,
# odd sizes, one tile per element, and a 1-D array.
CASES = [
    ((12, 5), 0, 3),
    ((12, 5), 1, 5),
    ((3, 8, 256), 1, 4),
    ((4, 6, 7), -1, 7),
    ((40,), 0, 2),
    ((2, 2, 1024), 2, 2),
    ((9, 4, 3), 1, 2),
]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("shape,dim,count", CASES, ids=[f"{s}-{d}-{c}" for s, d, c in CASES])
def test_matches_reference_and_numpy(kernels, shape, dim, count):
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
    fn = jax.jit(lambda x, i: kernels.tile(x, i, dim=dim, count=count))
    for index in [0, count - 1, count + 3, -1, -count - 2]:  # incl. out of range (clamped)
        got = fn(x, jnp.int32(index))
        np.testing.assert_array_equal(got, xla_tile.tile(x, jnp.int32(index), dim=dim % x.ndim,
                                                         count=count))
    size = shape[dim] // count
    np.testing.assert_array_equal(
        fn(x, jnp.int32(1 % count)),
        np.take(np.asarray(x), np.arange(size) + (1 % count) * size, axis=dim))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int32])
def test_dtypes_copy_exactly(kernels, dtype):
    x = jnp.asarray(np.arange(3 * 8 * 20).reshape(3, 8, 20) % 97, dtype)
    got = jax.jit(lambda x, i: kernels.tile(x, i, dim=1, count=4))(x, jnp.int32(2))
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, x[:, 4:6, :])


@pytest.mark.parametrize("backend", backends())
def test_gradient_places_the_cotangent_at_the_tile(kernels):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((6, 10, 3)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((6, 5, 3)), jnp.float32)
    got = jax.jit(jax.grad(lambda x, i: jnp.sum(kernels.tile(x, i, dim=1, count=2) * w)))(
        x, jnp.int32(1))
    want = jax.grad(lambda x: jnp.sum(xla_tile.tile(x, jnp.int32(1), dim=1, count=2) * w))(x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("backend", backends())
def test_vmap_over_arrays_and_over_indices(kernels):
    x = jnp.asarray(np.random.default_rng(5).standard_normal((6, 10)), jnp.float32)
    xs, indices = jnp.stack([x, -x, 2 * x]), jnp.array([0, 2, 1])
    per_example = jax.vmap(lambda v, i: kernels.tile(v, i, dim=1, count=2))(xs, indices)
    want = jax.vmap(lambda v, i: xla_tile.tile(v, i, dim=1, count=2))(xs, indices)
    np.testing.assert_array_equal(per_example, want)
    shared = jax.vmap(lambda v: kernels.tile(v, jnp.int32(1), dim=1, count=2))(xs)
    np.testing.assert_array_equal(shared, xs[:, :, 5:])


def test_pallas_default_platform_cpu_takes_a_traced_index():
    x = jnp.arange(24.0).reshape(4, 6)
    fn = jax.jit(lambda x, i: pallas_tile.tile(x, i, dim=0, count=4))
    for i in range(4):
        np.testing.assert_array_equal(fn(x, jnp.int32(i)), x[i:i + 1])


@pytest.mark.parametrize("shape,dtype,platform,backend", [
    ((8, 4), jnp.float32, "cuda", "pallas"),
    ((8, 4), jnp.bfloat16, "tpu", "pallas"),
    ((7, 4), jnp.float32, "cuda", "xla"),   # 7 rows do not split into 2 tiles
    ((8, 4), jnp.int8, "cuda", "xla"),      # 8-bit elements
    ((8, 4), jnp.float16, "tpu", "xla"),
])
def test_registry_choice(shape, dtype, platform, backend):
    avals = [jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct((), jnp.int32)]
    pallas = _selection.parse_selection("tile=pallas")
    if backend == "pallas":
        assert _choice.choose("tile", platform, pallas, avals, dim=0, count=2).kernel.backend \
            == "pallas"
    else:
        with pytest.raises(NxopsError, match="cannot run this case"):
            _choice.choose("tile", platform, pallas, avals, dim=0, count=2)
    # auto keeps XLA's dynamic slice: no GPU measured the kernel winning
    auto = _choice.choose("tile", platform, _selection.parse_selection("auto"), avals,
                            dim=0, count=2)
    why = {"cuda": "unmeasured on sm_90", "tpu": "nothing measured on tpu"}[platform]
    assert auto.kernel.backend == "xla" and why in auto.describe()
