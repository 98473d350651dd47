"""Programs compiled for H100 and A100 on this CPU-only machine (XLA's GPU
compiler, ptxas from the nvcc wheel): the Pallas kernels' launch and resources,
and the collectives of sharded nx.xmap programs on 8 H100s at the ring bound."""
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests._extras import require_gpu_compile

require_gpu_compile()

import nxops as nx
from tests._deviceless import gpu

S = jax.ShapeDtypeStruct
ARCHS = ["h100", "a100"]


def _pallas(fn, *args, arch):
    with nx.kernels.use("pallas"):
        return gpu.compile_gpu(fn, *args, arch=arch)


@pytest.fixture(scope="module", params=ARCHS)
def compiled(request):
    """One compile per kernel family and dtype, per arch (cached for the module)."""
    arch = request.param
    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        big = S((4096, 4096), dtype)       # 64 / 32 MiB: over the 16 MiB "large" line
        name = jnp.dtype(dtype).name
        for key, op, axes in (("rows_sum", "sum", 1), ("rows_lse", "logsumexp", 1),
                              ("columns_max", "max", 0), ("columns_lse", "logsumexp", 0),
                              ("single_row_sum", "sum", (0, 1))):
            # Shared with test_reduce_sass's (the same programs): compiled once.
            out[key, name] = gpu.compile_reduction("pallas", op, axes, name, big.shape, arch)
        out["matmul", name] = _pallas(lambda a, b: nx.einsum("mk,kn->mn", a, b), big, big,
                                      arch=arch)
        out["matmul_skinny", name] = _pallas(lambda a, b: nx.einsum("mk,kn->mn", a, b),
                                             S((8, 4096), dtype), big, arch=arch)
        out["matmul_grad", name] = _pallas(jax.grad(
            lambda a, b: nx.einsum("mk,kn->mn", a, b).astype(jnp.float32).sum(), argnums=(0, 1)),
            big, big, arch=arch)
    return arch, out


def test_every_pallas_kernel_compiles_with_no_spills(compiled):
    arch, reports = compiled
    kernels = [k for r in reports.values() for k in r.kernels if k.name.startswith("nxops")]
    assert len(kernels) >= len(reports)
    for k in kernels:
        assert k.registers is not None, f"{arch} {k.name}: ptxas gave no register count"
        assert (k.spill_stores, k.spill_loads) == (0, 0), f"{arch} {k.name} spills"
        assert k.ctas_per_sm >= 1, f"{arch} {k.name} does not fit an SM"


def _tensor_core_n(k) -> int:
    return int(re.search(r"n(\d+)k", k.tensor_core).group(1))


def test_matmul_kernels_use_the_architectures_tensor_cores(compiled):
    # f32 at DEFAULT precision runs TF32 tensor cores (k8 shapes).
    arch, reports = compiled
    want = "wgmma." if arch == "h100" else "mma."
    for key in (("matmul", "float32"), ("matmul", "bfloat16"), ("matmul_grad", "bfloat16")):
        for k in reports[key].kernels:
            if k.name.startswith("nxops_dot_general"):
                assert k.tensor_core and k.tensor_core.startswith(want), (arch, key, k)
                if arch == "h100":
                    assert _tensor_core_n(k) >= 128, (key, k.tensor_core)


def test_matmul_configuration_follows_the_architecture_and_shape(compiled):
    arch, reports = compiled
    big = reports["matmul", "bfloat16"].kernel("nxops_dot_general")
    # 4096^2 outputs: 128x256 tiles on H100 (512 programs), 128x128 on A100 (1024).
    assert big.blocks == {"h100": 512, "a100": 1024}[arch], (arch, big.grid)
    assert big.warps == 8
    # Decode-shaped 8x4096x4096: tiles narrowed until the launch fills the SMs
    # (16x16 on H100: 256 programs; 16x32 on A100: 128), mma on tensor cores.
    skinny = reports["matmul_skinny", "bfloat16"].kernel("nxops_dot_general")
    assert skinny.blocks == {"h100": 256, "a100": 128}[arch] and skinny.warps == 2, (arch, skinny)
    assert skinny.blocks >= gpu.ARCHS[arch].sm_count
    assert skinny.tensor_core and skinny.tensor_core.startswith("mma."), (arch, skinny)


