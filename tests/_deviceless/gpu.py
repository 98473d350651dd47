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
others are replicated over the topology mesh. Shared by the tests
(tests/static/) and the benchmarks' tables (``python -m bench.static.gpu``
writes ``bench/static/GPU.md``); ``tests._deviceless.sass`` reads a kernel's
SASS.
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

from nxops._supported_jax import _release
from tests._deviceless import uncached


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
    except Exception:
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
    with tempfile.TemporaryDirectory() as dump, jax.set_mesh(mesh), uncached(), \
            _triton_kernels_dumped(pathlib.Path(dump) / "triton") as launches:
        compiled = jax.jit(fn).trace(*placed).lower().compile(
            compiler_options={"xla_dump_to": dump, **_PTX_DUMP_OPTIONS})
        kernels = _read_dump(pathlib.Path(dump), ARCHS[arch])
        kernels += _read_triton_dump(pathlib.Path(dump) / "triton", launches, ARCHS[arch])
    return GpuCompileReport(ARCHS[arch], compiled, compiled.as_text(), kernels)


# XLA in JAX 0.12 dumps a kernel's PTX only for the emitters this matches (set
# from 0.11 on). JAX 0.10's XLA dumps every module's PTX anyway, and with it
# would also dump each Triton pass's IR: about 10 MB and 12 s per Pallas kernel.
_PTX_DUMP_OPTIONS = ({} if _release(jax.__version__) < (0, 11)
                     else {"xla_dump_emitter_re": ".*"})


@functools.lru_cache(maxsize=None)
def compile_reduction(backend: str, op: str, axes, dtype: str, shape: tuple[int, ...],
                      arch: str = "h100") -> GpuCompileReport:
    """``nx.<op>(x, axes)`` for an ``x`` of ``shape`` and ``dtype``, compiled
    for ``arch`` with the reduce kernels of ``backend``. Cached: several
    static test modules read the same programs, and each compile runs ptxas."""
    import nxops as nx
    with nx.kernels.use(backend):
        return compile_gpu(lambda v: getattr(nx, op)(v, axes),
                           jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype)), arch=arch)


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
