"""The one-pass reductions of issue 25 (logsumexp over rows and columns,
column sums), Pallas (Triton style, interpret mode) and Triton (Triton's
interpreter), against NumPy in float64: odd lengths, f32/bf16/f16, NaN,
+-inf, all -inf rows and columns, size 1 and size 0, forward and gradient.
Small blocks and program targets, so that the arrays span several steps,
pieces and a second pass."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._extras import skip_without_triton

from nxops.kernels import _knobs, _layout
from nxops.kernels.pallas import reduce as pallas_reduce
from tests.kernels._tolerances import FLOAT_DTYPES, assert_close, small_blocks

BACKENDS = ["pallas", pytest.param("triton", marks=skip_without_triton)]
# (shape, axis): rows and columns, odd lengths, blocks and pieces that tile
# the operand exactly (unmasked loads), a single element, one long row /
# column (split into pieces), and empty reduced or kept dims.
SHAPES = [((7, 301), 1), ((301, 7), 0), ((8, 256), 1), ((256, 8), 0), ((3, 37, 5), 1),
          ((1, 1), 1), ((1, 1), 0),
          ((1, 999), 1), ((999, 1), 0), ((0, 5), 1), ((5, 0), 1), ((0, 5), 0)]


def numpy_reduce(x, axis: int, op: str) -> np.ndarray:
    """float64 reference; logsumexp shifts by the max where it is finite, as
    ``jax.nn.logsumexp`` does (so all -inf gives -inf, any +inf gives +inf)."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    if op == "sum":
        return x.sum(axis)
    if x.shape[axis] == 0:
        return np.full(np.delete(x.shape, axis), -np.inf)
    m = np.max(x, axis=axis, keepdims=True)
    shift = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return np.squeeze(np.log(np.sum(np.exp(x - shift), axis=axis, keepdims=True)) + shift,
                          axis=axis)


@contextlib.contextmanager
def _small_triton():
    """The Triton backend's module with small blocks and a GPU of 6 programs."""
    from nxops.kernels.triton import reduce as triton_reduce
    with _knobs.tuned("triton.reduce", tile=32, cols=8, programs=6, min_steps=1):
        yield triton_reduce


@pytest.fixture
def run(monkeypatch):
    """``run(backend, x, axis, op)``: the kernel with small blocks and a GPU
    of a few programs."""
    def call(backend, x, axis, op):
        if backend == "pallas":
            with small_blocks("triton"):
                return pallas_reduce.reduce_in_style(x, axes=(axis,), op=op, style="triton")
        with _small_triton() as triton_reduce:
            return triton_reduce.reduce(x, axes=(axis,), op=op)
    return call


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_exactly_tiled_shapes_load_without_masks(monkeypatch, backend):
    # (8, 256) and (256, 8) take the unmasked path in the tests below.
    if backend == "pallas":
        with small_blocks("triton"):
            knobs = pallas_reduce._knobs()
    else:
        with _small_triton() as triton_reduce:
            knobs = triton_reduce.knobs()
    assert _layout.rows_plan(8, 256, 4, knobs).exact
    assert _layout.columns_plan(1, 256, 8, 4, knobs).exact
    assert not _layout.rows_plan(7, 301, 4, knobs).exact
    assert not _layout.columns_plan(1, 301, 7, 4, knobs).exact


def _assert_matches(got, want, dtype):
    """Within ``dtype``'s tolerance; NaN and infinities exactly where NumPy has them."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    special = ~np.isfinite(want) & ~np.isnan(want)
    np.testing.assert_array_equal(got[special], want[special])
    finite = np.isfinite(want)
    assert_close(got[finite], want[finite], dtype, np.sqrt(max(1, want.size)))


def _specials(x: np.ndarray, axis: int) -> np.ndarray:
    """Row/column 0 holds a NaN, 1 a +inf, 2 is all -inf, 3 has +inf and
    -inf, 4 one -inf (along the reduced ``axis``); the rest is finite."""
    x = np.moveaxis(x.copy(), axis, -1)
    n = x.shape[-1]
    if x.shape[0] >= 5 and n >= 3:
        x[0, ..., n // 2] = np.nan
        x[1, ..., n - 1] = np.inf
        x[2] = -np.inf
        x[3, ..., 0], x[3, ..., n - 1] = np.inf, -np.inf
        x[4, ..., 1] = -np.inf
    return np.moveaxis(x, -1, axis)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("op", ["logsumexp", "sum"])
def test_forward_matches_numpy_float64(run, backend, dtype, op):
    rng = np.random.default_rng(0)
    for shape, axis in SHAPES:
        x = rng.standard_normal(shape) * 3
        if op == "logsumexp":
            x = _specials(x, axis)
        x = jnp.asarray(x, dtype)
        got = run(backend, x, axis, op)
        assert got.dtype == x.dtype, (shape, axis)
        _assert_matches(got, numpy_reduce(x, axis, op), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_negative_infinity_columns_and_huge_values(run, backend):
    # Every column -inf, then values near the f32 limit (exp overflows
    # unless shifted by the max) beside -inf.
    x = np.full((300, 9), -np.inf, np.float32)
    assert np.all(np.asarray(run(backend, jnp.asarray(x), 0, "logsumexp")) == -np.inf)
    x[::7] = 3e38
    x[5, :] = -3e38
    _assert_matches(run(backend, jnp.asarray(x), 0, "logsumexp"),
                    numpy_reduce(x, 0, "logsumexp"), jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,axis", [((7, 301), 1), ((301, 7), 0)])
def test_gradient_is_the_softmax(run, backend, shape, axis):
    x = jnp.asarray(np.random.default_rng(1).standard_normal(shape) * 3, jnp.float32)
    w = np.random.default_rng(2).standard_normal(np.delete(shape, axis))
    grad = jax.grad(lambda v: jnp.sum(run(backend, v, axis, "logsumexp") * w))(x)
    x64 = np.asarray(x, np.float64)
    softmax = np.exp(x64 - np.expand_dims(numpy_reduce(x64, axis, "logsumexp"), axis))
    assert_close(grad, softmax * np.expand_dims(w, axis), jnp.float32)
