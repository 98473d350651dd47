"""The differential oracle for ``nx.attention``, in a stream of its own (its
draws never move the other oracles'): a fixed count of cases drawn from a
fixed seed, each one named program (attention over a key sequence ``s``
with query positions ``qs``, grouped-query heads, batch) under one placement,
against the materialized positional program (float64 NumPy for values, JAX's
float32 gradient of the same formula for gradients).

A case draws the placement (unmapped, vmapped by ``jax.vmap``, the keys and
queries on one mesh axis (the ring), the keys on a mesh axis only, a
``SerialLoop`` over the queries, and mixtures with batch or heads on another
mesh axis), causal or not, a bias or not, grouped-query heads, the sequence
length (some not a multiple of the block or of the devices: where a
placement cannot divide it, a clear ``nx.NxopsError``), and gradients taken
outside the xmap or inside the body. Tiny shapes: the cost is compiling.

Causal cases over a sequence stored in a zig-zag or striped layout
(``sequence_layout``) are a draw of their own (another seed, so the cases
above stay as they were): the data are permuted into the layout, the result
and gradients permuted back, and compared with the same reference.
"""
from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import nxops as nx
from tests import _tolerances

SEED = 20261129
CASES = 12
COUNTS: collections.Counter = collections.Counter()   # cases checked, by placement

# (name, axis_resources, the mesh axes the sequence is split over)
PLACEMENTS = [
    ("unmapped", None, 1),
    ("vmapped", {}, 1),
    ("ring on y", {"qs": "y", "s": "y"}, 4),
    ("keys on y", {"s": "y"}, 4),
    ("keys on x,y", {"s": ("x", "y")}, 8),
    ("queries loop", {"qs": nx.SerialLoop(2)}, 2),
    ("queries loop, keys on y", {"qs": nx.SerialLoop(2), "s": "y"}, 4),
    ("batch x, ring on y", {"b": "x", "qs": "y", "s": "y"}, 4),
    ("heads x, keys on y", {"h": "x", "s": "y"}, 4),
    ("heads x, queries loop", {"h": "x", "qs": nx.SerialLoop(2)}, 2),
]
# One value cannot be split along one mesh axis twice: a [queries, keys] bias
# cannot go where both sequences are on the same axis.
RING = {"ring on y", "batch x, ring on y"}
OUTSIDE_ONLY = {"unmapped", "vmapped"}     # no xmap body to take a gradient in


@dataclasses.dataclass(frozen=True)
class Case:
    placement: str
    causal: bool
    bias: bool
    group: int
    tokens: int
    block: int
    grad: str        # "outside" (of the xmap) or "inside" (dq, in the body)
    seed: int


def draw_cases(seed: int = SEED, count: int = CASES) -> list[Case]:
    """``count`` cases; the placements cycle through a shuffled list, so that
    every placement appears (count >= len(PLACEMENTS))."""
    rng = np.random.default_rng(seed)
    order = list(rng.permutation(len(PLACEMENTS)))
    cases = []
    for i in range(count):
        name, _, _ = PLACEMENTS[order[i % len(order)]]
        cases.append(Case(
            placement=name, causal=bool(rng.integers(2)),
            bias=name not in RING and bool(rng.integers(2)),
            group=int(rng.choice([1, 2])), tokens=int(rng.choice([8, 12, 16])),
            block=int(rng.choice([3, 5, 16])),
            grad="outside" if name in OUTSIDE_ONLY else str(rng.choice(["outside", "inside"])),
            seed=int(rng.integers(2**16))))
    return cases


B, H, D, E = 2, 2, 4, 3


def operands(case: Case):
    rng = np.random.default_rng(case.seed)
    t, g = case.tokens, case.group
    q = rng.standard_normal((B, H, g, t, D))
    k = rng.standard_normal((B, H, t, D))
    v = rng.standard_normal((B, H, t, E))
    bias = rng.standard_normal((t, t)) if case.bias else None
    c = rng.standard_normal((B, H, g, t, E))      # the loss's weights of the output
    return q, k, v, bias, c


def materialized(q, k, v, bias, causal, xp=np):
    """q [B, H, G, Tq, D] against k, v [B, H, Tk, *] in ``xp`` (NumPy float64 or jnp)."""
    s = xp.einsum("bhgqd,bhkd->bhgqk", q, k) / np.sqrt(D)
    if bias is not None:
        s = s + bias
    if causal:
        t = s.shape[-1]
        s = xp.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = xp.exp(s - s.max(-1, keepdims=True))
    return xp.einsum("bhgqk,bhke->bhgqe", p / p.sum(-1, keepdims=True), v)


