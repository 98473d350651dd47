"""The differential oracle for ``nx.cross_entropy``: one named program (the
loss of a token over a named vocab, with ignored positions and a z-loss
through ``return_lse``) under every placement (no resources, the vocab on
one or two mesh axes, the tokens on a mesh axis or a SerialLoop, tokens and
vocab both mapped), both backends (xla; pallas, interpreted on CPU), both
backwards, forward / ``jax.jit`` / ``jax.vmap`` / ``jax.grad`` outside and
inside the body, each against a float64 NumPy reference.

Its own random stream (``np.random.default_rng`` of a fixed seed per case),
so the other oracles' fixed draws stay as they are. A fixed, small case list
(about 40 s of CPU on one core).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from nxops.kernels.xla import cross_entropy as xla_cross_entropy
from tests import _tolerances

TOKENS, HIDDEN, VOCAB = 6, 5, 16
IGNORE = -1
Z_LOSS = 0.01
IN_AXES = [["tok", None], [None, "vocab"], ["tok"]]

# id: (mesh (shape, axis names) or None, axis_resources)
PLACEMENTS = {
    "none": (None, {}),
    "vocab on y": (((2, 4), ("x", "y")), {"vocab": "y"}),
    "vocab on x,y": (((2, 4), ("x", "y")), {"vocab": ("x", "y")}),
    "tokens on x": (((2, 4), ("x", "y")), {"tok": "x"}),
    "tokens x, vocab y": (((2, 4), ("x", "y")), {"tok": "x", "vocab": "y"}),
    "tokens loop": (None, {"tok": nx.SerialLoop(2)}),
    "tokens loop, vocab y": (((2, 4), ("x", "y")), {"tok": nx.SerialLoop(2), "vocab": "y"}),
}
# (placement, kernels, backward): every placement with the reference and its
# stored backward; the recompute backward in one token block and in blocks of
# 2 tokens (the budget made small; 3 tokens per device or loop step: the last
# block overlaps the one before);
# the Pallas kernel (its derivatives are the recompute backward's) where the
# vocab is local, sharded, and beside sharded tokens.
BLOCKS = "recompute, 2-token blocks"
CASES = ([(p, "xla", "in_forward") for p in PLACEMENTS] +
         [(p, "xla", "recompute") for p in ("none", "vocab on x,y", "tokens loop, vocab y")] +
         [(p, "xla", BLOCKS) for p in ("none", "vocab on y", "tokens x, vocab y")] +
         [(p, "cross_entropy=pallas", "auto")
          for p in ("none", "vocab on y", "tokens x, vocab y", "tokens loop")])


def draw(seed: int, batch: tuple = ()):
    """(h, w, labels, per-token weights) with about a quarter of the labels ignored."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((*batch, TOKENS, HIDDEN))
    w = rng.standard_normal((HIDDEN, VOCAB)) / np.sqrt(HIDDEN)
    labels = rng.integers(0, VOCAB, (*batch, TOKENS))
    labels = np.where(rng.random(labels.shape) < 0.25, IGNORE, labels)
    weights = rng.standard_normal((*batch, TOKENS))
    return h, w, labels, weights


def numpy_reference(h, w, labels, weights):
    """float64 (loss, lse, d total / dh, d total / dw, per-token dh, per-token
    dw) for total = sum(weights * loss) + Z_LOSS * sum(lse**2); ignored
    positions: loss, lse and every gradient 0."""
    logits = h @ w
    top = logits.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    kept = labels != IGNORE
    onehot = np.eye(VOCAB)[np.where(kept, labels, 0)]
    loss = np.where(kept, lse - (logits * onehot).sum(-1), 0.0)
    lse = np.where(kept, lse, 0.0)
    softmax = np.exp(logits - lse[..., None])
    g_lse = (weights + 2 * Z_LOSS * lse) * kept
    dlogits = g_lse[..., None] * softmax - (weights * kept)[..., None] * onehot
    dh = dlogits @ w.T
    dw_per_token = h[..., :, None] * dlogits[..., None, :]           # [..., T, H, V]
    return loss, lse, dh, dw_per_token.reshape(-1, HIDDEN, VOCAB).sum(0), dh, dw_per_token


def body(backward):
    def loss_and_lse(h, w, labels):
        return nx.cross_entropy(h, w, labels, hidden=0, vocab="vocab", ignore_index=IGNORE,
                                return_lse=True, backward=backward)
    return loss_and_lse


