"""nx.attention against the materialized program: values, logsumexp and
gradients (dq, dk, dv, dbias), positional (hypothesis over odd lengths,
blocks, GQA, bias, mask, causal, dtypes) and named under every placement
(gradients outside and inside the body), the compiled memory, and its errors."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import AxisType

import nxops as nx
from nxops.kernels.xla import attention as xla_attention
from tests import _tolerances

from tests.ops._util import assert_close

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def materialized(q, k, v, bias=None, mask=None, causal=False, scale=None):
    """The materialized program in f32: q [..., G, Tq, D] against k, v
    [..., Tk, D] (G query heads per key/value head). A query that sees no key
    gives output 0 and logsumexp -inf."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("...gqd,...kd->...gqk", q, k) * scale
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    if causal:
        tq, tk = s.shape[-2:]
        s = jnp.where(jnp.arange(tk) <= jnp.arange(tq)[:, None], s, -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.exp(s - top)
    total = jnp.sum(e, -1)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    o = jnp.einsum("...gqk,...ke->...gqe", e, v) / safe[..., None]
    return o, jnp.where(seen, top[..., 0] + jnp.log(safe), -jnp.inf)


def value_and_grads(fn, args, c_o, c_lse):
    """(o, lse) and the gradient of sum(c_o * o) + sum(c_lse * lse) (finite lse only)."""
    def total(*args):
        o, lse = fn(*args)
        lse_term = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(c_o * o.astype(jnp.float32)) + jnp.sum(c_lse * lse_term), (o, lse)
    (_, values), grads = jax.value_and_grad(total, argnums=tuple(range(len(args))),
                                            has_aux=True)(*args)
    return values, grads


def assert_matches(got, want, dtype):
    (o, lse), grads = got
    (want_o, want_lse), want_grads = want
    assert o.dtype == dtype and lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    finite = np.isfinite(np.asarray(want_lse))
    # The logsumexp: f32 accumulation of the same products in any dtype.
    _tolerances.assert_close(np.asarray(lse)[finite], np.asarray(want_lse)[finite], np.float32,
                             scale=10 * max(1.0, float(np.abs(np.asarray(want_lse)[finite]).max(
                                 initial=0))))
    # The output and gradients: the probabilities meet v (and q, k) in the
    # inputs' dtype, as the materialized program's dots would take them.
    for g, r in ((o, want_o), *zip(grads, want_grads)):
        assert g.shape == r.shape
        scale = max(1.0, _tolerances.max_abs(r)) if r.size else 1.0
        _tolerances.assert_close(g, r, dtype, scale=4 * scale)


def operands(shape_q, shape_k, e, dtype, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q)
    k = rng.standard_normal(shape_k)
    v = rng.standard_normal((*shape_k[:-1], e))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v)), rng


@settings(max_examples=10, deadline=None)
@given(batch=st.sampled_from([1, 2]), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       tq=st.sampled_from([1, 5, 13]), tk=st.sampled_from([1, 7, 13]), d=st.sampled_from([1, 4]),
       e=st.sampled_from([2, 3]), block=st.sampled_from([None, 1, 3, 4, 16]),
       causal=st.booleans(), bias=st.sampled_from([None, "shared", "per head"]),
       masked=st.booleans(), dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**16))
def test_positional_matches_materialized(batch, kv_heads, group, tq, tk, d, e, block, causal,
                                         bias, masked, dtype, seed):
    """q [B, Hkv, G, Tq, D] against k, v [B, Hkv, Tk, D]: GQA by layout."""
    dtype = DTYPES[dtype]
    (q, k, v), rng = operands((batch, kv_heads, group, tq, d), (batch, kv_heads, tk, d), e,
                              dtype, seed)
    bias_shape = {"shared": (tq, tk), "per head": (batch, kv_heads, group, tq, tk)}.get(bias)
    b = None if bias is None else jnp.asarray(rng.standard_normal(bias_shape), jnp.float32)
    mask = jnp.asarray(rng.random((group, tq, tk)) < 0.8) if masked else None
    c_o = jnp.asarray(rng.standard_normal((batch, kv_heads, group, tq, e)), jnp.float32)
    c_lse = jnp.asarray(rng.standard_normal((batch, kv_heads, group, tq)), jnp.float32)

    def fused(q, k, v, *b):
        return nx.attention(q, k, v, seq=2, q_seq=3, causal=causal, bias=b[0] if b else None,
                            mask=mask, block=block, return_lse=True)

    def reference(q, k, v, *b):
        return materialized(q, k, v, b[0] if b else None, mask, causal)
    args = (q, k, v) + (() if b is None else (b,))
    got = jax.jit(value_and_grads, static_argnums=0)(fused, args, c_o, c_lse)
    want = jax.jit(value_and_grads, static_argnums=0)(reference, args, c_o, c_lse)
    assert_matches(got, want, dtype)


