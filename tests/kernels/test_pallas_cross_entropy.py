"""The Pallas fused cross-entropy forward, in interpret mode on CPU, against
the reference (nxops.kernels.xla.cross_entropy): several token blocks,
hidden steps, vocab tiles and splits, ragged edges, dtypes, extreme logits;
and the gradient with the kernel's forward feeding the reference backward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from nxops.kernels import _reports
from tests import _tolerances
from nxops.kernels.pallas import cross_entropy as pallas_ce
from nxops.kernels.xla import cross_entropy as xla_ce


def operands(tokens, hidden, vocab, dtype, scale=1.0, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k[0], (tokens, hidden))
    w = scale * jax.random.normal(k[1], (hidden, vocab)) / hidden**0.5
    return h.astype(dtype), w.astype(dtype), jax.random.randint(k[2], (tokens,), 0, vocab)


@pytest.mark.parametrize("tokens, hidden, vocab, dtype, scale", [
    (70, 70, 300, jnp.float32, 1.0),     # 2 token blocks, 2 hidden steps, 3 vocab tiles (ragged)
    (70, 70, 300, jnp.bfloat16, 1.0),
    (5, 3, 13, jnp.float16, 1.0),
    (3, 8, 1, jnp.float32, 1.0),         # vocab 1
    (1, 16, 130, jnp.float32, 1e4),      # one token; logits ~ +-1e4
])
def test_kernel_matches_reference(tokens, hidden, vocab, dtype, scale):
    h, w, labels = operands(tokens, hidden, vocab, dtype, scale)
    bt, _, bv = pallas_ce.tiles(tokens, hidden, vocab)
    assert pallas_ce.vocab_splits(tokens, vocab, bt, bv)[0] == -(-vocab // bv)   # a split per tile
    got = pallas_ce.cross_entropy(h, w, labels, platform="cpu")
    want = xla_ce.cross_entropy(h, w, labels)
    magnitude = max(1.0, _tolerances.max_abs(want))
    _tolerances.assert_close(got, want, np.float32, scale=10 * magnitude,
                             relative_scale=10)


def test_splits_share_tiles_when_many_token_blocks():
    # 300 token blocks fill the GPU alone: one split walks every vocab tile.
    assert pallas_ce.vocab_splits(300 * 64, 1000, 64, 128) == (1, 8)
    assert pallas_ce.vocab_splits(64, 128256, 64, 128) == (251, 4)


def test_selected_kernel_runs_under_grad_with_the_reference_backward():
    h, w, labels = operands(70, 20, 300, jnp.bfloat16)
    labels = labels.at[3].set(-100)

    def step(h, w):
        return jax.value_and_grad(lambda h, w: jnp.sum(nx.cross_entropy(
            h, w, labels, hidden=1, vocab=1, ignore_index=-100)), argnums=(0, 1))(h, w)
    with nx.kernels.use("cross_entropy=pallas"), _reports.collect_reports() as reports:
        got = jax.jit(step)(h, w)
    assert {r.choice.kernel.name for r in reports} == {"pallas:cross_entropy"}
    want = jax.jit(step)(h, w)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _tolerances.assert_close(g, r, r.dtype, scale=_tolerances.max_abs(r))


def test_auto_keeps_the_reference_on_cuda():
    h, w, labels = operands(8, 4, 16, jnp.bfloat16)
    report = nx.kernels.explain(lambda h, w: nx.cross_entropy(h, w, labels, hidden=1, vocab=1),
                                h, w, platform="cuda")
    assert "xla:cross_entropy" in str(report)
    assert "pallas:cross_entropy" not in str(report).split("kernels:")[0]


def test_last_split_with_tiles_wholly_past_the_vocab(monkeypatch):
    # 7 vocab tiles over 3 splits of 3 tiles: the last split's last two tiles
    # hold no column (their logits are all -inf).
    monkeypatch.setattr(pallas_ce, "TARGET_PROGRAMS", 3)
    h, w, labels = operands(20, 16, 7 * 128 - 5, jnp.float32, seed=3)
    assert pallas_ce.vocab_splits(20, 7 * 128 - 5, 32, 128) == (3, 3)
    got = pallas_ce.cross_entropy(h, w, labels, platform="cpu")
    _tolerances.assert_close(got, xla_ce.cross_entropy(h, w, labels), np.float32, scale=10,
                             relative_scale=10)


def _loss_and_grads(h, w, labels, **options):
    """value_and_grad of a mean loss plus a z-loss (a per-token logsumexp
    cotangent: the stored backward recomputes dw for it)."""
    def loss(h, w):
        ce, lse = nx.cross_entropy(h, w, labels, hidden=1, vocab=1, return_lse=True, **options)
        return jnp.mean(ce) + 1e-2 * jnp.mean(lse ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1))(h, w)


@pytest.mark.parametrize("dtype, z_loss", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_stored_backward_with_the_softmax_kernel(dtype, z_loss):
    """backward="in_forward" with the kernel's softmax in place, against the
    reference's recompute backward: a vocab past one kernel step of columns
    (ragged), ignored positions, bf16, a z-loss."""
    h, w, labels = operands(9, 8, 1100, dtype, seed=5)
    labels = labels.at[2].set(-100)
    options = dict(ignore_index=-100)

    def grads(**backend):
        def step(h, w):
            if z_loss:
                return _loss_and_grads(h, w, labels, **options, **backend)
            return jax.value_and_grad(lambda h, w: jnp.mean(nx.cross_entropy(
                h, w, labels, hidden=1, vocab=1, **options, **backend)), argnums=(0, 1))(h, w)
        return jax.jit(step).trace(h, w)
    with nx.kernels.use("cross_entropy=pallas"):
        traced = grads(backward="in_forward")
    assert "nx_cross_entropy_stored_forward_pallas" in str(traced.jaxpr)
    got = traced.lower().compile()(h, w)
    want = grads(backward="recompute").lower().compile()(h, w)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _tolerances.assert_close(g, r, r.dtype, scale=_tolerances.max_abs(r))


def test_softmax_kernel_extreme_rows():
    """+inf and -inf logits: the same softmax and logsumexp as the reference's
    rows (NaN where the reference divides inf by inf)."""
    logits = jnp.array([[jnp.inf, -jnp.inf, 1.0], [1.0, 2.0, 3.0], [-1e4, 0.0, 1e4]])
    softmax, total, lse = pallas_ce.softmax_in_place(logits, dtype=jnp.float32, platform="cpu")
    exp, want_total, want_lse = xla_ce.exp_rows(logits)
    assert total is None
    np.testing.assert_array_equal(lse, want_lse)
    np.testing.assert_allclose(softmax, exp / want_total[:, None], rtol=1e-6)


def test_stored_backward_with_the_softmax_kernel_vocab_parallel():
    """The vocab on 4 devices (300 columns each, not a whole kernel step),
    the labels on every shard: loss and gradients as the reference's."""
    h, w, labels = operands(6, 8, 1200, jnp.float32, seed=7)

    def step(h, w):
        body = lambda h, w, l: nx.cross_entropy(h, w, l, hidden=0, vocab="v",
                                                backward="in_forward")
        f = nx.xmap(body, [["t", None], [None, "v"], ["t"]], ["t"], axis_resources={"v": "y"})
        return jax.value_and_grad(lambda h, w: jnp.mean(f(h, w, labels)), argnums=(0, 1))(h, w)
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        with nx.kernels.use("cross_entropy=pallas"):
            got = step(h, w)
        want = step(h, w)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _tolerances.assert_close(g, r, r.dtype, scale=_tolerances.max_abs(r))
