"""JAX's Pallas TPU flash attention as nxops' ``pallas`` attention on TPU:
the Mosaic kernels run here in Pallas's TPU interpret mode and are checked
against the materialized program (values, logsumexp, and the backward from
the op's cotangent rows), causal and not, with as many or fewer queries
than keys, head dims below 128 that are not powers of two, bf16; and the
cases it declines, each with its reason, through ``nx.attention`` too."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from nxops.kernels.pallas import attention as pallas_attention
from nxops.kernels.pallas import attention_tpu
from nxops.kernels.xla import attention as reference
from tests import _tolerances
from tests.kernels.test_attention import materialized, operands

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("dtype, causal, tq, tk, d", [
    (jnp.float32, True, 256, 256, 64),     # two query and key blocks: blocks above the diagonal skipped
    (jnp.float32, False, 120, 384, 72),    # one query block of 120 rows, 3 key blocks, head 72
    (jnp.bfloat16, True, 64, 256, 128),    # fewer queries than keys: query i sees keys 0..i
], ids=["f32-causal", "f32-full-odd", "bf16-causal-short-queries"])
def test_values_and_gradients_match_the_materialized_program(dtype, causal, tq, tk, d):
    q, k, v, q_pos, k_pos, _ = operands(2, tq, tk, d, d, dtype, q_offset=0, bias_rows=None)
    # a case the kernel takes (its causal mask needs the positions 0..T-1 these are)
    assert attention_tpu.not_supported_reasons(q, k, v, q_pos, k_pos, causal=causal,
                                               positions="iota") == []
    static = dict(scale=0.3, causal=causal)
    want, vjp = jax.vjp(lambda q, k, v: materialized(q, k, v, q_pos, k_pos, None, **static),
                        q, k, v)
    got = jax.jit(lambda: attention_tpu.forward(q, k, v, q_pos, k_pos, platform="cpu",
                                                **static))()
    assert got.dtype == jnp.float32 and got.shape == want.shape
    # the output comes back in q's dtype: bf16 rounds it once more than the reference
    _tolerances.assert_close(got, want, dtype, scale=4.0)

    g = jax.random.normal(jax.random.key(7), want.shape)
    rows = reference.cotangent_rows(want[..., :-1], want[..., -1], g[..., :-1], g[..., -1],
                                    v.dtype)
    grads = jax.jit(lambda: attention_tpu.backward(q, k, v, q_pos, k_pos, *rows,
                                                   platform="cpu", **static))()
    for name, got_g, want_g in zip("qkv", grads, vjp(g)):
        assert got_g.dtype == want_g.dtype and got_g.shape == want_g.shape, name
        _tolerances.assert_close(got_g, want_g, dtype,
                                 scale=float(jnp.max(jnp.abs(want_g.astype(jnp.float32)))) * 4)


def _reasons(tq=256, tk=256, d=128, e=None, dtype=jnp.bfloat16, bias=False, **params):
    q, v = S((4, tq, d), dtype), S((4, tk, e or d), dtype)
    extra = (S((1, tq, tk), jnp.float32),) if bias else ()
    return " ".join(pallas_attention.not_supported_reasons(
        q, S((4, tk, d), dtype), v, S((4, tq), jnp.int32), S((4, tk), jnp.int32), *extra,
        platform="tpu", **params))


@pytest.mark.parametrize("case", [dict(), dict(d=64), dict(d=256), dict(tq=8, d=72),
                                  dict(causal=True, positions="iota"), dict(dtype=jnp.float32)])
def test_takes_block_multiple_lengths_and_known_causal_positions(case):
    assert _reasons(**case) == ""


@pytest.mark.parametrize("case, words", [
    (dict(causal=True), "positions given as arrays"),
    (dict(bias=True), "a bias or mask"),
    (dict(dtype=jnp.float16), "dtype float16"),
    (dict(d=128, e=64), "differs from the values'"),
    (dict(d=192), "head dim 192"),
    (dict(tk=200), "key length 200"),
    (dict(tq=200), "query length 200"),
    (dict(tq=12), "query length 12"),
])
def test_declines_what_it_cannot_give_exactly(case, words):
    assert words in _reasons(**case)


# --- through nx.attention: which calls reach it with their positions known -------

Q = S((16, 1024, 128), jnp.bfloat16)


def _tpu_choice(fn, *args):
    with nx.kernels.use("attention=pallas"):
        (report,) = nx.kernels.explain(fn, *args, platform="tpu").reports
    return report.choice


def test_causal_unmapped_attention_takes_the_kernel_on_tpu():
    choice = _tpu_choice(lambda q, k, v: nx.attention(q, k, v, seq=1, q_seq=1, causal=True),
                         Q, Q, Q)
    assert choice.kernel.name == "pallas:attention", choice.describe()


def test_its_gradient_takes_the_kernels_backward_on_tpu():
    def grads(q, k, v):
        loss = lambda q, k, v: nx.attention(q, k, v, seq=1, q_seq=1, causal=True).astype(
            jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    with nx.kernels.use("attention=pallas"):
        reports = nx.kernels.explain(grads, Q, Q, Q, platform="tpu").reports
    assert {r.choice.kernel.name for r in reports} == {"pallas:attention",
                                                       "pallas:attention_backward"}


@pytest.mark.parametrize("call", [
    # a SequenceLayout: stored position i is not global position i
    lambda q, k, v: nx.attention(q, k, v, seq=1, q_seq=1, causal=True,
                                 sequence_layout=nx.SequenceLayout("zigzag", shards=2)),
    # grouped-query attention: a group's query heads fold into rows that repeat positions
    lambda q, k, v: nx.attention(q.reshape(4, 4, 1024, 128), k[:4], v[:4], seq=1, q_seq=2,
                                 causal=True),
], ids=["sequence_layout", "gqa"])
def test_causal_with_positions_it_cannot_know_is_declined_with_the_reason(call):
    with pytest.raises(nx.NxopsError, match="positions given as arrays"):
        _tpu_choice(call, Q, Q, Q)


def test_non_causal_grouped_query_attention_takes_it():
    choice = _tpu_choice(lambda q, k, v: nx.attention(q.reshape(4, 4, 1024, 128), k[:4], v[:4],
                                                      seq=1), Q, Q, Q)
    assert choice.kernel.name == "pallas:attention", choice.describe()


def test_auto_keeps_xla_on_tpu():
    (report,) = nx.kernels.explain(
        lambda q, k, v: nx.attention(q, k, v, seq=1, q_seq=1, causal=True), Q, Q, Q,
        platform="tpu").reports
    assert report.choice.kernel.backend == "xla"
    assert "nothing measured on tpu" in report.choice.describe()


def test_same_values_as_numpy_through_the_kernel_functions():
    # an independent check of the logsumexp column: NumPy in float64
    q, k, v, q_pos, k_pos, _ = operands(1, 8, 128, 16, 16, jnp.float32, q_offset=0,
                                        bias_rows=None)
    rows = np.asarray(jax.jit(lambda: attention_tpu.forward(q, k, v, q_pos, k_pos, scale=0.25,
                                                            causal=True, platform="cpu"))())
    s = np.einsum("bqd,bkd->bqk", np.float64(q), np.float64(k)) * 0.25
    s = np.where(np.arange(128)[None, None, :] <= np.arange(8)[None, :, None], s, -np.inf)
    lse = np.log(np.sum(np.exp(s - s.max(-1, keepdims=True)), -1)) + s.max(-1)
    out = np.einsum("bqk,bke->bqe", np.exp(s - lse[..., None]), np.float64(v))
    np.testing.assert_allclose(rows[..., -1], lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rows[..., :-1], out, rtol=1e-4, atol=1e-5)


def test_without_the_logsumexp_the_output_is_the_same_and_its_column_nan():
    q, k, v, q_pos, k_pos, _ = operands(2, 128, 256, 64, 64, jnp.bfloat16, q_offset=0,
                                        bias_rows=None)
    run = lambda need_lse: jax.jit(lambda: attention_tpu.forward(
        q, k, v, q_pos, k_pos, scale=0.125, causal=True, platform="cpu", need_lse=need_lse))()
    with_lse, without = run(True), run(False)
    np.testing.assert_array_equal(without[..., :-1], with_lse[..., :-1])
    assert bool(jnp.all(jnp.isnan(without[..., -1]))) and bool(jnp.all(jnp.isfinite(with_lse)))


def test_jax_vmap_keeps_the_positions_only_where_members_stay_batch_members():
    causal = lambda q, k, v: nx.attention(q, k, v, seq=1, q_seq=1, causal=True)
    members = S((2, *Q.shape), Q.dtype)
    # keys batched too: each member is a batch member of its own, positions 0..T-1
    choice = _tpu_choice(jax.vmap(causal), members, members, members)
    assert choice.kernel.name == "pallas:attention", choice.describe()
    # the same keys for every member: its queries fold into rows whose positions repeat
    with pytest.raises(nx.NxopsError, match="positions given as arrays"):
        _tpu_choice(jax.vmap(causal, in_axes=(0, None, None)), members, Q, Q)
