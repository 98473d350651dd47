"""The Pallas flash-attention kernel, in interpret mode on CPU, against the
materialized program (the scores held whole, JAX's own softmax and dots):
values, logsumexp and gradients of its forward and FlashAttention-2
backward; causal masks on global positions that differ between queries and
keys (a ring step's), queries that see no key, a bias shared by the batch,
lengths and head dims that are not multiples of the blocks, bf16; and
grouped-query attention through ``nx.attention`` with the kernels selected
(forward and backward), under vmap of grad (each member's own gradient), and
in a ring's steps (the sequence on a mesh axis), whose kernels the selection
picks as the unmapped op's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import nxops as nx
from nxops.kernels import _reports
from nxops.kernels.pallas import attention as pallas_attention
from tests import _tolerances


def materialized(q, k, v, q_pos, k_pos, bias, *, scale, causal):
    """[B, Tq, E + 1] f32: the output (0 for a query that sees no key) and
    the logsumexp (-inf there), from the whole [B, Tq, Tk] scores."""
    s = jnp.einsum("bqd,bkd->bqk", q, k, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        s = s + bias
    keep = jnp.ones(s.shape, bool)
    if causal:
        keep = k_pos[:, None, :] <= q_pos[:, :, None]
    seen = jnp.any(keep, axis=2)
    s = jnp.where(keep, s, -1e30)   # finite: no NaN gradient through an empty row
    lse = jax.nn.logsumexp(s, axis=2)
    p = jnp.exp(s - lse[..., None])
    o = jnp.einsum("bqk,bke->bqe", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return jnp.concatenate([jnp.where(seen[..., None], o, 0.0),
                            jnp.where(seen, lse, -jnp.inf)[..., None]], axis=-1)


def operands(batch, tq, tk, d, e, dtype, *, q_offset, bias_rows, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, tq, d)).astype(dtype)
    k = jax.random.normal(keys[1], (batch, tk, d)).astype(dtype)
    v = jax.random.normal(keys[2], (batch, tk, e)).astype(dtype)
    q_pos = jnp.broadcast_to(jnp.arange(tq, dtype=jnp.int32) + q_offset, (batch, tq))
    k_pos = jnp.broadcast_to(jnp.arange(tk, dtype=jnp.int32), (batch, tk))
    bias = None if bias_rows is None else jax.random.normal(keys[3], (bias_rows, tq, tk))
    return q, k, v, q_pos, k_pos, bias


def loss(fn, q_pos, k_pos, *, scale, causal):
    """A scalar of the output and the (finite) logsumexp, so that both cotangents flow."""
    def of(q, k, v, *bias):
        rows = fn(q, k, v, q_pos, k_pos, *(bias or (None,)), scale=scale, causal=causal)
        weights = jnp.cos(jnp.arange(rows.shape[-1], dtype=jnp.float32))
        lse = rows[..., -1]
        return (jnp.sum(jnp.sin(rows[..., :-1]) * weights[:-1])
                + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)))
    return of


def kernel_on_cpu(*operands, **static):
    return pallas_attention.attention(*operands, platform="cpu", **static)


@pytest.fixture
def small_blocks(monkeypatch):
    """16 x 16 blocks: several query and key blocks (and ragged last ones) at small sizes."""
    monkeypatch.setattr(pallas_attention, "FORWARD_BLOCKS", (16, 16))
    monkeypatch.setattr(pallas_attention, "DKDV_BLOCKS", (16, 16))
    monkeypatch.setattr(pallas_attention, "DQ_BLOCKS", (16, 16))


@pytest.mark.parametrize("dtype, causal, q_offset, bias_rows", [
    # The queries start 5 positions before the keys: the first 5 see no key
    # (a ring step's later shard); a bias shared by the batch.
    (jnp.float32, True, -5, 1),
    # bf16; the queries' global positions run past the keys' (an earlier shard).
    (jnp.bfloat16, True, 20, None),
    (jnp.float32, False, 0, 2),
], ids=["f32-causal-offset-bias", "bf16-causal-later-queries", "f32-full-bias-per-batch"])
def test_values_and_gradients_match_the_materialized_program(small_blocks, dtype, causal,
                                                             q_offset, bias_rows):
    # 37 queries, 45 keys, head dims 24 and 20: no size is a multiple of a block.
    q, k, v, q_pos, k_pos, bias = operands(2, 37, 45, 24, 20, dtype, q_offset=q_offset,
                                           bias_rows=bias_rows)
    static = dict(scale=0.3, causal=causal)
    diff = (q, k, v) + (() if bias is None else (bias,))
    argnums = tuple(range(len(diff)))

    def run(fn):
        rows = fn(q, k, v, q_pos, k_pos, bias, **static)
        grads = jax.grad(loss(fn, q_pos, k_pos, **static), argnums)(*diff)
        return rows, grads

    got_rows, got_grads = jax.jit(lambda: run(kernel_on_cpu))()
    want_rows, want_grads = jax.jit(lambda: run(materialized))()
    assert bool(jnp.any(jnp.isneginf(want_rows[..., -1]))) == (q_offset < 0)
    np.testing.assert_array_equal(np.isneginf(got_rows[..., -1]), np.isneginf(want_rows[..., -1]))
    finite = jnp.isfinite(want_rows)
    _tolerances.assert_close(jnp.where(finite, got_rows, 0), jnp.where(finite, want_rows, 0),
                             dtype, scale=4.0)
    for name, got, want in zip("q k v bias".split(), got_grads, want_grads):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        _tolerances.assert_close(got, want, dtype, scale=_tolerances.max_abs(want) * 4)


def test_grouped_query_attention_through_nx_attention_selects_the_kernel():
    # 2 key/value heads, each with 3 query heads; 19 positions (not a block multiple), bf16.
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (2, 3, 19, 16)).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (2, 19, 16)).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (2, 19, 16)).astype(jnp.bfloat16)

    def attend(q, k, v):
        return nx.attention(q, k, v, seq=1, q_seq=2, causal=True)

    def by_hand(q, k, v):   # every query head against its group's keys, scores whole
        s = jnp.einsum("hgqd,hkd->hgqk", q, k, preferred_element_type=jnp.float32) / 4.0
        s = jnp.where(jnp.tril(jnp.ones((19, 19), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("hgqk,hke->hgqe", p, v, preferred_element_type=jnp.float32
                          ).astype(v.dtype)

    def value_and_grads(fn):
        return jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2),
                                  argnums=(0, 1, 2))(q, k, v)

    with nx.kernels.use("attention=pallas"), _reports.collect_reports() as reports:
        got_out, got = jax.jit(lambda: (attend(q, k, v), value_and_grads(attend)))()
    # the forward and, under grad, the FlashAttention-2 backward
    assert {r.choice.kernel.name for r in reports} == {"pallas:attention",
                                                       "pallas:attention_backward"}
    want_out, want = jax.jit(lambda: (by_hand(q, k, v), value_and_grads(by_hand)))()
    assert got_out.dtype == jnp.bfloat16
    _tolerances.assert_close(got_out, want_out, jnp.bfloat16, scale=2.0)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _tolerances.assert_close(g, w, jnp.bfloat16, scale=_tolerances.max_abs(w) * 2)


def test_vmap_of_grad_gives_each_member_its_own_gradient():
    # keys shared by the members (not batched), queries per member: the
    # backward kernel's batching must not sum the members' dk, dv.
    keys = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(keys[0], (3, 2, 21, 8))
    k, v = (jax.random.normal(x, (2, 21, 8)) for x in keys[1:])

    def per_member(attend):
        def loss(q, k, v):
            return jnp.sum(jnp.sin(attend(q, k, v, seq=1, q_seq=1, causal=True)))
        return jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, None)))

    with nx.kernels.use("attention=pallas"):
        got = per_member(nx.attention)(q, k, v)

    def by_hand(q, k, v, **_):
        s = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(8)
        s = jnp.where(jnp.tril(jnp.ones((21, 21), bool)), s, -jnp.inf)
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)
    want = per_member(by_hand)(q, k, v)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        _tolerances.assert_close(g, w, jnp.float32, scale=_tolerances.max_abs(w) * 4)


def test_declines_what_it_cannot_take():
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    fine = (f32(2, 8, 64), f32(2, 8, 64), f32(2, 8, 64), i32(2, 8), i32(2, 8))
    assert pallas_attention.not_supported_reasons(*fine, platform="cuda") == []
    wide = (f32(2, 8, 512), f32(2, 8, 512), f32(2, 8, 64), i32(2, 8), i32(2, 8))
    assert "up to 256" in " ".join(pallas_attention.not_supported_reasons(*wide, platform="cuda"))
    # on tpu the kernel is JAX's TPU flash attention: keys in blocks of 128
    assert "key length 8" in " ".join(pallas_attention.not_supported_reasons(*fine,
                                                                             platform="tpu"))


@pytest.mark.parametrize("layout, dtype", [
    (None, jnp.float32), (nx.SequenceLayout("zigzag", shards=4), jnp.float32),
    # bf16 shards travel as their bits: the steps hand the kernel values.
    (None, jnp.bfloat16)], ids=["in-order", "zigzag", "in-order-bf16"])
def test_ring_steps_run_the_selected_kernel(layout, dtype):
    # Queries and keys on the 4 devices of y (a ring), causal, 2 key/value
    # heads of 2 query heads, 48 tokens (12 per device: ragged 16-blocks).
    tokens, n = 48, 4
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (2, 2, tokens, 8)).astype(dtype)
    k, v = (jax.random.normal(x, (2, tokens, 8)).astype(dtype) for x in keys[1:3])
    c = jax.random.normal(keys[3], q.shape)
    order = np.arange(tokens) if layout is None else layout.order(tokens)

    def loss(resources):
        ring = nx.xmap(lambda q, k, v: nx.attention(q, k, v, seq="s", q_seq="qs", causal=True,
                                                    sequence_layout=layout),
                       [["h", "g", "qs", None], ["h", "s", None], ["h", "s", None]],
                       ["h", "g", "qs", None], axis_resources=resources)
        # Stored in the layout's order; the loss's weights follow the data.
        return lambda q, k, v: jnp.sum(c[:, :, order] * ring(q, k, v).astype(jnp.float32))

    def by_hand(q, k, v):   # in order, the scores whole, in f32
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        s = jnp.einsum("hgqd,hkd->hgqk", q, k) / np.sqrt(8)
        s = jnp.where(jnp.tril(jnp.ones((tokens, tokens), bool)), s, -jnp.inf)
        return jnp.sum(c * jnp.einsum("hgqk,hke->hgqe", jax.nn.softmax(s, -1), v))

    stored = (q[:, :, order], k[:, order], v[:, order])
    mesh = jax.make_mesh((2, n), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    ring_step = jax.jit(jax.value_and_grad(loss({"qs": "y", "s": "y"}), argnums=(0, 1, 2)))
    with jax.set_mesh(mesh), nx.kernels.use("attention=pallas"), \
            _reports.collect_reports() as reports:
        got, grads = ring_step(*stored)
    assert {r.choice.kernel.name for r in reports} == {"pallas:attention",
                                                       "pallas:attention_backward"}
    want, want_grads = jax.value_and_grad(by_hand, argnums=(0, 1, 2))(q, k, v)
    _tolerances.assert_close(got, want, dtype, scale=4.0 * np.sqrt(q.size))
    inverse = np.argsort(order)
    got_grads = (grads[0][:, :, inverse], grads[1][:, inverse], grads[2][:, inverse])
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == dtype
        _tolerances.assert_close(g.astype(jnp.float32), w, dtype,
                                 scale=float(jnp.max(jnp.abs(w))) * 4)
    # `auto` keeps XLA's reference in the ring's steps: nothing has measured a kernel there.
    with jax.set_mesh(mesh), _reports.collect_reports() as reports:
        jax.jit(jax.value_and_grad(loss({"qs": "y", "s": "y"}), argnums=(0, 1, 2)))(*stored)
    assert {r.choice.kernel.name for r in reports} == {"xla:attention", "xla:attention_backward"}
