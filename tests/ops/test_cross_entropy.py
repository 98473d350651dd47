"""nx.cross_entropy against the unfused program: values and
gradients (dh, dw), positional (hypothesis over sizes, chunks, dtypes,
ignore_index, extreme logits) and named under every placement, and its
errors."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import AxisType

import nxops as nx
from nxops.kernels.xla import cross_entropy as xla_cross_entropy
from tests import _tolerances

from tests.ops._util import assert_close

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def unfused_loss(h, w, labels, ignore_index=None):
    """The unfused program in f32: positional einsum, logsumexp, take by label."""
    logits = nx.einsum("th,hv->tv", h.astype(jnp.float32), w.astype(jnp.float32))
    lse = nx.logsumexp(logits, 1)
    picked = jnp.take_along_axis(logits, jnp.clip(labels, 0, w.shape[1] - 1)[:, None], 1)[:, 0]
    loss = lse - picked
    if ignore_index is not None:
        kept = labels != ignore_index
        loss, lse = jnp.where(kept, loss, 0.0), jnp.where(kept, lse, 0.0)
    return loss, lse


def loss_and_grads(loss_fn, h, w, labels, cotangent_lse):
    """Per-token (loss, lse) and the gradient of sum(loss) + sum(c * lse) (a z-loss term)."""
    def total(h, w):
        loss, lse = loss_fn(h, w, labels)
        return jnp.sum(loss) + jnp.sum(cotangent_lse * lse), (loss, lse)
    (_, values), grads = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(h, w)
    return values, grads


def operands(tokens, hidden, vocab, dtype, logits, seed, ignore_index):
    rng = np.random.default_rng(seed)
    if logits == "equal":       # every logit the same: loss log(vocab)
        h = np.ones((tokens, hidden))
        w = np.full((hidden, vocab), 0.5)
    elif logits == "extreme":   # logits of +-1e4 (exact in every dtype: integers)
        h = rng.choice([-1.0, 1.0], (tokens, hidden))
        w = rng.choice([-5000.0, 0.0, 5000.0], (hidden, vocab))
    else:
        h = rng.standard_normal((tokens, hidden))
        w = rng.standard_normal((hidden, vocab)) / np.sqrt(hidden)
    labels = rng.integers(0, vocab, tokens)
    if ignore_index is not None:
        labels = np.where(rng.random(tokens) < 0.3, ignore_index, labels)
    return (jnp.asarray(h, dtype), jnp.asarray(w, dtype), jnp.asarray(labels, jnp.int32),
            jnp.asarray(rng.standard_normal(tokens), jnp.float32))


def assert_matches_unfused(got, want, dtype):
    (loss, lse), (dh, dw) = got
    (want_loss, want_lse), (want_dh, want_dw) = want
    # Forward: f32 accumulation of the same products, whatever the inputs'
    # dtype: f32 rounding of the logits' magnitude.
    magnitude = max(1.0, _tolerances.max_abs(want_lse) if want_lse.size else 1.0)
    for g, r in ((loss, want_loss), (lse, want_lse)):
        assert g.dtype == jnp.float32
        assert_close(g, r, np.float32, scale=10 * magnitude)
    # Backward: d(logits) rounded to the inputs' dtype before the dots. The
    # f32 reference's own softmax is off by the f32 rounding of a logsumexp
    # of that magnitude (at logits of 5000: dh of ~0.3 where the exact value
    # is 0, a sum of five 0.2 * 4992 less 4992): a difference within that
    # error passes (at logits of order 1 it is ~1e-6).
    for g, r in ((dh, want_dh), (dw, want_dw)):
        assert g.dtype == dtype and g.shape == r.shape
        scale = max(1.0, _tolerances.max_abs(r)) if r.size else 1.0
        reference_error = 4 * magnitude * np.finfo(np.float32).eps * max(scale, magnitude)
        if np.all(np.abs(np.asarray(g, np.float32) - np.asarray(r, np.float32)) <= reference_error):
            continue
        _tolerances.assert_close(g, r, dtype, scale=2 * scale)


@settings(max_examples=20, deadline=None)
@given(tokens=st.sampled_from([0, 1, 2, 5]), hidden=st.integers(1, 5),
       vocab=st.sampled_from([1, 2, 7, 13, 33]), chunk=st.sampled_from([None, 1, 4, 6, 64]),
       dtype=st.sampled_from(sorted(DTYPES)), logits=st.sampled_from(["normal", "extreme", "equal"]),
       ignore_index=st.sampled_from([None, -100, 0]), seed=st.integers(0, 2**16),
       backward=st.sampled_from(["auto", "in_forward", "recompute"]), z_loss=st.booleans())
def test_positional_matches_unfused(tokens, hidden, vocab, chunk, dtype, logits, ignore_index,
                                    seed, backward, z_loss):
    """Without a z-loss the logsumexp's cotangent is one number (the stored
    path scales its dw); with one it varies per token (the stored path
    recomputes dw)."""
    dtype = DTYPES[dtype]
    h, w, labels, c = operands(tokens, hidden, vocab, dtype, logits, seed, ignore_index)
    c = c if z_loss else jnp.zeros_like(c)
    fused = functools.partial(nx.cross_entropy, hidden=1, vocab=1, ignore_index=ignore_index,
                              return_lse=True, vocab_chunk=chunk, backward=backward)
    got = jax.jit(loss_and_grads, static_argnums=0)(fused, h, w, labels, c)
    want = jax.jit(loss_and_grads, static_argnums=0)(
        functools.partial(unfused_loss, ignore_index=ignore_index), h, w, labels, c)
    assert_matches_unfused(got, want, dtype)
    if logits == "equal" and tokens:
        kept = np.asarray(labels) != (ignore_index if ignore_index is not None else -1)
        np.testing.assert_allclose(np.asarray(got[0][0])[kept], np.log(vocab), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backward", ["in_forward", "recompute"])
@pytest.mark.parametrize("z_loss", [False, True])
def test_ignored_positions_give_zero_loss_and_no_gradient(backward, z_loss):
    """Also with a NaN in h there: dh's row is 0, and dw is the kept rows' dw."""
    h, w, labels, c = operands(4, 4, 9, jnp.float32, "normal", 0, None)
    labels, h = labels.at[1].set(-1), h.at[1].set(jnp.nan)
    c = c if z_loss else jnp.zeros_like(c)

    def total(h, w, labels, c):
        loss, lse = nx.cross_entropy(h, w, labels, hidden=1, vocab=1, ignore_index=-1,
                                     return_lse=True, backward=backward)
        return jnp.sum(loss) + jnp.sum(c * lse), loss
    (_, loss), (dh, dw) = jax.jit(jax.value_and_grad(total, (0, 1), has_aux=True))(h, w, labels, c)
    kept = np.array([0, 2, 3])
    _, (dh_kept, dw_kept) = jax.value_and_grad(total, (0, 1), has_aux=True)(
        h[kept], w, labels[kept], c[kept])
    assert loss[1] == 0 and np.all(np.asarray(dh[1]) == 0) and np.all(np.asarray(loss)[kept] > 0)
    assert_close(dh[kept], dh_kept)
    assert_close(dw, dw_kept)


@pytest.mark.parametrize("backward", ["in_forward", "recompute"])
def test_labels_outside_the_vocab_give_nan_loss(backward):
    """Under jit (no concrete labels to check): NaN there, as the unfused take
    gives for a label past the vocab; ignore_index still gives 0."""
    h, w, _, _ = operands(5, 3, 10, jnp.float32, "normal", 4, None)
    labels = jnp.array([0, 10, -100, -1, 9])
    fused = jax.jit(lambda h, w, labels: nx.cross_entropy(h, w, labels, hidden=1, vocab=1,
                                                          backward=backward))
    loss = np.asarray(fused(h, w, labels))
    assert np.isnan(loss[1:4]).all() and np.isfinite(loss[[0, 4]]).all(), loss
    assert_close(loss[[0, 4]], unfused_loss(h, w, labels)[0][np.array([0, 4])])
    ignored = nx.cross_entropy(h, w, labels, hidden=1, vocab=1, ignore_index=-100)
    assert ignored[2] == 0 and np.isnan(np.asarray(ignored)[[1, 3]]).all()


def test_auto_stores_gradients_only_within_its_budget():
    """The speed benchmark's size stores (three matmuls); the memory
    benchmark's recomputes (its f32 dw alone would be 1.05 GB)."""
    from nxops.ops._cross_entropy import _stores_grads
    assert _stores_grads("auto", 2048, 512, 32768)
    assert not _stores_grads("auto", 8192, 2048, 128256)
    assert not _stores_grads("in_forward", 0, 4, 8)      # no tokens: nothing to store


