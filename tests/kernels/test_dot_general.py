"""The contraction kernels of every backend (``nxops/kernels/{pallas,triton}/dot_general.py``)
against ``lax.dot_general`` (the xla reference) and NumPy (float64 einsum):
any dimension numbers, several blocks in M, N and K, f32/bf16/f16, NaN and
inf, gradients, vmap and jit; then each backend's tile tables and choices."""
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from nxops._errors import NxopsError
from nxops.kernels import _choice, _gpu_target, _knobs, _selection, _tpu_target
from nxops.kernels.pallas import dot_general as pallas_dot
from nxops.kernels.xla import dot_general as xla_dot
from tests._tolerances import assert_close
from tests.kernels._reference import assert_matches, backends, numpy_dot_general, operands

HIGHEST = lax.Precision.HIGHEST
MATMUL = (((1,), (0,)), ((), ()))

# (a shape, b shape, dimension_numbers): plain matmul 1xK / Mx1 / odd sizes,
# several blocks in M, N and K (with the small test blocks of each style),
# batched with batch dims not in front, contraction over several dims in any
# order, a vector dot, and an outer product (K = 1).
CASES = [
    ((1, 40), (40, 33), MATMUL),
    ((37, 5), (5, 1), MATMUL),
    ((40, 300), (300, 270), MATMUL),
    ((2, 5, 7), (2, 9, 7), (((2,), (2,)), ((0,), (0,)))),
    ((7, 3, 5), (2, 7, 3), (((0, 1), (1, 2)), ((), ()))),
    ((3, 4, 37, 2), (2, 37, 3, 20), (((2,), (1,)), ((3, 0), (0, 2)))),
    ((6,), (6,), (((0,), (0,)), ((), ()))),
    ((5, 1), (1, 6), MATMUL),
]


def contracted_size(a, dimension_numbers):
    return math.prod(a.shape[d] for d in dimension_numbers[0][0])


def jitted(kernels, dn, **kw):
    return jax.jit(lambda a, b: kernels.dot_general(a, b, dimension_numbers=dn, **kw))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("shape_a,shape_b,dn", CASES, ids=[f"{a}x{b}" for a, b, _ in CASES])
def test_matches_reference_and_numpy_f32(kernels, shape_a, shape_b, dn):
    a, b = operands(shape_a, shape_b, jnp.float32)
    got = jitted(kernels, dn, precision=HIGHEST)(a, b)
    want = xla_dot.dot_general(a, b, dimension_numbers=dn, precision=HIGHEST)
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = math.sqrt(contracted_size(a, dn))
    assert_close(got, want, jnp.float32, scale)
    assert_close(got, numpy_dot_general(a, b, dn), jnp.float32, scale)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("preferred", [None, jnp.float32])
def test_half_precision_inputs_and_output_dtype(kernels, dtype, preferred):
    shape_a, shape_b, dn = CASES[2]
    a, b = operands(shape_a, shape_b, dtype)
    got = jitted(kernels, dn, preferred_element_type=preferred)(a, b)
    want = lax.dot_general(a, b, dn, preferred_element_type=preferred)
    assert got.dtype == want.dtype
    # The kernel accumulates in f32: against float64 only the output is rounded.
    out_dtype = preferred or dtype
    scale = math.sqrt(contracted_size(a, dn))
    assert_close(got, numpy_dot_general(a, b, dn), out_dtype, scale)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("case", [2, 3, 5])
def test_gradient_matches_reference(kernels, case):
    shape_a, shape_b, dn = CASES[case]
    a, b = operands(shape_a, shape_b, jnp.float32, seed=case)
    w = jnp.asarray(np.random.default_rng(9).standard_normal(
        lax.dot_general(a, b, dn).shape), jnp.float32)

    def loss(fn, a, b):
        return jnp.sum(fn(a, b, dimension_numbers=dn, precision=HIGHEST) * w)

    got = jax.jit(jax.grad(lambda a, b: loss(kernels.dot_general, a, b), argnums=(0, 1)))(a, b)
    want = jax.grad(lambda a, b: loss(xla_dot.dot_general, a, b), argnums=(0, 1))(a, b)
    scale = math.sqrt(max(a.size, b.size))
    for g, h in zip(got, want):
        assert_close(g, h, jnp.float32, scale)


