"""nx.attention on JAX's Pallas TPU flash attention, compiled for TPU v5e
and v6e on this CPU-only machine (libtpu, deviceless): the forward and the
gradient of a causal attention (16 heads of 2048 x 128, bf16, per chip),
with the kernels selected, contain Mosaic kernels (Mosaic errors fail the
compile, as on a TPU) and no scores-sized array; `auto` keeps XLA's
blockwise reference, which has no Mosaic kernel."""
import re

import jax
import jax.numpy as jnp
import pytest

from tests._extras import require_extra

require_extra("compile", "libtpu")

import nxops as nx
from nxops.kernels.pallas import attention_tpu
from tests._deviceless import tpu

S = jax.ShapeDtypeStruct
HEADS, TOKENS, HEAD_DIM = 16, 2048, 128
OPERAND = S((HEADS, TOKENS, HEAD_DIM), jnp.bfloat16)
FORWARD = attention_tpu.FORWARD_NAME
BACKWARD = ("flash_mha_bwd_dkv", "flash_mha_bwd_dq")   # JAX's names, with their block sizes


def attend(q, k, v):
    return nx.attention(q, k, v, seq=1, q_seq=1, causal=True)


def gradient(q, k, v):
    return jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(),
                    argnums=(0, 1, 2))(q, k, v)


def _compile(fn, chip, selection):
    # check_vma=False: nx.attention's reference (its abstract evaluation)
    # cannot yet be typed with shard_map's varying axes
    with nx.kernels.use(selection):
        return tpu.compile_tpu(fn, OPERAND, OPERAND, OPERAND, chip=chip, check_vma=False)


def _scores_sized(report) -> list[str]:
    """Arrays of the compiled program as large as one head's scores (Tq x Tk)."""
    return re.findall(rf"\[[0-9,]*{TOKENS},{TOKENS}\]", report.hlo_text)


@pytest.fixture(scope="module", params=["v5e", "v6e"])
def compiled(request):
    chip = request.param
    return chip, {(name, selection): _compile(fn, chip, selection)
                  for name, fn in (("forward", attend), ("gradient", gradient))
                  for selection in ("attention=pallas", "auto")}


def test_forward_and_gradient_run_the_mosaic_kernels(compiled):
    chip, reports = compiled
    assert reports["forward", "attention=pallas"].kernels == [FORWARD], chip
    kernels = reports["gradient", "attention=pallas"].kernels
    assert kernels[0] == FORWARD and len(kernels) == 3, (chip, kernels)
    assert [k.startswith(name) for k, name in zip(kernels[1:], BACKWARD)] == [True, True], kernels
    for key, report in reports.items():
        assert not _scores_sized(report), (chip, key)
        # (temp_size_in_bytes counts HBM only: at this size XLA keeps the
        # kernels' lane-broadcast statistics in VMEM, memory space S(1))
        assert report.memory["generated_code_size_in_bytes"] > 0, (chip, key)


def test_auto_keeps_the_blockwise_reference(compiled):
    chip, reports = compiled
    assert reports["forward", "auto"].kernels == [] and reports["gradient", "auto"].kernels == []