def test_labels_outside_the_vocab_are_a_checkify_nan_error():
    """checkify's nan_checks reports them (not the ignored ones) as an error."""
    from jax.experimental import checkify
    h, w, _, _ = operands(4, 3, 10, jnp.float32, "normal", 4, None)

    def checked(labels, ignore_index=None):
        fn = lambda l: nx.cross_entropy(h, w, l, hidden=1, vocab=1, ignore_index=ignore_index)
        return jax.jit(checkify.checkify(fn, errors=checkify.nan_checks))(labels)[0].get()
    assert "nan generated by primitive: sub" in checked(jnp.array([0, 10, 2, 3]))
    assert checked(jnp.array([0, -100, 2, 3]), ignore_index=-100) is None
    assert checked(jnp.array([0, 9, 2, 3])) is None


@pytest.mark.parametrize("backward", ["in_forward", "recompute"])
def test_forward_mode_matches_unfused(backward):
    """jvp, jacfwd, linearize and hessian (forward over reverse) of the fused
    loss are the unfused program's, in h and in w."""
    h, w, labels, _ = operands(4, 3, 11, jnp.float32, "normal", 6, None)

    def fused(h, w):
        return jnp.sum(nx.cross_entropy(h, w, labels, hidden=1, vocab=1, vocab_chunk=4,
                                        backward=backward) ** 2)

    def unfused(h, w):
        return jnp.sum(unfused_loss(h, w, labels)[0] ** 2)
    tangents = (jnp.cos(h), jnp.sin(w))
    transforms = {
        "jvp": lambda f, h, w: jax.jvp(f, (h, w), tangents),
        "jacfwd": lambda f, h, w: jax.jacfwd(f, argnums=(0, 1))(h, w),
        "linearize": lambda f, h, w: jax.linearize(f, h, w)[1](*tangents),
        "hessian": lambda f, h, w: jax.hessian(f, argnums=(0, 1))(h, w),
        "jacfwd of jacfwd": lambda f, h, w: jax.jacfwd(jax.jacfwd(lambda h: f(h, w)))(h),
    }
    for transform in transforms.values():
        # Jitted: run eagerly, the nested transforms dispatch (and compile) op by op.
        run = jax.jit(transform, static_argnums=0)
        for got, want in zip(jax.tree.leaves(run(fused, h, w)), jax.tree.leaves(run(unfused, h, w))):
            assert_close(got, want, scale=10)


