"""Every public named op inside a user's ``jax.shard_map`` with ``check_vma=True``
(JAX's default), over a mesh axis that carries a batch dim: values and
gradients (``jax.grad`` outside the shard_map, and inside its body) equal the
same body's over the whole batch on one device.

The operands vary along the mesh axis (weights are replicated over it), while
each op works along other axes: its own loops, conds and collectives must
give their carries the operands' varying type. Named ops take a vmap name
(``'i'``) inside the body. Both kernel selections of test_kernel_contexts.py
(``pallas`` in interpret mode) where the op has a Pallas kernel. The cases
come from ``nxops.ops.__all__``: a new public op fails here until it has one.
Then the ops over the mesh axis itself: attention with its sequence there (a
ring), and an all-to-all over the mesh axis and a vmap name together.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import nxops as nx
import nxops.ops
from tests.ops._util import assert_close

BATCH = 8       # one batch row per device of the 8-device mesh
NAMED = 5       # the size of the vmap name 'i' inside the body


def along_i(fn, in_axes):
    """``fn`` under a vmap that names dim 1 of its batched operands ``'i'``;
    the result's dim 1 is ``'i'`` (the batch stays first)."""
    return jax.vmap(fn, in_axes=in_axes, out_axes=1, axis_name="i")


def normal(*shape):
    def make(rng):
        return rng.standard_normal(shape).astype(np.float32)
    return make


def ints(high, *shape):
    def make(rng):
        return rng.integers(0, high, shape).astype(np.int32)
    return make


@dataclasses.dataclass(frozen=True)
class Case:
    """How to call one op: ``body`` maps the operands (batch first, except the
    ``replicated`` ones) to one array with the batch first; ``diff``: the
    operands differentiated; ``pallas``: whether the pallas selection runs a
    Pallas kernel for it (checked by ``test_pallas_flags_say_which_ops_run_pallas``)."""
    op: str
    body: Callable
    operands: tuple
    replicated: tuple = ()
    diff: tuple = (0,)
    pallas: bool = False
    variant: str = ""

    @property
    def id(self) -> str:
        return f"{self.op}-{self.variant}" if self.variant else self.op

    def arrays(self):
        rng = np.random.default_rng(sum(map(ord, self.id)))
        return tuple(make(rng) for make in self.operands)


def _reduction(op):
    return Case(op, along_i(lambda r: getattr(nx, op)(r, ("i", 1)), 1),
                (normal(BATCH, NAMED, 3, 4),), pallas=True)


def _collective(op, fn, *shape, pallas=False, variant=""):
    return Case(op, along_i(fn, 1), (normal(BATCH, NAMED, *shape),), pallas=pallas,
                variant=variant)


def _cross_entropy(backward):
    def body(h, w, labels):
        return nx.cross_entropy(h, w, labels, hidden=2, vocab=1, vocab_chunk=3, backward=backward)
    return Case("cross_entropy", body, (normal(BATCH, 6, 4), normal(4, 7), ints(7, BATCH, 6)),
                replicated=(1,), diff=(0, 1), pallas=True, variant=backward)


def _attention_named(q, k, v):
    return nx.attention(q, k, v, seq="i", q_seq="i", causal=True)


_QKV = (normal(BATCH, 2, 12, 4),) * 3
_QKV_NAMED = (normal(BATCH, NAMED, 2, 4),) * 3