def body(causal, block):
    def attend(q, k, v, *bias):
        return nx.attention(q, k, v, seq="s", q_seq="qs", causal=causal, block=block,
                            bias=bias[0] if bias else None)
    return attend


Q_AXES, KV_AXES = ["b", "h", "g", "qs", None], ["b", "h", "s", None]


def program(case: Case, resources):
    """(q, k, v[, bias]) -> output, the attention of the case's placement."""
    if resources is None:           # positional: q [B, H, G, T, D], k [B, H, T, D]
        return lambda q, k, v, *bias: nx.attention(
            q, k, v, seq=2, q_seq=3, causal=case.causal, block=case.block,
            bias=bias[0] if bias else None)
    if case.placement == "vmapped":
        return _vmapped(case)
    in_axes = [Q_AXES, KV_AXES, KV_AXES] + ([["qs", "s"]] if case.bias else [])
    return nx.xmap(body(case.causal, case.block), in_axes, Q_AXES, axis_resources=resources)


def _vmapped(case: Case):
    """Batch, heads and groups as ``jax.vmap`` names; the sequences positional."""
    def per_head(q, k, v, *bias):      # q, k [T, D], bias [T, T]
        return nx.attention(q, k, v, seq=0, q_seq=0, causal=case.causal, block=case.block,
                            bias=bias[0] if bias else None)
    shared = (None,) if case.bias else ()
    f = jax.vmap(per_head, in_axes=(0, None, None) + shared, axis_name="g")
    f = jax.vmap(f, in_axes=(0, 0, 0) + shared, axis_name="h")
    return jax.vmap(f, in_axes=(0, 0, 0) + shared, axis_name="b")


def mesh():
    return jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)


def loss_of(fn, c):
    return lambda *args: jnp.sum(fn(*args).astype(jnp.float32) * c)


def inside_dq(case: Case, resources):
    """dq from jax.grad in the body (per query position: dq is replicated
    along the keys, so it is the whole gradient on every placement)."""
    attend = body(case.causal, case.block)

    def grads(q, k, v, *rest):
        *bias, c = rest
        return jax.grad(lambda q: jnp.sum(attend(q, k, v, *bias) * c))(q)
    in_axes = [Q_AXES, KV_AXES, KV_AXES] + ([["qs", "s"]] if case.bias else []) + [Q_AXES]
    return nx.xmap(grads, in_axes, Q_AXES, axis_resources=resources)


@pytest.mark.parametrize("case", draw_cases(), ids=lambda c: f"{c.placement}-{c.seed}")
def test_attention_oracle(case: Case):
    name, resources, split = next(p for p in PLACEMENTS if p[0] == case.placement)
    q, k, v, bias, c = operands(case)
    args = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v) + ((bias,) if case.bias else ()))
    c32 = jnp.asarray(c, jnp.float32)
    fn = program(case, resources)
    with jax.set_mesh(mesh()):
        if case.tokens % split:
            with pytest.raises(nx.NxopsError, match="not divisible"):
                jax.jit(fn)(*args)
            COUNTS["refused"] += 1
            return
        got = jax.jit(fn)(*args)
        if case.grad == "outside":
            got_grads = jax.jit(jax.grad(loss_of(fn, c32), argnums=tuple(range(len(args)))))(
                *args)
        else:
            got_grads = (jax.jit(inside_dq(case, resources))(*args, c32),)
    want = materialized(q, k, v, bias, case.causal)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    want_grads = jax.jit(jax.grad(  # jitted: eager, each op would compile on its own
        loss_of(lambda *a: materialized(*a[:3], a[3] if case.bias else None, case.causal, xp=jnp),
                c32),
        argnums=tuple(range(len(args)))))(*args)
    for g, w in zip(got_grads, want_grads):
        scale = max(1.0, _tolerances.max_abs(w))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5 * scale)
    COUNTS[f"{case.placement}, grad {case.grad}"] += 1


LAYOUT_SEED, LAYOUT_CASES, LAYOUT_SHARDS = 20261130, 5, 4
LAYOUT_PLACEMENTS = ("unmapped", "ring on y", "batch x, ring on y", "keys on y", "queries loop")


