"""Collectives in a compiled program, and how many bytes each device sends.

``nx.hlo.collective_traffic(fn, *args)`` jits, compiles and reads the HLO;
``nx.hlo.collectives(text_or_stage)`` reads HLO text (``Compiled.as_text()``,
``Lowered.as_text(dialect="hlo")``) or a ``jax.stages`` object. Each
all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute
(also their async ``-start`` forms, and ones inside fusions, loops and other
called computations, each counted once) becomes a ``Collective``.

Bytes per device are the bandwidth-optimal (ring) amounts, with ``N`` the
full (unsharded) buffer and ``n`` the replica group size:

==================  ====================  ==============================
kind                N                     bytes each device sends
==================  ====================  ==============================
all-gather          result                (n-1)/n · N
reduce-scatter      operand               (n-1)/n · N
all-reduce          operand               2(n-1)/n · N
all-to-all          operand               (n-1)/n · N
collective-permute  operand (the shard)   N
==================  ====================  ==============================

The lower bound is that of the *logical* collective: the one the program
asked for, read from the instruction's ``op_name`` metadata (the outermost
collective named in the JAX name stack: a primitive such as ``all_gather``,
``psum_scatter``, ``ppermute``, or a scope such as ``untile``). An all-gather
written as an all-reduce of a zero-padded buffer is an ``all-reduce`` whose
logical kind is ``all-gather``: it sends 2(n-1)/n·N where (n-1)/n·N would do,
ratio 2.0. Without such metadata the logical kind is the HLO kind (ratio 1.0).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterator

import jax

from nxops._errors import NxopsError

__all__ = ["Collective", "collectives", "collective_traffic", "executions", "format_table",
           "bytes_per_device"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# HLO element types -> bytes per element (sub-byte types round up their bits).
_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
         "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
         "c64": 64, "c128": 128, "token": 0}

# Names in an op_name path that say which collective the program asked for.
_LOGICAL_NAMES = {
    "all-gather": ("all_gather", "all_gather_invariant", "untile", "allgather"),
    "reduce-scatter": ("reduce_scatter", "psum_scatter"),
    "all-reduce": ("psum", "pmax", "pmin", "pmean", "psum_invariant", "all_reduce", "allreduce"),
    "all-to-all": ("all_to_all", "alltoall"),
    "collective-permute": ("ppermute", "pshuffle", "pswapaxes", "collective_permute"),
}
_LOGICAL_BY_NAME = {name: kind for kind, names in _LOGICAL_NAMES.items() for name in names}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a program and the traffic it causes.

    Examples:
        >>> f = nx.xmap(lambda v: nx.psum(v, 'i'), ['i', ...], [...], axis_resources={'i': 'x'})
        >>> with jax.set_mesh(jax.make_mesh((2,), ('x',))):      # needs 2 devices
        ...     (c,) = nx.hlo.collective_traffic(f, jnp.ones((2, 1024)))
        >>> print(c.kind, c.dtype, c.operand_shapes, c.buffer_bytes, c.lower_bound_bytes)
        all-reduce f32 ((1024,),) 4096 4096.0
    """

    kind: str                   # the HLO collective, one of KINDS
    logical_kind: str           # the collective the program asked for (see module doc)
    name: str                   # the HLO instruction
    computation: str            # the HLO computation holding it
    dtype: str                  # HLO element type of the (first) operand, e.g. "f32"
    operand_shapes: tuple[tuple[int, ...], ...]
    result_shapes: tuple[tuple[int, ...], ...]
    group_size: int             # n: devices in each replica group
    buffer_bytes: int           # N: the full buffer (see module doc)
    bytes_per_device: float     # what each device sends
    lower_bound_bytes: float    # the ring bound of the logical collective on N
    op_name: str = ""           # the JAX op_name metadata, when present

    @property
    def ratio(self) -> float:
        """bytes_per_device / lower_bound_bytes (1.0 = moves the minimum)."""
        if self.lower_bound_bytes == 0:
            return 1.0 if self.bytes_per_device == 0 else float("inf")
        return self.bytes_per_device / self.lower_bound_bytes


