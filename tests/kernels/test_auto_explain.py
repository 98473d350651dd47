"""`auto`'s rule as ``nx.kernels.explain`` reports it, lowering only (no
compile, no device): on TPU nothing is measured, so XLA is kept whatever a
model says; on cuda a kernel is taken only where the measured table has it
winning and no producer would fuse into the op."""
import jax
import jax.numpy as jnp
import pytest

import nxops as nx


def _why(fn, *args, platform="cuda"):
    (report, *_) = nx.kernels.explain(fn, *args, platform=platform).reports
    return report.choice.kernel.backend, report.choice.describe()


# 4096^2 f32 columns on cuda: measured 0.66x (with the measured kernel versions)
LSE_CASES = {"cuda": (jax.ShapeDtypeStruct((4096, 4096), jnp.float32), 0, "pallas 0.66x XLA")}


def test_auto_on_tpu_keeps_xla_whatever_the_model_says():
    backend, why = _why(lambda v: nx.logsumexp(v, 1), jnp.ones((64, 256), jnp.bfloat16),
                        platform="tpu")
    assert backend == "xla" and "nothing measured on tpu" in why


@pytest.mark.parametrize("platform", ["cuda"])
def test_auto_takes_the_logsumexp_kernel_only_where_no_producer_would_fuse(platform,
                                                                           measured_kernels):
    v, axis, evidence = LSE_CASES[platform]
    backend, why = _why(lambda v: nx.logsumexp(v, axis), v, platform=platform)
    assert backend == "pallas" and evidence in why
    backend, why = _why(lambda v: nx.logsumexp(jnp.exp(v) * 2, axis), v, platform=platform)
    assert backend == "xla" and "stablehlo.multiply" in why
    # a nested function's argument: its producer is not visible, XLA is kept
    backend, why = _why(jax.jit(lambda v: nx.logsumexp(v, axis)), v, platform=platform)
    assert backend == "xla" and "not visible" in why


def test_auto_keeps_xla_where_nothing_won(measured_kernels):
    a = jnp.ones((64, 64), jnp.bfloat16)
    backend, why = _why(lambda a: nx.einsum("mk,kn->mn", a, a), a)
    assert backend == "xla" and "unmeasured on sm_90" in why
    backend, why = _why(lambda a: nx.einsum("mk,kn->mn", a, a), a, platform="tpu")
    assert backend == "xla" and "nothing measured on tpu" in why
    backend, why = _why(lambda a: nx.max(a, 0), a, platform="tpu")
    assert backend == "xla" and "nothing measured on tpu" in why
    # columns on cuda: the kernel where the H200 measured it winning (bf16 sums
    # at 4096^2: 0.84x), XLA where it lost (f32: 1.32x) or nothing was measured
    big = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    assert _why(lambda a: nx.sum(a, 0), big)[0] == "pallas"
    backend, why = _why(lambda a: nx.sum(a, 0), jax.ShapeDtypeStruct((4096, 4096), jnp.float32))
    assert backend == "xla" and "pallas 1.32x XLA" in why
    assert _why(lambda a: nx.max(a, 0), big)[0] == "xla"