@st.composite
def dot_general_problems(draw):
    """Random operand shapes and dimension_numbers (batch, contracting and
    free dims in random positions of both operands)."""
    kinds = draw(st.lists(st.sampled_from(["batch", "contract", "a_free", "b_free"]),
                          min_size=1, max_size=5))
    # Few batch elements: Triton's interpreter runs every program in Python.
    sizes = [draw(st.integers(1, 3 if kind == "batch" else 20)) for kind in kinds]
    a_dims = [i for i, k in enumerate(kinds) if k != "b_free"]
    b_dims = [i for i, k in enumerate(kinds) if k != "a_free"]
    a_order = draw(st.permutations(a_dims))
    b_order = draw(st.permutations(b_dims))
    pos_a = {d: p for p, d in enumerate(a_order)}
    pos_b = {d: p for p, d in enumerate(b_order)}
    pick = lambda kind, pos: tuple(pos[i] for i, k in enumerate(kinds) if k == kind)
    dn = ((pick("contract", pos_a), pick("contract", pos_b)),
          (pick("batch", pos_a), pick("batch", pos_b)))
    return (tuple(sizes[d] for d in a_order), tuple(sizes[d] for d in b_order), dn)


@pytest.mark.parametrize("backend", backends())
@hypothesis.settings(max_examples=10, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(problem=dot_general_problems())
def test_random_dimension_numbers(kernels, problem):
    shape_a, shape_b, dn = problem
    a, b = operands(shape_a, shape_b, jnp.float32)
    got = jitted(kernels, dn, precision=HIGHEST)(a, b)
    scale = math.sqrt(max(1, contracted_size(a, dn)))
    assert_close(got, numpy_dot_general(a, b, dn), jnp.float32, scale)


@pytest.mark.parametrize("backend", backends())
def test_nan_inf_and_preferred_element_type(kernels):
    a = jnp.asarray(np.random.default_rng(3).standard_normal((20, 40)), jnp.bfloat16)
    a = a.at[3, 7].set(jnp.nan).at[5, 1].set(jnp.inf)
    b = jnp.ones((40, 18), jnp.bfloat16)
    got = kernels.dot_general(a, b, dimension_numbers=MATMUL, preferred_element_type=jnp.float32)
    want = lax.dot_general(a, b, MATMUL, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32
    assert_matches(got, want, jnp.bfloat16, scale=8.0)


@pytest.mark.parametrize("backend", backends())
def test_vmap_folds_into_the_batch(kernels):
    a, b = operands((2, 19, 23), (23, 2, 17), jnp.float32, seed=4)
    dims = (((2,), (0,)), ((0,), (1,)))
    kernel = lambda a, b: kernels.dot_general(a, b, dimension_numbers=dims, precision=HIGHEST)
    reference = lambda a, b: lax.dot_general(a, b, dims, precision=HIGHEST)
    stacked = jnp.stack([a, 2 * a])
    assert_close(jax.vmap(kernel, in_axes=(0, None))(stacked, b),
                 jax.vmap(reference, in_axes=(0, None))(stacked, b), jnp.float32, scale=5.0)


def test_pallas_default_platform_cpu_runs_interpret_mode():
    a, b = operands((9, 10), (10, 11), jnp.float32)
    got = pallas_dot.dot_general(a, b, dimension_numbers=MATMUL, precision=HIGHEST)
    assert_close(got, numpy_dot_general(a, b, MATMUL), jnp.float32, math.sqrt(10))


@pytest.mark.parametrize("a_dtype,b_dtype,platform,kw,reason", [
    (jnp.int32, jnp.int32, "cuda", {}, "integer"),
    (jnp.float32, jnp.bfloat16, "cuda", {}, "different dtypes"),
    (jnp.float16, jnp.float16, "tpu", {}, "float16"),
    (jnp.float32, jnp.float32, "tpu", {"precision": lax.Precision.HIGH}, "HIGH"),
    (jnp.float32, jnp.float32, "cuda", {"precision": lax.DotAlgorithmPreset.BF16_BF16_F32},
     "DotAlgorithmPreset"),
])
def test_unsupported_cases_fall_back_or_raise(a_dtype, b_dtype, platform, kw, reason):
    avals = [jax.ShapeDtypeStruct((4, 8), a_dtype), jax.ShapeDtypeStruct((8, 2), b_dtype)]
    params = dict(dimension_numbers=MATMUL, precision=None, preferred_element_type=None)
    params.update(kw)
    auto = _choice.choose("dot_general", platform, _selection.parse_selection("auto"), avals,
                            **params)
    assert auto.kernel.backend == "xla"
    with pytest.raises(NxopsError, match=reason):
        _choice.choose("dot_general", platform, _selection.parse_selection("pallas"), avals,
                         **params)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_registry_picks_a_kernel_for_supported_cases(platform):
    avals = [jax.ShapeDtypeStruct((4, 8), jnp.bfloat16), jax.ShapeDtypeStruct((8, 2), jnp.bfloat16)]
    # auto keeps cuBLAS / XLA's dots: unmeasured on cuda (XLA), nothing measured on TPU
    choice = _choice.choose("dot_general", platform, _selection.parse_selection("auto"), avals,
                              dimension_numbers=MATMUL, precision=None,
                              preferred_element_type=jnp.float32)
    why = {"cuda": "unmeasured on sm_90", "tpu": "nothing measured on tpu"}[platform]
    assert choice.kernel.backend == "xla" and why in choice.describe()
    pallas = _choice.choose("dot_general", platform, _selection.parse_selection("pallas"), avals,
                              dimension_numbers=MATMUL, precision=None,
                              preferred_element_type=jnp.float32)
    assert pallas.kernel is pallas_dot.KERNEL


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("precision", ["float32", "highest", "bfloat16"])
def test_bf16_matmul_under_a_global_matmul_precision_matches_numpy(kernels, precision):
    # Users set jax.default_matmul_precision globally; the kernel must run under it
    # (interpret mode on CPU once failed: DotThunk BF16 x BF16 = F32 unimplemented).
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((130, 300)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((300, 70)), jnp.bfloat16)
    dn = (((1,), (0,)), ((), ()))
    want = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    with jax.default_matmul_precision(precision):
        got = kernels.dot_general(a, b, dimension_numbers=dn)
        grad = jax.grad(lambda a: kernels.dot_general(
            a, b, dimension_numbers=dn).astype(jnp.float32).sum())(a)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-1)
    np.testing.assert_allclose(np.asarray(grad, np.float32),
                               np.broadcast_to(np.asarray(b, np.float32).sum(1), a.shape),
                               rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("arch,itemsize,shape,want", [
    ("sm90", 2, (4096, 4096, 4096), (128, 256, 64, 8, 3)),    # wgmma m64n256, enough tiles
    ("sm90", 2, (1024, 1024, 1024), (64, 64, 128, 4, 3)),     # 128x128: 64 programs, 132 SMs
    ("sm90", 4, (4096, 4096, 4096), (128, 128, 32, 8, 3)),    # TF32
    ("sm80", 2, (4096, 4096, 4096), (128, 128, 64, 8, 3)),    # mma.sync within 163 KiB
    ("sm80", 4, (4096, 4096, 4096), (128, 128, 32, 8, 3)),
    ("sm90", 2, (8, 4096, 4096), (16, 16, 256, 2, 3)),        # decode: 256 programs, 132 SMs
    ("sm80", 2, (8, 4096, 4096), (16, 32, 256, 2, 3)),        # 128 programs, 108 SMs
    ("sm90", 2, (128, 4096, 4096), (64, 32, 128, 2, 3)),      # B read by 2 rows of tiles
    ("sm80", 4, (8, 20, 8), (16, 16, 32, 2, 3)),
])
def test_triton_matmul_config_is_chosen_per_architecture_and_shape(arch, itemsize, shape, want):
    n_m, n_k, n_n = shape
    assert pallas_dot.triton_matmul_config(n_m, n_n, n_k, itemsize, arch) == want


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
@pytest.mark.parametrize("shape", [(8, 4096, 4096), (128, 4096, 4096), (1, 4096, 14336),
                                   (8, 14336, 4096), (1024, 1024, 1024), (3, 300, 700)])
def test_skinny_matmul_tiles_fill_the_sms_in_one_launch(arch, shape):
    # Decode shapes: tiles narrowed (no split-K: its partials need a second launch)
    # until the launch has a program per SM, where the output has that many 16x16 tiles.
    n_m, n_k, n_n = shape
    bm, bn, bk, warps, stages = pallas_dot.triton_matmul_config(n_m, n_n, n_k, 2, arch)
    programs = -(-n_m // bm) * -(-n_n // bn)
    assert programs >= min(_gpu_target.SM_COUNT[arch], -(-n_m // 16) * -(-n_n // 16))
    assert min(bm, bn, bk) >= 16 and stages * (bm + bn) * bk * 2 <= 160 * 1024


def test_gpu_arch_comes_from_the_lowering_devices_else_defaults_to_hopper():
    class FakeGpu:
        platform, compute_capability = "gpu", "8.0"

    assert _gpu_target.gpu_arch() == "sm90"                  # no GPU here: Pallas' own default
    with _gpu_target.target_devices([FakeGpu()]):
        assert _gpu_target.gpu_arch() == "sm80"
        with _gpu_target.target_devices(jax.devices("cpu")):  # not a GPU: the choice stays
            assert _gpu_target.gpu_arch() == "sm80"
    assert _gpu_target.gpu_arch() == "sm90"


# --- Mosaic tiles per TPU generation ----------------------------------------------


class FakeTpu:
    platform = "tpu"

    def __init__(self, device_kind):
        self.device_kind = device_kind


def test_tpu_generation_comes_from_the_lowering_devices():
    assert _tpu_target.tpu_chip() is None                   # none known: the generic tile
    with _gpu_target.target_devices([FakeTpu("TPU v6 lite")]):
        assert _tpu_target.tpu_chip().name == "v6e"
        with _gpu_target.target_devices(jax.devices("cpu")):  # not a TPU: the choice stays
            assert _tpu_target.tpu_chip().name == "v6e"
    assert [_tpu_target.chip_for_kind(k) for k in ("TPU v5 lite", "TPU v5", "TPU v5p", "TPU v4",
                                                   "cpu")] == ["v5e", "v5p", "v5p", "v4", None]


# (M, K, N): LLM projections / FFN / LM heads, decode, and odd sizes.
TPU_SHAPES = [(8192, 8192, 8192), (4096, 4096, 14336), (4096, 14336, 4096),
              (16384, 8192, 14336), (4096, 4096, 128256), (8, 4096, 4096), (128, 4096, 4096),
              (1000, 700, 1100), (3, 5000, 300)]


@pytest.mark.parametrize("chip", ["v5e", "v5p", "v6e"])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_mosaic_tiles_fit_vmem_and_model_no_slower_than_the_generic_tile(chip, itemsize):
    spec = _tpu_target.CHIPS[chip]
    for n_m, n_k, n_n in TPU_SHAPES:
        args = (1, n_m, n_n, n_k)
        bm, bn, bk, limit = pallas_dot.mosaic_matmul_tiles(*args, itemsize, itemsize, spec)
        assert bm == n_m or bm % 8 == 0, (chip, bm)            # legal Mosaic blocks
        assert bn == n_n or bn % spec.mxu == 0, (chip, bn)
        assert bk == n_k or bk % 128 == 0, (chip, bk)
        vmem = pallas_dot.matmul_tile_vmem(bm, bn, bk, itemsize, itemsize, n_k % bk != 0)
        assert vmem <= spec.vmem_bytes // 2 and vmem < limit <= spec.vmem_bytes
        generic = pallas_dot.mosaic_matmul_tiles(*args, itemsize, itemsize, None)[:3]
        assert (pallas_dot.matmul_tile_seconds(*args, bm, bn, bk, itemsize, itemsize, spec)
                <= pallas_dot.matmul_tile_seconds(*args, *generic, itemsize, itemsize, spec))
        # A stays in VMEM across column blocks only when K is one block.
        traffic = pallas_dot.matmul_tile_traffic(*args, bm, bn, bk, itemsize, itemsize)
        a_reads = 1 if bk == n_k else -(-n_n // bn)
        assert traffic == itemsize * (n_m * n_k * a_reads + n_k * n_n * -(-n_m // bm) + n_m * n_n)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mosaic_matmul_in_a_chips_tiles_matches_numpy_on_edge_blocks(dtype):
    # Tiles chosen for v5e within 128 caps: 128^3 blocks, edges in M, N and K.
    dn = (((2,), (1,)), ((0,), (0,)))
    a, b = operands((2, 300, 260), (2, 260, 390), dtype)
    a = a.at[1, 7, 3].set(jnp.nan)
    with (_gpu_target.target_devices([FakeTpu("TPU v5 lite")]),
          _knobs.tuned("pallas.mosaic", m=128, n=128, k=128)):
        assert pallas_dot.mosaic_matmul_tiles(
            2, 300, 390, 260, 4, 4, _tpu_target.tpu_chip())[:3] == (128, 128, 128)
        got = pallas_dot.dot_general_in_style(a, b, dimension_numbers=dn, precision=HIGHEST,
                                              style="mosaic")
    want = numpy_dot_general(a, b, dn)
    assert np.isnan(np.asarray(got, np.float32)[1, 7]).all()
    assert_close(got, want, dtype, math.sqrt(260))


# --- the Triton backend's choices ---------------------------------------------------


@pytest.mark.parametrize("backend", backends("triton"))
def test_triton_f32_precision_follows_the_argument_and_the_default(backend):
    from nxops.kernels.triton import dot_general as triton_dot
    assert triton_dot.input_precision(None, jnp.float32) == "tf32"
    assert triton_dot.input_precision(HIGHEST, jnp.float32) == "ieee"
    assert triton_dot.input_precision((lax.Precision.DEFAULT,) * 2, jnp.float32) == "tf32"
    with jax.default_matmul_precision("float32"):
        assert triton_dot.input_precision(None, jnp.float32) == "ieee"


@pytest.mark.parametrize("backend", backends("triton"))
def test_triton_declines_mixed_dtypes_saying_why(backend):
    from nxops.kernels.triton import dot_general as triton_dot
    reasons = triton_dot.not_supported_reasons(
        jax.ShapeDtypeStruct((4, 4), jnp.float32), jax.ShapeDtypeStruct((4, 4), jnp.bfloat16),
        platform="cuda", dimension_numbers=MATMUL)
    assert any("different dtypes" in r for r in reasons), reasons