def test_float64_numpy_reference_causal_odd_lengths():
    """An independent NumPy float64 computation of the same values."""
    (q, k, v), _ = operands((2, 11, 5), (2, 11, 5), 3, jnp.float32, 0)
    o, lse = nx.attention(q, k, v, seq=1, q_seq=1, causal=True, block=4, return_lse=True)
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    s = qn @ kn.transpose(0, 2, 1) / np.sqrt(5)
    s = np.where(np.tril(np.ones((11, 11), bool)), s, -np.inf)
    want_lse = np.log(np.sum(np.exp(s - s.max(-1, keepdims=True)), -1)) + s.max(-1)
    want_o = np.exp(s - want_lse[..., None]) @ vn
    np.testing.assert_allclose(o, want_o, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-6, atol=2e-6)


def test_layouts_seq_by_position_and_default_scale():
    """k as [Tk, B, D] (seq=0) against q [B, Tq, D]; an explicit scale."""
    (q, k, v), _ = operands((3, 6, 4), (3, 9, 4), 2, jnp.float32, 1)
    want = materialized(q[:, None], k, v, scale=0.3)[0][:, 0]
    got = nx.attention(q, jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1), seq=0, scale=0.3)
    assert_close(got, want)


def test_a_query_that_sees_no_key_gives_zero_and_no_gradient():
    (q, k, v), _ = operands((4, 3), (5, 3), 2, jnp.float32, 2)
    mask = jnp.ones((4, 5), bool).at[2].set(False)
    o, lse = nx.attention(q, k, v, seq=0, mask=mask, return_lse=True)
    assert not np.asarray(o[2]).any() and lse[2] == -jnp.inf and np.isfinite(np.asarray(lse)[[0, 1, 3]]).all()
    dq = jax.grad(lambda q: jnp.sum(nx.attention(q, k, v, seq=0, mask=mask)))(q)
    assert not np.asarray(dq[2]).any() and np.isfinite(dq).all()


# --- named: every placement, gradients outside and inside ------------------------

B, KVH, G, T, D, E = 2, 2, 2, 16, 4, 3      # T: over 2, 4, 8 devices and 4 loop steps; block 5
Q_AXES = ["b", "kvh", "g", "qs", None]
KV_AXES = ["b", "kvh", "s", None]
IN_AXES = [Q_AXES, KV_AXES, KV_AXES, ["qs", "s"]]
# The oracle (tests/oracle/test_oracle_attention.py) draws the keys on one
# mesh axis, a loop over queries with keys on a mesh axis, and batch or heads
# beside them; these are the placements it does not draw.
PLACEMENTS = {
    "none": {},
    "keys on x,y": {"s": ("x", "y")},
    "queries and keys on y": {"qs": "y", "s": "y"},
    "queries on x, keys on y": {"qs": "x", "s": "y"},
    "queries loop and x": {"qs": ("x", nx.SerialLoop(2))},
    "heads x, queries y": {"kvh": "x", "qs": "y"},
    "groups x, keys y": {"g": "x", "s": "y"},
}


# One value cannot be split along one mesh axis twice: the [queries, keys]
# bias cannot go where both sequences share a mesh axis (the ring's placement;
# with a bias the keys are gathered instead, see the one-name layer test).
WITHOUT_BIAS = {"queries and keys on y"}


def fused_body(q, k, v, bias=None):
    return nx.attention(q, k, v, seq="s", q_seq="qs", causal=True, bias=bias, block=5,
                        return_lse=True)


@functools.lru_cache(maxsize=None)
def named_operands():
    (q, k, v), rng = operands((B, KVH, G, T, D), (B, KVH, T, D), E, jnp.float32, 7)
    bias = jnp.asarray(rng.standard_normal((T, T)), jnp.float32)
    c_o = jnp.asarray(rng.standard_normal((B, KVH, G, T, E)), jnp.float32)
    c_lse = jnp.asarray(rng.standard_normal((B, KVH, G, T)), jnp.float32)
    return (q, k, v, bias), c_o, c_lse


def xmapped(resources, bias=True):
    return nx.xmap(fused_body, IN_AXES[:4 if bias else 3], [Q_AXES, Q_AXES[:-1]],
                   axis_resources=resources)


