"""Deviceless GPU compilation: what XLA's GPU compiler makes of a program for
an H100 or A100, on a machine with no GPU.

    report = compile_gpu(fn, *shape_dtype_structs, arch="h100")      # one GPU
    report = compile_gpu(fn, *args, arch="h100", mesh_shape=(8,), mesh_axes=("x",))
    report.kernels   # per kernel: grid, threads, registers, spills, smem, CTAs/SM, tensor cores

Needs the ``compile`` extra (the CUDA plugin of this JAX and the nvcc wheel)
and ``JAX_PLATFORMS=cpu``. ``jax.experimental.topologies`` gives devices of a
GPU described by ``targets/<arch>.txtpb`` (a ``GpuTargetConfigProto`` written
from the device's public figures); the program is compiled with a dump
directory, whose ``*thunk_sequence.txt`` gives each kernel's launch (grid,
threads, shared memory) and whose PTX, assembled by the nvcc wheel's
``ptxas -v``, gives registers and spills. Arguments with a ``sharding=`` keep it;
others are replicated over the topology mesh. ``python -m bench.static.gpu``
writes ``bench/static/GPU.md`` for the bench shapes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import pathlib
import re
import subprocess
import tempfile
from typing import Any, Callable, Sequence

import jax
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec


TARGETS = pathlib.Path(__file__).with_name("targets")


@dataclasses.dataclass(frozen=True)
class Arch:
    """A GPU's limits and peaks (public figures) for occupancy and rooflines."""

    name: str
    target_file: str
    sm_name: str            # ptxas --gpu-name
    sm_count: int
    smem_per_sm: int        # bytes usable by CTAs
    regs_per_sm: int = 65536
    threads_per_sm: int = 2048
    ctas_per_sm: int = 32
    smem_reserved_per_cta: int = 1024
    bandwidth: float = 0.0  # bytes/s
    tensor_flops: float = 0.0   # dense bf16 FLOP/s


ARCHS = {
    "h100": Arch("H100 SXM", "h100_sxm.txtpb", "sm_90a", 132, 233472,
                 bandwidth=3.35e12, tensor_flops=989e12),
    "a100": Arch("A100 SXM 80GB", "a100_sxm.txtpb", "sm_80", 108, 167936,
                 bandwidth=2.039e12, tensor_flops=312e12),
}


@dataclasses.dataclass(frozen=True)
class KernelStats:
    """One GPU kernel of a compiled program."""

    name: str
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    shared_memory: int            # dynamic, from the launch
    registers: int | None         # per thread, from ptxas
    spill_stores: int | None      # bytes
    spill_loads: int | None
    static_smem: int | None
    tensor_core: str | None       # e.g. 'wgmma.m64n128k16', 'mma.m16n8k16'
    ctas_per_sm: int | None
    ptx: str | None = dataclasses.field(default=None, repr=False, compare=False)
    sm_name: str | None = dataclasses.field(default=None, repr=False, compare=False)

    def loads(self):
        """Its global loads as the SASS has them (``bench.static.sass.LoadFacts``)."""
        from bench.static import sass
        if self.ptx is None:
            raise LookupError(f"{self.name}: no PTX was dumped for this kernel")
        return sass.load_facts(self.ptx, self.sm_name)[self.entry]

    @property
    def entry(self) -> str:
        """Its PTX entry: its name (XLA), or the one entry of its PTX
        (jax-triton names it after the @triton.jit function)."""
        entries = re.findall(r"\.entry\s+(\w+)", self.ptx or "")
        return self.name if self.name in entries or not entries else entries[0]

    @property
    def blocks(self) -> int:
        return math.prod(self.grid)

    @property
    def warps(self) -> int:
        return math.ceil(math.prod(self.threads) / 32)


@dataclasses.dataclass
class GpuCompileReport:
    arch: Arch
    compiled: Any
    hlo_text: str
    kernels: list[KernelStats]

    def kernel(self, prefix: str) -> KernelStats:
        """The one kernel whose name starts with ``prefix``."""
        found = [k for k in self.kernels if k.name.startswith(prefix)]
        if len(found) != 1:
            raise LookupError(f"{len(found)} kernels named {prefix}*: "
                              f"{[k.name for k in self.kernels]}")
        return found[0]


@functools.lru_cache(maxsize=None)
def topology(arch: str, num_devices: int = 1):
    text = (TARGETS / ARCHS[arch].target_file).read_text()
    return topologies.get_topology_desc(platform="cuda", target_config=text,
                                        topology=f"1x1x{num_devices}")


def compile_available(arch: str = "h100") -> bool:
    """Whether this machine compiles for ``arch`` without a GPU (the compile
    extra: the CUDA plugin); benchmarks skip their GPU figures without it."""
    try:
        topology(arch)
        return True
    except Exception:  # noqa: BLE001 - no CUDA plugin here: the GPU figure is skipped
        return False


