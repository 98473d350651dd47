"""A cost model of compiled programs: does ``NXOPS_KERNELS=auto`` make a
program slower than plain XLA (``NXOPS_KERNELS=xla``)?

    python -m bench.static.model            # the full program set, H100 + A100 + v5e + v6e
    python -m bench.static.model --quick    # the CI set (each kind of program once)
    python -m bench.static.model --measured --machines h100   # beside the measured table

The model decides nothing: `auto` reads what GPUs measured
(nxops/kernels/measured/; TPUs, never measured yet, keep XLA).
``--measured`` prints the modelled kernel / xla ratio beside the measured
one for every entry of the sm_90 table.

Each program of a fixed set (``programs()``) is compiled deviceless, once
under ``auto`` and once under ``xla``, for GPUs by XLA's GPU compiler
(``tests._deviceless.gpu``'s targets) and for TPUs by libtpu (``tests._deviceless.tpu``'s
slices), and its time is estimated from what the compiled program launches.

Assumptions (the whole model; nothing else goes in):

- A *launch* is every instruction of the optimized HLO's entry computation
  (and of the computations it calls: while bodies, async wrappers) except
  parameters, constants, tuples, get-tuple-elements, bitcasts and the
  ``*-done`` halves of async pairs. On a GPU each is one kernel (fusion,
  custom call: cuBLAS, Pallas, Triton), a copy or a collective; on a TPU one
  fused op or Mosaic call.
- A launch's *bytes* are the bytes of its HLO operands and results (its HBM
  traffic if every operand is read once and every result written once):
  cuBLAS' workspace (the ``s8`` tuple element) is not traffic; a fusion
  parameter that the fusion only slices counts the slices' bytes; a fusion
  that updates a slice in place counts the update, not the buffer. A kernel
  that re-reads its operands (a tiled matmul) is credited with one read, in
  its favour. Kernels' declared costs (``pl.CostEstimate``) are never read.
- A launch's *FLOPs* are those of the dots and convolutions it contains (2 x
  result elements x contracted size); a custom-call matmul (Pallas, Triton,
  Mosaic) counts 2 x result x K, with K from its first operand.
- time(launch) = max(bytes / HBM bandwidth, FLOPs / tensor peak), the peak of
  bf16/f16 operands, half of it for f32 (TF32 / MXU bf16 passes), and
  collectives at the interconnect bandwidth instead of HBM; on a GPU a kernel
  whose grid (from the compiled thunk sequence) has fewer CTAs than the GPU
  has SMs is slowed by SMs / CTAs (cuBLAS calls, whose grid is cuBLAS' own
  choice, and launches with no grid in the thunk sequence count as full);
  plus a fixed overhead per launch: 2 µs on a GPU, 0.5 µs on a TPU.
- The program's time is the sum over launches (no overlap).
- GPUs compile dots with ``xla_gpu_enable_triton_gemm=False`` (cuBLAS):
  a deviceless compile cannot autotune XLA's Triton GEMMs.
- Peaks: H100 SXM 3.35 TB/s, 989 TFLOP/s, 132 SMs, NVLink 450 GB/s; A100 SXM
  2.039 TB/s, 312 TFLOP/s, 108 SMs, 300 GB/s; TPU v5e 819 GB/s, 197 TFLOP/s;
  v6e 1640 GB/s, 918 TFLOP/s; ICI 100 GB/s (public figures).

What the model cannot see: caches (L2 reuse), instruction-level efficiency
of a kernel (it charges every kernel the roofline), overlap of launches. It
ranks programs by the traffic and launches they are made of, which is what
the choice between a kernel and XLA's fusions changes.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import re
import sys
import tempfile
import time
from typing import Any, Callable

import jax

from tests._deviceless import gpu, tpu, uncached

GPU_OVERHEAD = 2e-6
TPU_OVERHEAD = 0.5e-6


@dataclasses.dataclass(frozen=True)
class Machine:
    name: str
    kind: str            # "gpu" or "tpu"
    target: str          # tests._deviceless.gpu arch / tests._deviceless.tpu chip
    bandwidth: float     # HBM bytes/s
    tensor_flops: float  # dense bf16 FLOP/s
    link_bandwidth: float
    sm_count: int = 0    # GPUs: SMs a launch should fill
    overhead: float = GPU_OVERHEAD


MACHINES = {
    "h100": Machine("H100", "gpu", "h100", 3.35e12, 989e12, 450e9, 132),
    "a100": Machine("A100", "gpu", "a100", 2.039e12, 312e12, 300e9, 108),
    "v5e": Machine("v5e", "tpu", "v5e", 819e9, 197e12, 100e9, overhead=TPU_OVERHEAD),
    "v6e": Machine("v6e", "tpu", "v6e", 1640e9, 918e12, 100e9, overhead=TPU_OVERHEAD),
    "v5p": Machine("v5p", "tpu", "v5p", 2765e9, 459e12, 100e9, overhead=TPU_OVERHEAD),
}


# --- reading the optimized HLO ----------------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
                "f16": 2, "bf16": 2, "f8e4m3fn": 1, "f8e5m2": 1, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_NO_LAUNCH = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
              "partition-id", "replica-id", "opt-barrier", "add-dependency"}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute", "send", "recv")


@dataclasses.dataclass
class Instr:
    name: str
    type: str        # the result type text
    opcode: str
    operands: list[str]
    attrs: str
    args: str = ""   # the text between the opcode's parentheses


def _arrays(type_text: str, hbm_only: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays of a type (``hbm_only``: not those placed in on-chip memory,
    a layout's ``S(n)`` memory space, e.g. a TPU's VMEM)."""
    return [(d, tuple(int(n) for n in dims.split(",") if n))
            for d, dims, layout in _ARRAY.findall(type_text)
            if d in _DTYPE_BYTES and not (hbm_only and re.search(r"S\([1-9]", layout))]