def ring_bytes(kind: str, buffer_bytes: float, n: int) -> float:
    """Bytes each device sends for collective ``kind`` on an N-byte buffer."""
    if kind == "collective-permute":
        return float(buffer_bytes)
    factor = 2 if kind == "all-reduce" else 1
    return factor * (n - 1) / n * buffer_bytes


# ---------------------------------------------------------------------------
# Reading HLO text


@dataclasses.dataclass(frozen=True)
class _Instruction:
    name: str
    computation: str
    type: str
    opcode: str
    operands: tuple[str, ...]  # each "%name" or "TYPE %name"
    attributes: str


_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\((.*)\)\s*->\s*.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,\s<=]*)\]")


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise NxopsError(f"nx.hlo: unbalanced brackets in HLO at {text[start:start + 80]!r}: pass "
                     "the whole text as XLA printed it, not a cut")


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    parts, depth, current = [], 0, []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(c)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def _parse_instruction(line: str, computation: str) -> _Instruction | None:
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    name, rest = match.groups()
    rest = re.sub(r"/\*.*?\*/", "", rest).strip()
    if rest.startswith("("):
        end = _balanced(rest, 0)
        type_, rest = rest[:end], rest[end:].lstrip()
    else:
        type_, _, rest = rest.partition(" ")
        # A layout may follow the shape: f32[4,4]{1,0} (no space inside).
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    open_paren = op.end() - 1
    close = _balanced(rest, open_paren)
    operands = tuple(_split_top_level(rest[open_paren + 1:close - 1]))
    return _Instruction(name, computation, type_, op.group(1), operands, rest[close:])


def _instructions(text: str) -> Iterator[_Instruction]:
    computation = ""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            computation = header.group(1)
            # Parameters of called computations: "p: f32[4]" -> an instruction-like type.
            for param in _split_top_level(header.group(2) or ""):
                pname, _, ptype = param.partition(":")
                if ptype:
                    yield _Instruction(pname.strip().lstrip("%"), computation, ptype.strip(),
                                       "parameter", (), "")
            continue
        instruction = _parse_instruction(line, computation)
        if instruction is not None:
            yield instruction


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """[(element type, dims)] of every array in an HLO (tuple) type."""
    out = []
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype not in _BITS and not dtype.startswith("f8"):
            continue
        dims = tuple(int(d.replace("<=", "")) for d in dims.replace(" ", "").split(",") if d)
        out.append((dtype, dims))
    return out


def _nbytes(dtype: str, dims: tuple[int, ...]) -> int:
    bits = 8 if dtype.startswith("f8") else _BITS[dtype]
    count = 1
    for d in dims:
        count *= d
    return (count * bits + 7) // 8


def _group_size(attributes: str, num_devices: int | None) -> int:
    """Devices per group of one collective, from any of XLA's printed forms:
    explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]``, mesh axes (``jax_use_rgv3``,
    the default from JAX 0.11: ``mesh['x'=4,'y'=2] {'y'}``, optionally with
    ``device_ids=(...)`` before the axes), permute pairs, or
    ``{}`` (every device). Anything else is an error, never a guess."""
    explicit = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:\s*,\s*\{[\d,\s]*\})*)\}", attributes)
    if explicit:
        first = re.match(r"\{([\d,\s]*)\}", explicit.group(1)).group(1)
        return len([d for d in first.split(",") if d.strip()])
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[", attributes)
    if iota:
        return int(iota.group(2))
    over_mesh_axes = re.search(r"replica_groups=mesh\[([^\]]*)\]"
                               r"(?:,\s*device_ids=[^{]*)?\s*\{([^}]*)\}", attributes)
    if over_mesh_axes:
        return _mesh_axes_group_size(over_mesh_axes)
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attributes)
    if pairs:
        return len(set(re.findall(r"\d+", pairs.group(1))))
    if "replica_groups=" in attributes and "replica_groups={}" not in attributes:
        raise NxopsError(f"nx.hlo cannot read the replica groups of this collective (a form its "
                         f"reader does not know: please report it with the HLO): {attributes[:300]}")
    if num_devices is None:
        raise NxopsError("the HLO has a collective over all devices (replica_groups={}) and no "
                         "num_partitions/replica_count in its header: pass num_devices=")
    return num_devices