def inside_grads(resources, bias=True):
    """jax.grad in the body: dq per query; dk, dv per (query, key) position
    (replicated along the queries, they stay per position: docs/xmap.md's rule)."""
    def grads(q, k, v, *rest):
        *bias, c_o, c_lse = rest

        def loss(q, k, v):
            o, lse = fused_body(q, k, v, *bias)
            return jnp.sum(c_o * o) + c_lse * lse
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    in_axes = IN_AXES[:4 if bias else 3] + [Q_AXES, Q_AXES[:-1]]
    out_axes = [Q_AXES, ["b", "kvh", "g", "qs", "s", None], ["b", "kvh", "g", "qs", "s", None]]
    return jax.jit(nx.xmap(grads, in_axes, out_axes, axis_resources=resources))


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_named_placements_match_materialized(placement):
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    args, c_o, c_lse = named_operands()
    bias = placement not in WITHOUT_BIAS
    args = args if bias else args[:3]
    with jax.set_mesh(mesh):
        got = jax.jit(value_and_grads, static_argnums=0)(
            xmapped(PLACEMENTS[placement], bias), args, c_o, c_lse)
        if placement in WITHOUT_BIAS:
            # dk per (query, key) pair cannot sit where both share a mesh axis.
            with pytest.raises(nx.NxopsError, match="both mapped to the resource 'y'"):
                inside_grads(PLACEMENTS[placement], bias)(*args, c_o, c_lse)
        else:
            inside = inside_grads(PLACEMENTS[placement], bias)(*args, c_o, c_lse)
    want = jax.jit(value_and_grads, static_argnums=0)(causal_materialized, args, c_o, c_lse)
    assert_matches(got, want, jnp.float32)
    if placement in WITHOUT_BIAS:
        return
    # In the body: dq (replicated along the keys) is its whole gradient; dk,
    # dv per query position are the materialized named program's.
    assert_close(inside[0], want[1][0])
    for got_inside, want_inside in zip(inside[1:], inside_reference(bias)):
        assert_close(got_inside, want_inside, scale=4)


def causal_materialized(q, k, v, *bias):
    return materialized(q, k, v, *bias, causal=True)


@functools.lru_cache(maxsize=None)
def inside_reference(bias=True):
    """dk, dv per (query, key) pair from the materialized named program
    (nx.einsum, a named softmax), no resources."""
    def materialized_body(q, k, v, *bias):
        s = nx.einsum("d,d->", q, k) / np.sqrt(D) + sum(bias)
        s = jnp.where(nx.axis_index("s") <= nx.axis_index("qs"), s, -jnp.inf)
        lse = nx.logsumexp(s, "s")
        return nx.sum(jnp.exp(s - lse)[None] * v, "s"), lse

    def grads(q, k, v, *rest):
        *bias, c_o, c_lse = rest

        def loss(q, k, v):
            o, lse = materialized_body(q, k, v, *bias)
            return jnp.sum(c_o * o) + c_lse * lse
        return jax.grad(loss, argnums=(1, 2))(q, k, v)
    in_axes = IN_AXES[:4 if bias else 3] + [Q_AXES, Q_AXES[:-1]]
    out_axes = [["b", "kvh", "g", "qs", "s", None]] * 2
    args, c_o, c_lse = named_operands()
    return nx.xmap(grads, in_axes, out_axes)(*args[:4 if bias else 3], c_o, c_lse)


