"""Static proof that the GPU and TPU paths compile: every kernel, for several
shapes and dtypes, forward and gradient, lowers on CPU for cuda to Pallas's
Triton custom call (not Mosaic GPU) and for tpu to a Mosaic custom call whose
module parses and verifies. Grids and block shapes are checked against the
heuristic of ``_common.py`` for a few hand-computed cases.

Lowering needs no device, so shapes are abstract and may be large.
"""
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import pytest

from nxops.kernels import _gpu_target, _tpu_target
from nxops.kernels.pallas import dot_general as pallas_dot
from nxops.kernels.pallas import reduce as pallas_reduce
from nxops.kernels.pallas import tile as pallas_tile
from nxops.kernels.xla import reduce as xla_reduce
from tests.kernels._lowered import CALL_TARGET, kernel_calls, lower_text
from tests.kernels.test_dot_general import CASES as DOT_CASES
from tests.kernels.test_dot_general import FakeTpu, dot_general_problems

PLATFORMS = ("cuda", "tpu")
OPS = xla_reduce.REDUCE_OPS


def dtypes_for(platform):
    return (jnp.float32, jnp.bfloat16) + ((jnp.float16,) if platform == "cuda" else ())


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def assert_only_pallas_calls(text, platform, count, name_prefix):
    assert CALL_TARGET[platform] in text
    if platform == "cuda":
        assert "mosaic_gpu" not in text  # the Triton backend, not JAX 0.10's default
    calls = kernel_calls(text, platform)
    assert len(calls) == count, [c["name"] for c in calls]
    assert all(c["name"].startswith(name_prefix) for c in calls)
    return calls


# --- reductions ------------------------------------------------------------

