"""The cost model (bench/static/model.py) on its quick program set: every
program compiled deviceless for H100 and TPU v5e/v6e under NXOPS_KERNELS=auto
and =xla. The model decides nothing: on TPU (nothing measured) `auto`
compiles XLA's own program, and on cuda it follows the measured table; the
model is only shown beside the measurements (and disagrees:
bench/static/MODEL.md). Runs with the benchmarks (`pytest bench`): it checks
a benchmark tool. Compile-time facts only (no clocks)."""
import importlib.util

import numpy as np
import pytest

from bench.static import model
from tests._extras import gpu_compile_missing

MACHINES = ["h100", "v5e", "v6e"]


def _extras_missing() -> str:
    if (reason := gpu_compile_missing()):
        return reason
    if importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed (nxops' compile extra)"
    return ""


needs_compile_extras = pytest.mark.skipif(bool(_extras_missing()), reason=_extras_missing())


@pytest.fixture(scope="module")
def rows():
    quick = [p for p in model.programs() if p.quick]
    # where auto lowers to xla's very program the ratio is 1: only the programs
    # where auto chose kernels are compiled (twice)
    return model.evaluate(quick, MACHINES, compile_same=False)


TPUS = [m for m in MACHINES if model.MACHINES[m].kind == "tpu"]


@needs_compile_extras
def test_the_model_decides_nothing_on_tpu(rows):
    # No TPU has measured a kernel: `auto` compiles XLA's own program on every
    # TPU row, also where the model has a kernel modelled faster (rows
    # logsumexp at 0.50 on v5e; the H200 turned such modelled wins into losses).
    assert {r.machine for r in rows} == set(MACHINES)
    assert not [r for r in rows if r.error], model.markdown([r for r in rows if r.error])
    tpu_rows = [r for r in rows if r.machine in TPUS]
    assert tpu_rows and all(r.same_program for r in tpu_rows), \
        "\n" + model.markdown([r for r in tpu_rows if not r.same_program])
    lse = {r.machine: r for r in rows if r.program.startswith("rows logsumexp")}
    # on the H100 the table decides: the H200 measured this case at 1.65x XLA
    assert lse["h100"].same_program


@needs_compile_extras
def test_the_model_is_shown_beside_the_measurement():
    (row,) = model.against_measured("h100", k="cols_lse_4096x4096_bf16")
    assert (row.backend, round(row.measured, 2)) == ("pallas", 0.68)
    assert 0 < row.modelled < 1 and "| pallas |" in model.comparison_markdown([row])


# --- reading the compiled HLO (no compile needed) -------------------------------------

_HLO = """HloModule m, is_scheduled=true

%fused_add (param_0: f32[1024,256], param_1: f32[64,256]) -> f32[64,256] {
  %param_0 = f32[1024,256]{1,0} parameter(0)
  %slice.1 = f32[64,256]{1,0} slice(%param_0), slice={[0:64], [0:256]}
  %param_1 = f32[64,256]{1,0} parameter(1)
  ROOT %add.1 = f32[64,256]{1,0} add(%slice.1, %param_1)
}

%fused_dot (param_0.1: bf16[128,512], param_1.1: bf16[512,64]) -> f32[128,64] {
  %param_1.1 = bf16[512,64]{1,0} parameter(1)
  %param_0.1 = bf16[128,512]{1,0} parameter(0)
  ROOT %dot.1 = f32[128,64]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[1024,256], b: f32[64,256], c: bf16[128,512], d: bf16[512,64]) -> (f32[64,256], f32[128,64], bf16[128,64]) {
  %a = f32[1024,256]{1,0} parameter(0)
  %b = f32[64,256]{1,0} parameter(1)
  %c = bf16[128,512]{1,0} parameter(2)
  %d = bf16[512,64]{1,0} parameter(3)
  %sliced = f32[64,256]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_add
  %dotted = f32[128,64]{1,0} fusion(%c, %d), kind=kOutput, calls=%fused_dot
  %gemm = (bf16[128,64]{1,0}, s8[4194304]{0}) custom-call(%c, %d), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %prefetch = (f32[64,256]{1,0:S(1)}, f32[64,256]{1,0}, u32[]) copy-start(%b)
  %done = f32[64,256]{1,0:S(1)} copy-done(%prefetch)
  %gte = bf16[128,64]{1,0} get-tuple-element(%gemm), index=0
  ROOT %out = (f32[64,256]{1,0}, f32[128,64]{1,0}, bf16[128,64]{1,0}) tuple(%sliced, %dotted, %gte)
}
"""


def test_launches_count_hbm_bytes_and_dot_flops_from_the_hlo():
    found = {l.name: l for l in model.launches(_HLO)}
    assert sorted(found) == ["dotted", "gemm", "prefetch", "sliced"]   # no parameter, tuple, done
    tile = 64 * 256 * 4
    # the fusion only slices `a`: it reads the slice, b, and writes the sum
    assert found["sliced"].nbytes == 3 * tile and found["sliced"].flops == 0
    dot_bytes = (128 * 512 + 512 * 64) * 2
    assert found["dotted"].nbytes == dot_bytes + 128 * 64 * 4
    assert found["dotted"].flops == found["gemm"].flops == 2 * 128 * 64 * 512
    # cuBLAS' s8 workspace is not traffic
    assert found["gemm"].nbytes == dot_bytes + 128 * 64 * 2
    # a copy into on-chip memory (S(1)) reads its source once
    assert found["prefetch"].nbytes == tile


def test_launch_time_is_the_roofline_slowed_by_idle_sms_plus_the_overhead():
    h100 = model.MACHINES["h100"]
    launch = model.Launch("k", "fusion", "k", nbytes=3.35e6, flops=0.0, f32=False,
                          collective=False, ctas=33)
    np.testing.assert_allclose(model.launch_seconds(launch, h100), 1e-6 * 4 + 2e-6)
    launch.ctas, launch.flops = 1000, 989e6
    np.testing.assert_allclose(model.launch_seconds(launch, h100), 1e-6 + 2e-6)
    launch.f32 = True   # f32 dots at half the bf16 peak
    np.testing.assert_allclose(model.launch_seconds(launch, h100), 2e-6 + 2e-6)


def test_a_kernels_later_launches_are_read_under_its_name(tmp_path):
    # The thunk sequence names a kernel's second launch (a split reduction's
    # second pass) `name__1`; the HLO custom call keeps `name`: both grids count.
    (tmp_path / "m.thunk_sequence.txt").write_text(
        "nxops_reduce_columns_max grid: [1, 4, 69] threads: [256, 1, 1]\n"
        "nxops_reduce_columns_max__1 grid: [1, 256, 1] threads: [64, 1, 1]\n")
    assert model._gpu_grids(tmp_path) == {"nxops_reduce_columns_max": [276, 256]}