def test_keys_on_mesh_hlo_combines_with_one_pmax_one_psum():
    """Keys over 4 devices, queries unmapped: the forward's collectives are
    two all-reduces of per-query rows (no gather of keys)."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    args, _, _ = named_operands()
    with jax.set_mesh(mesh):
        text = jax.jit(xmapped({"s": "y"})).lower(*args).compile().as_text()
    found = nx.hlo.collectives(text)
    assert sorted(c.kind for c in found) == ["all-reduce", "all-reduce"], found
    per_query = B * KVH * G * T
    assert all(np.prod(s) <= per_query * (E + 1) for c in found for s in c.result_shapes), found


@pytest.mark.parametrize("layout", [None, nx.SequenceLayout("zigzag", shards=4)], ids=str)
def test_ring_collective_bytes_are_the_ring_bound(layout):
    """Queries and keys on the 4 devices of mesh axis y, bf16 (stored in
    order, or zig-zag: the layout changes which blocks are computed, never
    what travels): read back from
    the compiled program (each collective times its loop's trip count), each
    device sends exactly the ring bound and nothing else. Forward: its key,
    value (as their 16-bit bits) and int32 key-position shards, n - 1 times.
    Backward, which keeps no shard but the local one and the last one the
    forward saw: the shards between those two again (n - 2 times), and each
    shard's float32 dk, dv accumulators from the device that saw it last
    back home (n - 1 times)."""
    n = 4
    ring = nx.xmap(lambda q, k, v: nx.attention(q, k, v, seq="s", q_seq="qs", causal=True,
                                                block=5, return_lse=True, sequence_layout=layout),
                   IN_AXES[:3], [Q_AXES, Q_AXES[:-1]], axis_resources={"qs": "y", "s": "y"})
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    # Placed as the xmap places them (the sequences over y): no resharding.
    args = tuple(jax.device_put(x.astype(jnp.bfloat16), jax.NamedSharding(
        mesh, jax.sharding.PartitionSpec(*[None] * (x.ndim - 2), "y")))
        for x in named_operands()[0][:3])
    keys = T // n                                   # key positions per device
    shard = keys * (B * KVH * (D + E) * 2 + 4)      # k, v (bf16) and positions (int32)
    accumulators = keys * B * KVH * (D + E) * 4     # dk, dv (float32)

    def values_and_grads(q, k, v):   # no loss to all-reduce: the cotangents are ones
        out, pullback = jax.vjp(ring, q, k, v)
        return out, pullback(jax.tree.map(jnp.ones_like, out))
    with jax.set_mesh(mesh):
        forward = jax.jit(ring).lower(*args).compile()
        both = jax.jit(values_and_grads).lower(*args).compile()
    for program in (forward, both):
        kinds = {c.kind for c in nx.hlo.collectives(program)}
        assert kinds == {"collective-permute"}, kinds
    assert nx.hlo.bytes_per_device(forward) == (n - 1) * shard
    assert nx.hlo.bytes_per_device(both) == (2 * n - 3) * shard + (n - 1) * accumulators


def test_ring_bf16_matches_one_device():
    """bf16 over a ring of 4 devices: the loss and dq, dk, dv as the same xmap's
    on one device (the ring accumulates dk, dv in f32 across its shards)."""
    (q, k, v), _ = operands((2, 3, 24, 8), (2, 3, 24, 8), 8, jnp.bfloat16, 9)
    body = lambda q, k, v: nx.attention(q, k, v, seq="s", q_seq="qs", causal=True, block=5)

    def loss(resources):
        spec = lambda name: ["b", "h", name, None]
        attend = nx.xmap(body, [spec("qs"), spec("s"), spec("s")], spec("qs"),
                         axis_resources=resources)
        return lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss({"qs": "y", "s": "y"}), argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(loss({}), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == r.dtype
        r = r.astype(jnp.float32)
        _tolerances.assert_close(g, r, jnp.bfloat16,
                                 scale=4 * max(1.0, _tolerances.max_abs(r)))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_holds_a_sixth_of_one_device_program(causal):
    """Batch 1, 16 heads, 8192 tokens, head dim 128, bf16, queries and keys
    over 8 CPU devices: each device's temp of jit(value_and_grad) is at most
    1/6 of the same xmap's on one device, and, causal, at most 10.5 times one
    shard of q (bf16). Measured, causal: 10.18 shards on JAX 0.10.2 and 0.12
    (the f32 dq, dk, dv and one arriving accumulator, the output's cotangent,
    one arriving shard), which is 0.105 of one device on 0.10.2 (whose
    one-device program holds float32 copies of q, k, v) and 0.158 on 0.12;
    not causal: 0.125 and 0.158. The scan that JAX differentiated itself kept
    every shard and held 1.2x."""
    shape = (1, 16, 8192, 128)

    def temp(devices, resources):
        body = lambda q, k, v: nx.attention(q, k, v, seq="s", q_seq="qs", causal=causal)
        attend = nx.xmap(body, [["b", "h", "qs", None], ["b", "h", "s", None],
                                ["b", "h", "s", None]], ["b", "h", "qs", None],
                         axis_resources=resources)
        mesh = jax.make_mesh((len(devices),), ("d",), devices=devices,
                             axis_types=(AxisType.Explicit,))
        spec = jax.sharding.PartitionSpec(None, None, "d" if resources else None)
        struct = jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                      sharding=jax.sharding.NamedSharding(mesh, spec))
        loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)
        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(
                struct, struct, struct).lower().compile()
        return compiled.memory_analysis().temp_size_in_bytes
    one_device = temp(jax.devices()[:1], {})
    ring = temp(jax.devices()[:8], {"qs": "d", "s": "d"})
    assert 6 * ring <= one_device, (ring, one_device)
    if causal:
        shard = math.prod(shape) // 8 * 2
        assert ring <= 10.5 * shard, (ring, shard)


def computed_block_pairs(monkeypatch, layout, program, n, tokens):
    """Runs ``program()`` and counts the block pairs each device computes
    against each device's key shard: every computed pair (forward and
    backward, never a pair the causal mask hides, which is skipped) reports
    its first query and key positions (global), which say whose queries and
    whose keys they are. [n, n]: row the queries' device, column the keys'."""
    computed = []
    scores = xla_attention._scores

    def reporting(q_blk, k_blk, q_pos, k_pos, bias_blk, **params):
        jax.debug.callback(lambda q, k: computed.append((int(q), int(k))), q_pos.min(),
                           k_pos.min())
        return scores(q_blk, k_blk, q_pos, k_pos, bias_blk, **params)
    monkeypatch.setattr(xla_attention, "_scores", reporting)
    jax.block_until_ready(program())
    stored = np.argsort(np.arange(tokens) if layout is None else layout.order(tokens))
    device = stored // (tokens // n)          # the device storing each global position
    counts = np.zeros((n, n), int)
    for q, k in computed:
        counts[device[q], device[k]] += 1
    return counts


@pytest.mark.parametrize("layout", [None, nx.SequenceLayout("zigzag", shards=4),
                                    nx.SequenceLayout("striped", shards=4)], ids=str)
def test_causal_ring_work_is_balanced_in_a_zigzag_or_striped_layout(monkeypatch, layout):
    """A causal ring of 4 devices over 32 tokens, block 2. Stored in order,
    device i computes block pairs against i + 1 key shards (device 0: one);
    stored zig-zag, exactly half of every other device's shard's block pairs
    (8 of 16) and the same diagonal on every device; striped, the same on
    every device and every ring step. The values and gradients (permuted
    back) are the unmapped program's on the sequence in order."""
    n, tokens = 4, 32
    (q, k, v), rng = operands((2, tokens, 4), (2, tokens, 4), 3, jnp.float32, 12)
    c = jnp.asarray(rng.standard_normal((2, tokens, 3)), jnp.float32)
    order = np.arange(tokens) if layout is None else layout.order(tokens)
    body = lambda q, k, v: nx.attention(q, k, v, seq="s", q_seq="s", causal=True, block=2,
                                        sequence_layout=layout)
    ring = nx.xmap(body, [["h", "s", None]] * 3, ["h", "s", None], axis_resources={"s": "d"})
    mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n], axis_types=(AxisType.Explicit,))
    stored = tuple(jnp.asarray(np.asarray(x)[:, order]) for x in (q, k, v, c))
    loss = lambda q, k, v, c: jnp.sum(ring(q, k, v) * c)
    with jax.set_mesh(mesh):
        forward = computed_block_pairs(monkeypatch, layout, lambda: jax.jit(ring)(*stored[:3]),
                                       n, tokens)
        out = jax.jit(ring)(*stored[:3])
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*stored)
    back = np.argsort(order)
    want = materialized(q[:, None], k, v, causal=True)[0][:, 0]
    assert_close(np.asarray(out)[:, back], want)
    want_grads = jax.grad(lambda q, k, v: jnp.sum(materialized(q[:, None], k, v, causal=True)[0][
        :, 0] * c), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want_grads):
        assert_close(np.asarray(g)[:, back], w, scale=4)
    blocks = tokens // n // 2                   # block pairs per shard pair: blocks²
    off_diagonal = forward[~np.eye(n, dtype=bool)].reshape(n, n - 1)
    if layout is None:
        # Device i: i + 1 shards (all of an earlier one, a triangle of its own).
        assert forward.sum(1).tolist() == [blocks * (blocks + 1) // 2 + i * blocks**2
                                           for i in range(n)]
        return
    assert len(set(np.diag(forward))) == 1, forward
    assert len(set(off_diagonal.flat)) == 1, forward
    if layout.kind == "zigzag":
        assert off_diagonal[0, 0] == blocks**2 // 2, forward


