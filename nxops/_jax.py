"""Every private JAX API nxops uses, in one place.

nxops is tested on JAX 0.10.2 (CI) and runs on 0.11 (the GPU machines); a
private API that moves breaks only here. Each entry says what it is for and
the public alternative, if any.
"""
from __future__ import annotations

from jax._src import config as _config


def vma_checked() -> bool:
    """Whether the enclosing ``shard_map`` body is traced with ``check_vma=True``.

    It decides how a replicated collective result transposes: under
    ``check_vma=True`` an invariant-typed all-gather transposes to a slice;
    under ``check_vma=False`` shard_map divides replicated cotangents by the
    mesh size and a varying all-gather must sum them back. No public API.
    """
    return bool(_config._check_vma.value)
