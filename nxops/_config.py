"""Every ``NXOPS_*`` environment variable, in one place.

Each is a JAX config state: read from the environment when nxops is
imported, validated then (a bad value fails the import, listing the valid
ones), part of jit's cache key and trace context (switching one recompiles
instead of reusing a program lowered under the other value), and scoped by a
context manager, e.g. ``with _config.AUTOTUNE("on"): ...``. Lowering code
reads the states here, never ``os.environ``.

- ``NXOPS_KERNELS``: the kernel selection (``nxops.kernels._selection``).
- ``NXOPS_AUTOTUNE``: time the candidates on the local GPU at the first
  lowering of a case (``nxops.kernels._autotune``).
- ``NXOPS_AUTOTUNE_CACHE``: where autotuning keeps its results.
- ``NXOPS_MEASURED_DIR``: where ``python -m nxops.measure`` writes this
  machine's tables, which `auto` reads before the shipped ones.
- ``NXOPS_MGPU_COLLECTIVES``: JAX's Mosaic GPU collectives for
  ``collective=pallas`` on cuda.
- ``NXOPS_TRACEBACK_FILTERING``: hide nxops' own frames from tracebacks
  (default on; ``nxops._traceback`` reads it once, at import).
"""
from __future__ import annotations

import os
import pathlib
from typing import Any

from nxops._errors import NxopsError
from nxops._jax import config as _jax_config

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_flag(value: Any, name: str) -> bool:
    """A boolean flag's value: True/False, or 1/0/true/false/yes/no/on/off in
    any case ("" means unset: off). Anything else raises, listing those."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE or text == "":
        return False
    raise NxopsError(f"invalid {name}={value!r}: valid values are "
                     f"{', '.join(_TRUE + _FALSE)} (any case), or unset for off.")


def _validate_kernels(value: Any) -> None:
    # The parser lives with the selection, whose package imports this module.
    from nxops.kernels._selection import parse_selection
    parse_selection(value)


def _validate_path(name: str):
    def validate(value: Any) -> None:
        if not isinstance(value, (str, os.PathLike)):
            raise NxopsError(f"invalid {name}={value!r}: a directory path (a string), or unset "
                             f"for the default.")
    return validate


def _state(name: str, default: str, help: str, validator):
    return _jax_config.string_or_object_state(
        name.lower(), default, help, validator=validator,
        include_in_jit_key=True, include_in_trace_context=True)


def _flag(name: str, help: str):
    return _state(name, "0", help, lambda value: parse_flag(value, name))


KERNELS = _state(
    "NXOPS_KERNELS", "auto",
    "Which kernel implementation nxops uses per op: auto, xla, pallas, triton, "
    "cudnn (attention only), or op=backend pairs such as 'reduce=pallas,einsum=xla'.",
    _validate_kernels)
AUTOTUNE = _flag(
    "NXOPS_AUTOTUNE",
    "Whether `auto` times the candidate kernels on the local GPU at a case's first lowering.")
AUTOTUNE_CACHE = _state(
    "NXOPS_AUTOTUNE_CACHE", "", "Directory of the autotuning cache (default: "
    "~/.cache/nxops/autotune).", _validate_path("NXOPS_AUTOTUNE_CACHE"))
MEASURED_DIR = _state(
    "NXOPS_MEASURED_DIR", "", "Directory of this machine's measured tables, written by "
    "`python -m nxops.measure` (default: ~/.cache/nxops/measured).",
    _validate_path("NXOPS_MEASURED_DIR"))
MGPU_COLLECTIVES = _flag(
    "NXOPS_MGPU_COLLECTIVES",
    "Whether collective=pallas uses JAX's Mosaic GPU collectives on cuda (NVLink SHARP).")
TRACEBACK_FILTERING = _state(
    "NXOPS_TRACEBACK_FILTERING", "on",
    "Whether tracebacks of errors raised through nxops hide nxops' own frames.",
    lambda value: parse_flag(value, "NXOPS_TRACEBACK_FILTERING"))


def _cache_home() -> pathlib.Path:
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")


def autotune() -> bool:
    return parse_flag(AUTOTUNE.value, "NXOPS_AUTOTUNE")


def mgpu_collectives() -> bool:
    return parse_flag(MGPU_COLLECTIVES.value, "NXOPS_MGPU_COLLECTIVES")


def autotune_cache() -> pathlib.Path:
    return pathlib.Path(AUTOTUNE_CACHE.value or _cache_home() / "nxops" / "autotune")


def measured_dir() -> pathlib.Path:
    return pathlib.Path(MEASURED_DIR.value or _cache_home() / "nxops" / "measured")
