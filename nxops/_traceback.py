"""Tracebacks of errors raised through nxops end at the user's line.

JAX hides its own frames from a traceback that passes one of its API
boundaries (``JAX_TRACEBACK_FILTERING``). nxops registers its package folder
with that machinery as internal too, and marks its public entry points
(``nx.xmap`` and the callable it returns, the named ops, ``nx.export``,
``nx.random``) as boundaries: an ``NxopsError`` raised ten frames deep in the
planner shows the user's call as its last frame, with JAX's note saying how
to see everything.

Switches (the first read when nxops is imported):
  ``NXOPS_TRACEBACK_FILTERING=off``: show nxops' frames (JAX still hides its own);
  ``JAX_TRACEBACK_FILTERING=off``: show every frame, JAX's and nxops'.
"""
from __future__ import annotations

import inspect
import os
from typing import Callable, Iterable, TypeVar

from nxops import _config
from nxops._jax import traceback_util

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

F = TypeVar("F", bound=Callable)


def hides_nxops_frames() -> bool:
    return _config.parse_flag(_config.TRACEBACK_FILTERING.value, "NXOPS_TRACEBACK_FILTERING")


def api_boundary(fun: F) -> F:
    """``fun``, with tracebacks of exceptions raised below it filtered."""
    return traceback_util.api_boundary(fun)


def mark_boundaries(namespace: dict, names: Iterable[str]) -> None:
    """Makes the public functions ``names`` of a package's ``namespace``
    (its ``globals()``) boundaries, in place: every import of them, ``nx.*``
    or the package's own, gets the same object."""
    for name in names:
        if inspect.isfunction(namespace[name]):
            namespace[name] = api_boundary(namespace[name])


if hides_nxops_frames():
    traceback_util.register_exclusion(PACKAGE_DIR)