REDUCE_CASES = [  # (shape, axes, number of kernel calls)
    ((13, 37), (1,), 1),
    ((37, 13), (0,), 1),
    ((4096, 1000), (1,), 1),
    # columns: 32 programs cannot fill a GPU, so cuda splits the reduced dim
    # (then reduces the partials); TPU and interpret mode run the Mosaic kernel.
    ((8, 3000, 4096), (1,), {"cuda": 2, "tpu": 1, "cpu": 1}),
    ((4, 5, 6, 7), (0, 2), 1),
    ((1, 1 << 20), (1,), 2),  # one long row: split, then the partials reduced
    ((7,), (0,), 1),
    ((3, 4), (), 1),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape,axes,count", REDUCE_CASES, ids=[f"{s}-{a}" for s, a, _ in REDUCE_CASES])
def test_reduce_lowers(platform, shape, axes, count):
    for dtype in dtypes_for(platform):
        for op in OPS:
            text = lower_text(lambda x: pallas_reduce.reduce(x, axes=axes, op=op, platform=platform),
                              spec(shape, dtype), platform=platform)
            assert_only_pallas_calls(text, platform, count[platform] if isinstance(count, dict)
                                     else count, "nxops_reduce_")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_reduce_gradient_lowers(platform):
    # value_and_grad: a sum's gradient alone does not need the forward kernel.
    for op in OPS:
        for axes in [(0,), (0, 2)]:
            text = lower_text(jax.value_and_grad(lambda x: jnp.sum(
                pallas_reduce.reduce(x, axes=axes, op=op, platform=platform))),
                spec((16, 24, 50), jnp.float32), platform=platform)
            # cuda over axis 0: 10 programs of 128 columns, each one step
            # of 4 tiles of 4 rows: too short to cut into pieces.
            assert_only_pallas_calls(text, platform, 1, "nxops_reduce_")


def test_reduce_blocks_cuda():
    # rows kernel (_layout.rows_plan): a 512-element tile of 16 bytes a thread
    # (4 warps), one row a program (4096 programs), two tiles a step.
    text = lower_text(lambda x: pallas_reduce.reduce(x, axes=(1,), op="sum", platform="cuda"),
                      spec((4096, 1000), jnp.float32), platform="cuda")
    (call,) = kernel_calls(text, "cuda")
    assert call["grid"] == (4096, 1, 1) and call["num_warps"] == 4
    # columns kernel: 256 bf16 columns (a warp's 16-byte loads side by side)
    # by 4 rows, 4 tiles a step: 8 x 16 = 128 programs walking 188 steps,
    # cut into 10 pieces of 20 (1280 programs >= _layout.GPU_FILL_PROGRAMS),
    # then a second call reduces the 10 partial rows, in 128-column blocks
    # (8 x 32 = 256 programs >= 132 SMs).
    text = lower_text(lambda x: pallas_reduce.reduce(x, axes=(1,), op="max", platform="cuda"),
                      spec((8, 3000, 4096), jnp.bfloat16), platform="cuda")
    first, second = kernel_calls(text, "cuda")
    assert first["grid"] == (8, 16, 10) and second["grid"] == (8, 32, 1)
    # One slab (4096^2 columns): 256 steps in 64 pieces that tile them
    # exactly (1024 programs), 256 in the second pass (16 columns each).
    text = lower_text(lambda x: pallas_reduce.reduce(x, axes=(0,), op="max", platform="cuda"),
                      spec((4096, 4096), jnp.bfloat16), platform="cuda")
    first, second = kernel_calls(text, "cuda")
    assert first["grid"] == (1, 16, 64) and second["grid"] == (1, 256, 1)


def test_reduce_blocks_tpu():
    # rows: 256-row blocks (cap), the whole 1000-long row (fits the 2048 cap).
    text = lower_text(lambda x: pallas_reduce.reduce(x, axes=(1,), op="sum", platform="tpu"),
                      spec((4096, 1000), jnp.float32), platform="tpu")
    (call,) = kernel_calls(text, "tpu")
    assert call["grid"] == (16, 1) and call["blocks"] == [(256, 1000), (256, 1)]
    assert "#tpu.dimension_semantics<arbitrary>" in call["module"]
    # columns: (reduced 256, inner 2048) blocks, reduced axis last in the grid.
    text = lower_text(lambda x: pallas_reduce.reduce(x, axes=(1,), op="logsumexp", platform="tpu"),
                      spec((8, 3000, 4096), jnp.bfloat16), platform="tpu")
    (call,) = kernel_calls(text, "tpu")
    assert call["grid"] == (8, 2, 12) and call["blocks"] == [(1, 256, 2048), (1, 1, 2048)]
    # prod halves its blocks: a power-of-two block of the 300-long row (512).
    text = lower_text(lambda x: pallas_reduce.reduce(x, axes=(1,), op="prod", platform="tpu"),
                      spec((16, 300), jnp.float32), platform="tpu")
    (call,) = kernel_calls(text, "tpu")
    assert call["blocks"] == [(16, 512), (16, 1)]


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(data=st.data())
def test_reduce_lowers_for_random_shapes(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 700), min_size=1, max_size=4), label="shape"))
    hypothesis.assume(math.prod(shape) < 2**31)  # larger inputs are declared unsupported
    axes = tuple(sorted(data.draw(st.sets(st.integers(0, len(shape) - 1)), label="axes")))
    op = data.draw(st.sampled_from(OPS), label="op")
    for platform in PLATFORMS:
        dtype = data.draw(st.sampled_from(dtypes_for(platform)), label="dtype")
        text = lower_text(lambda x: pallas_reduce.reduce(x, axes=axes, op=op, platform=platform),
                          spec(shape, dtype), platform=platform)
        assert CALL_TARGET[platform] in text


def test_inputs_beyond_int32_indexing_are_declared_unsupported():
    huge = spec((93, 205, 209, 539), jnp.float32)
    for reasons in (pallas_reduce.not_supported_reasons(huge, platform="cuda", axes=(1,), op="sum"),
                    pallas_tile.not_supported_reasons(huge, None, platform="tpu", dim=0, count=3)):
        assert any("2**31" in r for r in reasons)


# --- dot_general -------------------------------------------------------------

BIG = ((3, 1000, 300), (3, 300, 700), (((2,), (1,)), ((0,), (0,))))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape_a,shape_b,dn", DOT_CASES + [BIG],
                         ids=[f"{a}x{b}" for a, b, _ in DOT_CASES + [BIG]])
