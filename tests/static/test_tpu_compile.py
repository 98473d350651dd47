"""Programs compiled for TPU v5e, v5p and v6e on this CPU-only machine (libtpu,
deviceless): every Mosaic kernel compiles forward and backward in f32 and bf16
(a Mosaic error fails the module's fixture, as it would fail on a TPU), the
compiled programs have a memory analysis, and each kernel's pl.CostEstimate
(the traffic XLA's scheduler is told) is the analytic count and reaches XLA.
Whether a kernel is faster than XLA is bench/static/model.py's question
(bench/static/test_model.py), never answered from these estimates."""
import jax
import jax.numpy as jnp
import pytest

from tests._extras import require_extra

require_extra("compile", "libtpu")
from jax import lax

import nxops as nx
from nxops.kernels import _tpu_target
from nxops.kernels.pallas import _common
from nxops.kernels.pallas import dot_general as pallas_dot
from tests._deviceless import tpu

S = jax.ShapeDtypeStruct
CHIPS = ["v5e", "v5p", "v6e"]
DTYPES = [jnp.float32, jnp.bfloat16]


def _loss(f):
    return lambda *a: jnp.sum(jnp.square(f(*a).astype(jnp.float32)))


def _grad(f, argnums=0):
    return jax.grad(_loss(f), argnums=argnums)


matmul = lambda a, b: nx.einsum("mk,kn->mn", a, b)
all_gather = lambda v: nx.all_gather(v, "x", axis=0, tiled=True)
reduce_scatter = lambda v: nx.psum_scatter(v, "x", scatter_dimension=0, tiled=True)
tile = lambda v: nx.tile(v, {"x": 0})

# name: (program, per-chip shapes, the Mosaic kernels it must contain). Shapes
# are not multiples of the blocks (masked edge blocks), per chip of a 4-chip slice.
PROGRAMS = {
    "rows_logsumexp": (lambda v: nx.logsumexp(v, 1), [(1000, 3000)],
                       ["nxops_reduce_rows_logsumexp"]),
    "columns_sum": (lambda v: nx.sum(v, 0), [(1000, 3000)], ["nxops_reduce_columns_sum"]),
    "long_row_max": (lambda v: nx.max(v, 1), [(2, 1 << 16)], ["nxops_reduce_rows_max"] * 2),
    # max's tangent weights come from the tie mask and the arg-max (r18), counted
    # in the same fusion as the mask: no second kernel
    "grad_rows_max": (_grad(lambda v: nx.max(v, 1)), [(1000, 3000)],
                      ["nxops_reduce_rows_max"]),
    "grad_columns_logsumexp": (_grad(lambda v: nx.logsumexp(v, 0)), [(1000, 3000)],
                               ["nxops_reduce_columns_logsumexp"]),
    "matmul": (matmul, [(1000, 700), (700, 1100)], ["nxops_dot_general"]),
    "grad_matmul": (_grad(matmul, (0, 1)), [(300, 700), (700, 500)], ["nxops_dot_general"] * 3),
    "tile": (tile, [(1024, 384)], ["nxops_tile"]),
    "tile_lane_sparse": (tile, [(40, 100)], ["nxops_tile"]),
    "grad_tile": (_grad(tile), [(1024, 384)], ["nxops_tile"]),
    "all_gather": (all_gather, [(2048, 128)], ["nxops_ring_all_gather"]),
    "all_gather_unsplit": (all_gather, [(8, 128)], ["nxops_ring_all_gather"]),
    "grad_all_gather": (_grad(all_gather), [(2048, 128)], ["nxops_ring_all_gather"]),
    "reduce_scatter": (reduce_scatter, [(2048, 128)], ["nxops_ring_reduce_scatter"]),
    "grad_reduce_scatter": (_grad(reduce_scatter), [(2048, 128)], ["nxops_ring_reduce_scatter"]),
}


@pytest.fixture(scope="module", params=CHIPS)
def compiled(request):
    """Every program in f32 and bf16 for one chip, with NXOPS_KERNELS=pallas."""
    chip = request.param
    out = {}
    for dtype in DTYPES:
        for name, (fn, shapes, _) in PROGRAMS.items():
            with nx.kernels.use("pallas"):
                out[name, jnp.dtype(dtype).name] = tpu.compile_tpu(
                    fn, *[S(s, dtype) for s in shapes], chip=chip)
    return chip, out


