"""The Pallas reductions (``nxops/kernels/pallas/reduce.py``) in interpret mode,
both kernel styles (Triton and Mosaic programs), against the xla reference
and NumPy (float64), forward and gradient."""
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx

from nxops._errors import NxopsError
from nxops.kernels import _auto, _choice, _layout, _registry, _selection
from nxops.kernels.pallas import _common, reduce as pallas_reduce
from nxops.kernels.xla import reduce as xla_reduce
from tests.kernels._tolerances import FLOAT_DTYPES, assert_close, small_blocks

OPS = xla_reduce.REDUCE_OPS
STYLES = _common.STYLES

# (shape, axes): 1xn and nx1, odd sizes, several blocks in every dim with the
# small test blocks, column (inner > 1) and non-contiguous (transposed) axes,
# full and empty axis sets, and a long single row (split into pieces).
CASES = [
    ((1, 37), (1,)),
    ((37, 1), (0,)),
    ((20, 300), (1,)),
    ((21, 300), (0,)),
    ((3, 20, 300), (1,)),
    ((4, 5, 6, 7), (0, -2)),
    ((2, 3, 4), (0, 1, 2)),
    ((6, 7), ()),
    ((1, 4096), (1,)),
    ((2, 301, 3), (1,)),   # columns cut into pieces (Triton), odd sizes
]


def sample(shape, op, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if op == "prod":  # near 1 with random signs: products neither overflow nor vanish
        values = rng.uniform(0.9, 1.1, shape) * rng.choice([-1.0, 1.0], shape)
    else:
        values = rng.standard_normal(shape)
    return jnp.asarray(values, dtype)


def numpy_reduce(x, axes, op):
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    if op == "logsumexp":
        m = np.max(x, axis=axes, keepdims=True)
        return np.squeeze(np.log(np.sum(np.exp(x - m), axis=axes, keepdims=True)) + m, axis=axes)
    return getattr(np, op)(x, axis=axes)


def sum_scale(shape, axes):
    """Magnitude of an f32 sum's rounding error, relative to one term."""
    return math.sqrt(math.prod(shape[a] for a in axes) if axes else 1)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("shape,axes", CASES, ids=[f"{s}-{a}" for s, a in CASES])
def test_matches_reference_and_numpy_f32(style, shape, axes):
    for op in OPS:
        x = sample(shape, op, jnp.float32)
        with small_blocks(style):
            got = jax.jit(lambda x: pallas_reduce.reduce_in_style(x, axes=axes, op=op, style=style))(x)
        want = xla_reduce.reduce(x, axes=axes, op=op)
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = sum_scale(shape, axes) if op == "sum" else 1.0
        assert_close(got, want, jnp.float32, scale)
        assert_close(got, numpy_reduce(x, tuple(a % len(shape) for a in axes), op), jnp.float32, scale)


@pytest.mark.parametrize("dtype,style", [(jnp.bfloat16, "triton"), (jnp.bfloat16, "mosaic"),
                                         (jnp.float16, "triton")])
@pytest.mark.parametrize("shape,axes", [((20, 300), (1,)), ((3, 20, 300), (1,))])
def test_half_precision_accumulates_in_f32(style, dtype, shape, axes):
    for op in OPS:
        x = sample(shape, op, dtype)
        with small_blocks(style):
            got = jax.jit(lambda x: pallas_reduce.reduce_in_style(x, axes=axes, op=op, style=style))(x)
        assert got.dtype == dtype
        # NumPy in float64 on the same (rounded) inputs: only the output is rounded.
        assert_close(got, numpy_reduce(x, axes, op), dtype)
        assert_close(got, xla_reduce.reduce(x, axes=axes, op=op), dtype,
                     sum_scale(shape, axes) if op == "sum" else 1.0)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("axes", [(1,), (0,)], ids=["rows", "columns"])
def test_nan_and_inf_as_jnp(style, axes):
    # Column j of the transposed case is row j here; rows: 0 has a NaN,
    # 1 a +inf, 2 is all -inf, 3 has +inf and -inf, 4 is finite.
    # Values near 1, so that no product underflows to 0 (0 * inf is NaN).
    x = np.random.default_rng(1).uniform(0.9, 1.1, (5, 300)).astype(np.float32)
    x[0, 290] = np.nan
    x[1, 7] = np.inf
    x[2, :] = -np.inf
    x[3, 3], x[3, 200] = np.inf, -np.inf
    x = jnp.asarray(x if axes == (1,) else x.T)
    for op in OPS:
        with small_blocks(style):
            got = jax.jit(lambda x: pallas_reduce.reduce_in_style(x, axes=axes, op=op, style=style))(x)
        want = xla_reduce.reduce(x, axes=axes, op=op)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=op)
        assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("shape,axes", [((20, 300), (1,)), ((3, 20, 9), (0, 2))])