def _nbytes(type_text: str) -> float:
    """HBM bytes of a type's arrays."""
    return sum(_DTYPE_BYTES[d] * math.prod(s) for d, s in _arrays(type_text, hbm_only=True))


def _closing(text: str, start: int) -> int:
    """The index of the bracket closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def _parse_instr(line: str) -> Instr | None:
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = ", line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _closing(rest, 0) + 1
    else:
        end = rest.index(" ")
    type_text, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-$]+)\(", rest)
    if not op:
        return None
    close = _closing(rest, op.end() - 1)
    operands = re.findall(r"%([\w.\-]+)", rest[op.end():close])
    return Instr(m.group(1), type_text, op.group(1), operands, rest[close + 1:],
                 rest[op.end():close])


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str]:
    """({computation name: instructions}, entry computation name)."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = re.match(r"(ENTRY\s+)?%?([\w.\-]+) (\(.*\) -> .*)?\{\s*$", line)
        if head and not line.startswith(" "):
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None and (instr := _parse_instr(line)):
            comps[current].append(instr)
    return comps, entry


def _called(instr: Instr, key: str) -> list[str]:
    m = re.search(key + r"=\{?%?([\w.\-]+(?:, %[\w.\-]+)*)\}?", instr.attrs)
    return [n.lstrip("%") for n in m.group(1).split(", ")] if m else []


# --- one launch's bytes and FLOPs --------------------------------------------------

def _dot_flops(instr: Instr, types: dict[str, str]) -> float:
    out = math.prod(_arrays(instr.type)[0][1])
    if instr.opcode == "dot":
        lhs = _arrays(types.get(instr.operands[0], ""))
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
        if not lhs or not dims:
            return 0.0
        k = math.prod(lhs[0][1][int(d)] for d in dims.group(1).split(",") if d)
        return 2.0 * out * k
    # convolution: the contracted size is the kernel's extent over every dim
    # but its output feature dim
    rhs = _arrays(types.get(instr.operands[1], ""))
    labels = re.search(r"dim_labels=\w+_(\w+)->", instr.attrs)
    if not rhs or not labels:
        return 0.0
    k = math.prod(n for n, label in zip(rhs[0][1], labels.group(1)) if label != "o")
    return 2.0 * out * k


def _custom_call_flops(instr: Instr, types: dict[str, str]) -> float:
    target = re.search(r'custom_call_target="([^"]+)"', instr.attrs)
    target = target.group(1) if target else ""
    if "cublas" in target or "gemm" in target:
        dims = re.search(r'"lhs_contracting_dimensions":\["?([\d",]*)"?\]', instr.attrs)
        lhs = _arrays(types.get(instr.operands[0], ""))
        if not dims or not lhs:
            return 0.0
        k = math.prod(lhs[0][1][int(d.strip('"'))] for d in dims.group(1).split(",") if d)
        return 2.0 * math.prod(_arrays(instr.type)[0][1]) * k
    if target == "triton_kernel_call" and len(instr.operands) == 2:
        # jax-triton's call names nothing readable (its config is compressed):
        # nxops' Triton matmul is the one taking [B, M, K] x [B, K, N]
        (_, a), *_ = _arrays(types.get(instr.operands[0], "")) or [("", ())]
        (_, b), *_ = _arrays(types.get(instr.operands[1], "")) or [("", ())]
        if len(a) == len(b) == 3 and a[0] == b[0] and a[2] == b[1]:
            return 2.0 * math.prod(a) * b[2]
    if re.search(r"dot_general|matmul", instr.attrs) and instr.operands:
        (_, out), *_ = _arrays(instr.type)
        (_, lhs), *_ = _arrays(types.get(instr.operands[0], "")) or [("", ())]
        if len(out) < 2 or not lhs:
            return 0.0
        batch_m = math.prod(out[:-1])
        return 2.0 * math.prod(out) * math.prod(lhs) / batch_m
    return 0.0


def _fusion_bytes(instr: Instr, comps, types) -> float:
    """Operands (a sliced-only parameter: its slices) and results (an in-place
    slice update: the update) of a fusion."""
    (fused,) = _called(instr, "calls") or [None]
    body = comps.get(fused, [])
    users: dict[str, list[Instr]] = {}
    for i in body:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    root = body[-1] if body else None
    updated = set()
    roots = [root] if root is not None and root.opcode != "tuple" else \
        [i for i in body if root is not None and i.name in root.operands]
    result = _nbytes(instr.type)
    for r in roots:
        if r.opcode == "dynamic-update-slice" and r.operands:
            updated.add(r.operands[0])
            byname = {i.name: i for i in body}
            result -= _nbytes(r.type) - _nbytes(byname[r.operands[1]].type) \
                if r.operands[1] in byname else 0
    total = max(result, 0.0)
    params = sorted((i for i in body if i.opcode == "parameter"), key=lambda p: int(p.args))
    for operand, param in zip(instr.operands, params):
        if param.name in updated:
            continue
        uses = users.get(param.name, [])
        if uses and all(u.opcode in ("slice", "dynamic-slice", "gather") and
                        u.operands[0] == param.name for u in uses):
            total += min(sum(_nbytes(u.type) for u in uses), _nbytes(types.get(operand, "")))
        else:
            total += _nbytes(types.get(operand, ""))
    return total


@dataclasses.dataclass
class Launch:
    name: str
    opcode: str
    kernel: str          # fusion / custom-call kernel name (for grid lookup and tables)
    nbytes: float
    flops: float
    f32: bool
    collective: bool
    ctas: int | None = None
    seconds: float = 0.0
    custom_kernel: bool = False   # a Pallas / Triton / Mosaic custom call


def launches(hlo_text: str) -> list[Launch]:
    comps, entry = parse_hlo(hlo_text)
    out: list[Launch] = []
    _walk(comps, entry, out, set())
    return out


def _walk(comps, comp: str, out: list[Launch], seen: set) -> None:
    if comp in seen or comp not in comps:
        return
    seen.add(comp)
    body = comps[comp]
    types = {i.name: i.type for i in body}
    for instr in body:
        op = instr.opcode
        if op in _NO_LAUNCH or op.endswith("-done"):
            continue
        if op in ("while", "call", "conditional"):
            for key in ("body", "condition", "to_apply", "branch_computations",
                        "true_computation", "false_computation"):
                for c in _called(instr, key):
                    _walk(comps, c, out, seen)
            continue
        if op == "async-start":
            for c in _called(instr, "calls"):
                _walk(comps, c, out, seen)
            continue
        kernel = instr.name
        flops = 0.0
        if op == "fusion":
            nbytes = _fusion_bytes(instr, comps, types)
            (fused,) = _called(instr, "calls") or [None]
            inner = comps.get(fused, [])
            inner_types = {i.name: i.type for i in inner}
            flops = sum(_dot_flops(i, inner_types) for i in inner
                        if i.opcode in ("dot", "convolution"))
        else:
            result = instr.type
            if op == "custom-call":
                # cuBLAS returns (result, s8 workspace): the workspace is not traffic
                result = ", ".join(f"{d}[{','.join(map(str, s))}]" for d, s in _arrays(instr.type)
                                   if d not in ("s8", "u8") or len(_arrays(instr.type)) == 1)
                named = re.search(r'name = \\?"([\w.\-]+)\\?"', instr.attrs) or \
                    re.search(r'kernel_name[\\"=: ]+([\w.\-]+)', instr.attrs)
                kernel = named.group(1) if named else instr.name
                flops = _custom_call_flops(instr, types)
            elif op in ("dot", "convolution"):
                flops = _dot_flops(instr, types)
            elif op == "copy-start":
                # (destination, source, context): the copy writes its destination
                result = instr.type[1:].split(", ", 1)[0] if instr.type.startswith("(") else result
            nbytes = _nbytes(result) + sum(_nbytes(types.get(o, "")) for o in instr.operands)
        f32 = any(d == "f32" for o in instr.operands[:2] for d, _ in _arrays(types.get(o, "")))
        custom = op == "custom-call" and re.search(
            r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton|triton_kernel_call)"',
            instr.attrs) is not None
        out.append(Launch(instr.name, op, kernel, nbytes, flops, f32,
                          any(op.startswith(c) for c in _COLLECTIVES), custom_kernel=custom))


