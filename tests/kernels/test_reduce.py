"""The reduction kernels of every backend (``nxops/kernels/{pallas,triton}/reduce.py``)
against the xla reference and NumPy in float64: odd shapes over several
blocks, row, column and non-contiguous axes, f32/bf16/f16, NaN and +-inf,
size 0, gradients, vmap and jit; then what each backend alone plans."""
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from nxops._errors import NxopsError
from nxops.kernels import _auto, _choice, _layout, _selection
from nxops.kernels.xla import reduce as xla_reduce
from tests.kernels._reference import (FLOAT_DTYPES, assert_matches, backends, numpy_reduce, sample,
                                      small_blocks, sum_scale)
from tests._tolerances import assert_close

OPS = xla_reduce.REDUCE_OPS

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
    ((2, 301, 3), (1,)),
]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("shape,axes", CASES, ids=[f"{s}-{a}" for s, a in CASES])
def test_matches_reference_and_numpy_f32(kernels, shape, axes):
    for op in OPS:
        x = sample(shape, op, jnp.float32)
        got = jax.jit(lambda x: kernels.reduce(x, axes=axes, op=op))(x)
        want = xla_reduce.reduce(x, axes=axes, op=op)
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = sum_scale(shape, axes) if op == "sum" else 1.0
        assert_close(got, want, jnp.float32, scale)
        assert_close(got, numpy_reduce(x, axes, op), jnp.float32, scale)


# The rows and the columns path, each in one half dtype: both dtypes take the
# same upcast to f32 (test_one_pass_matches_numpy_float64 runs every dtype on
# both paths of the one-pass kernels).
@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype,shape,axes", [(jnp.bfloat16, (20, 300), (1,)),
                                              (jnp.float16, (3, 20, 300), (1,))],
                         ids=["bf16-rows", "f16-columns"])
def test_half_precision_accumulates_in_f32(kernels, dtype, shape, axes):
    for op in OPS:
        x = sample(shape, op, dtype)
        got = jax.jit(lambda x: kernels.reduce(x, axes=axes, op=op))(x)
        assert got.dtype == dtype
        # NumPy in float64 on the same (rounded) inputs: only the output is rounded.
        assert_close(got, numpy_reduce(x, axes, op), dtype)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("axes", [(1,), (0,)], ids=["rows", "columns"])
def test_nan_and_inf_as_jnp(kernels, axes):
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
        got = jax.jit(lambda x: kernels.reduce(x, axes=axes, op=op))(x)
        assert_matches(got, xla_reduce.reduce(x, axes=axes, op=op), jnp.float32)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("shape,axes", [((20, 300), (1,)), ((3, 20, 9), (0, 2))])
def test_gradient_matches_reference(kernels, shape, axes):
    for op in OPS:
        x = sample(shape, op, jnp.float32, seed=2)
        if op in ("max", "min"):  # a tie: the cotangent is shared as in jnp
            x = x.at[(0,) * len(shape)].set(x[(1,) + (0,) * (len(shape) - 1)])
        w = jnp.asarray(np.random.default_rng(3).standard_normal(
            xla_reduce.reduce(x, axes=axes, op=op).shape), jnp.float32)

        def loss(fn, x):
            return jnp.sum(fn(x, axes=axes, op=op) * w)

        got = jax.jit(jax.grad(lambda x: loss(kernels.reduce, x)))(x)
        want = jax.grad(lambda x: loss(xla_reduce.reduce, x))(x)
        assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("backend", backends())
def test_vmap_moves_the_batch_into_the_kernel(kernels):
    x = sample((3, 6, 5), "sum", jnp.float32, seed=4)
    for op in OPS:
        batched = jax.vmap(lambda v: kernels.reduce(v, axes=(0,), op=op), in_axes=2)(x)
        assert_close(batched, xla_reduce.reduce(x, axes=(0,), op=op).T, jnp.float32)