LAYER_PLACEMENTS = {"none": {}, "batch x": {"b": "x"}, "sequence y": {"seq": "y"},
                    "batch x, sequence y": {"b": "x", "seq": "y"}}


@pytest.mark.parametrize("placement", sorted(LAYER_PLACEMENTS))
def test_causal_layer_one_sequence_name_every_placement(placement):
    """A residual attention layer whose queries and keys share one named
    sequence: loss and weight gradients as the positional layer's."""
    batch, tokens, model, heads = 2, 12, 8, 2
    hd = model // heads
    keys = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(keys[0], (batch, tokens, model))
    w_qkv = jax.random.normal(keys[1], (3, model, heads, hd)) / model**0.5
    w_out = jax.random.normal(keys[2], (heads, hd, model)) / model**0.5

    def token(x, w_qkv, w_out):     # x [model]: one (batch, sequence) position
        q, k, v = (jnp.einsum("m,mhd->hd", x, w) for w in w_qkv)
        o = nx.attention(q, k, v, seq="seq", q_seq="seq", causal=True, block=5)
        return x + jnp.einsum("hd,hdm->m", o, w_out)
    layer = nx.xmap(token, [["b", "seq", None], [...], [...]], ["b", "seq", None],
                    axis_resources=LAYER_PLACEMENTS[placement])

    def positional(x, w_qkv, w_out):
        q, k, v = (jnp.einsum("btm,mhd->bhtd", x, w) for w in w_qkv)
        o = materialized(q[:, :, None], k, v, causal=True)[0][:, :, 0]
        return x + jnp.einsum("bhtd,hdm->btm", o, w_out)

    def loss(layer_fn):
        return lambda w_qkv, w_out: jnp.mean(layer_fn(x, w_qkv, w_out) ** 2)
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss(layer), argnums=(0, 1)))(w_qkv, w_out)
    want = jax.jit(jax.value_and_grad(loss(positional), argnums=(0, 1)))(w_qkv, w_out)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, r, scale=4)