# --- timing -------------------------------------------------------------------------

def launch_seconds(launch: Launch, machine: Machine) -> float:
    bandwidth = machine.link_bandwidth if launch.collective else machine.bandwidth
    peak = machine.tensor_flops / (2 if launch.f32 else 1)
    seconds = max(launch.nbytes / bandwidth, launch.flops / peak)
    if machine.kind == "gpu" and launch.ctas and launch.ctas < machine.sm_count:
        seconds *= machine.sm_count / launch.ctas
    return seconds + machine.overhead


@dataclasses.dataclass
class Estimate:
    machine: str
    selection: str
    launches: list[Launch]

    @property
    def seconds(self) -> float:
        return sum(l.seconds for l in self.launches)

    @property
    def kernels(self) -> list[str]:
        """nxops' Pallas / Triton / Mosaic kernels among the launches."""
        return [l.kernel for l in self.launches if l.kernel.startswith("nxops") or l.custom_kernel]


_LAUNCH_LINE = re.compile(r"(\S+) grid: \[(\d+), (\d+), (\d+)\]")


def _gpu_grids(dump: pathlib.Path) -> dict[str, list[int]]:
    """CTAs per kernel name, in launch order. The thunk sequence names a
    kernel's second launch ``name__1`` (a split reduction's second pass),
    while the HLO custom call keeps ``name``: both are filed under ``name``."""
    grids: dict[str, list[int]] = {}
    for path in sorted(dump.glob("*thunk_sequence.txt")):
        for m in _LAUNCH_LINE.finditer(path.read_text()):
            name = re.sub(r"__\d+$", "", m.group(1))
            grids.setdefault(name, []).append(math.prod(map(int, m.group(2, 3, 4))))
    return grids


