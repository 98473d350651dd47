"""The xmap frontend against the same program written positionally.

- runtime: the old xmap tutorial's ``named_predict`` (two ``nx.pdot`` and a
  ``nx.logsumexp``) as a jitted ``nx.xmap`` vs its positional ``jax.jit`` twin;
- dispatch: per-call time of the xmap callable vs ``jax.jit`` on a tiny input;
- compile: trace + lower + compile of a fresh function, xmap vs ``jax.jit``;
- serial loop: ``axis_resources={'batch': SerialLoop(k)}`` vs no resources,
  timed, with the compiled programs' temporary memory (``memory_analysis``).

The xmap programs use the kernels ``NXOPS_KERNELS`` selects (``auto`` by
default); ``extra_info["kernels"]`` records the selection.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from bench._measure import Work, assert_close, measure, nbytes

pytestmark = pytest.mark.quick

BATCH, INPUTS, HIDDEN, CLASSES = 512, 784, 1024, 128
F32 = jnp.float32


def named_predict(w1, w2, images):
    hidden = jax.nn.relu(nx.pdot(images, w1, "inputs"))
    logits = nx.pdot(hidden, w2, "hidden")
    return logits - nx.logsumexp(logits, "classes")


def positional_predict(w1, w2, images):
    return jax.nn.log_softmax(jax.nn.relu(images @ w1) @ w2, axis=-1)


def xmapped_predict(**kwargs):
    return nx.xmap(named_predict,
                   in_axes=(["inputs", "hidden", ...], ["hidden", "classes", ...],
                            ["batch", "inputs", ...]),
                   out_axes=["batch", "classes", ...], **kwargs)


def info(**fields):
    return dict(fields, kernels=str(nx.kernels.current_selection()))


def predict_operands():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k1, (INPUTS, HIDDEN), F32) / INPUTS**0.5,
            jax.random.normal(k2, (HIDDEN, CLASSES), F32) / HIDDEN**0.5,
            jax.random.normal(k3, (BATCH, INPUTS), F32))


def predict_work(operands) -> Work:
    flops = 2 * BATCH * (INPUTS * HIDDEN + HIDDEN * CLASSES)
    return Work(bytes_moved=nbytes(*operands) + BATCH * CLASSES * 4, flops=flops)


@pytest.mark.parametrize("impl", ["baseline", "xmap"])
def test_runtime(benchmark, peak, impl):
    operands = predict_operands()
    fn = jax.jit(positional_predict) if impl == "baseline" else xmapped_predict()
    result = measure(benchmark, fn, *operands, work=predict_work(operands), peak=peak, dtype=F32,
                     group="frontend-runtime",
                     info=info(op="xmap named_predict", backend=impl,
                               size=f"batch {BATCH}, {INPUTS}-{HIDDEN}-{CLASSES}",
                               baseline=impl == "baseline"))
    assert_close(result, jax.jit(positional_predict)(*operands), F32)


@pytest.mark.parametrize("impl", ["baseline", "xmap"])
def test_dispatch(benchmark, peak, impl):
    x = jnp.arange(8, dtype=F32)
    double = lambda v: v * 2  # noqa: E731
    fn = jax.jit(double) if impl == "baseline" else nx.xmap(double, ["i", ...], ["i", ...])
    result = measure(benchmark, fn, x, work=None, peak=peak, dtype=F32, group="frontend-dispatch",
                     info=info(op="per-call overhead (x * 2)", backend=impl, size="8 floats",
                               baseline=impl == "baseline"))
    np.testing.assert_array_equal(result, np.arange(8) * 2)


@pytest.mark.parametrize("impl", ["baseline", "xmap"])
def test_compile(benchmark, peak, impl):
    operands = predict_operands()

    def trace_and_compile():
        # A new function object each round: jit's caches cannot answer.
        if impl == "baseline":
            fresh = lambda *a: positional_predict(*a)  # noqa: E731
            return jax.jit(fresh).lower(*operands).compile()
        fresh = lambda *a: named_predict(*a)  # noqa: E731
        return nx.xmap(fresh, in_axes=(["inputs", "hidden", ...], ["hidden", "classes", ...],
                                       ["batch", "inputs", ...]),
                       out_axes=["batch", "classes", ...]).lower(*operands).compile()

    compiled = measure(benchmark, trace_and_compile, work=None, peak=peak, dtype=F32,
                       group="frontend-compile", rounds=5,
                       info=info(op="trace + compile named_predict", backend=impl,
                                 size=f"batch {BATCH}", baseline=impl == "baseline"))
    assert_close(compiled(*operands), jax.jit(positional_predict)(*operands), F32)


LOOP_BATCH, LOOP_HIDDEN = 512, 1024


def hidden_roundtrip(v, m):
    # The (batch, hidden) activations dominate temporary memory; a serial
    # loop over the batch keeps only one chunk of them live.
    return jnp.tanh(v @ m) @ m.T


@pytest.mark.parametrize("loop", [1, 4, 8], ids=lambda k: "baseline" if k == 1 else f"SerialLoop({k})")
def test_serial_loop_memory(benchmark, peak, loop):
    kx, km = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (LOOP_BATCH, 128), F32)
    m = jax.random.normal(km, (128, LOOP_HIDDEN), F32) / 16
    resources = {} if loop == 1 else {"a": nx.SerialLoop(loop)}
    fn = nx.xmap(hidden_roundtrip, (["a", None], [...]), ["a", None], axis_resources=resources)
    unlooped = nx.xmap(hidden_roundtrip, (["a", None], [...]), ["a", None])
    temp = fn.lower(x, m).compile().memory_analysis().temp_size_in_bytes
    temp_unlooped = unlooped.lower(x, m).compile().memory_analysis().temp_size_in_bytes
    backend = "baseline" if loop == 1 else f"SerialLoop({loop})"
    result = measure(benchmark, fn, x, m, work=Work(nbytes(x, m) * 2, 4 * LOOP_BATCH * 128 * LOOP_HIDDEN),
                     peak=peak, dtype=F32, group="frontend-serial-loop",
                     info=info(op="xmap tanh(x@m)@m.T, temp memory", backend=backend,
                               size=f"batch {LOOP_BATCH}, hidden {LOOP_HIDDEN}",
                               baseline=loop == 1, temp_bytes=temp,
                               temp_ratio_to_unlooped=temp / temp_unlooped))
    assert_close(result, jax.jit(hidden_roundtrip)(x, m), F32)
