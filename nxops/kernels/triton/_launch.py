"""One launch path for every Triton kernel of the backend.

``launch(kernel, *args, out_shape=..., grid=..., platform=...)`` compiles the
kernel through ``jax_triton.triton_call`` on cuda, and runs it in Triton's
interpreter (``_interpreter.run`` inside ``jax.pure_callback``) on cpu. Both
take the arguments in jax-triton's order: arrays and Python scalars, then the
outputs, then the ``constexprs``.

On cuda Triton compiles for ``_gpu_target.compute_capability()``: that of
the devices the program is lowered for (a deviceless compile's topology
devices carry one: how the compile harness builds for an H100 or A100 here).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from nxops._jax import adapt_dce_rule
from nxops.kernels._gpu_target import DEFAULT_COMPUTE_CAPABILITY, arch_for, compute_capability
from nxops.kernels.triton import _interpreter

_OUT_KEYWORD = "out_shape"   # jax-triton 0.3; 0.4 names it out_type (out_shape deprecated)

# The kernels are written and checked with floating-point fusion (FMA) on.
# Passed with every launch: Triton's process-wide default
# (TRITON_DEFAULT_FP_FUSION) flips in 3.10, and 3.9 warns about it wherever
# a launch leaves the choice to it. The interpreter computes each operation
# in NumPy, unfused, and takes the option only to ignore it.
FP_FUSION = True


@functools.cache
def _jax_triton():
    """jax-triton, imported on first cuda launch and made to work with this JAX."""
    global _OUT_KEYWORD
    import jax_triton  # only the cuda path needs it
    from jax_triton import triton_lib

    if "out_type" in inspect.signature(jax_triton.triton_call).parameters:
        _OUT_KEYWORD = "out_type"
    # jax-triton 0.4.1's DCE rule has JAX <= 0.11's signature; JAX 0.12 passes
    # live_ins too (every jit of a Triton call failed). Until upstream fixes it.
    adapt_dce_rule(triton_lib.triton_kernel_call_p)
    return jax_triton


def _fp_fusion_keywords(triton_call) -> dict:
    """How ``triton_call`` takes the fp-fusion option: jax-triton 0.4 in
    ``backend_options`` (any other keyword becomes a constexpr of the kernel,
    which would break its signature); 0.3 as a keyword of its own."""
    if "backend_options" in inspect.signature(triton_call).parameters:
        return {"backend_options": {"enable_fp_fusion": FP_FUSION}}
    return {"enable_fp_fusion": FP_FUSION}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a kernel runs: ``platform`` ("cuda" or "cpu") and, on cuda, the
    compute capability it is compiled for. Kernels pass it as a static
    argument of their custom_vjp/custom_vmap, so a trace made for one GPU is
    never reused for another."""

    platform: str
    compute_capability: int | None = None

    @property
    def arch(self) -> str:
        return arch_for(self.compute_capability or DEFAULT_COMPUTE_CAPABILITY)


def target_for(platform: str) -> Target:
    """The target of ``platform`` as lowering now stands (see ``_gpu_target``)."""
    if platform not in ("cpu", "cuda"):
        raise ValueError(f"Triton kernels run on cuda (and cpu, interpreted), not {platform!r}")
    return Target(platform, compute_capability() if platform == "cuda" else None)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch, as traced (for the compile harness's tables)."""

    name: str             # the custom call's name
    kernel: str           # the @triton.jit function's name (the PTX entry)
    grid: tuple[int, ...]
    num_warps: int
    num_stages: int
    constexprs: tuple[tuple[str, Any], ...]


_RECORDS: contextvars.ContextVar[list[Launch] | None] = contextvars.ContextVar(
    "nxops_triton_launches", default=None)


@contextlib.contextmanager
def recording_launches() -> Iterator[list[Launch]]:
    """Lists every launch traced in the block (jit traces anew inside it only
    if its cache misses: use a fresh function or a new compute capability)."""
    token = _RECORDS.set([])
    try:
        yield _RECORDS.get()
    finally:
        _RECORDS.reset(token)


def launch(kernel, *args: Any, out_shape: Sequence[jax.ShapeDtypeStruct], grid: Sequence[int],
           target: Target, name: str, num_warps: int = 4, num_stages: int = 2,
           **constexprs: Any) -> list[jax.Array]:
    """Runs ``kernel`` over ``grid``; returns its outputs (a list)."""
    out_shape = list(out_shape)
    records = _RECORDS.get()
    if records is not None:
        records.append(Launch(name, kernel.fn.__name__, tuple(grid), num_warps, num_stages,
                              tuple(sorted(constexprs.items()))))
    if target.platform == "cuda":
        triton_call = _jax_triton().triton_call
        outs = triton_call(
            *args, kernel=kernel, **{_OUT_KEYWORD: out_shape}, grid=tuple(grid), name=name,
            num_warps=num_warps, num_stages=num_stages,
            compute_capability=target.compute_capability, **_fp_fusion_keywords(triton_call),
            **constexprs)
        return list(outs)
    arrays = [a for a in args if isinstance(a, jax.Array) or hasattr(a, "aval")]
    positions = [i for i, a in enumerate(args) if isinstance(a, jax.Array) or hasattr(a, "aval")]

    def on_host(*host_arrays):
        full = list(args)
        for i, array in zip(positions, host_arrays):
            full[i] = np.asarray(array)
        return _interpreter.run(kernel, grid, full, out_shape,
                                {**constexprs, "enable_fp_fusion": FP_FUSION})

    return list(jax.pure_callback(on_host, out_shape, *arrays))