def test_highest_precision_f32_matmul_stays_off_tensor_cores():
    S32 = S((1024, 1024), jnp.float32)
    with jax.default_matmul_precision("highest"):
        report = _pallas(lambda a, b: nx.einsum("mk,kn->mn", a, b), S32, S32, arch="h100")
    assert report.kernel("nxops_dot_general").tensor_core is None


REDUCTIONS = ("rows_sum", "rows_lse", "columns_max", "columns_lse", "single_row_sum")


def _first_pass(report):
    """The reduction kernel that reads the input (a split adds a second,
    ``nxops_reduce_*__1``, over the partial results)."""
    (k,) = [k for k in report.kernels if k.name.startswith("nxops_reduce") and "__" not in k.name]
    return k


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_reductions_launch_at_least_one_cta_per_sm_whatever_the_axes(compiled, dtype):
    # 4096x4096 is 64 / 32 MiB: rows, columns (reduced dim split across
    # programs) and the whole array as one long row all fill every SM.
    arch, reports = compiled
    for name in REDUCTIONS:
        k = _first_pass(reports[name, dtype])
        assert k.blocks >= gpu.ARCHS[arch].sm_count, (arch, name, dtype, k.grid)


def test_split_reductions_add_one_small_second_pass(compiled):
    arch, reports = compiled
    for name in ("columns_max", "columns_lse", "single_row_sum"):
        kernels = [k for k in reports[name, "float32"].kernels if k.name.startswith("nxops_reduce")]
        assert len(kernels) == 2, (arch, name, [k.name for k in kernels])
        first, second = kernels   # in launch order
        if name.startswith("columns"):
            # The second pass over 4096 columns of partials: narrow column
            # blocks give it a program per SM (it ran on 4).
            assert second.blocks >= gpu.ARCHS[arch].sm_count, (arch, name, second.grid)
        else:
            assert second.blocks <= first.blocks // 32, (arch, name, first.grid, second.grid)


def test_logsumexp_keeps_per_lane_statistics_at_four_ctas_per_sm(compiled):
    arch, reports = compiled
    for name in ("rows_lse", "columns_lse"):
        for dtype in ("float32", "bfloat16"):
            k = _first_pass(reports[name, dtype])
            assert k.ctas_per_sm >= 4, (arch, name, dtype, k.registers, k.ctas_per_sm)


def test_occupancy_follows_from_registers_threads_and_shared_memory():
    h100 = gpu.ARCHS["h100"]
    assert gpu._ctas_per_sm(h100, (256, 1, 1), 30, 128) == 8        # threads bound (2048/256)
    assert gpu._ctas_per_sm(h100, (256, 1, 1), 98, 0) == 2          # registers bound
    assert gpu._ctas_per_sm(h100, (128, 1, 1), 32, 100_000) == 2    # shared memory bound


COLLECTIVES = {
    "untile": (lambda v: nx.untile(v, {"a": 0}), [...]),
    "all_gather": (lambda v: nx.all_gather(v, "a"), [...]),
    "psum_scatter": (lambda v: nx.psum_scatter(v, "a", tiled=True), ["a", ...]),
    "psum": (lambda v: nx.psum(v, "a"), [...]),
    "sum_then_tile": (lambda v: nx.tile(nx.psum(v, "a"), {"a": 0}), ["a", ...]),
}


@pytest.mark.parametrize("op", COLLECTIVES)
def test_collectives_on_eight_h100s_send_the_ring_lower_bound(op):
    body, out_axes = COLLECTIVES[op]
    mesh = gpu.gpu_mesh("h100", (8,), ("x",))
    x = S((8, 4096), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    f = nx.xmap(body, ["a", ...], out_axes, axis_resources={"a": "x"})
    report = gpu.compile_gpu(f, x, arch="h100", mesh_shape=(8,), mesh_axes=("x",))
    (c,) = nx.hlo.collectives(report.hlo_text)
    assert c.group_size == 8
    assert c.ratio == pytest.approx(1.0), (op, c)