def lower(program: "Program", machine: str, selection: str):
    """``jax.stages.Lowered`` of ``program`` for ``machine`` under ``selection``:
    on GPUs over ``program.gpu_mesh`` GPUs (arguments replicated unless the
    program places them), on a TPU for one chip, or ``program.tpu_fn`` on the
    per-chip shards of a 4-chip slice in a shard_map over its axis "x"."""
    import numpy as np

    import nxops as nx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    m = MACHINES[machine]
    args, fn = program.args(), program.fn
    if m.kind == "gpu":
        mesh = gpu.gpu_mesh(m.target, program.gpu_mesh, ("x",))
    elif program.tpu_fn is not None:
        mesh = tpu.tpu_mesh(m.target)
        n = mesh.devices.size
        args = [jax.ShapeDtypeStruct((n * a.shape[0], *a.shape[1:]), a.dtype,
                                     sharding=NamedSharding(mesh, P("x"))) for a in args]
        fn = jax.shard_map(program.tpu_fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    else:
        mesh = Mesh(np.asarray(tpu.topology(m.target).devices[:1]), ("x",))
    placed = [a if getattr(a, "sharding", None) is not None else
              jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P()))
              for a in args]
    with jax.set_mesh(mesh), nx.kernels.use(selection), tpu._quiet_libtpu():
        return jax.jit(fn).trace(*placed).lower()