def test_gradient_matches_reference(style, shape, axes):
    for op in OPS:
        x = sample(shape, op, jnp.float32, seed=2)
        if op in ("max", "min"):  # a tie: the cotangent is shared as in jnp
            x = x.at[(0,) * len(shape)].set(x[(1,) + (0,) * (len(shape) - 1)])
        w = jnp.asarray(np.random.default_rng(3).standard_normal(
            xla_reduce.reduce(x, axes=axes, op=op).shape), jnp.float32)

        def loss(fn, x):
            return jnp.sum(fn(x, axes=axes, op=op) * w)

        with small_blocks(style):
            got = jax.jit(jax.grad(lambda x: loss(
                lambda x, **kw: pallas_reduce.reduce_in_style(x, style=style, **kw), x)))(x)
        want = jax.grad(lambda x: loss(xla_reduce.reduce, x))(x)
        assert_close(got, want, jnp.float32)


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(data=st.data())
def test_random_shapes_and_axes(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=4), label="shape"))
    axes = tuple(sorted(data.draw(st.sets(st.integers(0, len(shape) - 1)), label="axes")))
    op = data.draw(st.sampled_from(OPS), label="op")
    style = data.draw(st.sampled_from(STYLES), label="style")
    x = sample(shape, op, jnp.float32, seed=len(shape))
    with small_blocks(style):
        got = pallas_reduce.reduce_in_style(x, axes=axes, op=op, style=style)
    assert_close(got, xla_reduce.reduce(x, axes=axes, op=op), jnp.float32, sum_scale(shape, axes))


def test_long_single_row_is_split_into_pieces_mosaic():
    with small_blocks("mosaic"):
        assert pallas_reduce._row_split(1, 4096, "mosaic") > 1
        assert pallas_reduce._row_split(512, 4096, "mosaic") == 1


def test_gpu_split_reaches_the_program_target_with_no_empty_piece():
    target, steps = _layout.GPU_TARGET_PROGRAMS, _layout.MIN_STEPS_PER_PROGRAM
    for programs in (1, 4, 32, 100, 263):
        for n_blocks in (4 * target, 1024, 1000, 750, 77):
            split, per_piece = _layout.split_count(programs, n_blocks)
            assert per_piece >= steps or split == 1
            assert (split - 1) * per_piece < n_blocks <= split * per_piece   # no empty piece
            if n_blocks >= steps * target:
                assert programs * split >= target, (programs, n_blocks, split)
    assert _layout.split_count(target, 10**6) == (1, 10**6)      # enough programs already
    assert _layout.split_count(1, 7) == (1, 7)                   # too short to cut


def test_canonical_view_moves_data_only_for_non_contiguous_axes():
    assert _layout.canonical_view((2, 3, 4, 5), (1, 2)) == (None, (2, 12, 5))
    assert _layout.canonical_view((2, 3, 4, 5), (2, 3)) == (None, (6, 20, 1))
    assert _layout.canonical_view((2, 3, 4, 5), (0, 2)) == ((1, 3, 0, 2), (15, 8, 1))


def test_default_platform_cpu_runs_interpret_mode():
    x = sample((9, 10), "sum", jnp.float32)
    assert_close(pallas_reduce.reduce(x, axes=(1,), op="sum", platform="cpu"), x.sum(1), jnp.float32)


@pytest.mark.parametrize("dtype,platform,unsupported", [
    (jnp.float32, "cuda", False), (jnp.bfloat16, "tpu", False), (jnp.float16, "cuda", False),
    (jnp.float16, "tpu", True), (jnp.int32, "cuda", True), (jnp.int8, "cpu", True),
])
def test_registry_takes_pallas_or_falls_back_with_a_reason(dtype, platform, unsupported):
    aval = jax.ShapeDtypeStruct((4, 8), dtype)
    # a rows logsumexp of a program argument: `auto` keeps XLA (no TPU has
    # measured the kernel; on cuda this small case is unmeasured); `pallas` is obeyed
    auto = _choice.choose("reduce", platform, _selection.parse_selection("auto"), [aval],
                            False, (_auto.ARGUMENT,), axes=(1,), op="logsumexp")
    assert auto.kernel.backend == "xla"
    pallas = _selection.parse_selection("pallas")
    if unsupported:
        with pytest.raises(NxopsError, match="pallas"):
            _choice.choose("reduce", platform, pallas, [aval], axes=(1,), op="sum")
    else:
        assert _choice.choose("reduce", platform, pallas, [aval], axes=(1,), op="sum").kernel \
            is pallas_reduce.KERNEL


def test_zero_size_input_takes_the_reference_even_when_pallas_is_requested():
    # The registry answers zero-size cases before asking any kernel.
    choice = _choice.choose("reduce", "cuda", _selection.parse_selection("pallas"),
                               (jax.ShapeDtypeStruct((0, 3), jnp.float32),), axes=(0,), op="sum")
    assert choice.kernel.backend == "xla" and "zero-size" in choice.describe()
