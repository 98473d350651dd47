"""The pip command that installs an nxops extra, for error messages.

nxops is installed from a checkout or a git URL, not from an index, so
``pip install 'nxops[triton]'`` does not work: the hint names the extra's own
requirements (read from the installed metadata, so it follows pyproject.toml),
or, for a checkout on ``sys.path`` that was never installed, the checkout.
"""
from __future__ import annotations

import functools
import importlib.metadata
import pathlib
import re


def _extra_requirements(extra: str) -> list[str]:
    """The requirement strings of ``extra`` in the installed nxops metadata."""
    try:
        requires = importlib.metadata.requires("nxops") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    marker = re.compile(r"""\bextra\s*==\s*["']%s["']""" % re.escape(extra))
    return [req.split(";")[0].strip() for req in requires
            if ";" in req and marker.search(req.split(";", 1)[1])]


def _extra_for_this_jax(extra: str) -> str:
    """``triton`` -> ``triton-jax012`` under JAX 0.12: the per-JAX extra whose
    requirements fit the running JAX (the plain name picks by Python version)."""
    import jax

    minor = jax.__version__.split(".")[1]
    specific = f"{extra}-jax0{minor}"
    return specific if _extra_requirements(specific) else extra


@functools.cache
def install_command(extra: str) -> str:
    """A shell command, runnable as printed, that installs nxops' ``extra``."""
    extra = _extra_for_this_jax(extra)
    requirements = _extra_requirements(extra)
    if requirements:
        return "pip install " + " ".join(f"'{req}'" for req in requirements)
    checkout = pathlib.Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file():
        return f"pip install -e '{checkout}[{extra}]'"
    return f"pip install '<nxops checkout or git URL>[{extra}]' (see nxops' README, Install)"
