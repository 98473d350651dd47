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
TPU. Shared by the tests (tests/static/) and the benchmarks' tables
(``python -m bench.static.tpu`` writes ``bench/static/TPU.md``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import sys
from typing import Any, Callable

# libtpu takes the machine-wide /tmp/libtpu_lockfile unless told that several
# processes may load it. Compiling touches no TPU, and several clients do
# load it at once here: pytest-xdist's workers, both CI stacks, a table run
# beside a test run. A lockfile another process or user holds otherwise fails
# every compile ("Internal error when accessing libtpu multi-process lockfile").
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from tests._deviceless import uncached

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


def compile_tpu(fn: Callable, *args: jax.ShapeDtypeStruct, chip: str = "v5e",
                check_vma: bool = True) -> TpuCompileReport:
    """Compiles ``fn`` on per-chip ``args`` for a ``chip`` slice (see the module
    docstring) and reads what was made. ``check_vma``: the shard_map's (False
    for ops whose reference cannot be typed with varying axes yet: nx.attention's
    blockwise loops start from carries that vary along no axis)."""
    mesh = tpu_mesh(chip)
    n = mesh.devices.size
    stacked = [jax.ShapeDtypeStruct((n * a.shape[0], *a.shape[1:]), a.dtype,
                                    sharding=NamedSharding(mesh, PartitionSpec("x"))) for a in args]
    body = jax.shard_map(fn, mesh=mesh, in_specs=PartitionSpec("x"), out_specs=PartitionSpec("x"),
                         check_vma=check_vma)
    with jax.set_mesh(mesh), _quiet_libtpu(), uncached():
        compiled = jax.jit(body).trace(*stacked).lower().compile()
    text = compiled.as_text()
    memory = compiled.memory_analysis()
    memory = {k: getattr(memory, k) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                               "temp_size_in_bytes", "generated_code_size_in_bytes")}
    cost = compiled.cost_analysis() or {}
    cost = {k: float(cost[k]) for k in _COST_KEYS if k in cost}
    return TpuCompileReport(chip, compiled, text, _KERNEL.findall(text),
                            [tuple(map(int, m)) for m in _ESTIMATE.findall(text)],
                            memory, cost)


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