def estimate_lowered(lowered, machine: str, selection: str) -> Estimate:
    """Compiles ``lowered`` for ``machine`` and models the launches."""
    m = MACHINES[machine]
    grids: dict[str, list[int]] = {}
    if m.kind == "gpu":
        with tempfile.TemporaryDirectory() as dump, uncached():
            compiled = lowered.compile(compiler_options={
                "xla_dump_to": dump, "xla_gpu_enable_triton_gemm": False})
            grids = _gpu_grids(pathlib.Path(dump))
    else:
        with tpu._quiet_libtpu(), uncached():
            compiled = lowered.compile()
    return Estimate(machine, selection, timed_launches(compiled.as_text(), machine, grids))


def timed_launches(hlo_text: str, machine: str, grids: dict[str, list[int]] | None = None
                   ) -> list[Launch]:
    """The launches of a compiled program, timed; ``grids``: CTAs per kernel
    name, in launch order (GPUs)."""
    grids = {k: list(v) for k, v in (grids or {}).items()}
    found = launches(hlo_text)
    for launch in found:
        for key in (launch.kernel, launch.name):
            if grids.get(key):
                launch.ctas = grids[key].pop(0)
                break
        launch.seconds = launch_seconds(launch, MACHINES[machine])
    return found


def estimate(program: "Program", machine: str, selection: str) -> Estimate:
    return estimate_lowered(lower(program, machine, selection), machine, selection)


def estimate_both(program: "Program", machine: str, compile_same: bool = True
                  ) -> tuple[Estimate | None, Estimate | None]:
    """(auto, xla). Where ``auto`` lowers to the very program ``xla`` does (it
    chose no kernel), that program is compiled once, or not at all unless
    ``compile_same`` (the ratio is 1 by construction): (None, None)."""
    auto, xla = lower(program, machine, "auto"), lower(program, machine, "xla")
    if auto.as_text() == xla.as_text():
        if not compile_same:
            return None, None
        xla_estimate = estimate_lowered(xla, machine, "xla")
        return dataclasses.replace(xla_estimate, selection="auto"), xla_estimate
    return estimate_lowered(auto, machine, "auto"), estimate_lowered(xla, machine, "xla")


# --- the program set ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    fn: Callable
    shapes: tuple            # argument shapes (per device / chip)
    dtype: Any
    quick: bool = False
    gpu_mesh: tuple = (1,)   # GPUs it runs on ("x" axis)
    tpu_fn: Callable | None = None   # TPUs: a per-chip body for a 4-chip slice, when not ``fn``
    targets: tuple = ("gpu", "tpu")

    def args(self):
        dtypes = self.dtype if isinstance(self.dtype, tuple) else (self.dtype,) * len(self.shapes)
        return [jax.ShapeDtypeStruct(s, d) for s, d in zip(self.shapes, dtypes)]


def _loss(f):
    import jax.numpy as jnp
    return lambda *a: jnp.sum(f(*a).astype(jnp.float32))


