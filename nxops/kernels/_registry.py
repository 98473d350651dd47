"""The kernel registry: every implementation of every positional op, and the
selection (``NXOPS_KERNELS`` / ``nx.kernels.use``) that picks one.

A kernel knows nothing of axis names: it takes positional arrays and static
parameters. Each record says which platforms it runs on and, for a given case,
why it cannot take it (``not_supported_reasons``). The ``xla`` backend is the
reference implementation of every op and supports every case.

The selection is a JAX config state that is part of the jit cache key and the
trace context, so switching it recompiles instead of reusing a stale program.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import math
from typing import Any, Callable, Iterator, Sequence


from nxops._jax import config as _jax_config
from nxops._errors import NxopsError

# Positional ops that have kernels, grouped into the families that
# NXOPS_KERNELS selects per op (``reduce=pallas,einsum=xla``).
OP_FAMILY: dict[str, str] = {
    "reduce": "reduce",
    "dot_general": "einsum",
    "tile": "tile",
    "all_gather": "collective",
    "reduce_scatter": "collective",
    "cross_entropy": "cross_entropy",
}
FAMILIES: tuple[str, ...] = ("reduce", "einsum", "tile", "collective", "cross_entropy")
BACKENDS: tuple[str, ...] = ("xla", "pallas", "triton")
CHOICES: tuple[str, ...] = ("auto",) + BACKENDS
PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu")

# Where `auto`'s rule (below) lets a kernel take a case, it tries these
# backends in order on each platform; `xla` is always the last resort. On CPU
# the Pallas/Triton kernels only run interpreted, which is for testing, never
# faster: `auto` keeps XLA there.
AUTO_PREFERENCE: dict[str, tuple[str, ...]] = {
    "cpu": ("xla",),
    "cuda": ("pallas", "triton", "xla"),
    "rocm": ("pallas", "xla"),
    "tpu": ("pallas", "xla"),
}
AUTO_PREFERENCE_BY_FAMILY: dict[tuple[str, str], tuple[str, ...]] = {}


def auto_preference(op: str, platform: str) -> tuple[str, ...]:
    """The backends `auto` tries for ``op`` on ``platform``, in order, where
    its rule lets a kernel take the case."""
    default = AUTO_PREFERENCE.get(platform, ("xla",))
    return AUTO_PREFERENCE_BY_FAMILY.get((OP_FAMILY[op], platform), default)


# ---------------------------------------------------------------------------
# `auto`'s rule: a kernel only where the cost model says it wins
#
# The evidence is `python -m bench.static.model` (bench/static/model.py, table
# in bench/static/MODEL.md): each program compiled deviceless for H100/A100
# (XLA's GPU compiler, dots as cuBLAS) and TPU v5e/v6e (libtpu) under `auto`
# and under `xla`, its time estimated from what the compiled program launches
# (per launch max(HBM bytes of its operands and results / bandwidth, dot
# FLOPs / tensor peak), GPU launches with fewer CTAs than SMs slowed
# accordingly, + a fixed cost per launch; never a kernel's declared cost).
#
# What it showed, and the rule that follows (per op, platform, case):
#
# - reduce, logsumexp over trailing axes ("rows"), on cuda and tpu: one pass
#   over the operand against XLA's two (max, then sum of exp) and a third small
#   kernel: 4096^2 bf16 modelled 12.0 µs against 26.1 on H100 (0.46), 42.0
#   against 84.5 on v5e (0.50). But a custom call cannot fuse its producer:
#   where the operand is made by an elementwise op (or anything XLA would fuse
#   into the reduction: a convert, a broadcast, a transpose), XLA's fusion
#   reads the producer's inputs once and the kernel would add a write and a
#   read of the operand (`nx.sum(jnp.exp(v) * w, 1)`: 2.00 on H100 and v5e).
#   So the kernel takes the case only where the operand is a program argument,
#   a loop carry, or the result of an op XLA never fuses into a reduction (a
#   dot, a convolution, a custom call, a collective, a reduce); anything else,
#   or a producer the lowering cannot see (the argument of a nested function,
#   e.g. a shard_map body), keeps XLA.
# - reduce over a middle axis ("columns"), on cuda, with the same producer
#   condition, where XLA's column reduction would leave SMs idle: it launches
#   about one CTA per 128 kept columns per outer index (4096^2 bf16: 32 CTAs on
#   132 SMs); the kernel splits the rows over 264 programs and a second small
#   pass over the partials, itself in 16-column blocks so that it has 256
#   programs (in 1024-column blocks it had 4: 13.2 µs of the then 25.6, 0.59):
#   modelled 14.7 µs against 43.3 (0.34); 16384x4096 f32 logsumexp 0.48.
#   Where XLA fills the SMs the kernel's second launch loses ((8, 3000, 4096)
#   bf16 sum over 3000: 1.05), and under 8 MiB the second launch costs more
#   than the idle SMs. On tpu it ties (42.0 / 42.0): XLA.
# - reduce, every other case (sums, maxima over rows, all axes, permuted
#   axes): XLA's reduction fusions make one pass too and fuse with their
#   neighbours (layer norm over a named axis with kernels: 7.00 on H100, 3.28
#   on v5e); no modelled win: XLA.
# - einsum (dot_general), cuda: the Pallas matmul ties cuBLAS at best (same
#   bytes and FLOPs). Decode shapes no longer leave SMs idle: their tiles
#   narrow until one launch fills the SMs (8x4096x4096 bf16: 256 programs of
#   16x16 on H100, modelled 12.1 µs = cuBLAS's 12.1, was 43.5 with 32
#   programs; 128x4096x4096: 12.6 = 12.6, was 45.9; A100 likewise 1.00; the
#   Triton kernel's split-K needs a second launch for its partials: 1.22 and
#   1.95). A tie is no win, and XLA fuses around its dots where the kernel
#   cannot (gelu epilogue 1.23, gradient transposes 1.15 on H100): XLA.
# - einsum, tpu: the Mosaic matmul now takes each chip's least-traffic tile
#   (pallas/dot_general.py, mosaic_matmul_tiles: by the traffic count within
#   1.01-1.1x of the roofline for LLM shapes on v5e/v5p/v6e, where one 512^3
#   tile was 1.3-3.5x). The model credits a Mosaic call one read of each
#   operand, which these tiles achieve on decode shapes, and there it models
#   wins (M = 8-512, K = N = 4096 bf16: 0.54-0.97 on v5e and v6e) only
#   because XLA's program first copies the weight into VMEM (a cross-program
#   prefetch) and the model charges that copy unoverlapped, a limit the model
#   states; with a gelu epilogue 0.99 / 1.02; gradients' transposes 2.25 / 4.07:
#   XLA, until a TPU measures the decode case.
# - tile: XLA's dynamic slice reads only the tile; the kernel adds a launch for
#   the index and reads its whole operand (2.42 on 4 H100s; a tie on v5e): XLA.
# - collectives: not modelled (NCCL / ICI); XLA's are tuned: XLA.
# - rocm: no ROCm target to compile for, nothing modelled: XLA.
#
# An explicit `NXOPS_KERNELS=pallas` / `triton` (or op=backend) is obeyed as
# before: the rule decides only `auto`.

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

# The modelled figures quoted in `explain`'s "why" (bench/static/MODEL.md).
EVIDENCE = {
    "rows_logsumexp": "modelled kernel/xla 0.46 on H100, 0.50 on TPU v5e "
                      "(4096^2 bf16: one pass against XLA's two)",
    "columns": "XLA's column reduction would launch fewer CTAs than SMs: modelled "
               "kernel/xla 0.34 on H100 (max over 4096 rows of 4096^2 bf16: 32 CTAs on "
               "132 SMs; the kernel splits the rows over 264 programs, its second pass "
               "over the partials 256)",
    "fused_producer": "XLA fuses the operand's producer {producer} into its reduction "
                      "(a kernel would write and re-read the operand: sum(exp(v)*w) "
                      "modelled 2.00 on H100)",
    "reduce_other": "no modelled win: XLA's reduction fusion makes one pass and fuses "
                    "with its neighbours (layer norm over a named axis: 7.0 on H100)",
    "reduce_tpu": "no modelled win on TPU: XLA's fused reduction reads the operand once",
    "einsum": "no modelled win: cuBLAS/XLA dots tie the kernel at best (8x4096x4096 "
              "on H100: 1.00, its tiles narrowed to fill the SMs; was 3.61) and fuse "
              "epilogues and transposes (gelu 1.23, grad 1.15 on H100)",
    "einsum_tpu": "no modelled win on TPU but where XLA's weight prefetch is charged "
                  "unoverlapped (decode 8-512x4096x4096: 0.54-0.97 on v5e/v6e, a model "
                  "limit; gelu epilogue 1.02, grad 2.25 on v5e): XLA until measured",
    "tile": "no modelled win: XLA's dynamic slice reads only the tile "
            "(kernel 2.42 on 4 H100s)",
    "collective": "not modelled (NCCL / ICI); XLA's collectives are kept",
    "cross_entropy": "no GPU measurement of a fused kernel yet: the reference (chunked "
                     "lax loop, never holding the logits) is kept",
    "cpu": "kernels run interpreted on cpu (for testing)",
    "unmodelled": "no modelled win on {platform}",
}


def _reduce_layout(aval, axes) -> str:
    from nxops.kernels._layout import canonical_view
    shape = tuple(getattr(aval, "shape", ()))
    axes = tuple(sorted(a % len(shape) for a in axes)) if shape else ()
    permutation, (_, _, inner) = canonical_view(shape, axes)
    if permutation is None and axes:
        return "rows" if inner == 1 else "columns"
    return "other"


# XLA's column reduction launches about one CTA per 128 kept columns of each
# outer index (4096^2: 32 CTAs); below the smallest SM count of the modelled
# GPUs (A100: 108) it leaves SMs idle, which the split kernel fills. Below 8 MiB
# the kernel's second launch costs more than the idle SMs (model: the kernel
# wins where bytes / bandwidth x (SMs / CTAs - 1) exceeds one launch, 2 µs).
_XLA_COLUMN_CTAS_PER = 128
_FEWEST_SMS = 108
_COLUMNS_MIN_BYTES = 8 << 20


def _xla_columns_leave_sms_idle(aval, params) -> bool:
    from nxops.kernels._layout import canonical_view
    shape = tuple(aval.shape)
    axes = tuple(sorted(a % len(shape) for a in params.get("axes", ())))
    _, (outer, _, inner) = canonical_view(shape, axes)
    nbytes = math.prod(shape) * getattr(getattr(aval, "dtype", None), "itemsize", 4)
    xla_ctas = outer * -(-inner // _XLA_COLUMN_CTAS_PER)
    return xla_ctas < _FEWEST_SMS and nbytes >= _COLUMNS_MIN_BYTES


def auto_rule(op: str, platform: str, avals: Sequence[Any], params: dict,
              producers: Sequence[str] | None) -> tuple[bool, str]:
    """(whether `auto` lets a kernel take this case, why), from the cost model's
    evidence (see the comment above)."""
    family = OP_FAMILY[op]
    if platform == "cpu":
        return False, EVIDENCE["cpu"]
    if family == "einsum" and platform == "tpu":
        return False, EVIDENCE["einsum_tpu"]
    if family != "reduce":
        return False, EVIDENCE.get(family, EVIDENCE["unmodelled"].format(platform=platform))
    if platform not in ("cuda", "tpu"):
        return False, EVIDENCE["unmodelled"].format(platform=platform)
    layout = _reduce_layout(avals[0], params.get("axes", ()))
    if layout == "rows" and params.get("op") == "logsumexp":
        case = "rows_logsumexp"
    elif layout == "columns" and platform == "cuda" and _xla_columns_leave_sms_idle(avals[0], params):
        case = "columns"
    else:
        return False, EVIDENCE["reduce_other" if platform == "cuda" else "reduce_tpu"]
    producer = (producers or (UNKNOWN,))[0]
    if producer not in UNFUSED_PRODUCERS:
        return False, EVIDENCE["fused_producer"].format(producer=producer)
    return True, f"{case.replace('_', ' ')} of {'an' if producer == ARGUMENT else 'a'} " \
        f"{producer}: {EVIDENCE[case]}"

NotSupportedReasons = Callable[..., Sequence[str]]


def _always_supported(*avals: Any, platform: str, **params: Any) -> Sequence[str]:
    del avals, platform, params
    return ()


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One implementation of one positional op.

    ``fn(*arrays, platform=..., **params)`` computes the op; ``platforms`` are
    the lowering platforms it runs on; ``not_supported_reasons(*avals,
    platform=..., **params)`` returns why it cannot take a case (empty when it
    can); ``description`` is the one line ``explain`` prints for it. The
    ``xla`` kernel of each op is the reference the others are tested against.
    """

    op: str
    backend: str
    platforms: tuple[str, ...]
    fn: Callable[..., Any]
    not_supported_reasons: NotSupportedReasons = _always_supported
    description: str = ""
    # Platforms where XLA's SPMD partitioner cannot split this kernel (Mosaic
    # custom calls): there it runs only where every mesh axis is manual.
    manual_only_platforms: tuple[str, ...] = ()

    def __post_init__(self):
        if self.op not in OP_FAMILY:
            raise ValueError(f"unknown op {self.op!r}; known ops: {sorted(OP_FAMILY)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; known: {BACKENDS}")
        unknown = set(self.platforms) - set(PLATFORMS)
        if unknown:
            raise ValueError(f"unknown platforms {sorted(unknown)}; known: {PLATFORMS}")

    @property
    def name(self) -> str:
        return f"{self.backend}:{self.op}"