def test_every_mosaic_kernel_compiles_forward_and_backward(compiled):
    chip, reports = compiled
    for (name, dtype), report in reports.items():
        assert sorted(report.kernels) == sorted(PROGRAMS[name][2]), (chip, name, dtype,
                                                                     report.kernels)


def test_compiled_programs_have_a_memory_analysis(compiled):
    chip, reports = compiled
    for (name, dtype), report in reports.items():
        # HBM arrays are padded to whole (8 or 16, 128) tiles
        size = jnp.dtype(dtype).itemsize
        inputs = sum(size * r * c for r, c in PROGRAMS[name][1])
        padded = sum(size * -(-r // 16) * 16 * -(-c // 128) * 128 for r, c in PROGRAMS[name][1])
        assert inputs <= report.memory["argument_size_in_bytes"] <= padded, (chip, name, dtype)
        assert report.memory["output_size_in_bytes"] > 0, (chip, name, dtype)
        assert report.memory["generated_code_size_in_bytes"] > 0, (chip, name, dtype)


def test_each_kernel_declares_its_cost_and_xla_counts_it(compiled):
    chip, reports = compiled
    for dtype in ("float32", "bfloat16"):
        itemsize = jnp.dtype(dtype).itemsize
        lse = reports["rows_logsumexp", dtype]
        n = 1000 * 3000
        assert lse.estimates == [(4 * n, n + 1000, (n + 1000) * itemsize)], (chip, dtype)
        mm = reports["matmul", dtype]
        flops = 2 * 1000 * 700 * 1100
        ((mm_flops, _, mm_bytes),) = mm.estimates
        # The chip's tile (chosen by its traffic): the kernel declares that traffic,
        # so the chip was known when the kernel lowered.
        tiles = pallas_dot.mosaic_matmul_tiles(1, 1000, 1100, 700, itemsize, itemsize,
                                               _tpu_target.CHIPS[chip])[:3]
        assert (mm_flops, mm_bytes) == (flops, pallas_dot.matmul_tile_traffic(
            1, 1000, 1100, 700, *tiles, itemsize, itemsize)), (chip, dtype, tiles)
        # XLA's cost model adds the kernels' estimates to the program's cost
        assert lse.cost["transcendentals"] >= n, (chip, dtype, lse.cost)
        assert mm.cost["flops"] >= flops, (chip, dtype, mm.cost)
        for name in ("all_gather", "reduce_scatter", "tile"):
            (est,) = reports[name, dtype].estimates
            assert est[2] > 0, (chip, name, dtype)


def test_the_cost_helper_counts_every_read_and_write():
    est = _common.cost_estimate([((4, 8), jnp.bfloat16)] * 3, [S((2, 2), jnp.float32)],
                                flops=7, transcendentals=3, remote_bytes=5)
    assert (est.flops, est.transcendentals, est.bytes_accessed,
            est.remote_bytes_transferred) == (7, 3, 3 * 64 + 16, 5)


def test_xla_baseline_has_a_tpu_cost_model_time():
    report = tpu.compile_tpu(lambda v: lax.reduce_max(v, (1,)), S((1024, 1024), jnp.float32),
                             chip="v5e")
    assert report.kernels == []
    assert report.optimal_seconds > 0


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_llm_matmul_compiles_in_the_chips_large_tiles(chip):
    # 4096^3 bf16 takes 1024-row tiles and a raised VMEM limit (tens of MiB): Mosaic
    # accepts them on the chip (a scoped-VMEM overflow is a compile error).
    tiles = pallas_dot.mosaic_matmul_tiles(1, 4096, 4096, 4096, 2, 2, _tpu_target.CHIPS[chip])
    assert tiles[0] >= 1024 and tiles[3] > 32 << 20, tiles
    with nx.kernels.use("pallas"):
        report = tpu.compile_tpu(matmul, S((4096, 4096), jnp.bfloat16),
                                 S((4096, 4096), jnp.bfloat16), chip=chip)
    assert report.kernels == ["nxops_dot_general"]
