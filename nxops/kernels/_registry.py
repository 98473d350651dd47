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

# Positional ops that have kernels, grouped into the families that
# NXOPS_KERNELS selects per op (``reduce=pallas,einsum=xla``).
OP_FAMILY: dict[str, str] = {
    "reduce": "reduce",
    "dot_general": "einsum",
    "tile": "tile",
    "all_gather": "collective",
    "reduce_scatter": "collective",
}
FAMILIES: tuple[str, ...] = ("reduce", "einsum", "tile", "collective")
BACKENDS: tuple[str, ...] = ("xla", "pallas", "triton")
CHOICES: tuple[str, ...] = ("auto",) + BACKENDS
PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu")

# `auto` prefers these backends, in order, on each platform; `xla` is always
# the last resort. On CPU the Pallas/Triton kernels only run interpreted, which
# is for testing, never faster: `auto` keeps XLA there.
AUTO_PREFERENCE: dict[str, tuple[str, ...]] = {
    "cpu": ("xla",),
    "cuda": ("pallas", "triton", "xla"),
    "rocm": ("pallas", "xla"),
    "tpu": ("pallas", "xla"),
}
# On cuda, Pallas before Triton, on the deviceless compile evidence
# (bench/static/GPU.md; no GPU has timed either yet): both meet the static
# targets (0 spills, >= 1 CTA per SM for large reductions and tiles, >= 4
# CTAs/SM for logsumexp, pipelined 128x256 wgmma / 128x128 mma.sync tiles),
# and Pallas does it with fewer registers for the same tiles (4096^3 bf16
# matmul on H100: 186 against 218) and no extra package. Triton runs where
# Pallas declines, and `einsum=triton` gives split-K for skinny matmuls
# (8x4096x4096: 256 programs against Pallas' 32).
#
# Per-family exceptions. The Pallas ring collectives have only run in TPU
# interpret mode; XLA's ICI collectives are tuned, so `auto` keeps them until
# the kernels are measured on a TPU (`collective=pallas` still selects them).
AUTO_PREFERENCE_BY_FAMILY: dict[tuple[str, str], tuple[str, ...]] = {
    ("collective", "tpu"): ("xla",),
}


def auto_preference(op: str, platform: str) -> tuple[str, ...]:
    """The backends `auto` tries for ``op`` on ``platform``, in order."""
    default = AUTO_PREFERENCE.get(platform, ("xla",))
    return AUTO_PREFERENCE_BY_FAMILY.get((OP_FAMILY[op], platform), default)

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

    def describe(self) -> str:
        text = f"{self.kernel.backend} (requested {self.requested})"
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
           auto_partitioned: bool = False, /, **params: Any) -> Choice:
    """The kernel that runs ``op`` for this case on ``platform``.

    ``auto`` takes the first backend of ``auto_preference(op, platform)`` that is
    registered and supports the case; an explicitly requested backend that
    cannot take the case raises NxopsError with its reasons. ``auto_partitioned``
    says the op is lowered where XLA partitions some mesh axes automatically.
    """
    requested = selection.backend_for(op)
    if any(getattr(aval, "size", 1) == 0 for aval in avals):
        # Nothing to compute: any selection takes the reference, which returns
        # the empty (or identity-filled) result without launching a kernel.
        return Choice(_KERNELS[(op, "xla")], requested,
                      ((requested, ("zero-size operands: nothing for a kernel to do",)),))
    if requested == "auto":
        passed_over = []
        for backend in auto_preference(op, platform):
            kernel = _KERNELS.get((op, backend))
            if kernel is None:
                continue
            reasons = _reasons(kernel, platform, avals, params, auto_partitioned)
            if not reasons:
                return Choice(kernel, requested, tuple(passed_over))
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