def programs() -> list[Program]:
    import jax.numpy as jnp
    from jax import lax

    import nxops as nx

    bf16, f32 = jnp.bfloat16, jnp.float32
    mm = lambda a, b: nx.einsum("mk,kn->mn", a, b)
    out = [
        Program("rows logsumexp 4096^2", lambda v: nx.logsumexp(v, 1), ((4096, 4096),), bf16,
                quick=True),
        Program("rows logsumexp 4096^2 f32", lambda v: nx.logsumexp(v, 1), ((4096, 4096),), f32),
        Program("sum(exp(v)*w, 1) 4096^2", lambda v, w: nx.sum(jnp.exp(v) * w, 1),
                ((4096, 4096),) * 2, bf16, quick=True),
        Program("rows sum 4096^2", lambda v: nx.sum(v, 1), ((4096, 4096),), bf16),
        Program("columns max 4096^2", lambda v: nx.max(v, 0), ((4096, 4096),), bf16,
                quick=True),
        Program("columns sum (8,3000,4096)", lambda v: nx.sum(v, 1), ((8, 3000, 4096),), bf16),
        Program("columns logsumexp 16384x4096 f32", lambda v: nx.logsumexp(v, 0),
                ((16384, 4096),), f32),
        Program("grad rows logsumexp 4096^2", jax.grad(_loss(lambda v: nx.logsumexp(v, 1))),
                ((4096, 4096),), bf16),
        Program("gelu(einsum + c) 4096^3", lambda a, b, c: jax.nn.gelu(mm(a, b) + c),
                ((4096, 4096),) * 3, bf16, quick=True),
        Program("matmul 4096^3", mm, ((4096, 4096),) * 2, bf16),
        Program("grad einsum loss 4096^3", jax.grad(_loss(mm), argnums=(0, 1)),
                ((4096, 4096),) * 2, bf16, quick=True),
        Program("skinny 8x4096x4096", mm, ((8, 4096), (4096, 4096)), bf16, quick=True),
        Program("skinny 128x4096x4096", mm, ((128, 4096), (4096, 4096)), bf16),
        Program("tile (8192,4096) into 4", _gpu_tile, ((8192, 4096),), bf16, quick=True,
                gpu_mesh=(4,), tpu_fn=lambda v: nx.tile(v, {"x": 0})),
    ]
    # LLM shapes: projections and FFN at M tokens, the LM head and its loss
    for m_tokens, d in ((4096, 4096), (16384, 8192)):
        out.append(Program(f"FFN up {m_tokens}x{d}x14336", mm, ((m_tokens, d), (d, 14336)), bf16))
        out.append(Program(f"FFN down {m_tokens}x14336x{d}", mm, ((m_tokens, 14336), (14336, d)),
                           bf16))
    for vocab in (32000, 128256):
        out.append(Program(f"LM head + logsumexp 4096x4096x{vocab}",
                           lambda x, w: nx.logsumexp(mm(x, w).astype(jnp.float32), 1),
                           ((4096, 4096), (4096, vocab)), bf16))
    out += [
        Program("attention (named heads) 8x2048x128", _attention, ((2048, 8, 128),) * 3, bf16,
                quick=True),
        Program("layernorm over named d 8192x4096", _layernorm, ((8192, 4096),), bf16,
                quick=True),
        Program("softmax over named class 8192x32000", _softmax, ((8192, 32000),), bf16),
        Program("MLP in nx.xmap forward", _mlp_loss(nx), ((4096, 1024), (1024, 4096),
                (4096, 32000), (4096,)), (bf16, bf16, bf16, jnp.int32), targets=("gpu",)),
        Program("MLP in nx.xmap grad (training step)",
                jax.grad(_mlp_loss(nx), argnums=(1, 2)), ((4096, 1024), (1024, 4096),
                (4096, 32000), (4096,)), (bf16, bf16, bf16, jnp.int32), targets=("gpu",)),
        Program("training step (vmap-named MLP, grad) small", _train_step(nx),
                ((512, 256), (256, 1024), (1024, 4096), (512,)), (bf16, bf16, bf16, jnp.int32),
                quick=True),
    ]
    del lax
    return out


def _gpu_tile(v):
    import nxops as nx
    body = nx.xmap(lambda t: nx.tile(t, {"t": 0}), [...], ["t", ...], axis_sizes={"t": 4},
                   axis_resources={"t": "x"})
    return body(v)


def _attention(q, k, v):
    """Named heads ``h`` (vmapped): scores over positions, softmax, values."""
    import jax.numpy as jnp
    import nxops as nx

    def head(q, k, v):
        s = nx.einsum("qd,kd->qk", q, k).astype(jnp.float32) * (q.shape[-1] ** -0.5)
        p = jnp.exp(s - nx.logsumexp(s, 1)[:, None]).astype(v.dtype)
        return nx.einsum("qk,kd->qd", p, v)
    return jax.vmap(head, in_axes=1, out_axes=1, axis_name="h")(q, k, v)


