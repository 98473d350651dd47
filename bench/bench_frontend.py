"""The xmap frontend against the same program written positionally.

- runtime: the old xmap tutorial's ``named_predict`` (two ``nx.pdot`` and a
  ``nx.logsumexp``) as a jitted ``nx.xmap`` vs its positional ``jax.jit`` twin;
- dispatch: per-call time of the xmap callable vs ``jax.jit`` on a tiny input;
- compile: trace + lower + compile of a fresh function, xmap vs ``jax.jit``;
- serial loop: ``axis_resources={'batch': SerialLoop(k)}`` vs no resources,
  timed, with the compiled programs' temporary memory (``memory_analysis``);
- serial loop under ``jax.grad``: an MLP whose activations dominate, its
  gradient step timed, with the temporary memory of the forward and the
  gradient programs per loop (``remat`` on, and off for ``SerialLoop(8)``).

The xmap programs use the kernels ``NXOPS_KERNELS`` selects (``auto`` by
default); ``extra_info["kernels"]`` records the selection.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from nxops.kernels._selection import current_selection
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
    return dict(fields, kernels=str(current_selection()))


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
    double = lambda v: v * 2
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
            fresh = lambda *a: positional_predict(*a)
            return jax.jit(fresh).lower(*operands).compile()
        fresh = lambda *a: named_predict(*a)
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


# An MLP whose (batch, hidden) activations dominate (4 MiB each; weights 0.3
# MiB): temp memory of the forward program and of jax.grad, per loop.
MLP_BATCH, MLP_IN, MLP_HIDDEN = 4096, 64, 256
GRAD_LOOPS = {"baseline": {}, "SerialLoop(4)": {"b": 4}, "SerialLoop(8)": {"b": 8},
              "SerialLoop(8, remat=False)": {"b": 8, "remat": False},
              "SerialLoop(32)": {"b": 32}}


def mlp(w1, w2, x):
    return jnp.tanh(jnp.tanh(x @ w1) @ w2) @ w1.T


def mlp_operands():
    k = jax.random.split(jax.random.key(2), 3)
    return (jax.random.normal(k[0], (MLP_IN, MLP_HIDDEN), F32) / MLP_IN**0.5,
            jax.random.normal(k[1], (MLP_HIDDEN, MLP_HIDDEN), F32) / MLP_HIDDEN**0.5,
            jax.random.normal(k[2], (MLP_BATCH, MLP_IN), F32))


def mlp_forward_and_grad(loop: dict):
    resources = {} if not loop else {"b": nx.SerialLoop(loop["b"], remat=loop.get("remat", True))}
    forward = nx.xmap(mlp, ([...], [...], ["b", ...]), ["b", ...], axis_resources=resources)
    grad = jax.jit(jax.grad(lambda w1, w2, x: jnp.sum(forward(w1, w2, x) ** 2), argnums=(0, 1)))
    return forward, grad


def temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("loop", GRAD_LOOPS)
def test_serial_loop_grad_memory(benchmark, peak, loop):
    operands = mlp_operands()
    forward, grad = mlp_forward_and_grad(GRAD_LOOPS[loop])
    base_forward, base_grad = mlp_forward_and_grad({})
    temps = {"temp_bytes_forward": temp_bytes(forward, *operands),
             "temp_bytes_grad": temp_bytes(grad, *operands)}
    temps.update(temp_ratio_forward=temps["temp_bytes_forward"] / temp_bytes(base_forward, *operands),
                 temp_ratio_grad=temps["temp_bytes_grad"] / temp_bytes(base_grad, *operands))
    flops = 3 * 2 * MLP_BATCH * (2 * MLP_IN * MLP_HIDDEN + MLP_HIDDEN**2)
    result = measure(benchmark, grad, *operands, work=Work(nbytes(*operands), flops), peak=peak,
                     dtype=F32, group="frontend-serial-loop-grad",
                     info=info(op="jax.grad of an xmapped MLP, temp memory", backend=loop,
                               size=f"batch {MLP_BATCH}, {MLP_IN}-{MLP_HIDDEN}-{MLP_HIDDEN}",
                               baseline=loop == "baseline", **temps))
    for got, want in zip(result, base_grad(*operands)):   # gradients cancel: plain tolerances
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-3)
