"""The Pallas flash attention compiled for an H100 on this CPU-only machine:
the forward (through ``nx.attention`` with the kernel selected) and the
FlashAttention-2 backward kernels (the kernel differentiated directly),
each with no spills and its dots on the architecture's tensor cores."""
import jax
import jax.numpy as jnp
import pytest

from tests._extras import require_gpu_compile

require_gpu_compile()

import nxops as nx
from nxops.kernels.pallas import attention as pallas_attention
from tests._deviceless import gpu

S = jax.ShapeDtypeStruct
# One layer's attention at 4096 tokens: 16 heads of 128, bf16, causal, the
# queries a ring step's later shard (positions offset from the keys').
HEADS, TOKENS, HEAD_DIM = 16, 4096, 128


def _forward(q, k, v):
    return nx.attention(q, k, v, seq=1, q_seq=1, causal=True)


def _backward(q, k, v):
    q_pos = jnp.broadcast_to(jnp.arange(TOKENS, dtype=jnp.int32) + TOKENS, (HEADS, TOKENS))
    k_pos = jnp.broadcast_to(jnp.arange(TOKENS, dtype=jnp.int32), (HEADS, TOKENS))

    def loss(q, k, v):
        rows = pallas_attention.attention(q, k, v, q_pos, k_pos, scale=HEAD_DIM ** -0.5,
                                          causal=True, platform="cuda")
        return jnp.sum(rows[..., :-1].astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.fixture(scope="module")
def kernels():
    operands = [S((HEADS, TOKENS, HEAD_DIM), jnp.bfloat16)] * 3
    with nx.kernels.use("attention=pallas"):
        forward = gpu.compile_gpu(_forward, *operands, arch="h100")
    backward = gpu.compile_gpu(_backward, *operands, arch="h100")
    return {name: report.kernel(name) for report, names in (
        (forward, ["nxops_attention_forward"]),
        (backward, ["nxops_attention_forward", "nxops_attention_dkdv", "nxops_attention_dq"]))
        for name in names}


@pytest.mark.parametrize("name", ["nxops_attention_forward", "nxops_attention_dkdv",
                                  "nxops_attention_dq"])
def test_compiles_with_no_spills_on_tensor_cores(kernels, name):
    k = kernels[name]
    print(name, k)
    assert k.registers is not None and (k.spill_stores, k.spill_loads) == (0, 0), k
    assert k.tensor_core and k.tensor_core.startswith(("wgmma.", "mma.")), k
    assert k.ctas_per_sm >= 1, k


def test_grid_is_a_program_per_block_and_head(kernels):
    forward = kernels["nxops_attention_forward"]
    bq, _ = pallas_attention.blocks(TOKENS, TOKENS, pallas_attention.FORWARD_BLOCKS)
    assert forward.grid[:2] == (TOKENS // bq, HEADS), forward