def _layernorm(x):
    """Layer norm of each row over the named feature axis ``d``."""
    import jax.numpy as jnp
    import nxops as nx

    def row(x):
        def feature(v):
            v = v.astype(jnp.float32)
            mu = nx.mean(v, "d")
            var = nx.mean(jnp.square(v - mu), "d")
            return ((v - mu) * lax_rsqrt(var + 1e-5)).astype(jnp.bfloat16)
        return jax.vmap(feature, axis_name="d")(x)
    return jax.vmap(row)(x)


def lax_rsqrt(x):
    from jax import lax
    return lax.rsqrt(x)


def _softmax(x):
    """Softmax over the named class axis ``c``."""
    import jax.numpy as jnp
    import nxops as nx

    def cls(v):
        return jnp.exp(v.astype(jnp.float32) - nx.logsumexp(v, "c")).astype(v.dtype)
    return jax.vmap(lambda r: jax.vmap(cls, axis_name="c")(r))(x)


def _mlp_loss(nx):
    import jax.numpy as jnp

    def example(x, w1, w2, label):
        h = jax.nn.relu(nx.einsum("d,dh->h", x, w1))
        logits = nx.einsum("h,hc->c", h, w2).astype(jnp.float32)
        return nx.logsumexp(logits, 0) - logits[label]

    body = nx.xmap(lambda x, w1, w2, y: nx.mean(example(x, w1, w2, y), "batch"),
                   [["batch", ...], [...], [...], ["batch"]], [...])
    return body


def _train_step(nx):
    """One SGD step of a two-layer MLP whose loss is a named mean over the batch."""
    import jax.numpy as jnp

    def loss(w1, w2, x, y):
        def example(x, y):
            h = jax.nn.relu(nx.einsum("d,dh->h", x, w1))
            logits = nx.einsum("h,hc->c", h, w2).astype(jnp.float32)
            return nx.logsumexp(logits, 0) - logits[y]
        return jnp.mean(jax.vmap(example, axis_name="batch")(x, y))

    def step(x, w1, w2, y):
        g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2, x, y)
        return w1 - 0.1 * g1.astype(w1.dtype), w2 - 0.1 * g2.astype(w2.dtype)
    return step


# --- the table --------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    program: str
    machine: str
    auto: Estimate | None
    xla: Estimate | None
    error: str = ""

    @property
    def same_program(self) -> bool:
        """auto lowered to xla's program (not compiled: ratio 1)."""
        return self.auto is None and not self.error

    @property
    def ratio(self) -> float:
        return 1.0 if self.same_program else self.auto.seconds / self.xla.seconds


def evaluate(progs, machines, compile_same: bool = True, progress: bool = False) -> list[Row]:
    """One row per program and machine; ``compile_same=False`` skips compiling
    the programs for which auto chose no kernel (the CI test's shortcut)."""
    rows = []
    for machine in machines:
        kind = MACHINES[machine].kind
        for p in progs:
            if kind not in p.targets:
                continue
            try:
                rows.append(Row(p.name, machine, *estimate_both(p, machine, compile_same)))
            except Exception as e:  # a program that cannot compile is reported
                rows.append(Row(p.name, machine, None, None, f"{type(e).__name__}: {e}"[:200]))
            if progress:
                print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows


def _kernel_summary(e: Estimate) -> str:
    names: dict[str, int] = {}
    for k in e.kernels:
        names[k] = names.get(k, 0) + 1
    return ", ".join(f"{k}" + (f" x{n}" if n > 1 else "") for k, n in names.items()) or "-"


def markdown(rows: list[Row]) -> str:
    lines = ["| machine | program | launches auto / xla | modelled auto (µs) | modelled xla (µs) "
             "| auto / xla | kernels auto chose |", "|" + "---|" * 7]
    for r in rows:
        if r.error:
            lines.append(f"| {r.machine} | {r.program} | | | | | compile failed: {r.error} |")
            continue
        if r.same_program:
            lines.append(f"| {r.machine} | {r.program} | | | | 1 | - (xla's program) |")
            continue
        lines.append(f"| {r.machine} | {r.program} | {len(r.auto.launches)} / "
                     f"{len(r.xla.launches)} | {r.auto.seconds * 1e6:.1f} | "
                     f"{r.xla.seconds * 1e6:.1f} | {r.ratio:.2f} | {_kernel_summary(r.auto)} |")
    return "\n".join(lines)


