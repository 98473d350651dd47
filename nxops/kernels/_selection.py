"""The selection: which backend the user asked for, per op family
(``NXOPS_KERNELS`` / ``nx.kernels.use``).

The selection is a JAX config state that is part of the jit cache key and the
trace context, so switching it recompiles instead of reusing a stale program.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Iterator

from nxops import _config
from nxops._errors import NxopsError
from nxops._platforms import platform_named
from nxops.kernels._registry import BACKENDS, FAMILIES, OP_FAMILY

CHOICES: tuple[str, ...] = ("auto",) + BACKENDS


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


def current_selection() -> Selection:
    """The selection in force (validated: a bad NXOPS_KERNELS raises here)."""
    return parse_selection(_config.KERNELS.value)


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
    with _config.KERNELS(selection):
        yield parsed
