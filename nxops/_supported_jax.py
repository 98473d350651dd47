"""The JAX versions nxops supports, checked once when nxops is imported.

nxops reaches into JAX internals (all in ``nxops/_jax.py``) that move between
releases; outside the tested range it would fail later with an unrelated
``AttributeError``. This says so up front instead.
"""
from __future__ import annotations

import re

import jax

MINIMUM = (0, 10, 2)     # inclusive
BELOW = (0, 13)          # exclusive: the next minor release is untested
TESTED = "JAX 0.10.2 (Python 3.11) and 0.12.0.1 (Python 3.13) in CI; 0.11.2 on the GPU machines"


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0].split("rc")[0])[:4])


def check_jax_version(version: str = jax.__version__) -> None:
    """Raises ImportError naming the supported range when ``version`` is outside it."""
    release = _release(version)
    if MINIMUM <= release and release[:2] < BELOW:
        return
    raise ImportError(
        f"nxops supports JAX >= 0.10.2 and < 0.13 (tested: {TESTED}); this is JAX {version}. "
        f"Install a supported JAX next to nxops, e.g. pip install 'jax>=0.10.2,<0.13'.")