def gpu_mesh(arch: str, mesh_shape: Sequence[int], mesh_axes: Sequence[str]):
    """A mesh of ``prod(mesh_shape)`` GPUs of ``arch`` (for sharded arguments)."""
    topo = topology(arch, math.prod(mesh_shape))
    return topologies.make_mesh(topo, tuple(mesh_shape), tuple(mesh_axes))


def compile_gpu(fn: Callable, *args: jax.ShapeDtypeStruct, arch: str = "h100",
                mesh_shape: Sequence[int] = (1,), mesh_axes: Sequence[str] = ("x",)
                ) -> GpuCompileReport:
    """Compiles ``jax.jit(fn)`` for ``arch`` GPUs and reads what was made."""
    mesh = gpu_mesh(arch, mesh_shape, mesh_axes)
    placed = [a if getattr(a, "sharding", None) is not None else
              jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
              for a in args]
    with tempfile.TemporaryDirectory() as dump, jax.set_mesh(mesh), \
            _triton_kernels_dumped(pathlib.Path(dump) / "triton") as launches:
        compiled = jax.jit(fn).trace(*placed).lower().compile(
            # XLA (JAX 0.12) dumps each kernel's PTX only for emitters this matches
            compiler_options={"xla_dump_to": dump, "xla_dump_emitter_re": ".*"})
        kernels = _read_dump(pathlib.Path(dump), ARCHS[arch])
        kernels += _read_triton_dump(pathlib.Path(dump) / "triton", launches, ARCHS[arch])
    return GpuCompileReport(ARCHS[arch], compiled, compiled.as_text(), kernels)


@contextlib.contextmanager
def _triton_kernels_dumped(dump: pathlib.Path):
    """nxops' Triton kernels (jax-triton custom calls, compiled to PTX while
    lowering, not by XLA) dumped under ``dump``; yields their launches."""
    try:
        from jax_triton import triton_lib
        from nxops.kernels.triton import _launch
    except ImportError:   # the triton extra is not installed: no such kernels
        yield []
        return
    saved = triton_lib._JAX_TRITON_DUMP_DIR
    triton_lib._JAX_TRITON_DUMP_DIR = str(dump)
    _clear_compiled_kernels(triton_lib)   # compiled kernels are dumped when built
    try:
        with _launch.recording_launches() as rec:
            yield rec
    finally:
        triton_lib._JAX_TRITON_DUMP_DIR = saved


def _clear_compiled_kernels(triton_lib) -> None:
    """jax-triton 0.3 keeps built kernels in one module cache; 0.4 per kernel
    function (``_jT_kernel_cache``): nxops' kernels are cleared there."""
    if hasattr(triton_lib, "_COMPILED_KERNEL_CACHE"):
        triton_lib._COMPILED_KERNEL_CACHE.clear()
        return
    from nxops.kernels.triton import dot_general, reduce, tile
    for module in (dot_general, reduce, tile):
        for value in vars(module).values():   # a @triton.jit function (or its autotuner)
            for kernel in (value, getattr(value, "fn", None)):
                cache = getattr(kernel, "_jT_kernel_cache", None)
                if isinstance(cache, dict):
                    cache.clear()


def _read_triton_dump(dump: pathlib.Path, launches, arch: Arch) -> list[KernelStats]:
    """One KernelStats per recorded launch: grid and warps from the launch,
    PTX and shared memory from jax-triton's dump of the kernel it built (its
    ``config`` names the function, constexprs, warps and stages)."""
    built = []   # (config text, ptx, shared memory) per compiled kernel
    for config in sorted(dump.glob("*/config")):
        ptx = next(config.parent.glob("*.ptx")).read_text()
        info = next(config.parent.glob("*.compile_info")).read_text()
        built.append((config.read_text(), ptx, int(info.rsplit(":", 1)[1])))

    def made_by(launch, config: str) -> bool:
        return (f":{launch.kernel})" in config
                and f"num_warps={launch.num_warps}," in config
                and f"num_stages={launch.num_stages}," in config
                and all(repr(item) in config for item in launch.constexprs))

    stats = []
    for launch in launches:
        (_, ptx, smem), *_ = [b for b in built if made_by(launch, b[0])]
        ((regs, stores, loads, static),) = _ptxas(ptx, arch.sm_name).values()
        tensor_core = next(iter(_tensor_core_instructions(ptx).values()), None)
        threads = (32 * launch.num_warps, 1, 1)
        grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
        stats.append(KernelStats(launch.name, grid, threads, smem, regs, stores, loads, static,
                                 tensor_core, _ctas_per_sm(arch, threads, regs, smem + static),
                                 ptx, arch.sm_name))
    return stats


_LAUNCH = re.compile(r"(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]"
                     r"\s+shared_memory: (\d+) bytes")