def total(loss, lse, weights):
    return jnp.sum(weights * loss) + Z_LOSS * jnp.sum(lse ** 2)


def mesh_of(placement):
    spec = PLACEMENTS[placement][0]
    return jax.make_mesh(*spec, devices=jax.devices()[:8]) if spec else None


def in_mesh(placement, fn):
    mesh = mesh_of(placement)
    if mesh is None:
        return fn()
    with jax.set_mesh(mesh):
        return fn()


def check(got, want, what: str):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    try:
        _tolerances.assert_close(got, want, jnp.float32, scale=max(1.0, np.abs(want).max()))
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


@pytest.mark.parametrize("placement, kernels, backward", CASES)
def test_values_and_gradients_outside_and_inside(placement, kernels, backward, monkeypatch):
    seed = 1000 + CASES.index((placement, kernels, backward))
    if backward == BLOCKS:
        monkeypatch.setattr(xla_cross_entropy, "DH_BLOCK_BYTES", 4 * HIDDEN * 2)
        backward = "recompute"
    h, w, labels, weights = draw(seed)
    want = numpy_reference(h, w, labels, weights)
    args = (jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32),
            jnp.asarray(labels, jnp.int32))
    resources = PLACEMENTS[placement][1]
    xmapped = nx.xmap(body(backward), IN_AXES, (["tok"], ["tok"]), axis_resources=resources)

    def outside(h, w, labels):
        def objective(h, w):
            loss, lse = xmapped(h, w, labels)
            return total(loss, lse, weights), (loss, lse)
        return jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(h, w)

    def inside(h, w, labels, weights):
        def objective(h, w):
            loss, lse = body(backward)(h, w, labels)
            return weights * loss + Z_LOSS * lse ** 2
        return jax.grad(objective, argnums=(0, 1))(h, w)
    inside_xmapped = nx.xmap(inside, IN_AXES + [["tok"]],
                             (["tok", None], ["tok", None, "vocab"]), axis_resources=resources)

    with nx.kernels.use(kernels):
        ((_, (loss, lse)), (dh, dw)), (dh_in, dw_in), (loss_eager, _) = in_mesh(
            placement, lambda: (jax.jit(outside)(*args),
                                jax.jit(inside_xmapped)(*args, jnp.asarray(weights, jnp.float32)),
                                xmapped(*args)))
    for got, ref, what in ((loss, want[0], "loss"), (lse, want[1], "lse"),
                           (loss_eager, want[0], "loss, not jitted"),
                           (dh, want[2], "dh, grad outside"), (dw, want[3], "dw, grad outside"),
                           (dh_in, want[4], "dh, grad inside"),
                           # dw inside: per (token, vocab) position; the vocab
                           # is a named reduction, whose transpose is a psum
                           # (docs/xmap.md): vocab times the positional one.
                           (dw_in, VOCAB * want[5], "dw, grad inside")):
        check(got, ref, f"{placement}, {kernels}, {backward}: {what}")


@pytest.mark.parametrize("placement, kernels", [("vocab on y", "xla"),
                                                ("tokens x, vocab y", "cross_entropy=pallas")])
def test_vmap_over_batches_of_tokens(placement, kernels):
    """jax.vmap of the xmapped loss and of its outside gradient over a batch of
    (h, labels) with one w: each member as the reference's."""
    h, w, labels, weights = draw(2000 + len(placement), batch=(3,))
    resources = PLACEMENTS[placement][1]
    xmapped = nx.xmap(body("auto"), IN_AXES, (["tok"], ["tok"]), axis_resources=resources)

    def member(h, labels, weights):
        def objective(h):
            loss, lse = xmapped(h, jnp.asarray(w, jnp.float32), labels)
            return total(loss, lse, weights), loss
        return jax.value_and_grad(objective, has_aux=True)(h)

    with nx.kernels.use(kernels):
        (_, loss), dh = in_mesh(placement, lambda: jax.jit(jax.vmap(member))(
            jnp.asarray(h, jnp.float32), jnp.asarray(labels, jnp.int32),
            jnp.asarray(weights, jnp.float32)))
    want = [numpy_reference(h[i], w, labels[i], weights[i]) for i in range(3)]
    check(loss, np.stack([r[0] for r in want]), f"{placement}, {kernels}: loss under vmap")
    check(dh, np.stack([r[2] for r in want]), f"{placement}, {kernels}: dh under vmap")
