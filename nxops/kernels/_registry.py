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
from typing import Any, Callable, Iterator, Sequence


from nxops._jax import config as _jax_config
from nxops._errors import NxopsError
from nxops._platforms import PLATFORMS, platform_named   # one list, shared with nx.export and nx.xmap
from nxops.kernels import _autotune, _measured

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

# Where `auto`'s rule (below) lets a kernel take a case on TPU, it tries these
# backends in order; `xla` is always the last resort. On cuda the measured
# table orders the backends (fastest first). On CPU the Pallas/Triton kernels
# only run interpreted, which is for testing, never faster: `auto` keeps XLA.
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
# `auto`'s rule
#
# On cuda: only what a GPU measured decides (nxops/kernels/_measured.py). The
# table of the target's architecture (sm_90: H100, H200; seeded from an H200
# run, ../shared/gpu_runs/ in the repository's history, rewritten by
# `bash ci/gpu.sh`) gives each case's kernel time relative to XLA's. A kernel
# takes the case only where its entry was measured at <= 0.95x XLA and its
# source is unchanged since; stale, unmeasured, or a GPU with no table: XLA.
# Why no model: the deviceless cost model (bench/static) predicted 0.46x for
# rows logsumexp and 0.34x for column reductions; the H200 measured 0.95-1.76x
# and 0.66-1.49x. XLA runs plain sums at 86-95% of HBM bandwidth.
# With NXOPS_AUTOTUNE=1, a lowering on a real GPU times the candidates instead
# (nxops/kernels/_autotune.py), once per case, GPU kind and nxops version.
#
# On every platform, a custom call cannot fuse its producer: where XLA would
# fuse what made the operand into the op (an elementwise op, a convert, a
# broadcast, a transpose), its fusion reads the producer's inputs once and a
# kernel would add a write and a read of the operand (`nx.sum(jnp.exp(v) * w,
# 1)`: 2x on the H200 too, 33.5 against 16.9 us). So a kernel takes a case
# only where the operand is a program argument, a loop carry, or the result of
# an op XLA never fuses into its consumer (a dot, a convolution, a custom
# call, a collective, a reduce); a producer the lowering cannot see (the
# argument of a nested function, e.g. a shard_map body) keeps XLA.
#
# On tpu no TPU has measured nxops yet: XLA everywhere, as on rocm and cpu.
# The deviceless model (bench/static/MODEL.md) explains but decides nothing:
# `explain` quotes its figure where it has one (rows logsumexp, modelled 0.50
# on v5e), and the H200 turned such modelled wins into 1.5-1.8x losses.
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

# What `explain` says where no table decides (tpu's modelled figures from
# bench/static/MODEL.md).
EVIDENCE = {
    "rows_logsumexp_tpu": "modelled kernel/xla 0.50 on TPU v5e (4096^2 bf16: one pass "
                          "against XLA's two), but no TPU has measured it: XLA until one does",
    "fused_producer": "XLA fuses the operand's producer {producer} into its consumer "
                      "(a kernel would write and re-read the operand: sum(exp(v)*w) "
                      "measured 1.98x XLA on an H200)",
    "reduce_tpu": "no modelled win on TPU (nothing measured there): XLA's fused reduction reads the operand once",
    "einsum_tpu": "no modelled win on TPU but where XLA's weight prefetch is charged "
                  "unoverlapped (decode 8-512x4096x4096: 0.54-0.97 on v5e/v6e, a model "
                  "limit; gelu epilogue 1.02, grad 2.25 on v5e): XLA until measured",
    "unknown_producer": "the operand's producer is not visible to the lowering (e.g. the "
                        "argument of a nested function): XLA may fuse it into its consumer",
    "collective": "collectives are not measured per case (NCCL / ICI); XLA's are kept",
    "cpu": "kernels run interpreted on cpu (for testing)",
    "unmeasured_platform": "nothing measured on {platform}: XLA",
}

# Candidates `auto` tries, best first: (backend, why).
Candidates = tuple[tuple[str, str], ...]


def _fused_producer(producers: Sequence[str] | None) -> str | None:
    """The first operand producer XLA would fuse into the op (None: none)."""
    for producer in producers or (UNKNOWN,):
        if producer not in UNFUSED_PRODUCERS:
            return producer
    return None


def auto_rule(op: str, platform: str, avals: Sequence[Any], params: dict,
              producers: Sequence[str] | None) -> tuple[Candidates, str]:
    """(the kernels `auto` may take for this case, best first, each with why;
    why XLA otherwise). See the comment above."""
    family = OP_FAMILY[op]
    if platform == "cpu":
        return (), EVIDENCE["cpu"]
    if family == "collective":
        return (), EVIDENCE["collective"]
    if platform == "cuda":
        candidates, why = _measured_candidates(op, avals, params)
    elif platform == "tpu":
        return (), _tpu_why(op, avals, params)
    else:
        return (), EVIDENCE["unmeasured_platform"].format(platform=platform)
    producer = _fused_producer(producers)
    if candidates and producer is not None:
        return (), _producer_why(producer)
    return candidates, why


def _producer_why(producer: str) -> str:
    if producer == UNKNOWN:
        return EVIDENCE["unknown_producer"]
    return EVIDENCE["fused_producer"].format(producer=producer)