@pytest.mark.parametrize("resources", [{}, {"seq": "y"}, {"b": "x", "seq": "y"}])
def test_key_bias_with_one_sequence_name_gathers_the_keys(resources):
    """One name for both sequences and a bias along it (a bias per key,
    the same for every query): on mesh axes the keys are all-gathered, and
    values and gradients (the bias's too) are the positional program's."""
    (q, k, v), rng = operands((2, 12, 4), (2, 12, 4), 3, jnp.float32, 6)
    bias = jnp.asarray(rng.standard_normal((2, 12)), jnp.float32)
    body = lambda q, k, v, b: nx.attention(q, k, v, seq="seq", q_seq="seq", causal=True,
                                           bias=b, block=5, return_lse=True)
    spec = ["b", "seq", None]
    xmapped = nx.xmap(body, [spec, spec, spec, ["b", "seq"]], [spec, spec[:-1]],
                      axis_resources=resources)
    c_o = jnp.asarray(rng.standard_normal((2, 12, 3)), jnp.float32)
    c_lse = jnp.asarray(rng.standard_normal((2, 12)), jnp.float32)
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        got = jax.jit(value_and_grads, static_argnums=0)(xmapped, (q, k, v, bias), c_o, c_lse)
        if resources:
            text = jax.jit(xmapped).lower(q, k, v, bias).compile().as_text()
            # gathered (an all-to-all where an Explicit mesh axis stays automatic:
            # the reference all-gather's form there), never a ring's permutes
            assert ("all-gather" in text or "all-to-all" in text), text
            assert "collective-permute" not in text

    def reference(q, k, v, bias):
        o, lse = materialized(q[:, None], k, v, bias[:, None, None, :], causal=True)
        return o[:, 0], lse[:, 0]
    assert_matches(got, value_and_grads(reference, (q, k, v, bias), c_o, c_lse), jnp.float32)


def test_plain_vmap_names_and_bf16_gqa():
    """Outside xmap: heads and groups as jax.vmap names, bf16."""
    (q, k, v), _ = operands((T, KVH, G, D), (T, KVH, D), E, jnp.bfloat16, 3)

    def per_head(q, k, v):   # q [T, D], k [T, D]
        return nx.attention(q, k, v, seq=0, q_seq=0, causal=True, block=5)
    per_group = jax.vmap(per_head, in_axes=(1, None, None), out_axes=1, axis_name="g")
    got = jax.jit(jax.vmap(per_group, in_axes=(1, 1, 1), out_axes=1, axis_name="kvh"))(q, k, v)
    want = materialized(jnp.transpose(q, (1, 2, 0, 3)), jnp.swapaxes(k, 0, 1),
                        jnp.swapaxes(v, 0, 1), causal=True)[0]
    assert got.dtype == jnp.bfloat16
    _tolerances.assert_close(got.astype(jnp.float32), jnp.transpose(want, (2, 0, 1, 3)),
                             jnp.bfloat16, scale=4)


def test_compiled_value_and_grad_holds_no_scores():
    """CPU, 2048 tokens: the temp of jit(value_and_grad) is a small fraction
    of the materialized program's, which holds [heads, T, T] score matrices."""
    heads, tokens, d = 4, 2048, 64
    struct = jax.ShapeDtypeStruct((heads, tokens, d), jnp.float32)

    def temp(attend):
        loss = lambda q, k, v: jnp.sum(attend(q, k, v) ** 2)
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
            struct, struct, struct).compile()
        return compiled.memory_analysis().temp_size_in_bytes
    fused = temp(lambda q, k, v: nx.attention(q, k, v, seq=1, q_seq=1, causal=True, block=256))
    unfused = temp(lambda q, k, v: materialized(q[:, None], k, v, causal=True)[0])
    assert unfused > 2 * heads * tokens * tokens * 4 and fused < unfused / 15, (fused, unfused)


def test_forward_mode_matches_materialized():
    """jax.jvp and jax.jacfwd: the tangent is a blockwise pass of its own (its
    transpose is the backward), positional with a bias, and under nx.xmap
    with the keys on a mesh axis (causal, GQA, the pmax/psum combine)."""
    (q, k, v), rng = operands((2, 3, 7, 4), (2, 9, 4), 3, jnp.float32, 11)
    bias = jnp.asarray(rng.standard_normal((3, 7, 9)), jnp.float32)
    primals = (q, k, v, bias)
    tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in primals)

    def fused(q, k, v, b):
        return nx.attention(q, k, v, seq=1, bias=b, block=4, return_lse=True)
    got = jax.jit(lambda p, t: jax.jvp(fused, p, t))(primals, tangents)
    want = jax.jit(lambda p, t: jax.jvp(materialized, p, t))(primals, tangents)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, r, scale=4)
    # jacfwd in k: the keys' tangents vary along the basis (batch members, not rows).
    def jacfwd_in_k(attention):
        return jax.jit(jax.jacfwd(lambda k: attention(q, k, v, bias)[0]))(k)
    assert_close(jacfwd_in_k(fused), jacfwd_in_k(materialized), scale=4)

    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    args, _, _ = named_operands()
    named_tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in args)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda p, t: jax.jvp(xmapped({"s": "y"}), p, t))(args, named_tangents)
    want = jax.jit(lambda p, t: jax.jvp(causal_materialized, p, t))(args, named_tangents)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, r, scale=4)