def _mesh_axes_group_size(match: re.Match) -> int:
    """``mesh['x'=4,'y'=2] {'x','y'}``: the product of the named axes' sizes."""
    sizes = dict(re.findall(r"'([^']+)'\s*=\s*(\d+)", match.group(1)))
    names = re.findall(r"'([^']+)'", match.group(2))
    if not names or any(n not in sizes for n in names) or re.search(r"[^'\w\s,]", match.group(2)):
        raise NxopsError(f"nx.hlo cannot read the replica groups {match.group(0)!r} (a form its "
                         "reader does not know: please report it with the HLO)")
    size = 1
    for name in names:
        size *= int(sizes[name])
    return size


def _logical_kind(op_name: str, kind: str) -> str:
    """The outermost collective named in ``op_name`` (e.g. "jit(f)/untile/psum")."""
    for part in op_name.split("/"):
        part = re.sub(r"^(?:jit|pjit|shard_map|vmap|checkpoint)\((.*)\)$", r"\1", part)
        part = part.rsplit(".", 1)[-1].lower()   # "nx.untile" -> "untile"
        if part in _LOGICAL_BY_NAME:
            return _LOGICAL_BY_NAME[part]
    return kind


def _device_count(text: str) -> int | None:
    header = text.split("\n", 1)[0]
    partitions = re.search(r"num_partitions=(\d+)", header)
    replicas = re.search(r"replica_count=(\d+)", header)
    if not partitions and not replicas:
        return None
    return int(partitions.group(1) if partitions else 1) * int(replicas.group(1) if replicas else 1)


def _hlo_text(program: Any) -> str:
    if isinstance(program, str):
        text = program
    elif isinstance(program, jax.stages.Lowered):
        text = program.as_text(dialect="hlo", debug_info=True)
    elif hasattr(program, "as_text"):
        text = program.as_text()
    else:
        raise NxopsError(f"nx.hlo: expected HLO text or a jax.stages Lowered/Compiled, got "
                         f"{type(program)}: pass jax.jit(f).lower(...) or its .compile()")
    if text.lstrip().startswith("module"):
        raise NxopsError("this is StableHLO (MLIR), not HLO text: pass the Lowered object, "
                         "lowered.as_text(dialect='hlo'), or compiled.as_text()")
    return text


def collectives(program: Any, *, num_devices: int | None = None) -> list[Collective]:
    """Every collective in ``program`` (HLO text, or a ``jax.stages``
    Lowered/Compiled), in program order, with its per-device traffic.

    ``num_devices`` is the device count for collectives over all devices
    (``replica_groups={}``); by default it is read from the HLO header.

    Examples:
        >>> f = nx.xmap(lambda v: nx.psum(v, 'i'), ['i', ...], [...], axis_resources={'i': 'x'})
        >>> with jax.set_mesh(jax.make_mesh((2,), ('x',))):      # needs 2 devices
        ...     compiled = f.lower(jnp.ones((2, 1024))).compile()
        >>> print([c.kind for c in nx.hlo.collectives(compiled)])
        ['all-reduce']
    """
    text = _hlo_text(program)
    if num_devices is None:
        num_devices = _device_count(text)
    types: dict[str, str] = {}
    found = []
    for inst in _instructions(text):
        types[inst.name] = inst.type
        kind = inst.opcode.removesuffix("-start")
        if kind not in KINDS:
            continue  # also skips the -done halves of async pairs
        found.append(_collective(inst, kind, types, num_devices))
    return found


