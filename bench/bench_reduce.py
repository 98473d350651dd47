"""Reductions (sum, max, logsumexp, mean) over the last axis of a matrix.

Each group (op, variant, dtype, size) holds the hand-written ``jnp`` baseline
and every nxops backend. ``positional`` reduces axis 1 with ``nx.<op>(x, 1)``;
``named`` reduces the same data over a name bound by ``jax.vmap(axis_name=)``.
Reductions are memory bound: bytes moved = input + output.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import nxops as nx
from bench import _peaks
from bench._backends import BASELINE, IMPLEMENTATIONS, compile_for, interpreted, skip_reason
from bench._measure import Work, assert_close, measure, nbytes

OPS = ("sum", "max", "logsumexp", "mean")
VARIANTS = ("positional", "named")
DTYPES = (jnp.float32, jnp.bfloat16)
# f32: 2 MiB (fits the caches of a CPU), 64 MiB (does not), 2 GiB.
SHAPES = {"small": (512, 1024), "medium": (4096, 4096), "large": (16384, 32768)}

BASELINES = {
    "sum": functools.partial(jnp.sum, axis=1),
    "max": functools.partial(jnp.max, axis=1),
    "logsumexp": functools.partial(jax.nn.logsumexp, axis=1),
    "mean": functools.partial(jnp.mean, axis=1),
}


def nxops_reduce(op: str, variant: str):
    """The nxops function under test: ``nx.<op>`` over a position or a name."""
    named_op = getattr(nx, op)
    if variant == "positional":
        return lambda x: named_op(x, 1)
    return jax.vmap(lambda column: named_op(column, "j"), in_axes=1, out_axes=None, axis_name="j")


def cases():
    for op in OPS:
        for variant in VARIANTS:
            for dtype in DTYPES:
                for size in SHAPES:
                    for impl in IMPLEMENTATIONS:
                        # Quick: sum (f32, bf16) and logsumexp (f32) at the small
                        # size, and one sum too large for the caches (the
                        # memory-bound case); no interpreted kernels (their times
                        # say nothing about the hardware).
                        quick = (((op, dtype) in (("sum", jnp.float32), ("sum", jnp.bfloat16),
                                                  ("logsumexp", jnp.float32)) and size == "small")
                                 or (op, variant, dtype, size) == ("sum", "positional", jnp.float32, "medium")
                                 ) and not interpreted(impl, _peaks.platform())
                        yield pytest.param(op, variant, dtype, size, impl,
                                           id=f"{op}-{variant}-{jnp.dtype(dtype).name}-{size}-{impl}",
                                           marks=[pytest.mark.quick] if quick else [])


@pytest.mark.parametrize("op,variant,dtype,size,impl", list(cases()))
def test_reduce(benchmark, peak, platform, op, variant, dtype, size, impl):
    shape = SHAPES[size]
    x_aval = jax.ShapeDtypeStruct(shape, dtype)
    kernel_op = "sum" if op == "mean" else op
    reason = skip_reason("reduce", impl, size, platform, (x_aval,), dict(axes=(1,), op=kernel_op))
    if reason:
        pytest.skip(reason)

    x = jax.random.uniform(jax.random.key(0), shape, dtype)
    fn = BASELINES[op] if impl == BASELINE else nxops_reduce(op, variant)
    compiled = compile_for(impl, fn, x)
    expected = jax.jit(BASELINES[op])(x.astype(jnp.float32))
    work = Work(bytes_moved=nbytes(x) + shape[0] * jnp.dtype(dtype).itemsize,
                flops=x.size)
    result = measure(benchmark, compiled, x, work=work, peak=peak, dtype=dtype,
                     group=f"reduce-{op}-{variant}-{jnp.dtype(dtype).name}-{size}",
                     info=dict(op=f"reduce {op} ({variant})", backend=impl,
                               size=f"{size} {shape[0]}x{shape[1]}", baseline=impl == BASELINE))
    assert result.shape == (shape[0],)
    assert_close(result, expected, dtype)