# --- the model beside what a GPU measured ------------------------------------------


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One measured table entry: the model's kernel / xla on ``machine`` beside
    the GPU's (nxops/kernels/measured/), for the case the entry was measured on."""

    key: str
    case: str
    backend: str
    modelled: float
    measured: float
    device: str

    @property
    def off(self) -> float:
        """How far the model is from the measurement (modelled / measured)."""
        return self.modelled / self.measured


def against_measured(machine: str = "h100", arch: str = "sm_90", k: str = "") -> list[Comparison]:
    """Every entry of ``arch``'s measured table whose case contains ``k``,
    modelled on ``machine`` (the table's ratio is within one GPU; the model's
    too, so an H100 model faces an H200 measurement). The model decides
    nothing: `auto` reads the table."""
    from nxops.measure import _cases as gpu_cases
    from nxops.kernels import _measured

    rows, xla_seconds = [], {}
    for key, by_backend in sorted(_measured.load(arch).items()):
        for backend, m in sorted(by_backend.items()):
            section, name = m.cases[0].split("/", 1)
            if k not in name:
                continue
            case = gpu_cases.case(section, name)
            program = Program(name, case.fn, tuple(s for s, _ in case.shapes),
                              tuple(d for _, d in case.shapes))
            if name not in xla_seconds:
                xla_seconds[name] = estimate(program, machine, "xla").seconds
            modelled = estimate(program, machine, backend).seconds / xla_seconds[name]
            rows.append(Comparison(key, m.cases[0], backend, modelled, m.ratio, m.device))
    return rows


def comparison_markdown(rows: list[Comparison], machine: str = "h100") -> str:
    lines = [f"| case (table key) | backend | modelled /xla ({MACHINES[machine].name}) "
             "| measured /xla | modelled / measured |", "|" + "---|" * 5]
    lines += [f"| {r.case} (`{r.key}`) | {r.backend} | {r.modelled:.2f} | {r.measured:.2f} "
              f"({r.device}) | {'**' if abs(r.off - 1) > 0.25 else ''}{r.off:.2f}"
              f"{'**' if abs(r.off - 1) > 0.25 else ''} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", action="store_true",
                        help="model every case of the measured table beside its measurement")
    parser.add_argument("--quick", action="store_true", help="the CI program set")
    parser.add_argument("--machines", default="h100,a100,v5e,v6e")
    parser.add_argument("-k", default="", help="only programs whose name contains this")
    parser.add_argument("--write", action="store_true",
                        help="write the table into bench/static/MODEL.md (below its notes)")
    ns = parser.parse_args(argv)
    if ns.measured:
        machine = ns.machines.split(",")[0]
        rows = against_measured(machine, k=ns.k)
        far = sum(abs(r.off - 1) > 0.25 for r in rows)
        print(comparison_markdown(rows, machine) + f"\n\n{len(rows)} entries, {far} modelled "
              f"more than 25% off the measurement")
        return 0
    progs = [p for p in programs() if (p.quick or not ns.quick) and ns.k in p.name]
    start = time.perf_counter()
    rows = evaluate(progs, ns.machines.split(","), progress=True)
    text = markdown(rows)
    worst = max((r.ratio for r in rows if not r.error), default=float("nan"))
    summary = (f"{len(rows)} rows, worst auto/xla {worst:.2f}, "
               f"{sum(bool(r.error) for r in rows)} failed, {time.perf_counter() - start:.0f} s")
    print(text + "\n\n" + summary)
    if ns.write:
        out = pathlib.Path(__file__).with_name("MODEL.md")
        notes = out.read_text().split(_TABLE_MARK)[0] if out.exists() else ""
        out.write_text(notes + _TABLE_MARK + "\n\n" + text + "\n\n" + summary + "\n")
    return 0 if worst <= 1.02 else 1


_TABLE_MARK = "## The table (auto as it is now)"


if __name__ == "__main__":
    sys.exit(main())