@pytest.mark.parametrize("layout", [None, nx.SequenceLayout("zigzag", shards=2)], ids=str)
def test_forward_mode_on_the_ring_matches_materialized(layout):
    """Queries and keys on the 4 devices of y (the ring), causal, GQA, in
    order or zig-zag: jax.jvp (the tangent passes around the ring with the
    shards) and jax.jacfwd in v, against the materialized program's."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    args = named_operands()[0][:3]
    rng = np.random.default_rng(13)
    tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in args)
    order = np.arange(T) if layout is None else layout.order(T)
    stored = lambda xs: tuple(jnp.asarray(np.take(np.asarray(x), order, x.ndim - 2)) for x in xs)
    ring = nx.xmap(lambda q, k, v: nx.attention(q, k, v, seq="s", q_seq="qs", causal=True,
                                                block=5, return_lse=True, sequence_layout=layout),
                   IN_AXES[:3], [Q_AXES, Q_AXES[:-1]], axis_resources={"qs": "y", "s": "y"})
    with jax.set_mesh(mesh):
        got = jax.jit(lambda p, t: jax.jvp(ring, p, t))(stored(args), stored(tangents))
        q, k, v = stored(args)
        jacobian = jax.jit(jax.jacfwd(lambda v: ring(q, k, v)[0]))(v)
    back = np.argsort(order)
    want = jax.jvp(lambda q, k, v: materialized(q, k, v, causal=True), args, tangents)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(np.take(np.asarray(g), back, 3), r, scale=4)
    # [B, KVH, G, Tq, E] x [B, KVH, Tk, E]: both sequences stored in the layout.
    want_jacobian = jax.jacfwd(lambda v: materialized(*args[:2], v, causal=True)[0])(args[2])
    assert_close(np.take(np.take(np.asarray(jacobian), back, 3), back, 7), want_jacobian,
                 scale=4)
    with jax.set_mesh(mesh):
        for second in (lambda v: jax.jvp(lambda v: ring(q, k, v)[0], (v,), (v,))[1],
                       jax.grad(lambda v: jnp.sum(ring(q, k, v)[0]))):
            with pytest.raises(nx.NxopsError, match="a second derivative"):
                jax.jit(lambda v, t: jax.jvp(second, (v,), (t,))).lower(v, tangents[2])


# --- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, shapes, match", [
    (dict(seq=1), ((2, 3), (2, 5, 4), (2, 5, 4)), r"q has shape \(2, 3\) and k \(2, 5, 4\)"),
    (dict(seq=1), ((2, 4), (2, 5, 4), (2, 6, 4)), r"k has shape \(2, 5, 4\) and v \(2, 6, 4\)"),
    (dict(seq=2), ((2, 4), (2, 5, 4), (2, 5, 4)), r"seq=2 is k's last dim"),
    (dict(seq=3), ((2, 4), (2, 5, 4), (2, 5, 4)), r"seq=3 is out of range for k of shape"),
    (dict(seq=0), ((3, 4), (0, 4), (0, 4)), r"length 0"),
    (dict(seq=0, causal=True), ((3, 4), (5, 4), (5, 4)), r"causal=True needs .* q_seq"),
    (dict(seq=0, q_seq=1), ((3, 4), (5, 4), (5, 4)), r"q_seq=1 is q's last dim"),
    (dict(seq=1.5), ((3, 4), (5, 4), (5, 4)), r"seq=1.5; give"),
    (dict(seq=0, block=0), ((3, 4), (5, 4), (5, 4)), r"block=0"),
    (dict(seq=0, bias=jnp.zeros((3, 4))), ((3, 4), (5, 4), (5, 4)),
     r"bias has shape \(3, 4\).*\(3, 5\)"),
    (dict(seq=0, mask=jnp.zeros((3, 5))), ((3, 4), (5, 4), (5, 4)), r"mask has dtype float32"),
])
def test_errors_quote_shapes(kwargs, shapes, match):
    q, k, v = (jnp.zeros(s) for s in shapes)
    with pytest.raises(nx.NxopsError, match=match):
        nx.attention(q, k, v, **kwargs)


def test_symbolic_lengths_are_refused_symbolic_batch_exports():
    t, b = jax.export.symbolic_shape("t, b")
    fn = jax.jit(lambda q: nx.attention(q, q, q, seq=1, q_seq=1, causal=True))
    with pytest.raises(nx.NxopsError, match="lengths must be static"):
        jax.export.export(fn)(jax.ShapeDtypeStruct((2, t, 4), jnp.float32))
    exported = jax.export.export(fn)(jax.ShapeDtypeStruct((b, 5, 4), jnp.float32))
    (q, _, _), _ = operands((3, 5, 4), (3, 5, 4), 4, jnp.float32, 5)
    assert_close(exported.call(q), materialized(q[:, None], q, q, causal=True)[0][:, 0])


def test_errors_sequence_layout():
    q = jnp.zeros((12, 4))
    zigzag = nx.SequenceLayout("zigzag", shards=4)
    with pytest.raises(nx.NxopsError, match="without causal=True"):
        nx.attention(q, q, q, seq=0, q_seq=0, sequence_layout=zigzag)
    with pytest.raises(nx.NxopsError, match="sequence_layout='zigzag'; give an nx.SequenceLayout"):
        nx.attention(q, q, q, seq=0, q_seq=0, causal=True, sequence_layout="zigzag")
    with pytest.raises(nx.NxopsError, match=r"seq=0 has length 12, which SequenceLayout\('zigzag', "
                       r"shards=4\) cannot split: it needs a multiple of 8"):
        nx.attention(q, q, q, seq=0, q_seq=0, causal=True, sequence_layout=zigzag)
    with pytest.raises(nx.NxopsError, match="kind='ring'"):
        nx.SequenceLayout("ring", shards=4)
    with pytest.raises(nx.NxopsError, match="shards=0"):
        nx.SequenceLayout("striped", shards=0)


def test_sequence_layout_orders():
    """The layouts' orders, written out, and their inverses."""
    assert nx.SequenceLayout("zigzag", 3).order(12).tolist() == [0, 1, 10, 11, 2, 3, 8, 9,
                                                                 4, 5, 6, 7]
    assert nx.SequenceLayout("striped", 3).order(6).tolist() == [0, 3, 1, 4, 2, 5]
    for layout in (nx.SequenceLayout("zigzag", 4), nx.SequenceLayout("striped", 4)):
        assert (layout.order(24)[layout.inverse(24)] == np.arange(24)).all()