def _read_dump(dump: pathlib.Path, arch: Arch) -> list[KernelStats]:
    launches = {}
    for path in dump.glob("*thunk_sequence.txt"):
        for m in _LAUNCH.finditer(path.read_text()):
            launches[m.group(1)] = (tuple(map(int, m.group(2, 3, 4))),
                                    tuple(map(int, m.group(5, 6, 7))), int(m.group(8)))
    assembled, tensor_cores, ptx_of = {}, {}, {}
    for path in dump.glob("*.ptx"):
        ptx = path.read_text()
        if ".version" not in ptx:   # XLA leaves empty PTX files for modules with no kernel
            continue
        entries = _ptxas(ptx, arch.sm_name)
        assembled.update(entries)
        ptx_of.update(dict.fromkeys(entries, ptx))
        tensor_cores.update(_tensor_core_instructions(ptx))
    stats = []
    for name, (grid, threads, smem) in sorted(launches.items()):
        regs, stores, loads, static = assembled.get(name, (None, None, None, None))
        stats.append(KernelStats(name, grid, threads, smem, regs, stores, loads, static,
                                 tensor_cores.get(name),
                                 _ctas_per_sm(arch, threads, regs, smem + (static or 0)),
                                 ptx_of.get(name), arch.sm_name))
    return stats


def ptxas_path() -> str:
    """ptxas from the nvcc wheel: ``nvidia/cuda_nvcc/bin`` (nvidia-cuda-nvcc-cu12,
    JAX 0.10) or ``nvidia/cu13/bin`` (nvidia-cuda-nvcc 13, JAX 0.12)."""
    return nvidia_tool("ptxas", ("cuda_nvcc", "cu13"))


def nvidia_tool(tool: str, packages: tuple[str, ...]) -> str:
    """The path of CUDA's ``tool`` in the first of the nvidia wheels' ``packages``
    (folders under ``nvidia/``) that holds ``bin/<tool>``."""
    import nvidia
    for root in map(pathlib.Path, nvidia.__path__):
        for package in packages:
            if (root / package / "bin" / tool).exists():
                return str(root / package / "bin" / tool)
    raise FileNotFoundError(f"no {tool} in the nvidia wheels: install the compile extra "
                            "(pip install 'nxops[compile]')")


_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")   # smem: when nonzero
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas(ptx: str, sm_name: str) -> dict[str, tuple[int, int, int, int]]:
    """{entry: (registers, spill store bytes, spill load bytes, static smem)}."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        run = subprocess.run([ptxas_path(), "-v", f"--gpu-name={sm_name}", f.name, "-o", os.devnull],
                             capture_output=True, text=True, timeout=300)
    if run.returncode:
        raise RuntimeError(f"ptxas failed for {sm_name}:\n{run.stderr[-3000:]}")
    out, entry, spills = {}, None, (0, 0)
    for line in run.stderr.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
        elif (m := _SPILLS.search(line)) and entry:
            spills = (int(m.group(1)), int(m.group(2)))
        elif (m := _USED.search(line)) and entry:
            out[entry] = (int(m.group(1)), *spills, int(m.group(2) or 0))
    return out


_WGMMA = re.compile(r"wgmma\.mma_async\S*\.(m\d+n\d+k\d+)")
_MMA = re.compile(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)")


def _tensor_core_instructions(ptx: str) -> dict[str, str]:
    """{entry: the widest tensor-core instruction in its body}."""
    found = {}
    for chunk in re.split(r"\.entry\s+", ptx)[1:]:
        name = chunk.split("(", 1)[0].strip()
        shapes = [f"wgmma.{s}" for s in _WGMMA.findall(chunk)] or \
                 [f"mma.{s}" for s in _MMA.findall(chunk)]
        if shapes:
            found[name] = max(shapes, key=lambda s: int(re.search(r"n(\d+)", s).group(1)))
    return found


def _ctas_per_sm(arch: Arch, threads, registers, smem) -> int | None:
    if registers is None:
        return None
    n_threads = math.prod(threads)
    warps = math.ceil(n_threads / 32)
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256   # allocation unit: 256
    limits = [arch.ctas_per_sm, arch.threads_per_sm // n_threads,
              arch.regs_per_sm // (regs_per_warp * warps)]
    if smem:
        limits.append(arch.smem_per_sm // (smem + arch.smem_reserved_per_cta))
    return max(0, min(limits))


def roofline_seconds(arch: str, bytes_moved: float, flops: float = 0.0) -> float:
    """The lower bound of a kernel's time: memory or tensor-core throughput."""
    a = ARCHS[arch]
    return max(bytes_moved / a.bandwidth, flops / a.tensor_flops)


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
    from bench.static import model
    grids: dict[str, list[int]] = {}
    for k in report.kernels:
        grids.setdefault(k.name, []).append(k.blocks)
    return sum(l.seconds for l in model.timed_launches(report.hlo_text, arch, grids)) * 1e6


def table(archs=("h100", "a100"), backends=("pallas", "triton")) -> str:
    """The markdown table of every kernel x case x dtype x arch x backend, and
    for each case the XLA baseline row (``NXOPS_KERNELS=xla``, dots as cuBLAS)."""
    import jax.numpy as jnp

    import nxops as nx
    from bench.static import model

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
`targets/`, once with `NXOPS_KERNELS=pallas` (Pallas' Triton lowering) and once
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