def test_dot_general_lowers(platform, shape_a, shape_b, dn):
    for dtype in dtypes_for(platform):
        for preferred in (None, jnp.float32):
            text = lower_text(lambda a, b: pallas_dot.dot_general(
                a, b, dimension_numbers=dn, preferred_element_type=preferred, platform=platform),
                spec(shape_a, dtype), spec(shape_b, dtype), platform=platform)
            assert_only_pallas_calls(text, platform, 1, "nxops_dot_general")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("precision", [None, jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST])
def test_dot_general_precisions_lower(platform, precision):
    a, b, dn = BIG
    text = lower_text(lambda a, b: pallas_dot.dot_general(
        a, b, dimension_numbers=dn, precision=precision, platform=platform),
        spec(a, jnp.float32), spec(b, jnp.float32), platform=platform)
    calls = assert_only_pallas_calls(text, platform, 1, "nxops_dot_general")
    if platform == "tpu":
        highest = "#tpu.contract_precision<fp32>" in calls[0]["module"]
        assert highest == (precision == jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_dot_general_gradient_lowers_to_three_kernels(platform):
    a, b, dn = DOT_CASES[5]
    text = lower_text(jax.value_and_grad(lambda a, b: jnp.sum(pallas_dot.dot_general(
        a, b, dimension_numbers=dn, platform=platform)), argnums=(0, 1)),
        spec(a, jnp.bfloat16), spec(b, jnp.bfloat16), platform=platform)
    assert_only_pallas_calls(text, platform, 3, "nxops_dot_general")


def test_dot_general_blocks():
    a, b, dn = BIG
    args = (spec(a, jnp.bfloat16), spec(b, jnp.bfloat16))
    # cuda: 128 x 128 output blocks (1000 / 128 -> 8, 700 / 128 -> 6) as one grid dim of
    # 48 tiles in grouped order, 8 warps, 3 stages; K looped in-kernel.
    (call,) = kernel_calls(lower_text(lambda a, b: pallas_dot.dot_general(
        a, b, dimension_numbers=dn, platform="cuda"), *args, platform="cuda"), "cuda")
    assert call["grid"] == (3, 48, 1) and (call["num_warps"], call["num_stages"]) == (8, 3)
    # tpu: 512 x 512 output blocks (cap), the whole K = 300 (under the 512 cap) in one step.
    (call,) = kernel_calls(lower_text(lambda a, b: pallas_dot.dot_general(
        a, b, dimension_numbers=dn, platform="tpu"), *args, platform="tpu"), "tpu")
    assert call["grid"] == (3, 2, 2, 1)
    assert call["blocks"] == [(1, 512, 300), (1, 300, 512), (1, 512, 512)]


@pytest.mark.parametrize("kind,chip", [("TPU v5 lite", "v5e"), ("TPU v6 lite", "v6e"),
                                       ("TPU v5", "v5p")])
def test_dot_general_tpu_tiles_follow_the_chip(kind, chip):
    # 4096^3 bf16: the chip's least-traffic tile (not 512^3, which reads A and B
    # 8 times each: 3.5x the MXU time on v6e by the traffic count).
    mm = (((1,), (0,)), ((), ()))
    args = (spec((4096, 4096), jnp.bfloat16),) * 2
    with _gpu_target.target_devices([FakeTpu(kind)]):
        (call,) = kernel_calls(lower_text(lambda a, b: pallas_dot.dot_general(
            a, b, dimension_numbers=mm, platform="tpu"), *args, platform="tpu"), "tpu")
    bm, bn, bk, _ = pallas_dot.mosaic_matmul_tiles(1, 4096, 4096, 4096, 2, 2,
                                                   _tpu_target.CHIPS[chip])
    assert call["blocks"] == [(1, bm, bk), (1, bk, bn), (1, bm, bn)] and bm * bn > 512 * 512
    assert call["grid"] == (1, 4096 // bm, 4096 // bn, 4096 // bk)


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(problem=dot_general_problems())
def test_dot_general_lowers_for_random_dimension_numbers(problem):
    shape_a, shape_b, dn = problem
    for platform in PLATFORMS:
        text = lower_text(lambda a, b: pallas_dot.dot_general(
            a, b, dimension_numbers=dn, platform=platform),
            spec(shape_a, jnp.bfloat16), spec(shape_b, jnp.bfloat16), platform=platform)
        assert_only_pallas_calls(text, platform, 1, "nxops_dot_general")


# --- tile --------------------------------------------------------------------

TILE_CASES = [((12, 5), 0, 3), ((12, 5), 1, 5), ((8, 4, 1024), 1, 4), ((4096, 8), 1, 2),
              ((40,), 0, 2), ((8, 4096 * 128), 1, 4)]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape,dim,count", TILE_CASES, ids=[f"{s}-{d}-{c}" for s, d, c in TILE_CASES])
def test_tile_lowers(platform, shape, dim, count):
    for dtype in dtypes_for(platform) + (jnp.int32,):
        fn = lambda x, i: pallas_tile.tile(x, i, dim=dim, count=count, platform=platform)
        text = lower_text(fn, spec(shape, dtype), spec((), jnp.int32), platform=platform)
        calls = assert_only_pallas_calls(text, platform, 1, "nxops_tile")
        if platform == "tpu":
            assert "scalar_prefetch = 1" in calls[0]["module"]
        if jnp.issubdtype(dtype, jnp.floating):
            grad = jax.value_and_grad(lambda x, i: jnp.sum(fn(x, i) ** 2))
            text = lower_text(grad, spec(shape, dtype), spec((), jnp.int32), platform=platform)
            assert_only_pallas_calls(text, platform, 1, "nxops_tile")


def test_tile_blocks_tpu():
    # The tile keeps the array's last dim (1024 lanes, no relayout); all 8 outer rows in
    # one block.
    text = lower_text(lambda x, i: pallas_tile.tile(x, i, dim=1, count=4, platform="tpu"),
                      spec((8, 4, 1024), jnp.float32), spec((), jnp.int32), platform="tpu")
    (call,) = kernel_calls(text, "tpu")
    assert call["grid"] == (1, 1, 1) and call["blocks"] == [(8, 1, 1, 1024), (8, 1, 1024)]
    # Tiling the last dim: the tile's 1024 elements as [8, 128].
    text = lower_text(lambda x, i: pallas_tile.tile(x, i, dim=1, count=4, platform="tpu"),
                      spec((8, 4096), jnp.float32), spec((), jnp.int32), platform="tpu")
    (call,) = kernel_calls(text, "tpu")
    assert call["grid"] == (1, 1, 1) and call["blocks"] == [(8, 1, 8, 128), (8, 8, 128)]


@pytest.mark.parametrize("n_tiles_m,n_tiles_n", [(1, 1), (3, 5), (8, 6), (17, 3), (9, 64)])
def test_grouped_program_order_visits_every_output_tile_once(n_tiles_m, n_tiles_n):
    tiles = [tuple(int(t) for t in pallas_dot._grouped_tile(jnp.int32(pid), n_tiles_m, n_tiles_n))
             for pid in range(n_tiles_m * n_tiles_n)]
    assert sorted(tiles) == [(i, j) for i in range(n_tiles_m) for j in range(n_tiles_n)]


@pytest.mark.parametrize("shape,itemsize,want", [
    ((4096, 4096, 4096), 2, (128, 256, 64, 8, 3)),  # no GPU here: the sm90 (H100) row
    ((4096, 4096, 4096), 4, (128, 128, 32, 8, 3)),
    ((8, 4096, 4096), 2, (16, 16, 256, 2, 3)),      # decode: narrowed to fill 132 SMs
    ((100, 60, 20), 2, (16, 16, 32, 2, 3)),
])
def test_triton_matmul_config_by_shape_class(shape, itemsize, want):
    assert pallas_dot.triton_matmul_config(*shape, itemsize) == want
