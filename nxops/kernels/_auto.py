"""`auto`'s rule: which kernels may take a case, from what was measured.

On cuda only what a GPU measured decides: the table of the target's
architecture (``_measured``: a user's own, written by ``python -m
nxops.measure``, else the one shipped in ``kernels/measured/``) gives each
case's kernel time relative to XLA's. A kernel takes the case only where its
entry is fresh and wins; stale, unmeasured, or a GPU with no table: XLA.
With ``NXOPS_AUTOTUNE`` on, a lowering on a real GPU times the candidates
instead (``_autotune``).

On tpu likewise, from the table of the TPU generation being built for
(``tpu_v5e.json``); none is shipped, so every case keeps XLA until a TPU has
measured a kernel. On cpu the kernels only run interpreted, for testing: XLA. Deviceless
cost models explain, but decide nothing: their predicted wins turned into
losses on the first GPU that measured them (bench/README.md).

On every platform a custom call cannot fuse its producer (attention aside:
``COMPUTE_BOUND``): where XLA would
fuse what made the operand into the op (an elementwise op, a convert, a
broadcast, a transpose), its fusion reads the producer's inputs once and a
kernel would add a write and a read of the operand. So a kernel takes a case
only where the operand is a program argument, a loop carry, or the result of
an op XLA never fuses into its consumer; a producer the lowering cannot see
(the argument of a nested function, e.g. a shard_map body) keeps XLA.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from nxops.kernels import _measured
from nxops.kernels._registry import OP_FAMILY, Kernel

# What made an operand, as the lowering rule sees it in the module being built
# (``producers`` of `choose`): "argument" (a parameter of the program or a
# loop's carry), the StableHLO op's name (e.g. "stablehlo.multiply"), or
# "unknown" (e.g. the argument of a nested function).
ARGUMENT, UNKNOWN = "argument", "unknown"
# Producers XLA does not fuse into a reduction: the operand is in HBM anyway.
UNFUSED_PRODUCERS = frozenset({
    ARGUMENT, "stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution",
    "stablehlo.custom_call", "stablehlo.reduce", "stablehlo.all_reduce",
    "stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.all_to_all",
    "stablehlo.collective_permute", "stablehlo.sort", "stablehlo.scatter",
    "stablehlo.while", "stablehlo.case", "stablehlo.rng_bit_generator",
})

# Ops whose work grows faster than their operands: attention reads
# tokens x head dim and computes tokens^2 x head dim, so the write and read
# of an operand XLA would have fused is no reason to keep XLA there.
COMPUTE_BOUND = frozenset({"attention", "attention_backward"})

# Candidates `auto` may take, best first: (backend, why).
Candidates = tuple[tuple[str, str], ...]


def fused_producer(producers: Sequence[str] | None) -> str | None:
    """The first operand producer XLA would fuse into the op (None: none)."""
    for producer in producers or (UNKNOWN,):
        if producer not in UNFUSED_PRODUCERS:
            return producer
    return None


def _producer_why(producer: str) -> str:
    if producer == UNKNOWN:
        return ("the operand's producer is not visible to the lowering (e.g. the argument "
                "of a nested function): XLA may fuse it into its consumer")
    return (f"XLA fuses the operand's producer {producer} into its consumer (a kernel "
            f"would write and re-read the operand)")


def auto_rule(op: str, platform: str, avals: Sequence[Any], params: dict,
              producers: Sequence[str] | None,
              kernels: Mapping[str, Kernel]) -> tuple[Candidates, str]:
    """(the kernels `auto` may take for this case, best first, each with why;
    why XLA otherwise). ``kernels``: the registered non-xla kernels of ``op``
    by backend."""
    if platform == "cpu":
        return (), "kernels run interpreted on cpu (for testing)"
    if OP_FAMILY[op] == "collective":
        return (), "collectives are not measured per case (NCCL / ICI): XLA's are kept"
    nothing = f"nothing measured on {platform} (no such device has measured an nxops kernel): XLA"
    if platform == "tpu":
        verdict = _measured.verdict_for_tpu(op, avals, params, kernels)
        if verdict is None:
            return (), nothing
    elif platform == "cuda":
        verdict = _measured.verdict_for_target(op, avals, params, kernels)
    else:
        return (), nothing
    producer = None if op in COMPUTE_BOUND else fused_producer(producers)
    if verdict.winners and producer is not None:
        return (), _producer_why(producer)
    return verdict.winners, verdict.why_xla
