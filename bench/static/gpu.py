"""nxops' GPU kernels compiled for H100 and A100 at the bench shapes, with no
GPU (``tests._deviceless.gpu``: XLA's GPU compiler and ptxas), each beside
its XLA program and the cost model's time of both (``bench.static.model``):
``python -m bench.static.gpu`` writes ``bench/static/GPU.md``.
"""
from __future__ import annotations

import math
import pathlib

import jax

from bench.static import model
from tests._deviceless.gpu import GpuCompileReport, compile_gpu, roofline_seconds


# --- the table: every Pallas kernel at the bench shapes ------------------------

def _cases():
    """(label, fn, args, bytes moved, flops): forward and backward cases."""
    import jax.numpy as jnp

    import nxops as nx

    S = jax.ShapeDtypeStruct
    cases = []
    for dtype in (jnp.float32, jnp.bfloat16):
        size = jnp.dtype(dtype).itemsize
        for shape in ((4096, 4096), (16384, 32768)):
            n = math.prod(shape)
            for op in ("sum", "max", "logsumexp"):
                for axis, where in ((1, "rows"), (0, "columns")):
                    cases.append((f"{where} {op} {shape}", _reduce(op, axis), (S(shape, dtype),),
                                  n * size, n))
        cases.append(("single row sum (4096, 4096) (all axes)", _reduce("sum", (0, 1)),
                      (S((4096, 4096), dtype),), 4096 * 4096 * size, 4096 * 4096))
        cases.append(("columns logsumexp (8, 3000, 4096)", _reduce("logsumexp", 1),
                      (S((8, 3000, 4096), dtype),), 8 * 3000 * 4096 * size, 8 * 3000 * 4096))
        cases.append(("grad rows logsumexp (4096, 4096)", jax.grad(
            lambda v: nx.logsumexp(v, 1).sum().astype(jnp.float32)), (S((4096, 4096), dtype),),
            3 * 4096 * 4096 * size, 3 * 4096 * 4096))
        for m, k, n in ((4096, 4096, 4096), (1024, 1024, 1024), (8, 4096, 4096)):
            operands = (S((m, k), dtype), S((k, n), dtype))
            cases.append((f"matmul {m}x{k}x{n}", lambda a, b: nx.einsum("mk,kn->mn", a, b),
                          operands, (m * k + k * n + m * n) * size, 2 * m * k * n))
        cases.append(("grad matmul 4096^3", jax.grad(
            lambda a, b: nx.einsum("mk,kn->mn", a, b).astype(jnp.float32).sum(), argnums=(0, 1)),
            (S((4096, 4096), dtype), S((4096, 4096), dtype)), 6 * 4096 * 4096 * size,
            4 * 4096 ** 3))
        cases.append(("tile (8192, 4096) into 4", lambda v: nx.tile(v, {"t": 0}),
                      (S((8192, 4096), dtype),), 8192 * 4096 * size // 4, 0))
    return cases


def _reduce(op, axis):
    import nxops as nx
    return lambda v: getattr(nx, op)(v, axis)


def _modelled_us(report: GpuCompileReport, arch: str) -> float:
    """The program's time by bench/static/model.py (from what it launches)."""
    grids: dict[str, list[int]] = {}
    for k in report.kernels:
        grids.setdefault(k.name, []).append(k.blocks)
    return sum(l.seconds for l in model.timed_launches(report.hlo_text, arch, grids)) * 1e6


def table(archs=("h100", "a100"), backends=("pallas", "triton")) -> str:
    """The markdown table of every kernel x case x dtype x arch x backend, and
    for each case the XLA baseline row (``NXOPS_KERNELS=xla``, dots as cuBLAS)."""
    import jax.numpy as jnp

    import nxops as nx

    rows = ["| arch | backend | case | dtype | kernel | grid | warps | regs | spills (B) | "
            "smem (B) | CTAs/SM | tensor cores | roofline (µs) | program modelled (µs) |",
            "|" + "---|" * 14]
    for arch in archs:
        for label, fn, args, nbytes, flops in _cases():
            body, mesh = fn, {}
            if label.startswith("tile"):   # one tile per GPU of 4 (a vmap would take them all)
                body = nx.xmap(lambda v: nx.tile(v, {"t": 0}), [...], ["t", ...],
                               axis_sizes={"t": 4}, axis_resources={"t": "x"})
                mesh = dict(mesh_shape=(4,), mesh_axes=("x",))
            dtype = jnp.dtype(args[0].dtype).name
            roof = roofline_seconds(arch, nbytes, flops if "matmul" in label else 0) * 1e6
            for backend in backends:
                with nx.kernels.use(backend):
                    report = compile_gpu(body, *args, arch=arch, **mesh)
                modelled = _modelled_us(report, arch)
                for k in [k for k in report.kernels if k.name.startswith("nxops") or mesh]:
                    rows.append(
                        f"| {arch} | {backend} | {label} | {dtype} | {k.name} | "
                        f"{'x'.join(map(str, k.grid))} | {k.warps} | {k.registers} | "
                        f"{k.spill_stores}/{k.spill_loads} | {k.shared_memory + (k.static_smem or 0)} | "
                        f"{k.ctas_per_sm} | {k.tensor_core or '-'} | {roof:.1f} | {modelled:.1f} |")
            program = model.Program(label, body, tuple(a.shape for a in args),
                                    tuple(a.dtype for a in args),
                                    gpu_mesh=mesh.get("mesh_shape", (1,)))
            xla = model.estimate(program, arch, "xla")
            names = ", ".join(sorted({l.kernel for l in xla.launches}))
            rows.append(f"| {arch} | xla | {label} | {dtype} | {len(xla.launches)} launches: "
                        f"{names} | | | | | | | | {roof:.1f} | {xla.seconds * 1e6:.1f} |")
    return "\n".join(rows)


def main() -> None:
    out = pathlib.Path(__file__).with_name("GPU.md")
    text = table()
    out.write_text(_GPU_MD_HEADER + text + "\n")
    print(f"wrote {out} ({text.count(chr(10)) - 1} kernel rows)")


_GPU_MD_HEADER = """# nxops' GPU kernels compiled for H100 and A100 (no GPU needed)

Written by `python -m bench.static.gpu` (JAX_PLATFORMS=cpu, the `compile` and
`triton` extras): each case is compiled by XLA's GPU compiler for the target in
`tests/_deviceless/targets/`, once with `NXOPS_KERNELS=pallas` (Pallas' Triton lowering) and once
with `NXOPS_KERNELS=triton` (jax-triton, compiled for compute capability 90 /
80). Registers and spills come from `ptxas -v` (nvcc wheel) on the PTX (XLA's
dump for Pallas, jax-triton's for Triton); grid/threads/shared memory from the
thunk sequence (Pallas) or the launch (Triton); CTAs/SM from registers,
threads and shared memory against the SM's limits. Roofline: bytes / HBM
bandwidth (3.35 TB/s H100, 2.039 TB/s A100), or for matmuls max(that, FLOPs /
dense bf16 tensor peak: 989 / 312 TFLOP/s). A case with two rows of one
backend is a split reduction or split-K (partials, then a second launch).
*program modelled*: `bench/static/model.py`'s time of the whole compiled
program (per launch max(HBM bytes of its HLO operands and results /
bandwidth, dot FLOPs / tensor peak), slowed by SMs / CTAs where a launch has
fewer CTAs than SMs, + 2 µs), never a kernel's declared cost. Under each
case's kernel rows, its **xla** row: the same program under
`NXOPS_KERNELS=xla` (dots as cuBLAS calls), its launches and modelled time.
Which kernels `NXOPS_KERNELS=auto` takes is decided from these figures
(`python -m bench.static.model`, bench/static/MODEL.md).

Issue 10, before (main at ae5bc8c) and after: the Pallas kernels that
changed, 4096x4096 (64 / 32 MiB) and the 8x3000x4096 columns case. "a + b":
the first pass over the input and the small second pass over its f32 partial
results (columns and long rows are now split along the reduced dim to at
least `_layout.GPU_TARGET_PROGRAMS` = 264 programs). logsumexp keeps its max and
sum per lane and combines lanes once. The matmul configuration now comes from
a table keyed by (arch, dtype, shape class) (`dot_general._TRITON_MATMUL_TABLE`):
H100 bf16 takes 128x256 tiles (wgmma m64n256), A100 keeps 128x128 (mma.sync),
skinny shapes 16x128. f32 at DEFAULT precision: TF32 (k8 shapes); HIGHEST:
no tensor-core instruction. No kernel spills (0/0 everywhere below).

| arch | case | dtype | grid before → after | regs before → after | CTAs/SM before → after | tensor cores before → after |
|---|---|---|---|---|---|---|
| h100 | columns sum (4096, 4096) | float32 | 1x4x1 → 1x4x69 + 1x4x1 | 30 → 40/34 | 8 → 6/6 | - |
| h100 | columns sum (4096, 4096) | bfloat16 | 1x4x1 → 1x4x69 + 1x4x1 | 40 → 32/34 | 6 → 8/6 | - |
| h100 | columns max (4096, 4096) | float32 | 1x4x1 → 1x4x69 + 1x4x1 | 32 → 40/36 | 8 → 6/6 | - |
| h100 | columns max (4096, 4096) | bfloat16 | 1x4x1 → 1x4x69 + 1x4x1 | 32 → 30/36 | 8 → 8/6 | - |
| h100 | rows logsumexp (4096, 4096) | float32 | 1024x1x1 → 2048x1x1 | 98 → 54 | 2 → 4 | - |
| h100 | rows logsumexp (4096, 4096) | bfloat16 | 1024x1x1 → 2048x1x1 | 80 → 54 | 3 → 4 | - |
| h100 | columns logsumexp (4096, 4096) | float32 | 1x4x1 → 1x4x67 + 1x4x1 | 61 → 36/42 | 4 → 6/5 | - |
| h100 | columns logsumexp (4096, 4096) | bfloat16 | 1x4x1 → 1x4x67 + 1x4x1 | 80 → 40/42 | 3 → 6/5 | - |
| h100 | columns logsumexp (8, 3000, 4096) | float32 | 8x4x1 → 8x4x10 + 8x4x1 | 48 → 36/43 | 5 → 6/5 | - |
| h100 | columns logsumexp (8, 3000, 4096) | bfloat16 | 8x4x1 → 8x4x10 + 8x4x1 | 80 → 40/43 | 3 → 6/5 | - |
| h100 | single row sum (4096, 4096) (all axes) | float32 | 64x1x1 + 1x1x1 → 1x274x1 + 1x1x1 | 32/15 → 32/19 | 8/32 → 8/32 | - |
| h100 | single row sum (4096, 4096) (all axes) | bfloat16 | 64x1x1 + 1x1x1 → 1x274x1 + 1x1x1 | 32/15 → 32/19 | 8/32 → 8/32 | - |
| h100 | matmul 4096x4096x4096 | float32 | 1x1024x1 → 1x1024x1 | 128 → 128 | 2 → 2 | wgmma.m64n128k8 → wgmma.m64n128k8 |
| h100 | matmul 4096x4096x4096 | bfloat16 | 1x1024x1 → 1x512x1 | 112 → 186 | 2 → 1 | wgmma.m64n128k16 → wgmma.m64n256k16 |
| h100 | matmul 8x4096x4096 | float32 | 1x32x1 → 1x32x1 | 116 → 116 | 6 → 6 | mma.m16n8k8 → mma.m16n8k8 |
| h100 | matmul 8x4096x4096 | bfloat16 | 1x32x1 → 1x32x1 | 128 → 128 | 6 → 6 | mma.m16n8k16 → mma.m16n8k16 |
| a100 | columns sum (4096, 4096) | float32 | 1x4x1 → 1x4x69 + 1x4x1 | 30 → 40/32 | 8 → 6/8 | - |
| a100 | columns sum (4096, 4096) | bfloat16 | 1x4x1 → 1x4x69 + 1x4x1 | 40 → 39/32 | 6 → 6/8 | - |
| a100 | columns max (4096, 4096) | float32 | 1x4x1 → 1x4x69 + 1x4x1 | 32 → 30/36 | 8 → 8/6 | - |
| a100 | columns max (4096, 4096) | bfloat16 | 1x4x1 → 1x4x69 + 1x4x1 | 37 → 32/36 | 6 → 8/6 | - |
| a100 | rows logsumexp (4096, 4096) | float32 | 1024x1x1 → 2048x1x1 | 96 → 60 | 2 → 4 | - |
| a100 | rows logsumexp (4096, 4096) | bfloat16 | 1024x1x1 → 2048x1x1 | 80 → 61 | 3 → 4 | - |
| a100 | columns logsumexp (4096, 4096) | float32 | 1x4x1 → 1x4x67 + 1x4x1 | 61 → 42/43 | 4 → 5/5 | - |
| a100 | columns logsumexp (4096, 4096) | bfloat16 | 1x4x1 → 1x4x67 + 1x4x1 | 80 → 42/43 | 3 → 5/5 | - |
| a100 | columns logsumexp (8, 3000, 4096) | float32 | 8x4x1 → 8x4x10 + 8x4x1 | 61 → 44/42 | 4 → 5/5 | - |
| a100 | columns logsumexp (8, 3000, 4096) | bfloat16 | 8x4x1 → 8x4x10 + 8x4x1 | 80 → 42/42 | 3 → 5/5 | - |
| a100 | single row sum (4096, 4096) (all axes) | float32 | 64x1x1 + 1x1x1 → 1x274x1 + 1x1x1 | 32/15 → 40/19 | 8/32 → 6/32 | - |
| a100 | single row sum (4096, 4096) (all axes) | bfloat16 | 64x1x1 + 1x1x1 → 1x274x1 + 1x1x1 | 38/15 → 32/19 | 6/32 → 8/32 | - |
| a100 | matmul 4096x4096x4096 | float32 | 1x1024x1 → 1x1024x1 | 176 → 176 | 1 → 1 | mma.m16n8k8 → mma.m16n8k8 |
| a100 | matmul 4096x4096x4096 | bfloat16 | 1x1024x1 → 1x1024x1 | 164 → 164 | 1 → 1 | mma.m16n8k16 → mma.m16n8k16 |
| a100 | matmul 8x4096x4096 | float32 | 1x32x1 → 1x32x1 | 126 → 126 | 4 → 4 | mma.m16n8k8 → mma.m16n8k8 |
| a100 | matmul 8x4096x4096 | bfloat16 | 1x32x1 → 1x32x1 | 128 → 128 | 4 → 4 | mma.m16n8k16 → mma.m16n8k16 |
| h100 | tile (8192, 4096) into 4 | float32 | loop_minimum_fusion 1x1x1 (1 thread: index clamp) + nxops_tile 1x8192x1 → loop_convert_fusion 1x1x1 (lax.axis_index's partition-id & 3, convert) + nxops_tile 1x8192x1 (clamps inside) | 10 + 26 → 10 + 26 | 32 → 32 | - |

The tile kernel now clamps its index itself; the one-thread kernel left before
it is `lax.axis_index`'s own `partition-id & 3` and convert, which XLA does
not fuse into the Pallas custom call.

"""


if __name__ == "__main__":
    main()