def test_errors_dtypes_and_named_axes():
    q = jnp.zeros((3, 4))
    with pytest.raises(nx.NxopsError, match="q, k, v have dtypes float32, bfloat16, float32"):
        nx.attention(q, q.astype(jnp.bfloat16), q, seq=0)
    with pytest.raises(nx.NxopsError, match="k has dtype int32"):
        nx.attention(q, q.astype(jnp.int32), q, seq=0)
    with pytest.raises(nx.NxopsError, match="'s' is not bound here"):
        nx.attention(q, q[0], q[0], seq="s")
    looped = nx.xmap(fused_body, IN_AXES, [Q_AXES, Q_AXES[:-1]],
                     axis_resources={"s": nx.SerialLoop(2)})
    with pytest.raises(nx.NxopsError, match="keys' sequence 's' runs on the serial loop.*"
                       "Loop over the queries instead"):
        looped(*named_operands()[0])
    odd = nx.xmap(fused_body, IN_AXES, [Q_AXES, Q_AXES[:-1]], axis_resources={"s": "y"})
    (q, k, v, bias), _, _ = named_operands()
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh), pytest.raises(nx.NxopsError, match="not divisible"):
        odd(q[:, :, :, :10], k[:, :, :10], v[:, :, :10], bias[:10, :10])


@pytest.mark.parametrize("resources", [{"t": "y"}, {"t": "x"}, {"t": ("x", "y")}])
def test_ring_gradients_inside_the_body_with_one_sequence_name(resources):
    """jax.grad in the body, queries and keys on one name over a ring (with
    2 or 4 positions per device, or 1): dq, dk, dv as with no resources. The
    ring's backward sums the dk, dv of a device's positions in one pass; each
    position takes its own keys' share of that, not the sum once per position."""
    (q, k, v), rng = operands((8, 2, 4), (8, 2, 4), 3, jnp.float32, 12)
    c = jnp.asarray(rng.standard_normal((8, 2, 3)), jnp.float32)

    def grads(q, k, v, c):
        loss = lambda q, k, v: jnp.sum(c * nx.attention(q, k, v, seq="t", q_seq="t",
                                                         causal=True, block=3))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    spec = ["t", None, None]
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        got = nx.xmap(grads, [spec] * 4, [spec] * 3, axis_resources=resources)(q, k, v, c)
    want = nx.xmap(grads, [spec] * 4, [spec] * 3)(q, k, v, c)
    for g, w in zip(got, want):
        assert_close(g, w)
