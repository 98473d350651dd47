"""The triton backend compiled for H100 and A100 on this CPU-only machine:
jax-triton lowers each kernel to PTX for the given compute capability, ptxas
(nvcc wheel) assembles it, and the whole program compiles with XLA's GPU
compiler. The static targets: no spills, tensor cores with large tiles in the
matmul, at least one CTA per SM for large reductions, logsumexp occupancy."""
import jax
import jax.numpy as jnp
import pytest

from tests._extras import require_extra, require_gpu_compile

require_extra("triton", "triton", "jax_triton")
require_gpu_compile()

import nxops as nx
from tests._deviceless import gpu
from nxops.kernels.triton import dot_general as triton_dot

S = jax.ShapeDtypeStruct
ARCHS = ["h100", "a100"]
LARGE = (4096, 4096)   # 64 / 32 MiB: over the 16 MiB "large" line


def _triton(fn, *args, arch, **mesh):
    with nx.kernels.use("triton"):
        report = gpu.compile_gpu(fn, *args, arch=arch, **mesh)
    kernels = [k for k in report.kernels if k.name.startswith("nxops_triton")]
    assert kernels, f"no Triton kernel in {[k.name for k in report.kernels]}"
    return kernels


def _matmul(a, b):
    return nx.einsum("mk,kn->mn", a, b)


@pytest.fixture(scope="module", params=ARCHS)
def compiled(request):
    arch = request.param
    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        big = S(LARGE, dtype)
        out["rows_sum", name] = _triton(lambda v: nx.sum(v, 1), big, arch=arch)
        out["columns_max", name] = _triton(lambda v: nx.max(v, 0), big, arch=arch)
        out["rows_lse", name] = _triton(lambda v: nx.logsumexp(v, 1), big, arch=arch)
        out["one_row_lse", name] = _triton(lambda v: nx.logsumexp(v, 0),
                                           S((16 * 1024 * 1024,), dtype), arch=arch)
        out["columns_lse", name] = _triton(lambda v: nx.logsumexp(v, 1),
                                           S((8, 3000, 4096), dtype), arch=arch)
        out["matmul", name] = _triton(_matmul, big, big, arch=arch)
        out["matmul_grad", name] = _triton(jax.grad(
            lambda a, b: _matmul(a, b).astype(jnp.float32).sum(), argnums=(0, 1)),
            big, big, arch=arch)
        out["skinny", name] = _triton(_matmul, S((8, 8192), dtype), S((8192, 8), dtype),
                                      arch=arch)
        # One tile per GPU of 4 (under a vmap, nx.tile of every position is a reshape).
        out["tile", name] = _triton(
            nx.xmap(lambda v: nx.tile(v, {"t": 0}), [...], ["t", ...], axis_sizes={"t": 4},
                    axis_resources={"t": "x"}),
            S((8192, 4096), dtype), arch=arch, mesh_shape=(4,), mesh_axes=("x",))
    return arch, out


def test_every_triton_kernel_compiles_with_no_spills(compiled):
    arch, out = compiled
    for case, kernels in out.items():
        for k in kernels:
            assert k.registers is not None, (arch, case, k)
            assert (k.spill_stores, k.spill_loads) == (0, 0), (arch, case, k)


@pytest.mark.parametrize("case", ["rows_sum", "columns_max", "rows_lse", "one_row_lse",
                                  "columns_lse", "tile"])
def test_large_inputs_launch_at_least_one_cta_per_sm(compiled, case):
    """The first (big) launch of each large reduction or tile covers the GPU,
    whichever axes it reduces: a long reduced axis is split across programs."""
    arch, out = compiled
    for dtype in ("float32", "bfloat16"):
        first = out[case, dtype][0]
        assert first.blocks >= gpu.ARCHS[arch].sm_count, (arch, case, dtype, first)
        assert first.ctas_per_sm >= 1


def test_logsumexp_keeps_per_lane_statistics_at_four_ctas_per_sm(compiled):
    arch, out = compiled
    for dtype in ("float32", "bfloat16"):
        assert out["rows_lse", dtype][0].ctas_per_sm >= 4, out["rows_lse", dtype]


def test_matmul_uses_the_arch_tensor_cores_with_large_pipelined_tiles(compiled):
    arch, out = compiled
    for dtype in ("float32", "bfloat16"):
        (mm,) = out["matmul", dtype]
        wide = arch == "h100" and dtype == "bfloat16"   # 128x256 tiles there, else 128x128
        assert mm.blocks == (4096 // 128) * (4096 // (256 if wide else 128)), mm   # no K split
        assert mm.warps == 8
        if arch == "h100":
            assert mm.tensor_core.startswith("wgmma.m64n256" if wide else "wgmma.m64n128"), mm
        else:
            assert mm.tensor_core.startswith("mma.m16n8"), mm
        # Loads pipelined: at least two stages of both operand tiles in shared memory.
        stage = 128 * 64 * 2 + 64 * (256 if wide else 128) * 2 if dtype == "bfloat16" else \
            2 * 128 * 32 * 4
        assert mm.shared_memory >= 2 * stage, mm
        for k in out["matmul_grad", dtype]:
            assert k.tensor_core is not None, k


def test_skinny_matmul_takes_small_tiles_and_splits_k(compiled):
    arch, out = compiled
    for dtype in ("float32", "bfloat16"):
        mm = out["skinny", dtype][0]
        assert mm.grid[0] * mm.grid[1] == 1 and mm.grid[2] > 1, mm   # one 16x16 tile, split K
        assert mm.warps <= 2 and mm.tensor_core is not None, mm


def test_the_configuration_table_is_per_architecture():
    assert triton_dot.config_for(4096, 4096, 4096, 2, "sm90").bn == 256
    assert triton_dot.config_for(1024, 1024, 1024, 2, "sm90").bn == 128   # 32 tiles of 128x256: too few
    assert triton_dot.config_for(4096, 4096, 4096, 2, "sm80").bn >= 128
    skinny = triton_dot.config_for(8, 4096, 4096, 2, "sm90")
    assert skinny.bm == 16 and skinny.bn >= 128