def test_layouts_hidden_and_vocab_by_position():
    """w as [vocab, hidden] (tied embeddings: vocab=0), h with the hidden axis first."""
    h, w, labels, _ = operands(4, 3, 10, jnp.float32, "normal", 1, None)
    want = unfused_loss(h, w, labels)[0]
    got = nx.cross_entropy(h.T, w.T, labels, hidden=0, vocab=0)
    assert_close(got, want)
    tokens_2d = nx.cross_entropy(h.reshape(2, 2, 3), w, labels.reshape(2, 2), hidden=-1, vocab=-1)
    assert_close(tokens_2d, want.reshape(2, 2))


# --- named: every placement, grad outside and inside ---------------------------

T, H, V = 8, 3, 24     # V over 4 and 8 devices, chunk 5 does not divide it
IN_AXES = [["tok", None], [None, "vocab"], ["tok"]]
PLACEMENTS = {
    "none": {},
    "tokens on x": {"tok": "x"},
    "vocab on y": {"vocab": "y"},
    "vocab on x,y": {"vocab": ("x", "y")},
    "tokens x, vocab y": {"tok": "x", "vocab": "y"},
    "tokens loop, vocab y": {"tok": nx.SerialLoop(2), "vocab": "y"},
    "tokens loop and x": {"tok": ("x", nx.SerialLoop(2))},
}


