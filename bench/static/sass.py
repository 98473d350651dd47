"""The one-pass reductions' machine code (SASS), compiled for a GPU with no
GPU (``tests._deviceless.gpu``, ``tests._deviceless.sass``): per launch its
grid, registers, spills and load widths, and per element of its main loop
its loads and instructions. ``python -m bench.static.sass`` writes
``bench/static/SASS.md``.
"""
from __future__ import annotations

import pathlib

from tests._deviceless import gpu
from tests._deviceless.sass import first_pass_plan, kernel_loads, loads_per_element

REDUCTION_CASES = (("logsumexp", 1), ("logsumexp", 0), ("sum", 0))


def reduction_table(arch: str = "h100", backends=("pallas", "triton"),
                    shapes=((16384, 8192), (4096, 4096)), dtypes=("float32", "bfloat16")) -> str:
    """Markdown: per reduction launch (the first reads the operand; a second,
    ``__1`` or the second Triton row, reduces f32 partials), its grid,
    threads, registers, spills, load widths; for the first, loads per element
    and, per element of its main loop, MUFU.EX2 and instructions."""
    import math

    import jax
    import jax.numpy as jnp

    import nxops as nx

    rows = ["| backend | case | dtype | shape | kernel | grid | threads | regs | spills | "
            "load bits | loads / element | ex2 / element | instr / element |",
            "|" + "---|" * 13]
    for backend in backends:
        for op, axis in REDUCTION_CASES:
            for dtype in dtypes:
                if op == "sum" and dtype != "bfloat16":
                    continue
                for shape in shapes:
                    with nx.kernels.use(backend):
                        report = gpu.compile_gpu(lambda v: getattr(nx, op)(v, axis),
                                                 jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)),
                                                 arch=arch)
                    plan = first_pass_plan(backend, axis, dtype, shape)
                    kernels = [k for k in report.kernels if k.name.startswith("nxops")]
                    for i, k in enumerate(kernels):
                        facts, threads = kernel_loads(k), math.prod(k.threads)
                        per_element = ["-"] * 3
                        if i == 0:
                            loop_elements = plan.unroll * math.prod(plan.block)
                            per_element = [
                                f"{loads_per_element(facts, plan, threads, jnp.dtype(dtype).itemsize):.2f}",
                                *(f"{n * threads / loop_elements:.2f}" if facts.loop_widths else "-"
                                  for n in (facts.exp_per_loop, facts.loop_instructions))]
                        rows.append(
                            f"| {backend} | {op} {'rows' if axis else 'columns'} | {dtype} | "
                            f"{shape[0]}x{shape[1]} | {k.name} | {'x'.join(map(str, k.grid))} | "
                            f"{threads} | {k.registers} | {k.spill_stores}/{k.spill_loads} | "
                            f"{'/'.join(map(str, sorted(set(facts.widths))))} | "
                            + " | ".join(per_element) + " |")
    return "\n".join(rows)


_SASS_MD_HEADER = """# The one-pass reductions' machine code, compiled for an H100 (no GPU needed)

Written by `python -m bench.static.sass` (JAX_PLATFORMS=cpu, the `compile` and
`triton` extras; `tests/static/test_reduce_sass.py` checks the same facts in
CI). Each case is compiled by XLA's GPU compiler for `tests/_deviceless/targets/h100_sxm.txtpb`;
ptxas (nvcc wheel) assembles each kernel's PTX for sm_90a and nvdisasm
disassembles it. *load bits*: the width of every global load (LDG) in the
kernel. *loads / element*: the bytes a program loads over its piece (the main
loop's loads times its trips, or all loads where ptxas unrolled the piece),
over the bytes of the piece (1.00: each element once). *ex2* and *instr /
element*: MUFU.EX2 and all instructions of the main loop, per element it
covers (`-`: no loop left). A case's second row is the pass over the f32
partials. No timing: these are structural facts, not speed.

"""


def main() -> None:
    out = pathlib.Path(__file__).with_name("SASS.md")
    out.write_text(_SASS_MD_HEADER + reduction_table() + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