@st.composite
def reductions(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=ndim, max_size=ndim)))
    axes = tuple(sorted(draw(st.sets(st.integers(0, ndim - 1), min_size=1))))
    return (shape, axes, draw(st.sampled_from(OPS)), draw(st.sampled_from(FLOAT_DTYPES)),
            draw(st.booleans()), draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("backend", backends())
@hypothesis.settings(max_examples=10, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(case=reductions())
def test_random_shapes_axes_dtypes_and_specials(kernels, case):
    shape, axes, op, dtype, specials, seed = case
    x = sample(shape, op, dtype, seed, specials=specials)
    got = kernels.reduce(x, axes=axes, op=op)
    assert got.dtype == x.dtype
    want = xla_reduce.reduce(x.astype(jnp.float32), axes=axes, op=op)
    assert_matches(got, want, dtype, sum_scale(shape, axes) if op == "sum" else 1.0)


# ---------------------------------------------------------------------------
# The one-pass reductions (Triton-style programs): logsumexp and sums over
# rows and columns, several steps, pieces and a second pass


ONE_PASS = backends("pallas-triton", "triton")
# (shape, axis): rows and columns, odd lengths, blocks and pieces that tile
# the operand exactly (unmasked loads), a single element, one long row /
# column (split into pieces), and empty reduced or kept dims.
ONE_PASS_SHAPES = [((7, 301), 1), ((301, 7), 0), ((8, 256), 1), ((256, 8), 0), ((3, 37, 5), 1),
                   ((1, 1), 1), ((1, 1), 0), ((1, 999), 1), ((999, 1), 0), ((0, 5), 1),
                   ((5, 0), 1), ((0, 5), 0)]


def _plan_knobs(backend: str) -> _layout.ReduceKnobs:
    if backend == "triton":
        from nxops.kernels.triton import reduce as triton_reduce
        return triton_reduce.knobs()
    from nxops.kernels.pallas import reduce as pallas_reduce
    return pallas_reduce._knobs()


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


@pytest.mark.parametrize("backend", ONE_PASS)
def test_the_exactly_tiled_shapes_load_without_masks(kernels, backend):
    # (8, 256) and (256, 8) take the unmasked path in the tests below.
    knobs = _plan_knobs(backend)
    assert _layout.rows_plan(8, 256, 4, knobs).exact
    assert _layout.columns_plan(1, 256, 8, 4, knobs).exact
    assert not _layout.rows_plan(7, 301, 4, knobs).exact
    assert not _layout.columns_plan(1, 301, 7, 4, knobs).exact


@pytest.mark.parametrize("backend", ONE_PASS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("op", ["logsumexp", "sum"])
def test_one_pass_matches_numpy_float64(kernels, dtype, op):
    rng = np.random.default_rng(0)
    for shape, axis in ONE_PASS_SHAPES:
        x = rng.standard_normal(shape) * 3
        if op == "logsumexp":
            x = _specials(x, axis)
        x = jnp.asarray(x, dtype)
        got = kernels.reduce(x, axes=(axis,), op=op)
        assert got.dtype == x.dtype, (shape, axis)
        want = numpy_reduce(x, (axis,), op)
        assert_matches(got, want, dtype, np.sqrt(max(1, want.size)))


@pytest.mark.parametrize("backend", ONE_PASS)
@pytest.mark.parametrize("shape,axis", [((5, 70), 1), ((70, 3), 0), ((1, 200), 1)])
def test_a_long_reduced_axis_is_split_and_the_partials_recombine(kernels, backend, shape, axis):
    knobs = _plan_knobs(backend)
    plan = (_layout.rows_plan(*shape, 4, knobs) if axis == 1
            else _layout.columns_plan(1, *shape, 4, knobs))
    assert plan.n_pieces > 1, plan
    x = sample(shape, "logsumexp", jnp.float32, seed=1)
    for op in OPS:
        assert_matches(kernels.reduce(x, axes=(axis,), op=op),
                       xla_reduce.reduce(x, axes=(axis,), op=op), jnp.float32, scale=10.0)


@pytest.mark.parametrize("backend", ONE_PASS)
def test_all_negative_infinity_columns_and_huge_values(kernels):
    # Every column -inf, then values near the f32 limit (exp overflows
    # unless shifted by the max) beside -inf.
    x = np.full((300, 9), -np.inf, np.float32)
    assert np.all(np.asarray(kernels.reduce(jnp.asarray(x), axes=(0,), op="logsumexp")) == -np.inf)
    x[::7] = 3e38
    x[5, :] = -3e38
    assert_matches(kernels.reduce(jnp.asarray(x), axes=(0,), op="logsumexp"),
                   numpy_reduce(x, (0,), "logsumexp"), jnp.float32)


@pytest.mark.parametrize("backend", ONE_PASS)
@pytest.mark.parametrize("shape,axis", [((7, 301), 1), ((301, 7), 0)])
def test_logsumexp_gradient_is_the_softmax(kernels, shape, axis):
    x = jnp.asarray(np.random.default_rng(1).standard_normal(shape) * 3, jnp.float32)
    w = np.random.default_rng(2).standard_normal(np.delete(shape, axis))
    grad = jax.grad(lambda v: jnp.sum(kernels.reduce(v, axes=(axis,), op="logsumexp") * w))(x)
    x64 = np.asarray(x, np.float64)
    softmax = np.exp(x64 - np.expand_dims(numpy_reduce(x64, (axis,), "logsumexp"), axis))
    assert_close(grad, softmax * np.expand_dims(w, axis), jnp.float32)


# ---------------------------------------------------------------------------
# Plans and registration, per backend


def test_mosaic_cuts_a_long_single_row_into_rows():
    from nxops.kernels.pallas import reduce as pallas_reduce
    with small_blocks("pallas-mosaic"):
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


def test_pallas_default_platform_cpu_runs_interpret_mode():
    from nxops.kernels.pallas import reduce as pallas_reduce
    x = sample((9, 10), "sum", jnp.float32)
    assert_close(pallas_reduce.reduce(x, axes=(1,), op="sum", platform="cpu"), x.sum(1), jnp.float32)


@pytest.mark.parametrize("dtype,platform,unsupported", [
    (jnp.float32, "cuda", False), (jnp.bfloat16, "tpu", False), (jnp.float16, "cuda", False),
    (jnp.float16, "tpu", True), (jnp.int32, "cuda", True), (jnp.int8, "cpu", True),
])
def test_registry_takes_pallas_or_falls_back_with_a_reason(dtype, platform, unsupported):
    from nxops.kernels.pallas import reduce as pallas_reduce
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


@pytest.mark.parametrize("backend", backends("triton"))
def test_triton_is_selected_through_nxops_kernels_and_reported_by_explain(backend):
    x = jnp.asarray(np.random.default_rng(6).standard_normal((4, 9)), jnp.float32)
    with nx.kernels.use(backend):
        got = nx.logsumexp(x, 1)
        text = str(nx.kernels.explain(lambda v: nx.logsumexp(v, 1), x))
    assert_close(got, jax.nn.logsumexp(x, axis=1), jnp.float32)
    assert "triton:reduce" in text, text


@pytest.mark.parametrize("backend", backends("triton"))
def test_triton_declines_integers_saying_why(backend):
    from nxops.kernels.triton import reduce as triton_reduce
    ints = jax.ShapeDtypeStruct((4, 4), jnp.int32)
    reasons = triton_reduce.not_supported_reasons(ints, platform="cuda", axes=(0,), op="sum")
    assert any("int32" in r for r in reasons), reasons
    with nx.kernels.use(f"reduce={backend}"), pytest.raises(nx.NxopsError, match="int32"):
        nx.sum(jnp.ones((3, 4), jnp.int32), 0)