def fused_body(h, w, labels):
    return nx.cross_entropy(h, w, labels, hidden=0, vocab="vocab", vocab_chunk=5)


def unfused_body(h, w, labels):
    logits = nx.einsum("h,h->", h, w)          # one (token, vocab) logit
    picked = nx.sum(jnp.where(labels == nx.axis_index("vocab"), logits, 0.0), "vocab")
    return nx.logsumexp(logits, "vocab") - picked


def inside_grads(body, resources=None, argnums=(0, 1)):
    """grad taken in the body: dh per token, dw per (token, vocab) position."""
    def grads(h, w, labels):
        return jax.grad(lambda h, w: body(h, w, labels), argnums=argnums)(h, w)
    out_axes = {0: ["tok", None], 1: ["tok", None, "vocab"]}
    return jax.jit(nx.xmap(grads, IN_AXES, [out_axes[a] for a in argnums],
                           axis_resources=resources or {}))


def outside_step(xmapped):
    def step(h, w, labels):
        loss, grads = jax.value_and_grad(lambda h, w: jnp.sum(xmapped(h, w, labels) ** 2),
                                         argnums=(0, 1))(h, w)
        return xmapped(h, w, labels), grads
    return jax.jit(step)


@functools.lru_cache(maxsize=None)
def named_operands():
    h, w, labels, _ = operands(T, H, V, jnp.float32, "normal", 7, None)
    return h, w, labels


@functools.lru_cache(maxsize=None)
def unfused_named_results():
    """The unfused program, no resources: loss with grads outside, and dw inside
    (its dh inside is per vocab position: replicated inputs' gradients stay
    per position)."""
    args = named_operands()
    outside = outside_step(nx.xmap(unfused_body, IN_AXES, ["tok"]))(*args)
    return outside, inside_grads(unfused_body, argnums=(1,))(*args)


@pytest.fixture
def mesh():
    return jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)


@pytest.mark.parametrize("axis_type, placement", [(AxisType.Explicit, p) for p in PLACEMENTS] +
                         [(AxisType.Auto, "tokens x, vocab y")])
def test_named_placements_match_unfused(axis_type, placement):
    mesh2x4 = jax.make_mesh((2, 4), ("x", "y"), axis_types=(axis_type,) * 2)
    resources = PLACEMENTS[placement]
    args = named_operands()
    xmapped = nx.xmap(fused_body, IN_AXES, ["tok"], axis_resources=resources)
    with jax.set_mesh(mesh2x4):
        outside = outside_step(xmapped)(*args)
        grads = inside_grads(fused_body, resources)(*args)
    want_outside, (want_dw_inside,) = unfused_named_results()
    assert_close(outside[0], unfused_loss(*args)[0])
    for got, want in zip(jax.tree.leaves(outside), jax.tree.leaves(want_outside)):
        assert_close(got, want)
    # In the body: dw as the unfused program's (the named-reduction rule);
    # dh, replicated along the vocab, is its whole gradient (docs/cross_entropy.md).
    assert_close(grads[0], jax.grad(lambda h: jnp.sum(unfused_loss(h, *args[1:])[0]))(args[0]))
    assert_close(grads[1], want_dw_inside)


