"""Which implementations a benchmark compares, and why one is skipped here.

Every group holds a hand-written JAX ``baseline`` and one entry per nxops
backend (``xla``, ``pallas``, ``triton``). A backend is skipped with its
reason when it has no kernel for the op, does not run on this platform, or
cannot take the case; sizes are limited where a platform makes them slow.
"""
from __future__ import annotations

import jax

import nxops as nx
from bench import _peaks
from nxops.kernels._choice import choose
from nxops.kernels._registry import BACKENDS
from nxops.kernels._selection import parse_selection

BASELINE = "baseline"
# cuDNN implements attention only: bench_attention.py times it itself.
IMPLEMENTATIONS = (BASELINE,) + tuple(b for b in BACKENDS if b != "cudnn")

# Sizes each platform runs. Pallas (and the Pallas collectives) run in
# interpret mode on CPU: correct but slow, so only the small size there;
# Triton's interpreter is slower still, so its entries run on a GPU only.
ACCELERATOR_ONLY_SIZES = ("large",)
INTERPRETED_SIZES = ("small",)


def mesh_devices():
    """The devices a benchmark over a mesh runs on: the default ones when
    there are several, else the (8 simulated) CPU devices."""
    devices = jax.devices()
    return devices if len(devices) > 1 else jax.devices("cpu")


def mesh_platform() -> str:
    """The platform of :func:`mesh_devices`."""
    return "cpu" if mesh_devices()[0].platform == "cpu" else _peaks.platform()


def interpreted(backend: str, platform: str) -> bool:
    """Whether ``backend``'s kernels run in an interpreter on ``platform``
    (Pallas interpret mode, Triton's interpreter): correct, but their times
    say nothing about the hardware they are written for."""
    return platform == "cpu" and backend in ("pallas", "triton")


def skip_reason(op: str, backend: str, size: str, platform: str, avals=(),
                params=None) -> str | None:
    """Why ``backend`` cannot run the kernel ``op`` (with ``avals`` and
    ``params``) at ``size`` here, or None if it can."""
    if size in ACCELERATOR_ONLY_SIZES and platform == "cpu":
        return f"size {size!r} runs only on an accelerator (too slow and large on CPU)"
    if backend == BASELINE:
        return None
    if backend == "triton" and platform == "cpu":
        return ("the triton kernels run in Triton's interpreter on CPU, one Python loop per "
                "program (a small max reduction takes ~90 s): timed only on a GPU; "
                "tests/kernels/test_<op>.py checks their numerics here")
    if backend == "pallas" and platform == "cpu" and size not in INTERPRETED_SIZES:
        return f"Pallas runs in interpret mode on CPU: only sizes {INTERPRETED_SIZES} there"
    # The registry's own choice, as the ops make it when they lower.
    try:
        choice = choose(op, platform, parse_selection(backend), avals, **(params or {}))
    except nx.NxopsError as e:
        return str(e)
    if choice.kernel.backend != backend:   # e.g. zero-size operands take the reference
        return choice.describe()
    return None


def compile_for(backend: str, fn, *args):
    """``jax.jit(fn)`` lowered and compiled for ``args`` with ``backend``'s kernels.

    The kernel selection is read while tracing, so the compiled executable
    keeps it wherever it is called; the baseline compiles under ``auto``.
    """
    if backend == BASELINE:
        return jax.jit(fn).lower(*args).compile()
    with nx.kernels.use(backend):
        return jax.jit(fn).lower(*args).compile()