CASES = [
    *(_reduction(op) for op in ("sum", "max", "min", "mean", "prod", "logsumexp", "var", "std")),
    *(_collective(op, lambda r, op=op: getattr(nx, op)(r, "i"), 3, pallas=True)
      for op in ("psum", "pmax", "pmin", "pmean")),
    _collective("all_gather", lambda r: nx.all_gather(r, "i", axis=1), 3),
    _collective("psum_scatter", lambda r: nx.psum_scatter(r, "i", scatter_dimension=1), NAMED),
    _collective("all_to_all", lambda r: nx.all_to_all(r, "i", 1, 1), NAMED),
    *(_collective("ppermute", lambda r, n=n: nx.ppermute(r, "i", [(j, (j + 2) % NAMED)
                                                                  for j in range(n)]), 3,
                  variant=variant)
      for n, variant in ((NAMED, "full"), (NAMED - 1, "partial"))),
    _collective("tile", lambda r: nx.tile(r, {"i": 1}), 2 * NAMED),
    _collective("untile", lambda r: nx.untile(r, {"i": 1}), 2),
    _collective("axis_index", lambda r: r * nx.axis_index("i"), 3),
    _collective("axis_size", lambda r: r * nx.axis_size("i"), 3),
    Case("one_hot", along_i(lambda r, label: r * nx.one_hot(label, axis="i"), (1, None)),
         (normal(BATCH, NAMED), ints(NAMED, BATCH))),
    Case("einsum", along_i(lambda r, w: nx.einsum("bk<i>,km<i>->bm", r, w), (1, 0)),
         (normal(BATCH, NAMED, 3), normal(NAMED, 3, 4)), replicated=(1,), diff=(0, 1),
         pallas=True),
    Case("pdot", along_i(lambda r, w: nx.pdot(r, w, "i", pos_contract=((1,), (0,))), (1, 0)),
         (normal(BATCH, NAMED, 3), normal(NAMED, 3, 4)), replicated=(1,), diff=(0, 1),
         pallas=True),
    _cross_entropy("recompute"),
    _cross_entropy("in_forward"),
    Case("cross_entropy", along_i(lambda h, w, labels: nx.cross_entropy(
        h, w, labels, hidden="i", vocab=0, vocab_chunk=3), (2, 0, None)),
         (normal(BATCH, 6, NAMED), normal(NAMED, 7), ints(7, BATCH, 6)), replicated=(1,),
         diff=(0, 1), pallas=True, variant="named"),
    Case("attention", lambda q, k, v: nx.attention(q, k, v, seq=-2, q_seq=-2, causal=True,
                                                   block=8),
         _QKV, diff=(0, 1, 2), pallas=True, variant="positional"),
    Case("attention", along_i(_attention_named, 1), _QKV_NAMED, diff=(0, 1, 2), pallas=True,
         variant="named"),
]

# Public names of nxops.ops that are not ops, or are checked elsewhere.
EXCLUDED = {
    "SequenceLayout": "a description of how a sequence is stored (attention's "
                      "sequence_layout=), not an op of its own",
}

SELECTIONS = [pytest.param(case, selection, id=f"{case.id}-{selection}")
              for case in CASES for selection in (("xla", "pallas") if case.pallas else ("xla",))]


def test_every_public_op_has_a_case():
    covered = {case.op for case in CASES}
    assert covered.isdisjoint(EXCLUDED)
    assert covered | set(EXCLUDED) == set(nxops.ops.__all__)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_pallas_flags_say_which_ops_run_pallas(case):
    with nx.kernels.use("pallas"):
        backends = nx.kernels.explain(case.body, *case.arrays(), platform="cpu").backends()
    assert any("pallas" in used for used in backends.values()) == case.pallas, backends


def _loss(body):
    """The body's result weighed by a cotangent (the last operand)."""
    return lambda *operands: jnp.sum(body(*operands[:-1]) * operands[-1])


@functools.lru_cache(maxsize=None)
def _unmapped(case: Case, selection: str):
    """Value and gradients of the body over the whole batch, on one device."""
    operands = case.arrays()
    cotangent = _cotangent(case, operands)
    with nx.kernels.use(selection):
        value, grads = jax.jit(lambda *a: (case.body(*a[:-1]),
                                           jax.grad(_loss(case.body), argnums=case.diff)(*a))
                               )(*operands, cotangent)
    return operands, cotangent, np.asarray(value), [np.asarray(g) for g in grads]


def _cotangent(case, operands):
    shape = jax.eval_shape(case.body, *operands).shape
    return np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)