def test_hidden_and_vocab_both_named_bf16():
    h, w, labels, _ = operands(T, H, V, jnp.bfloat16, "normal", 3, None)
    body = lambda h, w, l: nx.cross_entropy(h, w, l, hidden="hid", vocab="vocab")
    xmapped = nx.xmap(body, [["tok", "hid"], ["hid", "vocab"], ["tok"]], ["tok"])
    got = loss_and_grads(lambda h, w, l: (xmapped(h, w, l), jnp.zeros(T)), h, w, labels,
                         jnp.zeros(T))
    want = loss_and_grads(unfused_loss, h, w, labels, jnp.zeros(T))
    assert_close(got[0][0], want[0][0], scale=10)
    for g, r in zip(got[1], want[1]):
        _tolerances.assert_close(g, r, jnp.bfloat16, scale=2 * _tolerances.max_abs(r))


def test_vocab_parallel_hlo_has_no_gather_and_one_pmax_one_psum(mesh):
    """Vocab over 4 devices: the only collectives are all-reduces of per-token scalars."""
    xmapped = nx.xmap(fused_body, IN_AXES, ["tok"], axis_resources={"vocab": "y"})
    with jax.set_mesh(mesh):
        compiled = jax.jit(xmapped).lower(*named_operands()).compile()
    found = nx.hlo.collectives(compiled.as_text())
    assert sorted(c.kind for c in found) == ["all-reduce", "all-reduce"], found
    assert all(np.prod(s) <= 2 * T for c in found for s in c.result_shapes), found


def test_vocab_parallel_gradient_outside_all_reduces_dh_once(mesh):
    """jax.grad outside the xmap: dh (tokens x hidden) is summed over the
    vocab shards by one all-reduce, as in the unfused program."""
    xmapped = nx.xmap(fused_body, IN_AXES, ["tok"], axis_resources={"vocab": "y"})
    step = jax.grad(lambda h, w, l: jnp.sum(xmapped(h, w, l)), argnums=(0, 1))
    h, w, labels = named_operands()
    with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(h, w, labels).compile()
    # (nx.hlo reads no replica groups of the resharding all-gather of dw,
    # which the Explicit mesh makes at the end: the all-reduces are read here.)
    all_reduces = re.findall(r"= \w+\[([\d,]*)\]\S* all-reduce(?:-start)?\(",
                             compiled.as_text())
    sizes = [np.prod([int(d) for d in dims.split(",") if d]) for dims in all_reduces]
    assert sum(size >= h.size for size in sizes) == 1, all_reduces


def _numpy_gradients(h, w, labels, g_lse, g_picked):
    """float64 (dh, dw) of sum(g_lse * lse + g_picked * picked)."""
    h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
    logits = h @ w
    softmax = np.exp(logits - logits.max(1, keepdims=True))
    softmax /= softmax.sum(1, keepdims=True)
    dlogits = softmax * np.asarray(g_lse)[:, None]
    own = (labels >= 0) & (labels < w.shape[1])
    dlogits[np.arange(len(labels))[own], labels[own]] += np.asarray(g_picked)[own]
    return dlogits @ w.T, h.T @ dlogits


@pytest.mark.parametrize("order", [None, *xla_cross_entropy.ORDERS])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("block", [4, 16, 37])
def test_recompute_backward_by_token_blocks_matches_numpy(dtype, block, order):
    """Token blocks (the last one overlapping the one before) and vocab chunks
    (likewise), none a divisor of the sizes, in either loop order (and the
    platform's, None): dh and
    dw as float64 NumPy's, with a label outside this shard and a row with no
    cotangent."""
    tokens, hidden, vocab, chunk = 37, 8, 29, 6
    rng = np.random.default_rng(block)
    h = jnp.asarray(rng.standard_normal((tokens, hidden)), DTYPES[dtype])
    w = jnp.asarray(rng.standard_normal((hidden, vocab)) / np.sqrt(hidden), DTYPES[dtype])
    labels = rng.integers(0, vocab, tokens)
    labels[5] = vocab + 3
    g = rng.standard_normal((2, tokens)).astype(np.float32)
    g[:, 9] = 0.0
    lse = jax.nn.logsumexp(np.asarray(h, np.float32) @ np.asarray(w, np.float32), axis=1)
    dh, dw = xla_cross_entropy.backward(h, w, jnp.asarray(labels, jnp.int32), lse,
                                        jnp.asarray(g), chunk, block=block, order=order)
    want_dh, want_dw = _numpy_gradients(h, w, labels, g[0], g[1])
    for got, want in ((dh, want_dh), (dw, want_dw)):
        assert got.dtype == DTYPES[dtype]
        _tolerances.assert_close(np.asarray(got, np.float32), want, DTYPES[dtype],
                                 scale=np.abs(want).max())