_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def executions(program: Any) -> dict[str, int]:
    """How many times each computation of ``program`` (as ``collectives``
    takes it) runs per call of its entry computation: a while loop's body
    runs its known trip count times (XLA's ``known_trip_count``) per run of
    the computation holding the loop; every other called computation (both
    branches of a conditional, fusions, reductions) once per run of its
    caller. A body whose trip count XLA does not know counts as ``-1``:
    unknown, and so is everything it calls.

    Examples:
        >>> def body(v):     # a loop of 3 steps: its body runs 3 times, its condition 4
        ...     return jax.lax.fori_loop(0, 3, lambda i, v: nx.ppermute(v, 'i', [(0, 1), (1, 0)]), v)
        >>> f = nx.xmap(body, ['i', ...], ['i', ...], axis_resources={'i': 'x'})
        >>> with jax.set_mesh(jax.make_mesh((2,), ('x',))):      # needs 2 devices
        ...     compiled = jax.jit(f).lower(jnp.ones((2, 256))).compile()
        >>> runs = nx.hlo.executions(compiled)
        >>> print(sorted({n for n in runs.values() if n > 1}))
        [3, 4]
    """
    text = _hlo_text(program)
    entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.MULTILINE)
    if entry is None:
        raise NxopsError("nx.hlo: no ENTRY computation in this HLO text: pass a whole module "
                         "(lowered.as_text(dialect='hlo') or compiled.as_text()), not a fragment")
    calls: dict[str, list[tuple[str, int]]] = {}
    for inst in _instructions(text):
        for called in _called_computations(inst):
            calls.setdefault(inst.computation, []).append(called)
    counts: dict[str, int] = {}

    def visit(name: str, times: int):
        counts[name] = -1 if times < 0 or counts.get(name, 0) < 0 else counts.get(name, 0) + times
        for callee, factor in calls.get(name, ()):
            visit(callee, -1 if times < 0 or factor < 0 else times * factor)
    visit(entry.group(1), 1)
    return counts


def _called_computations(inst: _Instruction) -> list[tuple[str, int]]:
    """(computation, runs per run of ``inst``) for each computation it calls."""
    out = []
    trip = _TRIP_COUNT.search(inst.attributes)
    for attribute, names in re.findall(r"\b(calls|to_apply|condition|body|branch_computations)="
                                       r"(\{[^}]*\}|%?[\w.\-]+)", inst.attributes):
        for name in re.findall(r"%?([\w.\-]+)", names):
            if attribute == "body":
                out.append((name, int(trip.group(1)) if trip else -1))
            elif attribute == "condition":
                out.append((name, int(trip.group(1)) + 1 if trip else -1))
            else:
                out.append((name, 1))
    return out


def bytes_per_device(program: Any, *, num_devices: int | None = None) -> float:
    """What each device sends in one run of ``program``: every collective's
    ``bytes_per_device`` times the runs of the computation that holds it
    (``executions``: a collective in a loop counts once per iteration).
    Raises ``ValueError`` for a collective in a loop of unknown trip count.

    Examples:
        >>> def body(v):     # a ring: each device passes its block 3 times
        ...     return jax.lax.fori_loop(0, 3, lambda i, v: nx.ppermute(v, 'i', [(0, 1), (1, 0)]), v)
        >>> f = nx.xmap(body, ['i', ...], ['i', ...], axis_resources={'i': 'x'})
        >>> with jax.set_mesh(jax.make_mesh((2,), ('x',))):      # needs 2 devices
        ...     compiled = jax.jit(f).lower(jnp.ones((2, 256))).compile()
        >>> print(nx.hlo.bytes_per_device(compiled))
        3072.0
    """
    text = _hlo_text(program)
    runs = executions(text)
    total = 0.0
    for c in collectives(text, num_devices=num_devices):
        times = runs.get(c.computation, 0)
        if times < 0:
            raise NxopsError(f"nx.hlo.bytes_per_device: collective {c.name} runs in a loop whose trip "
                             f"count XLA does not know (computation {c.computation}): give the "
                             "loop static bounds (lax.fori_loop with Python ints), or read "
                             "nx.hlo.collectives per iteration")
        total += times * c.bytes_per_device
    return total


