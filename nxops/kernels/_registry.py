"""The kernel registry: every implementation of every positional op.

A kernel knows nothing of axis names: it takes positional arrays and static
parameters. Each record says which platforms it runs on and, for a given case,
why it cannot take it (``not_supported_reasons``). The ``xla`` backend is the
reference implementation of every op and supports every case.

Which kernel runs a case is decided elsewhere: ``_selection`` (what the user
asked for), ``_auto`` (`auto`'s rule), ``_choice`` (the pick) and
``_reports`` / ``_explain`` (what was picked, and why).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from nxops._platforms import PLATFORMS   # one list, shared with nx.export and nx.xmap

# Positional ops that have kernels, grouped into the families that
# NXOPS_KERNELS selects per op (``reduce=pallas,einsum=xla``).
OP_FAMILY: dict[str, str] = {
    "reduce": "reduce",
    "dot_general": "einsum",
    "tile": "tile",
    "all_gather": "collective",
    "reduce_scatter": "collective",
    "cross_entropy": "cross_entropy",
    "attention": "attention",
    "attention_backward": "attention",   # its gradient: chosen like its forward
}
FAMILIES: tuple[str, ...] = ("reduce", "einsum", "tile", "collective", "cross_entropy",
                             "attention")
BACKENDS: tuple[str, ...] = ("xla", "pallas", "triton", "cudnn")

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


def lookup(op: str, backend: str) -> Kernel | None:
    """The ``backend`` kernel of ``op`` (None: none registered)."""
    return _KERNELS.get((op, backend))


def register_load_check(backend: str, problems: Callable[[str], Sequence[str]]) -> None:
    """``problems(platform)``: why ``backend`` cannot load there (empty: it can)."""
    _LOAD_PROBLEMS[backend] = problems


def load_problems(backend: str, platform: str) -> tuple[str, ...]:
    """Why ``backend`` cannot load on ``platform`` (empty: it can)."""
    check = _LOAD_PROBLEMS.get(backend)
    return tuple(check(platform)) if check else ()
