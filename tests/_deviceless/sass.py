"""What a kernel's machine code (SASS) says about its memory traffic, with
no GPU: ptxas (nvcc wheel) assembles the PTX for an architecture and nvdisasm
(the ``nvidia-cuda-nvdisasm`` wheel, in the compile extra) disassembles it.

    facts = load_facts(ptx, "sm_90a")[entry]
    facts.widths            # bits of every global load (LDG) in the kernel
    facts.loop_load_bytes   # bytes a thread loads per trip of the main loop
    facts.loop_exchanges    # shuffles, barriers, shared-memory ops in that loop

The main loop is the innermost loop (a backward branch) that holds global
loads; with the elements a program advances per trip (the launch's
constexprs), ``loop_load_bytes * threads / (elements * itemsize)`` is how
many times each element is loaded (1.0: once).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re
import subprocess
import tempfile

from tests._deviceless.gpu import KernelStats, nvidia_tool, ptxas_path


@functools.cache
def nvdisasm_path() -> str:
    """nvdisasm from the ``nvidia-cuda-nvdisasm`` wheel (``nvidia/cu13/bin``)."""
    return nvidia_tool("nvdisasm", ("cu13", "cuda_nvdisasm"))


def sass(ptx: str, sm_name: str) -> str:
    """The disassembled machine code of every entry of ``ptx``."""
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        pathlib.Path(source).write_text(ptx)
        subprocess.run([ptxas_path(), f"--gpu-name={sm_name}", source, "-o", cubin],
                       check=True, capture_output=True, timeout=300)
        run = subprocess.run([nvdisasm_path(), "-c", "-ndf", cubin], capture_output=True,
                             text=True, timeout=300, check=True)
    return run.stdout


@dataclasses.dataclass(frozen=True)
class LoadFacts:
    """The global loads of one kernel, as its SASS has them."""

    widths: tuple[int, ...]          # bits of each LDG in the kernel, in code order
    loop_widths: tuple[int, ...]     # bits of each LDG in the main loop
    loop_exchanges: tuple[str, ...]  # SHFL / BAR / LDS / STS opcodes in the main loop
    exp_per_loop: int                # MUFU.EX2 in the main loop
    loop_instructions: int           # instructions in the main loop

    @property
    def loop_load_bytes(self) -> int:
        return sum(self.loop_widths) // 8


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):", re.M)
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_EXCHANGE = ("SHFL", "BAR", "LDS", "STS", "REDUX")


def _width(opcode: str) -> int:
    """Bits of an LDG: ``LDG.E.128``, ``LDG.E.64.CONSTANT``, ``LDG.E.U16``, ``LDG.E``."""
    for part in opcode.split(".")[1:]:
        if part in ("64", "128"):
            return int(part)
        if part in ("U8", "S8"):
            return 8
        if part in ("U16", "S16"):
            return 16
    return 32


def _facts(body: str) -> LoadFacts:
    labels = {m.group(1): None for m in _LABEL.finditer(body)}
    code = []   # (address, opcode, operands)
    pending = []
    for line in body.splitlines():
        if m := _LABEL.match(line.strip()):
            pending.append(m.group(1))
        elif m := _INSTRUCTION.search(line):
            address = int(m.group(1), 16)
            for label in pending:
                labels[label] = address
            pending = []
            code.append((address, m.group(2), m.group(3)))
    loops = []   # (start, end) of each backward branch
    for address, opcode, operands in code:
        if opcode.startswith("BRA") and (t := _TARGET.search(operands)):
            start = labels.get(t.group(1))
            if start is not None and start <= address:
                loops.append((start, address))
    loads = [(a, op) for a, op, _ in code if op.startswith("LDG")]
    with_loads = [l for l in loops if any(l[0] <= a <= l[1] for a, _ in loads)]
    main = min(with_loads, key=lambda l: l[1] - l[0], default=None)
    inside = [(op, operands) for a, op, operands in code if main and main[0] <= a <= main[1]]
    return LoadFacts(
        widths=tuple(_width(op) for _, op in loads),
        loop_widths=tuple(_width(op) for op, _ in inside if op.startswith("LDG")),
        loop_exchanges=tuple(op for op, _ in inside if op.split(".")[0] in _EXCHANGE),
        exp_per_loop=sum(op.startswith("MUFU.EX2") for op, _ in inside),
        loop_instructions=len(inside))


def load_facts(ptx: str, sm_name: str = "sm_90a") -> dict[str, LoadFacts]:
    """{entry: its LoadFacts} for every entry of ``ptx``."""
    text = sass(ptx, sm_name)
    chunks = re.split(r"//-+ \.text\.", text)[1:]
    return {chunk.split()[0]: _facts(chunk) for chunk in chunks}


# --- the one-pass reductions: plans, loads per element, the table -------------

def kernel_loads(kernel: KernelStats) -> LoadFacts:
    """A compiled kernel's global loads as its SASS has them."""
    if kernel.ptx is None:
        raise LookupError(f"{kernel.name}: no PTX was dumped for this kernel")
    return load_facts(kernel.ptx, kernel.sm_name)[kernel.entry]


def first_pass_plan(backend: str, axis: int, dtype, shape):
    """The plan of the launch that reads a 2-D operand (``nxops.kernels._layout``),
    as the backend's wrapper makes it."""
    import jax.numpy as jnp

    from nxops.kernels import _layout
    if backend == "triton":
        from nxops.kernels.triton import reduce as triton_reduce
        knobs = triton_reduce.knobs()
    else:
        from nxops.kernels.pallas import reduce as pallas_reduce
        knobs = pallas_reduce._knobs()
    itemsize = jnp.dtype(dtype).itemsize
    if axis == 1:
        return _layout.rows_plan(*shape, itemsize, knobs)
    return _layout.columns_plan(1, *shape, itemsize, knobs)


def loads_per_element(facts: LoadFacts, plan, threads: int, itemsize: int) -> float:
    """Bytes a program loads over its piece, over the bytes of its piece: 1.0
    when each element is loaded once (the main loop, or the whole kernel when
    ptxas unrolled a piece of a step or two)."""
    trips = plan.piece_len // plan.step
    step_bytes = plan.unroll * plan.block[0] * plan.block[1] * itemsize
    loaded = facts.loop_load_bytes * trips if facts.loop_widths else sum(facts.widths) // 8
    return loaded * threads / (trips * step_bytes)
