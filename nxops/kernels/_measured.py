"""What GPUs measured: the tables `auto` chooses kernels from on cuda.

A table per GPU architecture (``measured/sm_90.json``: H100 and H200) maps a
*case* (op, layout, reduce op, dtype, operand size bucket) to each backend's
kernel time relative to XLA's in the same run, with the GPU, the date and the
*version* of the kernel that was measured. ``python -m nxops.measure`` writes
this machine's tables into ``NXOPS_MEASURED_DIR``, which `auto` reads before
the tables shipped in ``measured/``; nothing here runs on a GPU.

A kernel's version is a hash of its source: the module that defines it and
every ``nxops.kernels`` module it imports, transitively (the selection
machinery and package ``__init__`` files excepted). Editing a kernel, or a
file it comes to import, makes its own entries stale, and only its own.

`auto` takes a kernel only where its entry is fresh and measured at
``THRESHOLD`` of XLA's time or less; a stale or unmeasured case, a GPU with
no table, or a table that cannot be read (a warning names it) keeps XLA.

TPUs have tables of the same form per generation (``measured/tpu_v5e.json``,
:func:`tpu_table_name`), read only where one exists for the generation
being built for; none is shipped (no TPU has measured a kernel), so `auto`
keeps XLA on every TPU until one does.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import math
import pathlib
import warnings
from typing import Any, Callable, Mapping, Sequence

TABLE_DIR = pathlib.Path(__file__).parent / "measured"
FORMAT = 1
# A kernel must measure at most this fraction of XLA's time: run-to-run noise
# on the same GPU was ~1-3%; a tie is no reason for a custom call, which XLA
# cannot fuse with its neighbours.
THRESHOLD = 0.95

_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[2]   # holds nxops/
# Modules that select kernels rather than compute anything: not part of a version.
_NOT_KERNEL_CODE = frozenset({
    "nxops.kernels", "nxops.kernels._registry", "nxops.kernels._selection",
    "nxops.kernels._choice", "nxops.kernels._auto", "nxops.kernels._reports",
    "nxops.kernels._explain", "nxops.kernels._measured", "nxops.kernels._autotune",
})


# --- cases ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """What the tables distinguish: ``op`` (the registry's), ``layout``,
    ``reduce_op`` (reductions; else ""), ``dtype`` and ``bytes_log2``, the
    operands' total size bucket ``[2**bytes_log2, 2**(bytes_log2 + 1))``."""

    op: str
    layout: str
    reduce_op: str
    dtype: str
    bytes_log2: int

    @property
    def key(self) -> str:
        return "/".join([self.op, self.layout, self.reduce_op or "-", self.dtype,
                         f"2^{self.bytes_log2}B"])

    def describe(self) -> str:
        what = " ".join(w for w in (self.layout, self.reduce_op or self.op) if w)
        return f"{what} {self.dtype}, {_size_text(self.bytes_log2)} operands"


def _size_text(log2: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if log2 >= shift:
            return f"{1 << (log2 - shift)}-{1 << (log2 + 1 - shift)} {unit}"
    return f"{1 << log2}-{1 << (log2 + 1)} B"


def _nbytes(aval) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize


def reduce_layout(shape: Sequence[int], axes: Sequence[int]) -> str:
    """rows (trailing axes reduced), columns (a middle block), all, or other
    (reduced axes not contiguous: the kernels permute first)."""
    from nxops.kernels._layout import canonical_view
    shape = tuple(shape)
    axes = tuple(sorted(a % len(shape) for a in axes)) if shape else ()
    if shape and len(axes) == len(shape):
        return "all"
    permutation, (_, _, inner) = canonical_view(shape, axes)
    if permutation is None and axes:
        return "rows" if inner == 1 else "columns"
    return "other"


def _matmul_layout(a, b, dimension_numbers) -> str:
    """matmul, batched, skinny (a free side of at most 128) or odd (a size
    not a multiple of 128: XLA pads or picks other cuBLAS kernels)."""
    (a_contract, b_contract), (a_batch, b_batch) = dimension_numbers
    free = lambda shape, skip: math.prod(d for i, d in enumerate(shape) if i not in skip)
    m = free(a.shape, (*a_contract, *a_batch))
    n = free(b.shape, (*b_contract, *b_batch))
    k = math.prod(a.shape[i] for i in a_contract)
    if a_batch:
        return "batched"
    if min(m, n) <= 128:
        return "skinny"
    return "odd" if any(d % 128 for d in (m, n, k)) else "matmul"


def attention_layout(bias: bool, causal: bool) -> str:
    """causal or full, with +bias where an additive bias (or mask) comes along."""
    return ("causal" if causal else "full") + ("+bias" if bias else "")


def case_of(op: str, avals: Sequence[Any], params: Mapping[str, Any]) -> Case | None:
    """The table case of one op, or None where the tables say nothing of its kind.

    Attention's backward has its forward's case (its forward's operands: q,
    k, v, the positions and the bias): a program's forward and backward are
    timed together, and one entry decides both."""
    if op == "attention_backward":
        op, avals = "attention", (*avals[:5], *avals[8:9])
    if not avals or any(not isinstance(d, int) for a in avals for d in getattr(a, "shape", ())):
        return None
    nbytes = sum(_nbytes(a) for a in avals)
    if nbytes == 0:
        return None
    dtype = str(avals[0].dtype)
    log2 = nbytes.bit_length() - 1
    if op == "reduce":
        layout = reduce_layout(avals[0].shape, params.get("axes", ()))
        return Case(op, layout, str(params.get("op", "")), dtype, log2)
    if op == "dot_general":
        layout = _matmul_layout(avals[0], avals[1], params["dimension_numbers"])
        return Case(op, layout, "", dtype, log2)
    if op == "tile":
        return Case(op, "tile", "", dtype, log2)
    if op == "attention":
        return Case(op, attention_layout(len(avals) > 5, bool(params.get("causal"))), "", dtype,
                    log2)
    return None   # collectives: NCCL's, not measured per case


# --- kernel versions --------------------------------------------------------------


def _read_tree(module: str) -> str | None:
    for path in (_PACKAGE_ROOT / (module.replace(".", "/") + ".py"),):
        if path.is_file():
            return path.read_text()
    return None


def _imports(module: str, source: str, exists: Callable[[str], bool]) -> set[str]:
    """The ``nxops.kernels`` modules ``source`` imports (``from pkg import mod``
    counts when ``mod`` is a module)."""
    found = set()
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if exists(f"{base}.{a.name}"))
    return {m for m in found if m.startswith("nxops.kernels") and exists(m)}


def version_of_module(module: str, read: Callable[[str], str | None] = _read_tree) -> str:
    """A 12-hex-digit hash of ``module``'s source and of every kernel module it
    imports, transitively. ``read(module)`` gives a module's source (None: not
    a module): the working tree by default, or a git commit's."""
    exists = functools.cache(lambda m: m not in _NOT_KERNEL_CODE and read(m) is not None)
    seen: dict[str, str] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen or not exists(name):
            continue
        seen[name] = read(name) or ""
        todo.extend(_imports(name, seen[name], exists))
    digest = hashlib.sha256()
    for name in sorted(seen):
        digest.update(f"{name}\n{seen[name]}\n".encode())
    return digest.hexdigest()[:12]


def kernel_module(kernel) -> str:
    """The module that defines a registered kernel (its ``fn``'s, or by the
    backends' convention for a placeholder, e.g. triton when not installed)."""
    module = getattr(kernel.fn, "__module__", None)
    if module and module.startswith("nxops.kernels."):
        return module
    name = "collectives" if kernel.op in ("all_gather", "reduce_scatter") else kernel.op
    return f"nxops.kernels.{kernel.backend}.{name}"


@functools.cache
def _tree_version(module: str) -> str:
    return version_of_module(module)


def kernel_version(kernel) -> str:
    """The version of a registered kernel in this installation."""
    return _tree_version(kernel_module(kernel))


# --- tables ----------------------------------------------------------------------


def arch_name(compute_capability: int) -> str:
    """``sm_90`` for compute capability 9.0: the tables' unit (one per architecture)."""
    return f"sm_{compute_capability}"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One backend of one case: its time relative to XLA's, on which GPU and
    when, and the version of the kernel that ran."""

    backend: str
    ratio: float
    kernel_us: float
    xla_us: float
    version: str
    device: str
    date: str
    cases: tuple[str, ...] = ()

    def quote(self) -> str:
        return f"{self.backend} {self.ratio:.2f}x XLA ({self.kernel_us:.1f} vs " \
               f"{self.xla_us:.1f} us) on {self.device}, {self.date}"


SHIPPED = "shipped"   # how `explain` names the table shipped with the package


def _read_table(path: pathlib.Path) -> dict[str, dict[str, Measurement]]:
    data = json.loads(path.read_text())
    table: dict[str, dict[str, Measurement]] = {}
    for entry in data["entries"]:
        table[str(entry["key"])] = {
            backend: Measurement(backend, float(m["ratio"]), float(m["kernel_us"]),
                                 float(m["xla_us"]), str(m["version"]), str(m["device"]),
                                 str(m["date"]), tuple(m.get("cases", ())))
            for backend, m in entry["backends"].items()}
    return table


@functools.cache
def load(arch: str, directory: str | None = None) -> dict[str, dict[str, Measurement]]:
    """``{case key: {backend: Measurement}}`` of ``arch``'s table in
    ``directory`` (default: the shipped one); {} if none. A table that cannot
    be read is ignored with a warning naming it: its cases keep XLA."""
    path = pathlib.Path(directory or TABLE_DIR) / f"{arch}.json"
    if not path.is_file():
        return {}
    try:
        return _read_table(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"nxops: ignoring the measured table {path}: it is not a table "
                      f"({type(e).__name__}: {e}); `auto` keeps XLA for the cases it would "
                      f"decide. Measure again (python -m nxops.measure) or delete the file.",
                      stacklevel=2)
        return {}


def _sources(user_directory: str | None) -> list[tuple[str, str | None]]:
    """(name `explain` gives it, directory) of the tables to read, in order:
    this machine's (``NXOPS_MEASURED_DIR``), then the shipped one."""
    sources: list[tuple[str, str | None]] = []
    if user_directory and pathlib.Path(user_directory).resolve() != TABLE_DIR.resolve():
        sources.append((str(pathlib.Path(user_directory)), user_directory))
    return sources + [(SHIPPED, None)]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the tables say of one case: the kernels that won (best first,
    each with the sentence `explain` quotes) and why XLA otherwise."""

    winners: tuple[tuple[str, str], ...]
    why_xla: str


def _table_name(source: str, arch: str) -> str:
    return f"table {SHIPPED}" if source == SHIPPED else f"table {pathlib.Path(source) / arch}.json"


def verdict(case: Case | None, arch: str, kernels: Mapping[str, Any],
            user_directory: str | None = None) -> Verdict:
    """Reads ``arch``'s tables for ``case``: this machine's first, where it has
    a fresh entry (measured with the installed kernel), else the shipped one.
    ``kernels`` maps each backend to its registered kernel."""
    if case is None:
        return Verdict((), "not a kind of case the GPU tables measure")
    tables = [(source, load(arch, directory)) for source, directory in _sources(user_directory)]
    if not any(table for _, table in tables):
        return Verdict((), f"no measured table for {arch} (unknown GPU): XLA")
    stale: list[str] = []
    for source, table in tables:
        measured = [m for m in table.get(case.key, {}).values() if m.backend in kernels]
        fresh = sorted((m for m in measured if m.version == kernel_version(kernels[m.backend])),
                       key=lambda m: m.ratio)
        stale += [f"{m.backend} stale since {m.date} (kernel {m.version} measured, now "
                  f"{kernel_version(kernels[m.backend])}; {_table_name(source, arch)})"
                  for m in measured if m not in fresh]
        if fresh:
            return _decide(case, fresh, stale, _table_name(source, arch))
    if not stale:
        return Verdict((), f"unmeasured on {arch} ({case.describe()}): XLA")
    return Verdict((), f"{'; '.join(stale)} (nothing fresh measured; {case.describe()}): XLA")


def _decide(case: Case, fresh: list[Measurement], stale: list[str], table: str) -> Verdict:
    winners = tuple((m.backend, f"measured {m.quote()} ({case.describe()}; {table})")
                    for m in fresh if m.ratio <= THRESHOLD)
    losses = [f"measured {m.quote()}" for m in fresh if m.ratio > THRESHOLD]
    why = f"{'; '.join(losses + stale)} (a kernel needs <= {THRESHOLD}x; {case.describe()}; " \
          f"{table}): XLA"
    return Verdict(winners, why)


def verdict_for_target(op: str, avals: Sequence[Any], params: Mapping[str, Any],
                       kernels: Mapping[str, Any]) -> Verdict:
    """``verdict`` for the GPU the op is being lowered for (its architecture's
    tables: this machine's, ``NXOPS_MEASURED_DIR``, then the shipped one)."""
    from nxops import _config
    from nxops.kernels import _gpu_target
    arch = arch_name(_gpu_target.compute_capability())
    return verdict(case_of(op, avals, params), arch, kernels, str(_config.measured_dir()))


def tpu_table_name(chip: str) -> str:
    """``tpu_v5e`` for a v5e: the TPU tables' unit (one per generation)."""
    return f"tpu_{chip}"


def verdict_for_tpu(op: str, avals: Sequence[Any], params: Mapping[str, Any],
                    kernels: Mapping[str, Any]) -> Verdict | None:
    """``verdict`` for the TPU generation the op is being lowered for (its
    table in ``NXOPS_MEASURED_DIR``, then the shipped one); None where the
    generation is unknown or has no table."""
    from nxops import _config
    from nxops.kernels import _tpu_target
    chip = _tpu_target.tpu_chip()
    if chip is None:
        return None
    arch, directory = tpu_table_name(chip.name), str(_config.measured_dir())
    if not any(load(arch, d) for _, d in _sources(directory)):
        return None
    return verdict(case_of(op, avals, params), arch, kernels, directory)
