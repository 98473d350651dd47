"""Deviceless TPU compilation: what libtpu's XLA and Mosaic make of a program
for a TPU v5e, v5p, v6e or v4 slice, on a machine with no TPU.

    report = compile_tpu(fn, *shape_dtype_structs, chip="v5e")
    report.kernels          # names of the Mosaic kernels (tpu_custom_call) in the program
    report.memory           # compiled.memory_analysis() figures (bytes, per chip)
    report.cost             # flops, bytes accessed, transcendentals, optimal_seconds

Needs the ``compile`` extra (libtpu) and ``JAX_PLATFORMS=cpu``.
``jax.experimental.topologies`` gives the chips of a small slice
(``TOPOLOGIES``; 4 chips, 8 TensorCores on v4). The arguments are *per chip*:
``compile_tpu`` stacks them along their leading dim over a one-axis mesh
``"x"`` of every chip and runs ``fn`` in a ``jax.shard_map`` over it, so every
mesh axis is manual (Mosaic kernels cannot be partitioned by XLA) and ``fn``
may use ``"x"`` as a named axis (collectives, ``nx.tile``). Results are
concatenated along their leading dim. A Mosaic compile error raises, as on a
TPU. ``python -m bench.static.tpu`` writes ``bench/static/TPU.md``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import pathlib
import re
import sys
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "v4": "v4:2x2x1"}


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU chip's public peaks, for rooflines."""

    name: str
    bandwidth: float   # HBM bytes/s
    bf16_flops: float  # dense MXU FLOP/s


CHIPS = {
    "v5e": Chip("TPU v5e", 819e9, 197e12),
    "v5p": Chip("TPU v5p", 2765e9, 459e12),
    "v6e": Chip("TPU v6e", 1640e9, 918e12),
    "v4": Chip("TPU v4", 1200e9, 275e12),
}

_COST_KEYS = ("flops", "bytes accessed", "transcendentals", "optimal_seconds")
_KERNEL = re.compile(r"%([\w.-]+?)(?:\.\d+)? = .*custom_call_target=\"tpu_custom_call\"")
_ESTIMATE = re.compile(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"(\d+)",'
                       r'"bytes_accessed":"(\d+)"')


@dataclasses.dataclass
class TpuCompileReport:
    chip: str
    compiled: Any
    hlo_text: str
    kernels: list[str]                       # Mosaic kernel names, in program order
    estimates: list[tuple[int, int, int]]    # their pl.CostEstimate: flops, transcendentals, bytes
    memory: dict[str, int]
    cost: dict[str, float]
    seconds: float                           # compile time

    @property
    def optimal_seconds(self) -> float | None:
        return self.cost.get("optimal_seconds")


@functools.lru_cache(maxsize=None)
def topology(chip: str):
    with _quiet_libtpu():
        return topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[chip])


def tpu_mesh(chip: str):
    """A one-axis mesh ``"x"`` over every device of the slice (a TensorCore on
    v4, whose topology is not in megacore mode: ``topologies.make_mesh`` refuses it)."""
    return jax.sharding.Mesh(np.asarray(topology(chip).devices), ("x",))


def compile_tpu(fn: Callable, *args: jax.ShapeDtypeStruct, chip: str = "v5e") -> TpuCompileReport:
    """Compiles ``fn`` on per-chip ``args`` for a ``chip`` slice (see the module
    docstring) and reads what was made."""
    mesh = tpu_mesh(chip)
    n = mesh.devices.size
    stacked = [jax.ShapeDtypeStruct((n * a.shape[0], *a.shape[1:]), a.dtype,
                                    sharding=NamedSharding(mesh, PartitionSpec("x"))) for a in args]
    body = jax.shard_map(fn, mesh=mesh, in_specs=PartitionSpec("x"), out_specs=PartitionSpec("x"))
    start = time.perf_counter()
    with jax.set_mesh(mesh), _quiet_libtpu():
        compiled = jax.jit(body).trace(*stacked).lower().compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    memory = compiled.memory_analysis()
    memory = {k: getattr(memory, k) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                               "temp_size_in_bytes", "generated_code_size_in_bytes")}
    cost = compiled.cost_analysis() or {}
    cost = {k: float(cost[k]) for k in _COST_KEYS if k in cost}
    return TpuCompileReport(chip, compiled, text, _KERNEL.findall(text),
                            [tuple(map(int, m)) for m in _ESTIMATE.findall(text)],
                            memory, cost, seconds)


@contextlib.contextmanager
def _quiet_libtpu():
    """libtpu logs host-name warnings to fd 2 on first use (harmless here)."""
    if os.environ.get("NXOPS_TPU_VERBOSE"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def roofline_seconds(chip: str, bytes_moved: float, flops: float = 0.0) -> float:
    c = CHIPS[chip]
    return max(bytes_moved / c.bandwidth, flops / c.bf16_flops)


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


def _modelled_us(report: TpuCompileReport) -> str:
    """The program's time by bench/static/model.py (from what it launches)."""
    from bench.static import model
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
                        report = compile_tpu(case.kernel, *args, chip=chip)
                except nx.NxopsError as e:   # a case the kernel declines (not a compile error)
                    reason = str(e).split(" on tpu: ", 1)[-1].split(". Use ")[0]
                    rows.append(f"{head} pallas | declined: {reason} | | | | |")
                    report = None
                base = compile_tpu(case.baseline, *args, chip=chip)
                for backend, r in (("pallas", report), ("xla (jnp)", base)):
                    if r is None:
                        continue
                    m = r.memory
                    rows.append(
                        f"{head} {backend} | {', '.join(r.kernels) or '-'} | "
                        f"{_mib(m['argument_size_in_bytes'])} / {_mib(m['output_size_in_bytes'])} / "
                        f"{_mib(m['temp_size_in_bytes'])} | {_modelled_us(r)} | {roof} | "
                        f"{r.seconds:.2f} |")
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