def _in_shard_map(body, mesh, specs, out_spec, diff, operands, cotangent):
    """(value, gradients taken outside the shard_map, gradients taken inside
    its body) of ``body`` in a shard_map over ``mesh``, in one jit."""
    forward = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec)
    grads_inside = jax.shard_map(jax.grad(_loss(body), argnums=diff), mesh=mesh,
                                 in_specs=specs + (out_spec,),
                                 out_specs=tuple(specs[i] for i in diff))
    grads_outside = jax.grad(_loss(forward), argnums=diff)

    @jax.jit
    def everything(*a):
        return forward(*a[:-1]), grads_outside(*a), grads_inside(*a)

    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, NamedSharding(mesh, spec))
                  for x, spec in zip((*operands, cotangent), specs + (out_spec,))]
        return everything(*placed)


def _assert_same(sharded, value, grads):
    got, outside, inside = sharded
    assert_close(got, value, scale=10)
    assert len(outside) == len(inside) == len(grads)
    for want, from_outside, from_inside in zip(grads, outside, inside):
        assert_close(from_outside, want, scale=10)
        assert_close(from_inside, want, scale=10)


@pytest.mark.parametrize("case,selection", SELECTIONS)
def test_op_in_shard_map_with_check_vma(case, selection, mesh8):
    operands, cotangent, value, grads = _unmapped(case, selection)
    (axis,) = mesh8.axis_names
    specs = tuple(P() if i in case.replicated else P(axis) for i in range(len(operands)))
    with nx.kernels.use(selection):
        sharded = _in_shard_map(case.body, mesh8, specs, P(axis), case.diff, operands, cotangent)
    _assert_same(sharded, value, grads)


# --- attention along the shard_map's own axis: a ring ----------------------------


@pytest.mark.parametrize("selection", ["xla", "pallas"])
def test_attention_with_the_sequence_on_the_shard_map_axis(selection, mesh8):
    """seq and q_seq name the mesh axis: one query and one key position per
    device (the shard's sequence dim has length 1), and the keys pass around
    a ring. The unmapped program is the positional attention over the whole
    sequence."""
    (axis,) = mesh8.axis_names
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 3, mesh8.size, 4)).astype(np.float32) for _ in range(3))
    cotangent = rng.standard_normal(q.shape).astype(np.float32)

    def unmapped(q, k, v):
        return nx.attention(q, k, v, seq=-2, q_seq=-2, causal=True)

    def body(q, k, v):   # [batch, heads, 1, head]: this device's position
        out = nx.attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], seq=axis, q_seq=axis,
                           causal=True)
        return out[:, :, None]

    diff = (0, 1, 2)
    with nx.kernels.use(selection):
        value = unmapped(q, k, v)
        grads = jax.grad(_loss(unmapped), argnums=diff)(q, k, v, cotangent)
        with jax.set_mesh(mesh8):
            placed = [jax.device_put(x, NamedSharding(mesh8, P(None, None, axis)))
                      for x in (q, k, v)]
            jaxpr = jax.make_jaxpr(jax.shard_map(body, mesh=mesh8, in_specs=(P(None, None, axis),) * 3,
                                                 out_specs=P(None, None, axis)))(*placed)
        sharded = _in_shard_map(body, mesh8, (P(None, None, axis),) * 3, P(None, None, axis), diff,
                                (q, k, v), cotangent)
    assert "ppermute" in str(jaxpr)   # a ring, not a gather of every key
    _assert_same(sharded, value, grads)


# --- a collective over the shard_map's axis and a vmap name together --------------


def test_all_to_all_over_the_mesh_axis_and_a_vmap_name(mesh8):
    """Positions run over (mesh axis, vmap name), major to minor: an
    all-to-all of one element per pair of positions is the transpose of the
    positions x elements matrix (NumPy's); its gradient is the cotangent's."""
    (axis,) = mesh8.axis_names
    positions = mesh8.size * NAMED
    x = np.random.default_rng(5).standard_normal((mesh8.size, NAMED, positions))
    x, cotangent = x.astype(np.float32), np.arange(x.size, dtype=np.float32).reshape(x.shape)
    body = along_i(lambda r: nx.all_to_all(r, (axis, "i"), 1, 1), 1)
    sharded = _in_shard_map(body, mesh8, (P(axis),), P(axis), (0,), (x,), cotangent)
    square = (positions, positions)
    _assert_same(sharded, x.reshape(square).T.reshape(x.shape),
                 [cotangent.reshape(square).T.reshape(x.shape)])
