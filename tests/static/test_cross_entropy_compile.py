"""The Pallas fused cross-entropy (forward kernel + reference backward)
compiled for an H100 on this CPU-only machine: no spills, the
architecture's tensor cores, and a launch that fills the SMs."""
import jax
import jax.numpy as jnp
import pytest

from tests._extras import require_gpu_compile

require_gpu_compile()

import nxops as nx
from tests._deviceless import gpu

S = jax.ShapeDtypeStruct
TOKENS, HIDDEN, VOCAB = 2048, 512, 8000


@pytest.fixture(scope="module", params=["h100"])
def kernel(request):
    arch = request.param
    step = jax.value_and_grad(lambda h, w, labels: nx.cross_entropy(
        h, w, labels, hidden=1, vocab=1).sum(), argnums=(0, 1))
    with nx.kernels.use("cross_entropy=pallas"):
        report = gpu.compile_gpu(step, S((TOKENS, HIDDEN), jnp.bfloat16),
                                 S((HIDDEN, VOCAB), jnp.bfloat16), S((TOKENS,), jnp.int32),
                                 arch=arch)
    return arch, report.kernel("nxops_cross_entropy")


def test_compiles_with_no_spills_on_tensor_cores(kernel):
    arch, k = kernel
    assert k.registers is not None and (k.spill_stores, k.spill_loads) == (0, 0), (arch, k)
    assert k.tensor_core and k.tensor_core.startswith("wgmma." if arch == "h100" else "mma."), k
    assert k.ctas_per_sm >= 1, (arch, k)


def test_launch_fills_the_sms(kernel):
    # 32 token blocks of 64 alone would leave most SMs idle: the vocab splits fill them.
    arch, k = kernel
    assert k.grid[0] == TOKENS // 64 and k.blocks >= gpu.ARCHS[arch].sm_count, (arch, k)


def test_stored_backward_softmax_kernel_compiles_with_no_spills():
    """backward="in_forward" with the Pallas kernel: the softmax written over
    each block's logits (between XLA's matmuls), one program per 4 rows."""
    step = jax.value_and_grad(lambda h, w, labels: nx.cross_entropy(
        h, w, labels, hidden=1, vocab=1, backward="in_forward").sum(), argnums=(0, 1))
    with nx.kernels.use("cross_entropy=pallas"):
        report = gpu.compile_gpu(step, S((TOKENS, HIDDEN), jnp.bfloat16),
                                 S((HIDDEN, VOCAB), jnp.bfloat16), S((TOKENS,), jnp.int32),
                                 arch="h100")
    k = report.kernel("nxops_cross_entropy_softmax")
    assert k.registers is not None and (k.spill_stores, k.spill_loads) == (0, 0), k
    assert k.ctas_per_sm >= 1 and k.blocks >= gpu.ARCHS["h100"].sm_count, k