def test_backward_token_blocks_only_beyond_the_budget():
    hidden = 2048
    fits = xla_cross_entropy.DH_BLOCK_BYTES // (4 * hidden)
    assert xla_cross_entropy.backward_token_block(8192, hidden) == fits < 8192
    assert xla_cross_entropy.backward_token_block(fits, hidden) == fits
    assert xla_cross_entropy.backward_token_block(fits + 1, hidden) == fits


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_compiled_step_holds_no_copy_of_the_weight(dtype):
    """CPU, value and gradients over 32 chunks, the backward recomputing: the
    temp holds chunks, dh and h's f32 copy, never a whole-weight copy
    (XLA:CPU slices 16-bit data in f32, and would hoist the convert of all of
    w out of the loop)."""
    tokens, hidden, vocab = 128, 256, 8192
    structs = (jax.ShapeDtypeStruct((tokens, hidden), dtype),
               jax.ShapeDtypeStruct((hidden, vocab), dtype),
               jax.ShapeDtypeStruct((tokens,), jnp.int32))
    loss = lambda h, w, l: nx.cross_entropy(h, w, l, hidden=1, vocab=1, vocab_chunk=256,
                                            backward="recompute").sum()
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*structs).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < hidden * vocab * jnp.dtype(dtype).itemsize, temp


# --- errors ---------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, args, match", [
    (dict(hidden=1, vocab=1), ((4, 3), (5, 9), (4,)), r"hidden axis 1 has size 3 in h .*\(4, 3\).* 5 in w"),
    (dict(hidden=1, vocab=1), ((4, 3), (3, 9), (5,)), r"labels have shape \(5,\).*\(4,\)"),
    (dict(hidden=1, vocab=1), ((4, 3), (3, 0), (4,)), r"vocab axis 1 has size 0"),
    (dict(hidden=1, vocab=1), ((4, 3), (3, 9, 2), (4,)), r"w has shape \(3, 9, 2\).*2 positional"),
    (dict(hidden=2, vocab=1), ((4, 3), (3, 9), (4,)), r"hidden=2 is out of range for h of shape \(4, 3\)"),
    (dict(hidden=1.0, vocab=1), ((4, 3), (3, 9), (4,)), r"hidden=1.0; give"),
    (dict(hidden=1, vocab=1, vocab_chunk=0), ((4, 3), (3, 9), (4,)), r"vocab_chunk=0"),
])
def test_errors_quote_shapes(kwargs, args, match):
    h, w, labels = (jnp.zeros(s, jnp.int32 if i == 2 else jnp.float32) for i, s in enumerate(args))
    with pytest.raises(nx.NxopsError, match=match):
        nx.cross_entropy(h, w, labels, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(ignore_index="-100"), r"ignore_index='-100'; give an int in the int32 range"),
    (dict(ignore_index=2**40), r"ignore_index=1099511627776; give an int in the int32 range"),
    (dict(ignore_index=True), r"ignore_index=True"),
    (dict(vocab_chunk=True), r"vocab_chunk=True; give a positive int"),
    (dict(vocab_chunk=2.0), r"vocab_chunk=2.0"),
    (dict(return_lse="no"), r"return_lse='no'; give True or False"),
    (dict(backward="fast"), r"backward='fast'; give one of 'auto', 'in_forward', 'recompute'"),
])
def test_errors_name_the_argument(kwargs, match):
    h, w, labels = jnp.zeros((2, 3)), jnp.zeros((3, 4)), jnp.zeros(2, jnp.int32)
    with pytest.raises(nx.NxopsError, match=match):
        nx.cross_entropy(h, w, labels, hidden=1, vocab=1, **kwargs)