def _operand_arrays(operand: str, types: dict[str, str]) -> list[tuple[str, tuple[int, ...]]]:
    inline = _arrays(operand.rsplit("%", 1)[0]) if "%" in operand else _arrays(operand)
    if inline:
        return inline
    name = operand.split()[-1].lstrip("%")
    return _arrays(types.get(name, ""))


def _collective(inst: _Instruction, kind: str, types: dict[str, str],
                num_devices: int | None) -> Collective:
    operands = [_operand_arrays(op, types) for op in inst.operands]
    if kind == "collective-permute" and len(operands) == 4:  # in-place form: +offsets
        operands = operands[:1]
    arrays = [a for op in operands for a in op]
    n = _group_size(inst.attributes, num_devices)
    operand_bytes = sum(_nbytes(*a) for a in arrays)
    buffer_bytes = operand_bytes * n if kind == "all-gather" else operand_bytes
    op_name = re.search(r'op_name="([^"]*)"', inst.attributes)
    op_name = op_name.group(1) if op_name else ""
    logical = _logical_kind(op_name, kind)
    results = _arrays(inst.type)
    if inst.opcode.endswith("-start") and len(results) > len(arrays):
        results = results[len(arrays):len(arrays) * 2]  # (operands, results, context...)
    return Collective(
        kind=kind, logical_kind=logical, name=inst.name, computation=inst.computation,
        dtype=arrays[0][0] if arrays else "", operand_shapes=tuple(d for _, d in arrays),
        result_shapes=tuple(d for _, d in results), group_size=n, buffer_bytes=buffer_bytes,
        bytes_per_device=ring_bytes(kind, buffer_bytes, n),
        lower_bound_bytes=ring_bytes(logical, buffer_bytes, n), op_name=op_name)


def collective_traffic(fn: Callable, *args: Any, **kwargs: Any) -> list[Collective]:
    """Jits ``fn``, compiles it for ``args`` and returns its collectives.

    Examples:
        >>> f = nx.xmap(lambda v: nx.psum(v, 'i'), ['i', ...], [...], axis_resources={'i': 'x'})
        >>> with jax.set_mesh(jax.make_mesh((2,), ('x',))):      # needs 2 devices
        ...     found = nx.hlo.collective_traffic(f, jnp.ones((2, 1024)))
        >>> print([(c.kind, c.group_size, c.bytes_per_device, c.ratio) for c in found])
        [('all-reduce', 2, 4096.0, 1.0)]
    """
    compiled = jax.jit(fn).lower(*args, **kwargs).compile()
    return collectives(compiled.as_text())


def format_table(found: list[Collective]) -> str:
    """A plain-text table of collectives (for reports and ``bench/``).

    Examples:
        >>> f = nx.xmap(lambda v: nx.psum(v, 'i'), ['i', ...], [...], axis_resources={'i': 'x'})
        >>> with jax.set_mesh(jax.make_mesh((2,), ('x',))):      # needs 2 devices
        ...     print(nx.hlo.format_table(nx.hlo.collective_traffic(f, jnp.ones((2, 1024)))))
        kind        logical     dtype  operands  n  bytes/device  bound  ratio
        all-reduce  all-reduce  f32    (1024,)   2  4096          4096   1.00
    """
    rows = [("kind", "logical", "dtype", "operands", "n", "bytes/device", "bound", "ratio")]
    for c in found:
        rows.append((c.kind, c.logical_kind, c.dtype, " ".join(map(str, c.operand_shapes)),
                     str(c.group_size), f"{c.bytes_per_device:.0f}", f"{c.lower_bound_bytes:.0f}",
                     f"{c.ratio:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)
