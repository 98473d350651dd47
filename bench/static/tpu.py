"""nxops' Pallas kernels compiled for TPU v5e and v6e slices at the bench
shapes, with no TPU (``tests._deviceless.tpu``: libtpu), each beside the same
computation written with jnp/lax, and the cost model's time of both
(``bench.static.model``): ``python -m bench.static.tpu`` writes
``bench/static/TPU.md``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import time
from typing import Callable

import jax

from bench.static import model
from tests._deviceless.tpu import TpuCompileReport, compile_tpu, roofline_seconds


# --- the table: every Mosaic kernel at the bench shapes --------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    kernel: Callable        # the nxops program (compiled with NXOPS_KERNELS=pallas)
    baseline: Callable      # the same computation written with jnp / lax
    shapes: tuple           # per-chip argument shapes
    nbytes: int             # minimum HBM bytes per chip (per dtype byte)
    flops: int = 0


def _squared_sum(f):
    """A loss that keeps ``f``'s result alive, so its gradient runs the kernel."""
    import jax.numpy as jnp
    return lambda *a: jnp.sum(jnp.square(f(*a).astype(jnp.float32)))


def _grad(f, argnums=0):
    return jax.grad(_squared_sum(f), argnums=argnums)


def cases() -> list[Case]:
    """Forward and backward cases at shapes of bench/bench_*.py (per chip)."""
    import jax.numpy as jnp
    from jax import lax

    import nxops as nx

    out = []
    for shape in ((4096, 4096), (16384, 32768)):     # bench_reduce medium / large
        n = math.prod(shape)
        for op, ref in (("sum", jnp.sum), ("max", jnp.max), ("logsumexp", jax.nn.logsumexp)):
            for axis, where in ((1, "rows"), (0, "columns")):
                kernel = functools.partial(lambda v, op, axis: getattr(nx, op)(v, axis), op=op, axis=axis)
                base = functools.partial(lambda v, ref, axis: ref(v, axis=axis), ref=ref, axis=axis)
                out.append(Case(f"{where} {op} {shape}", kernel, base, (shape,), n))
                if shape == (4096, 4096):
                    out.append(Case(f"grad {where} {op} {shape}", _grad(kernel), _grad(base),
                                    (shape,), 3 * n))
    for size in (1024, 8192):                         # bench_einsum matmul medium / large
        mm = lambda a, b: nx.einsum("mk,kn->mn", a, b)
        out.append(Case(f"matmul {size}^3", mm, jnp.matmul, ((size, size),) * 2,
                        3 * size * size, 2 * size ** 3))
    out.append(Case("grad matmul 1024^3", _grad(mm, (0, 1)), _grad(jnp.matmul, (0, 1)),
                    ((1024, 1024),) * 2, 7 * 1024 * 1024, 6 * 1024 ** 3))
    tile = lambda v: nx.tile(v, {"x": 0})
    tile_ref = lambda v: lax.dynamic_slice_in_dim(
        v, lax.axis_index("x") * (v.shape[0] // 4), v.shape[0] // 4, 0)
    out.append(Case("tile (8192, 4096) 1 of 4", tile, tile_ref, ((8192, 4096),), 8192 * 4096 // 2))
    out.append(Case("grad tile (8192, 4096)", _grad(tile), _grad(tile_ref), ((8192, 4096),),
                    8192 * 4096 + 8192 * 4096 // 2))
    for rows in (8, 2048, 131072):                    # bench_collectives shards: 4 KiB .. 64 MiB f32
        shard = (rows, 128)
        ag = lambda v: nx.all_gather(v, "x", axis=0, tiled=True)
        ag_ref = lambda v: lax.all_gather(v, "x", axis=0, tiled=True)
        rs = lambda v: nx.psum_scatter(v, "x", scatter_dimension=0, tiled=True)
        rs_ref = lambda v: lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True)
        out.append(Case(f"ring all-gather {shard}", ag, ag_ref, (shard,), 3 * rows * 128))
        out.append(Case(f"ring reduce-scatter {shard}", rs, rs_ref, (shard,), rows * 128 * 5 // 4))
        if rows == 2048:
            out.append(Case(f"grad ring all-gather {shard}", _grad(ag), _grad(ag_ref), (shard,),
                            6 * rows * 128))
            out.append(Case(f"grad ring reduce-scatter {shard}", _grad(rs), _grad(rs_ref),
                            (shard,), 3 * rows * 128))
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _us(seconds: float | None) -> str:
    # XLA's cost model answers a negative time for programs it cannot model.
    return "n/a" if seconds is None or seconds < 0 else f"{seconds * 1e6:.1f}"


def _timed_compile(fn, *args, chip: str) -> tuple[TpuCompileReport, float]:
    """The deviceless compile and its wall time (the table's compile column)."""
    start = time.perf_counter()
    report = compile_tpu(fn, *args, chip=chip)
    return report, time.perf_counter() - start


def _modelled_us(report: TpuCompileReport) -> str:
    """The program's time by bench/static/model.py (from what it launches)."""
    return f"{sum(l.seconds for l in model.timed_launches(report.hlo_text, report.chip)) * 1e6:.1f}"


def table(chips=("v5e", "v6e"), dtypes=None) -> str:
    """The markdown table: chip x case x dtype, a Pallas row (NXOPS_KERNELS=pallas)
    and beside it the XLA baseline row (the jnp program), each with the cost
    model's time (bench/static/model.py: from the compiled launches, never
    from a kernel's declared cost)."""
    import jax.numpy as jnp

    import nxops as nx

    dtypes = dtypes or (jnp.float32, jnp.bfloat16)
    rows = ["| chip | case | dtype | backend | Mosaic kernels | args / out / temp (MiB) | "
            "modelled (µs) | roofline (µs) | compile (s) |", "|" + "---|" * 9]
    for chip in chips:
        for case in cases():
            for dtype in dtypes:
                size = jnp.dtype(dtype).itemsize
                args = [jax.ShapeDtypeStruct(s, dtype) for s in case.shapes]
                head = f"| {chip} | {case.label} | {jnp.dtype(dtype).name} |"
                roof = _us(roofline_seconds(chip, case.nbytes * size, case.flops))
                try:
                    with nx.kernels.use("pallas"):
                        report = _timed_compile(case.kernel, *args, chip=chip)
                except nx.NxopsError as e:   # a case the kernel declines (not a compile error)
                    reason = str(e).split(" on tpu: ", 1)[-1].split(". Use ")[0]
                    rows.append(f"{head} pallas | declined: {reason} | | | | |")
                    report = None
                base = _timed_compile(case.baseline, *args, chip=chip)
                for backend, timed in (("pallas", report), ("xla (jnp)", base)):
                    if timed is None:
                        continue
                    r, seconds = timed
                    m = r.memory
                    rows.append(
                        f"{head} {backend} | {', '.join(r.kernels) or '-'} | "
                        f"{_mib(m['argument_size_in_bytes'])} / {_mib(m['output_size_in_bytes'])} / "
                        f"{_mib(m['temp_size_in_bytes'])} | {_modelled_us(r)} | {roof} | "
                        f"{seconds:.2f} |")
    return "\n".join(rows)


def main() -> None:
    out = pathlib.Path(__file__).with_name("TPU.md")
    start = time.perf_counter()
    text = table()
    out.write_text(_TPU_MD_HEADER + text + "\n")
    print(f"wrote {out} ({text.count(chr(10)) - 1} rows, {time.perf_counter() - start:.0f} s)")


_TPU_MD_HEADER = """# Pallas kernels compiled for TPU v5e and v6e (no TPU needed), beside XLA

Written by `python -m bench.static.tpu` (JAX_PLATFORMS=cpu, libtpu from the
`compile` extra): each case is compiled by libtpu for a 4-chip slice
(`v5e:2x2`, `v6e:2x2`) inside a `shard_map` over all chips, once with
`NXOPS_KERNELS=pallas` and once as the same computation written with
`jnp`/`lax` (the XLA baseline row under it); shapes are **per chip** (bench
shapes of `bench_reduce.py`, `bench_einsum.py`, `bench_collectives.py`;
matmul at 1024^3 and 8192^3). Every Mosaic kernel compiled: a Mosaic error
would have stopped the generation.

- *Mosaic kernels*: the program's `tpu_custom_call`s.
- *args / out / temp*: `compiled.memory_analysis()` per chip.
- *modelled*: `bench/static/model.py`'s time of the compiled program: per
  launch max(HBM bytes of its HLO operands and results / bandwidth, dot
  FLOPs / MXU peak) + 0.5 µs. It never reads a kernel's declared
  `pl.CostEstimate` (nor XLA's `optimal_seconds`, which counts kernels by
  their declared estimate: earlier versions of this table showed it, and it
  proved nothing about the kernels). A Mosaic kernel is credited with one
  read of each operand, in its favour (a tiled matmul re-reads them).
- *roofline*: minimum bytes / HBM bandwidth (819, 1640 GB/s) or FLOPs /
  dense bf16 peak (197, 918 TFLOP/s), whichever is larger. Collectives: HBM
  bytes only (ICI not modelled).
- Which of these kernels `NXOPS_KERNELS=auto` takes is decided by what a
  device measured (`nxops/kernels/_auto.py`); the model
  (bench/static/MODEL.md) decides nothing.

"""


if __name__ == "__main__":
    main()