def _tpu_why(op: str, avals: Sequence[Any], params: dict) -> str:
    """Why XLA on TPU: no TPU has measured a kernel (the deviceless model's
    figure, where it has one, is quoted, but decides nothing)."""
    family = OP_FAMILY[op]
    if family == "einsum":
        return EVIDENCE["einsum_tpu"]
    if family != "reduce":
        return EVIDENCE["unmeasured_platform"].format(platform="tpu")
    layout = _measured.reduce_layout(avals[0].shape, params.get("axes", ()))
    if layout == "rows" and params.get("op") == "logsumexp":
        return EVIDENCE["rows_logsumexp_tpu"]
    return EVIDENCE["reduce_tpu"]


def _measured_candidates(op: str, avals: Sequence[Any], params: dict) -> tuple[Candidates, str]:
    from nxops.kernels import _gpu_target  # noqa: PLC0415  (imports jax's device state)
    arch = _measured.arch_name(_gpu_target.compute_capability())
    kernels = {b: k for (o, b), k in _KERNELS.items() if o == op and b != "xla"}
    verdict = _measured.verdict(_measured.case_of(op, avals, params), arch, kernels)
    return verdict.winners, verdict.why_xla


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

    Examples:
        >>> reference = [k for k in nx.kernels.registered('reduce') if k.backend == 'xla'][0]
        >>> print(reference.op, reference.backend, 'cpu' in reference.platforms)
        reduce xla True
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
# Per backend: why it cannot load on a platform (e.g. an incompatible jax-triton
# / triton pair), asked before any of its kernels' own reasons.
_LOAD_PROBLEMS: dict[str, Callable[[str], Sequence[str]]] = {}


def register_load_check(backend: str, problems: Callable[[str], Sequence[str]]) -> None:
    """``problems(platform)``: why ``backend`` cannot load there (empty: it can)."""
    _LOAD_PROBLEMS[backend] = problems


def register(kernel: Kernel) -> Kernel:
    """Adds ``kernel``; registering the same (op, backend) twice is a bug.

    Examples:
        >>> reference = [k for k in nx.kernels.registered('reduce') if k.backend == 'xla'][0]
        >>> nx.kernels.register(reference) is reference  # the same object again: no change
        True
    """
    key = (kernel.op, kernel.backend)
    if key in _KERNELS and _KERNELS[key] is not kernel:
        raise ValueError(f"a {kernel.backend!r} kernel for {kernel.op!r} is already registered")
    _KERNELS[key] = kernel
    return kernel


def registered(op: str | None = None) -> list[Kernel]:
    """The registered kernels, of one op or of all.

    Examples:
        >>> sorted(k.backend for k in nx.kernels.registered('reduce') if k.backend != 'triton')
        ['pallas', 'xla']
    """
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
    platform = platform_named(word)
    if platform is not None:
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
            if platform_named(backend) is not None:
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

    Examples:
        >>> program = jax.ShapeDtypeStruct((8,), jnp.float32)
        >>> with nx.kernels.use("pallas"):
        ...     report = nx.kernels.explain(lambda v: nx.sum(v, 0), program)
        >>> print(report.selection, report.backends())
        pallas {'reduce': {'pallas'}}
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
    why: str = ""   # `auto`'s reason (what was measured, or why XLA)
    case: str = ""  # the measured tables' key of this case (_measured.Case.key; "" if none)

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
    load_problems = tuple(_LOAD_PROBLEMS.get(kernel.backend, lambda p: ())(platform))
    if load_problems:
        return load_problems
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
    """The kernel that runs ``op`` for this case on ``platform`` (see
    ``_choose``), with the case's key in the measured tables."""
    choice = _choose(op, platform, selection, avals, auto_partitioned, producers, **params)
    case = _measured.case_of(op, avals, params)
    return dataclasses.replace(choice, case=case.key if case else "")


def _choose(op: str, platform: str, selection: Selection, avals: Sequence[Any],
            auto_partitioned: bool = False, producers: Sequence[str] | None = None, /,
            **params: Any) -> Choice:
    """The kernel that runs ``op`` for this case on ``platform``.

    ``auto`` keeps XLA unless ``auto_rule`` (on cuda: the measured table) lets
    a kernel take the case; then it takes the first of its candidates that is
    registered, loads and supports the case.
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
        return _choose_auto(op, platform, avals, auto_partitioned, producers, params)
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


def _choose_auto(op: str, platform: str, avals: Sequence[Any], auto_partitioned: bool,
                 producers: Sequence[str] | None, params: dict) -> Choice:
    candidates, why_xla = auto_rule(op, platform, avals, params, producers)
    if platform == "cuda" and not _fused_producer(producers) and _autotune.active(platform):
        supported = [b for b in BACKENDS if (op, b) in _KERNELS and
                     not _reasons(_KERNELS[(op, b)], platform, avals, params, auto_partitioned)]
        backend, why = _autotune.winner(op, avals, params, supported)
        return Choice(_KERNELS[(op, backend)], "auto", (), why)
    passed_over = []
    for backend, why in candidates:
        kernel = _KERNELS.get((op, backend))
        if kernel is None:
            continue
        reasons = _reasons(kernel, platform, avals, params, auto_partitioned)
        if not reasons:
            return Choice(kernel, "auto", tuple(passed_over), why)
        passed_over.append((backend, reasons))
    return Choice(_KERNELS[(op, "xla")], "auto", tuple(passed_over), why_xla)


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