def draw_layout_cases(seed: int = LAYOUT_SEED, count: int = LAYOUT_CASES) -> list[Case]:
    """Causal cases without a bias; ``bias`` unused, the layout kind in
    ``placement`` after a slash ("ring on y/zigzag")."""
    rng = np.random.default_rng(seed)
    order = list(rng.permutation(len(LAYOUT_PLACEMENTS)))
    cases = []
    for i in range(count):
        name = LAYOUT_PLACEMENTS[order[i % len(order)]]
        kind = str(rng.choice(["zigzag", "striped"]))
        cases.append(Case(
            placement=f"{name}/{kind}", causal=True, bias=False, group=int(rng.choice([1, 2])),
            tokens=int(rng.choice([8, 12, 16])), block=int(rng.choice([2, 3, 16])),
            grad="outside" if name in OUTSIDE_ONLY else str(rng.choice(["outside", "inside"])),
            seed=int(rng.integers(2**16))))
    return cases


def layout_program(case: Case, resources, layout):
    if resources is None:
        return lambda q, k, v: nx.attention(q, k, v, seq=2, q_seq=3, causal=True,
                                            block=case.block, sequence_layout=layout)

    def attend(q, k, v):
        return nx.attention(q, k, v, seq="s", q_seq="qs", causal=True, block=case.block,
                            sequence_layout=layout)
    if case.grad == "inside":
        def grads(q, k, v, c):
            return jax.grad(lambda q: jnp.sum(attend(q, k, v) * c))(q)
        return nx.xmap(grads, [Q_AXES, KV_AXES, KV_AXES, Q_AXES], Q_AXES,
                       axis_resources=resources)
    return nx.xmap(attend, [Q_AXES, KV_AXES, KV_AXES], Q_AXES, axis_resources=resources)


@pytest.mark.parametrize("case", draw_layout_cases(), ids=lambda c: f"{c.placement}-{c.seed}")
def test_attention_oracle_sequence_layouts(case: Case):
    name, kind = case.placement.split("/")
    _, resources, _ = next(p for p in PLACEMENTS if p[0] == name)
    layout = nx.SequenceLayout(kind, shards=LAYOUT_SHARDS)
    q, k, v, _, c = operands(case)
    fn = layout_program(case, resources, layout)
    chunks = 2 * LAYOUT_SHARDS if kind == "zigzag" else LAYOUT_SHARDS
    with jax.set_mesh(mesh()):
        if case.tokens % chunks:
            with pytest.raises(nx.NxopsError, match="cannot split"):
                jax.jit(fn)(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
                            *((jnp.asarray(c, jnp.float32),) if case.grad == "inside" else ()))
            COUNTS["layout refused"] += 1
            return
        order = layout.order(case.tokens)
        stored = lambda x, axis: jnp.asarray(np.take(x, order, axis), jnp.float32)
        args = (stored(q, 3), stored(k, 2), stored(v, 2))
        c_stored = stored(c, 3)
        if case.grad == "inside":
            got_grads = (jax.jit(fn)(*args, c_stored),)
        else:
            got = jax.jit(fn)(*args)
            got_grads = jax.jit(jax.grad(loss_of(fn, c_stored), argnums=(0, 1, 2)))(*args)
    back = layout.inverse(case.tokens)
    args32 = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))
    want_grads = jax.jit(jax.grad(loss_of(lambda *a: materialized(*a, None, True, xp=jnp),
                                          jnp.asarray(c, jnp.float32)), argnums=(0, 1, 2)))(*args32)
    if case.grad == "outside":
        np.testing.assert_allclose(np.take(np.asarray(got), back, 3),
                                   materialized(q, k, v, None, True), rtol=2e-5, atol=2e-5)
    for g, w, axis in zip(got_grads, want_grads, (3, 2, 2)):
        scale = max(1.0, _tolerances.max_abs(w))
        np.testing.assert_allclose(np.take(np.asarray(g), back, axis), np.asarray(w), rtol=1e-4,
                                   atol=1e-5 * scale)
    COUNTS[f"{case.placement}, grad {case.grad}"] += 1


def test_every_placement_is_drawn():
    assert {c.placement for c in draw_cases()} == {p[0] for p in PLACEMENTS}
    assert any(c.tokens % split for c in draw_cases()
               for p, _, split in PLACEMENTS if p == c.placement), "no refused case drawn"
    layouts = draw_layout_cases()
    assert {c.placement.split("/")[0] for c in layouts} == set(LAYOUT_PLACEMENTS)
    assert {c.placement.split("/")[1] for c in layouts} == {"zigzag", "striped"}