def test_errors_dtypes():
    h, w, labels = jnp.zeros((2, 3)), jnp.zeros((3, 4)), jnp.zeros(2, jnp.int32)
    with pytest.raises(nx.NxopsError, match="labels have dtype float32"):
        nx.cross_entropy(h, w, labels.astype(jnp.float32), hidden=1, vocab=1)
    with pytest.raises(nx.NxopsError, match="h is float32 and w is bfloat16"):
        nx.cross_entropy(h, w.astype(jnp.bfloat16), labels, hidden=1, vocab=1)
    with pytest.raises(nx.NxopsError, match="w has dtype int32"):
        nx.cross_entropy(h, w.astype(jnp.int32), labels, hidden=1, vocab=1)


def test_errors_named_axes(mesh):
    h, w, labels = named_operands()
    with pytest.raises(nx.NxopsError, match="'vocab' is not bound here"):
        nx.cross_entropy(h, w[:, 0], labels, hidden=1, vocab="vocab")
    body = lambda h, w, l: nx.cross_entropy(h, w, l, hidden="hid", vocab="vocab")
    on_mesh = nx.xmap(body, [["tok", "hid"], ["hid", "vocab"], ["tok"]], ["tok"],
                      axis_resources={"hid": "y"})
    looped = nx.xmap(fused_body, IN_AXES, ["tok"], axis_resources={"vocab": nx.SerialLoop(2)})
    with jax.set_mesh(mesh):
        with pytest.raises(nx.NxopsError, match="hidden axis 'hid' runs on mesh axes"):
            on_mesh(jnp.zeros((T, 4)), jnp.zeros((4, V)), labels)
        with pytest.raises(nx.NxopsError, match="serial loop"):
            looped(h, w, labels)


def test_plain_vmap_vocab_name_and_a_weight_per_member():
    """Outside xmap: the vocab as a jax.vmap name; and vmap over stacked weights
    (no shared matmul to fold the tokens into: one loop per weight)."""
    h, w, labels, _ = operands(5, 3, 11, jnp.float32, "normal", 2, None)
    named = jax.vmap(lambda w: nx.cross_entropy(h, w, labels, hidden=1, vocab="v"),
                     in_axes=1, out_axes=None, axis_name="v")
    assert_close(named(w), unfused_loss(h, w, labels)[0])
    weights = jnp.stack([w, -2 * w])

    def per_weight(loss_fn):
        return lambda ws: jnp.sum(jax.vmap(lambda w: loss_fn(h, w, labels))(ws) ** 2)
    fused = per_weight(lambda h, w, l: nx.cross_entropy(h, w, l, hidden=1, vocab=1))
    unfused = per_weight(lambda h, w, l: unfused_loss(h, w, l)[0])
    assert_close(fused(weights), unfused(weights))
    assert_close(jax.grad(fused)(weights), jax.grad(unfused)(weights))


def test_vocab_parallel_bf16_ignore_index_and_z_loss(mesh):
    """bf16, tokens on x and the vocab on y, ignored positions, a z-loss on the
    logsumexp: values and gradients (outside) as the unfused f32 program's."""
    h, w, labels, c = operands(T, H, V, jnp.bfloat16, "normal", 5, -100)

    def body(h, w, labels):
        return nx.cross_entropy(h, w, labels, hidden=0, vocab="vocab", ignore_index=-100,
                                return_lse=True)
    xmapped = nx.xmap(body, IN_AXES, [["tok"], ["tok"]],
                      axis_resources={"tok": "x", "vocab": "y"})
    with jax.set_mesh(mesh):
        got = jax.jit(loss_and_grads, static_argnums=0)(xmapped, h, w, labels, c)
    want = loss_and_grads(functools.partial(unfused_loss, ignore_index=-100), h, w, labels, c)
    assert_matches_unfused(got, want, jnp.bfloat16)
