"""Which jax-triton / triton pairs work with which JAX, checked when the
backend loads (from the installed metadata: nothing is imported to ask).

What was found (the wheels' sources, `pip download --no-deps`, and the H200 run):

| JAX | jax-triton | triton | why |
|---|---|---|---|
| 0.10 | 0.3.1 | 3.6-3.8 (CI: 3.8) | 0.4.x requires JAX >= 0.11; 0.3.1 was built for triton 3.6 |
| 0.11, 0.12 | 0.4.1 | 3.7-3.9 (CI: 3.9 on 0.12) | 0.4.0/0.4.1 import `TMA_TF32` from triton's NVIDIA driver, new in 3.7 |
| 0.11, 0.12 | 0.4.1 | 3.6, with nxops' shim | without `TMA_TF32` jax-triton 0.4 replaces triton's whole CUDA backend by a stub (`'_Stub' object has no attribute 'backend'` on every call); nxops defines the constant before jax-triton is imported (its value in triton 3.7+; used only for TMA descriptors, which nxops' kernels do not use). The H200 run (JAX 0.11.2, triton 3.6) was correct with the import patched this way; deviceless on JAX 0.12.0.1 + triton 3.6.0 the shim makes jax-triton 0.4.1 load and lower nxops' kernels, and without it its backend is the stub |

An incompatible pair makes the backend unavailable on cuda, with a reason that
names the versions and the pip command that installs a working pair: `auto`
passes over it; an explicit ``NXOPS_KERNELS=triton`` raises NxopsError.
"""
from __future__ import annotations

import functools
import importlib.metadata
import re
import sys

from nxops._install import install_command

# The constant triton >= 3.7's NVIDIA driver defines and jax-triton 0.4 imports.
TMA_TF32 = 11


def installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, ...]:
    """``"3.6.0"`` -> (3, 6, 0); pre/post/dev suffixes dropped."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def pair_problem(jax: str, jax_triton: str, triton: str) -> str | None:
    """Why these versions do not work together (None: they do)."""
    jt, tr, jx = release(jax_triton), release(triton), release(jax)
    if jt < (0, 3, 1):
        return f"jax-triton {jax_triton} is older than nxops supports (0.3.1 with JAX 0.10, " \
               f"0.4.1 with JAX 0.11+)"
    if jt >= (0, 4) and jx < (0, 11):
        return f"jax-triton {jax_triton} requires JAX >= 0.11, and JAX {jax} is installed " \
               f"(with JAX 0.10 use jax-triton 0.3.1)"
    if tr < (3, 6):
        return f"triton {triton} is older than jax-triton {jax_triton} supports (>= 3.6)"
    return None


def _stubbed_backend() -> bool:
    """Whether an already imported jax-triton replaced triton's CUDA backend by
    its stub (it was imported before nxops, with a triton lacking TMA_TF32)."""
    triton_lib = sys.modules.get("jax_triton.triton_lib")
    backend = getattr(getattr(triton_lib, "cb", None), "CUDABackend", None)
    return backend is not None and getattr(backend, "__name__", "") == "_Stub"


def problem(versions: dict[str, str | None] | None = None) -> str | None:
    """Why the installed (or given) JAX, jax-triton and triton cannot compile
    Triton kernels on cuda, with the command that fixes it; None if they can."""
    versions = versions or {d: installed(d) for d in ("jax", "jax-triton", "triton")}
    if not versions.get("jax-triton") or not versions.get("triton"):
        return None   # missing packages: the backend's own reasons say what to install
    why = pair_problem(versions["jax"] or "0", versions["jax-triton"], versions["triton"])
    fix = install_command("triton")
    if why is None and _stubbed_backend():
        why = (f"jax-triton {versions['jax-triton']} was imported before nxops with triton "
               f"{versions['triton']}, which lacks TMA_TF32 (triton >= 3.7): its CUDA backend is "
               f"a stub")
        fix = "import nxops before jax_triton (nxops supplies TMA_TF32), or pip install " \
              "'triton>=3.7,<3.10'"
    if why is None:
        return None
    return (f"incompatible Triton stack: {why} (installed: JAX {versions['jax']}, jax-triton "
            f"{versions['jax-triton']}, triton {versions['triton']}). Fix: {fix}")


def reasons(platform: str) -> list[str]:
    """The backend's load problem on ``platform`` (jax-triton compiles only on cuda)."""
    if platform != "cuda":
        return []
    found = _installed_problem()
    return [found] if found else []


@functools.cache   # asked on every lowering; installs do not change in a process
def _installed_problem() -> str | None:
    return problem()


def provide_tma_tf32() -> None:
    """Defines ``TMA_TF32`` in triton < 3.7's NVIDIA driver before jax-triton
    0.4 imports it (see the module docstring); nothing for other stacks."""
    triton, jax_triton = installed("triton"), installed("jax-triton")
    if not triton or not jax_triton or release(triton) >= (3, 7) or release(jax_triton) < (0, 4):
        return
    if "jax_triton.triton_lib" in sys.modules:
        return   # too late: `problem` reports it
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return
    if not hasattr(driver, "TMA_TF32"):
        driver.TMA_TF32 = TMA_TF32
