"""Contractions: matmul, batched matmul, and a contraction over a named axis
(``nx.einsum`` with a ``<k>`` group, and ``nx.pdot``) inside ``jax.vmap``.

Each group (case, dtype, size) holds the hand-written ``jnp`` baseline and
every nxops backend. FLOPs = 2·batch·m·n·k; bytes moved = operands + result.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import nxops as nx
from bench import _peaks
from bench._backends import BASELINE, IMPLEMENTATIONS, compile_for, interpreted, skip_reason
from bench._measure import Work, assert_close, measure, nbytes

DTYPES = (jnp.float32, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class Case:
    """One contraction: its jnp spelling and its kernel dimension numbers."""

    spec: str                   # jnp.einsum spec of the positional computation
    dimension_numbers: tuple    # the dot_general it reduces to
    shapes: dict                # size -> (batch, m, k, n)


MATMUL_SHAPES = {"small": (1, 256, 256, 256), "medium": (1, 1024, 1024, 1024),
                 "large": (1, 8192, 8192, 8192)}
CASES = {
    "matmul": Case("mk,kn->mn", (((1,), (0,)), ((), ())), MATMUL_SHAPES),
    "batched": Case("bmk,bkn->bmn", (((2,), (1,)), ((0,), (0,))),
                    {"small": (8, 128, 128, 128), "medium": (16, 512, 512, 512),
                     "large": (64, 2048, 2048, 2048)}),
    "einsum-named": Case("mk,kn->mn", (((1,), (0,)), ((), ())), MATMUL_SHAPES),
    "pdot-named": Case("mk,kn->mn", (((1,), (0,)), ((), ())), MATMUL_SHAPES),
}


def operands(case: Case, size: str, dtype):
    batch, m, k, n = case.shapes[size]
    lead = (batch,) if "b" in case.spec else ()
    ka, kb = jax.random.split(jax.random.key(0))
    return (jax.random.uniform(ka, lead + (m, k), dtype),
            jax.random.uniform(kb, lead + (k, n), dtype))


def nxops_contraction(name: str, case: Case):
    """The nxops function under test: ``nx.einsum`` or ``nx.pdot``."""
    if name == "einsum-named":
        return jax.vmap(lambda a, b: nx.einsum("m<k>,<k>n->mn", a, b), in_axes=(1, 0),
                        out_axes=None, axis_name="k")
    if name == "pdot-named":
        return jax.vmap(lambda a, b: nx.pdot(a, b, "k"), in_axes=(1, 0), out_axes=None,
                        axis_name="k")
    return lambda a, b: nx.einsum(case.spec, a, b)


def cases():
    for name in CASES:
        for dtype in DTYPES:
            for size in MATMUL_SHAPES:
                for impl in IMPLEMENTATIONS:
                    quick = (name in ("matmul", "einsum-named") and size == "small"
                             and not interpreted(impl, _peaks.platform()))
                    yield pytest.param(name, dtype, size, impl,
                                       id=f"{name}-{jnp.dtype(dtype).name}-{size}-{impl}",
                                       marks=[pytest.mark.quick] if quick else [])


@pytest.mark.parametrize("name,dtype,size,impl", list(cases()))
def test_einsum(benchmark, peak, platform, name, dtype, size, impl):
    case = CASES[name]
    a, b = operands(case, size, dtype)
    reason = skip_reason("dot_general", impl, size, platform, (a, b),
                         dict(dimension_numbers=case.dimension_numbers))
    if reason:
        pytest.skip(reason)

    baseline = lambda a, b: jnp.einsum(case.spec, a, b)
    fn = baseline if impl == BASELINE else nxops_contraction(name, case)
    compiled = compile_for(impl, fn, a, b)
    expected = jnp.einsum(case.spec, a.astype(jnp.float32), b.astype(jnp.float32),
                          precision=lax.Precision.HIGHEST)
    batch, m, k, n = case.shapes[size]
    work = Work(bytes_moved=nbytes(a, b) + expected.size * jnp.dtype(dtype).itemsize,
                flops=2 * batch * m * n * k)
    result = measure(benchmark, compiled, a, b, work=work, peak=peak, dtype=dtype,
                     group=f"einsum-{name}-{jnp.dtype(dtype).name}-{size}",
                     info=dict(op=f"einsum {name} '{case.spec}'", backend=impl,
                               size=f"{size} b{batch} {m}x{k}x{n}", baseline=impl == BASELINE))
    assert result.shape == expected.shape
    assert_close(result, expected, dtype)