_KERNELS: dict[tuple[str, str], Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    """Adds ``kernel``; registering the same (op, backend) twice is a bug."""
    key = (kernel.op, kernel.backend)
    if key in _KERNELS and _KERNELS[key] is not kernel:
        raise ValueError(f"a {kernel.backend!r} kernel for {kernel.op!r} is already registered")
    _KERNELS[key] = kernel
    return kernel


def registered(op: str | None = None) -> list[Kernel]:
    """The registered kernels, of one op or of all."""
    return [k for (o, _), k in sorted(_KERNELS.items()) if op is None or o == op]


# ---------------------------------------------------------------------------
# The selection


@dataclasses.dataclass(frozen=True)
class Selection:
    """The backend chosen per op family: each one of ``CHOICES``."""

    per_family: tuple[tuple[str, str], ...]

    def backend_for(self, op: str) -> str:
        return dict(self.per_family)[OP_FAMILY[op]]

    def __str__(self) -> str:
        backends = {b for _, b in self.per_family}
        if len(backends) == 1:
            return backends.pop()
        return ",".join(f"{f}={b}" for f, b in self.per_family)


def _selection_error(value: str, why: str, where: str = "NXOPS_KERNELS") -> NxopsError:
    given = f"{where}={value!r}" if where == "NXOPS_KERNELS" else f"{where}({value!r})"
    return NxopsError(
        f"invalid kernel selection {given}: {why}. Valid values: one of "
        f"{', '.join(CHOICES)} for every op, or a comma-separated list of "
        f"op=backend with op in {{{', '.join(FAMILIES)}}} and backend in "
        f"{{{', '.join(CHOICES)}}}, e.g. 'reduce=pallas,einsum=xla' (unlisted ops use auto)."
    )


def _not_a_backend(word: str) -> str:
    """Why ``word`` is not a backend, with the fix when it is a platform name."""
    if word in PLATFORMS or word == "gpu":
        platform = "cuda" if word == "gpu" else word
        return (f"{word!r} is a platform, not a kernel backend: the platform comes from the "
                f"devices (or explain's platform=); the backend says which implementation "
                f"runs there. See what runs on {platform} with "
                f"nx.kernels.explain(fn, *args, platform={platform!r})")
    return f"{word!r} is neither a backend nor op=backend"


@functools.lru_cache(maxsize=64)
def parse_selection(value: str, where: str = "NXOPS_KERNELS") -> Selection:
    """Parses an ``NXOPS_KERNELS`` value; raises NxopsError naming the bad part
    (and ``where`` it came from: the variable, or ``nx.kernels.use``)."""
    if not isinstance(value, str):
        raise _selection_error(repr(value), "it must be a string", where)
    text = value.strip().lower() or "auto"   # NXOPS_KERNELS= (set but empty) means auto
    if text in CHOICES:
        return Selection(tuple((f, text) for f in FAMILIES))
    chosen: dict[str, str] = {}
    for part in text.split(","):
        family, eq, backend = (s.strip() for s in part.partition("="))
        if not eq:
            raise _selection_error(value, _not_a_backend(part.strip()), where)
        if family not in FAMILIES:
            raise _selection_error(value, f"unknown op {family!r}", where)
        if backend not in CHOICES:
            why = f"unknown backend {backend!r} for {family}"
            if backend in PLATFORMS or backend == "gpu":
                why += f" ({_not_a_backend(backend)})"
            raise _selection_error(value, why, where)
        if family in chosen:
            raise _selection_error(value, f"op {family!r} is given twice", where)
        chosen[family] = backend
    return Selection(tuple((f, chosen.get(f, "auto")) for f in FAMILIES))


def _validate_state_value(value: Any) -> None:
    parse_selection(value)


# Read from the NXOPS_KERNELS environment variable when nxops is imported;
# part of jit's cache key and trace context, so `use(...)` forces a retrace.
_SELECTION_STATE = _jax_config.string_or_object_state(
    "nxops_kernels",
    "auto",
    "Which kernel implementation nxops uses per op: auto, xla, pallas, triton, "
    "or op=backend pairs such as 'reduce=pallas,einsum=xla'.",
    include_in_jit_key=True,
    include_in_trace_context=True,
    validator=_validate_state_value,
)


def current_selection() -> Selection:
    """The selection in force (validated: a bad NXOPS_KERNELS raises here)."""
    return parse_selection(_SELECTION_STATE.value)


@contextlib.contextmanager
def use(selection: str) -> Iterator[Selection]:
    """Selects kernels within a block: ``with nx.kernels.use("pallas"): ...``.

    Takes the same values as ``NXOPS_KERNELS``. Functions jitted inside the
    block are traced and compiled for this selection.
    """
    parsed = parse_selection(selection, "nx.kernels.use")
    with _SELECTION_STATE(selection):
        yield parsed


# ---------------------------------------------------------------------------
# Choosing a kernel for one case


@dataclasses.dataclass(frozen=True)
class Choice:
    """The kernel picked for one case, and why others were passed over."""

    kernel: Kernel
    requested: str
    passed_over: tuple[tuple[str, tuple[str, ...]], ...] = ()
    why: str = ""   # `auto`'s reason (the modelled evidence)

    def describe(self) -> str:
        text = f"{self.kernel.backend} (requested {self.requested}"
        text += f": {self.why})" if self.why else ")"
        for backend, reasons in self.passed_over:
            text += f"; {backend} not used: {'; '.join(reasons)}"
        return text


def _reasons(kernel: Kernel, platform: str, avals: Sequence[Any], params: dict,
             auto_partitioned: bool, /) -> tuple[str, ...]:
    if platform not in kernel.platforms:
        return (f"it runs on {', '.join(kernel.platforms)}, not {platform}",)
    symbolic = any(not isinstance(d, int) for aval in avals for d in getattr(aval, "shape", ()))
    if symbolic and kernel.backend != "xla":   # xla is pure JAX: it takes symbolic sizes
        return ("symbolic sizes (jax.export shape polymorphism): the kernel's blocks and grid "
                "need concrete sizes",)
    if auto_partitioned and platform in kernel.manual_only_platforms:
        return (f"on {platform} it cannot be partitioned automatically; run it where every "
                f"mesh axis is manual (map all mesh axes in axis_resources, or use shard_map)",)
    return tuple(kernel.not_supported_reasons(*avals, platform=platform, **params))


def choose(op: str, platform: str, selection: Selection, avals: Sequence[Any],
           auto_partitioned: bool = False, producers: Sequence[str] | None = None, /,
           **params: Any) -> Choice:
    """The kernel that runs ``op`` for this case on ``platform``.

    ``auto`` keeps XLA unless ``auto_rule`` (the cost model's evidence) lets a
    kernel take the case; then it takes the first backend of
    ``auto_preference(op, platform)`` that is registered and supports the case.
    An explicitly requested backend that cannot take the case raises NxopsError
    with its reasons. ``auto_partitioned`` says the op is lowered where XLA
    partitions some mesh axes automatically; ``producers`` says what made each
    operand (see ``ARGUMENT``; None: unknown).
    """
    requested = selection.backend_for(op)
    if any(getattr(aval, "size", 1) == 0 for aval in avals):
        # Nothing to compute: any selection takes the reference, which returns
        # the empty (or identity-filled) result without launching a kernel.
        return Choice(_KERNELS[(op, "xla")], requested,
                      ((requested, ("zero-size operands: nothing for a kernel to do",)),))
    if requested == "auto":
        wins, why = auto_rule(op, platform, avals, params, producers)
        if not wins:
            return Choice(_KERNELS[(op, "xla")], requested, (), why)
        passed_over = []
        for backend in auto_preference(op, platform):
            kernel = _KERNELS.get((op, backend))
            if kernel is None:
                continue
            reasons = _reasons(kernel, platform, avals, params, auto_partitioned)
            if not reasons:
                return Choice(kernel, requested, tuple(passed_over), why if backend != "xla" else "")
            passed_over.append((backend, reasons))
        return Choice(_KERNELS[(op, "xla")], requested, tuple(passed_over))

    kernel = _KERNELS.get((op, requested))
    family = OP_FAMILY[op]
    if kernel is None:
        have = sorted(b for (o, b) in _KERNELS if o == op)
        raise NxopsError(
            f"NXOPS_KERNELS asks for the {requested!r} implementation of {family!r} "
            f"(op {op!r}), but none is registered (registered: {', '.join(have)}). "
            f"Use {family}=auto or {family}=xla, or install what {requested!r} needs."
        )
    reasons = _reasons(kernel, platform, avals, params, auto_partitioned)
    if reasons:
        shapes = ", ".join(f"{getattr(a, 'dtype', '?')}{list(getattr(a, 'shape', ()))}" for a in avals)
        raise NxopsError(
            f"the {requested!r} implementation of {op!r} cannot run this case "
            f"({shapes}; {params}) on {platform}: {'; '.join(reasons)}. "
            f"Use NXOPS_KERNELS={family}=auto to fall back to xla for such cases."
        )
    return Choice(kernel, requested)


# ---------------------------------------------------------------------------
# Reporting which kernel ran (for `explain` and the demo)


@dataclasses.dataclass(frozen=True)
class Report:
    """One op of a program and the kernel chosen for it."""

    op: str
    operands: str
    choice: Choice

    def __str__(self) -> str:
        return f"{self.op:<15} {self.operands:<40} {self.choice.kernel.name:<20} {self.choice.describe()}"


# The report lists of the enclosing `collect_reports` blocks of this thread /
# context (a context variable: threads explaining at once never mix reports).
_COLLECTORS: contextvars.ContextVar[tuple[list[Report], ...]] = contextvars.ContextVar(
    "nxops_report_collectors", default=())

# A fresh value per `collect_reports` block; part of the trace context, so jit
# caches cannot skip the tracing and lowering that make the reports.
_COLLECTION_EPOCH = _jax_config.int_state(
    "nxops_report_epoch", 0, "internal: forces a retrace while nxops collects kernel reports",
    include_in_jit_key=True, include_in_trace_context=True)
_epochs = itertools.count(1)


def report(op: str, choice: Choice, avals: Sequence[Any], /) -> None:
    """Called by lowering rules (and trace-time dispatch) with each choice."""
    collectors = _COLLECTORS.get()
    if not collectors:
        return
    operands = ", ".join(f"{getattr(a, 'dtype', '?')}{list(getattr(a, 'shape', ()))}" for a in avals)
    for collector in collectors:
        collector.append(Report(op, operands, choice))


# The platform a program is being traced for, when not the devices' own (set
# by `explain(..., platform=...)`): ops that choose kernels at trace time
# (collectives) choose for it.
_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "nxops_target_platform", default=None)


def target_platform() -> str | None:
    return _TARGET_PLATFORM.get()


@contextlib.contextmanager
def collect_reports(platform: str | None = None) -> Iterator[list[Report]]:
    """Records every kernel choice made while the block traces or lowers
    (for ``platform``, when given)."""
    reports: list[Report] = []
    collectors_token = _COLLECTORS.set(_COLLECTORS.get() + (reports,))
    token = _TARGET_PLATFORM.set(platform)
    try:
        with _COLLECTION_EPOCH(next(_epochs)):
            yield reports
    finally:
        _TARGET_PLATFORM.reset(token)
        _COLLECTORS.reset(collectors_token)
