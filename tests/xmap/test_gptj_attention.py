"""GPT-J's layer (tests/_megatron.py) with its hand-written attention and
with nx.attention: the same loss and the same gradients (every weight and
the input) on every placement, taken outside the xmap and inside the body
(as GPT-J's training step takes them), both equal to a positional
plain-JAX layer on one device; and the training step's temp memory drops by
the score matrices (bench/bench_attention.py's `layer` table at 8192 tokens)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import nxops as nx
from bench.bench_attention import LAYER_SIZES, WITHOUT_ATTENTION, layer_memory, score_matrix_bytes
from tests._megatron import ATTENTION, GPTJ_AXES, fg_operators, gptj_layer, gptj_params, layer_norm
from tests._tolerances import assert_close

BATCH, TOKENS, MODEL, HEADS, HEAD_DIM, FFN = 2, 8, 16, 8, 4, 32
SHARDS = 4     # the heads' name "s": 2 heads per shard

# (layout, resources): "positional" keeps the tokens positional in the body
# (GPT-J's layout); "named" names them "t", which a mesh axis can split
# (ring attention, and the materialized program's all-gather of the keys).
PLACEMENTS = {
    "none": ("positional", {}),
    "batch on dp": ("positional", {"b": "dp"}),
    "heads on mp": ("positional", {"s": "mp"}),
    "batch dp, heads mp": ("positional", {"b": "dp", "s": "mp"}),
    "batch on a loop": ("positional", {"b": nx.SerialLoop(2)}),
    "sequence on mp": ("named", {"t": "mp"}),
    "heads dp, sequence mp": ("named", {"s": "dp", "t": "mp"}),
}
TOKEN_NAMES = {"positional": ["b"], "named": ["b", "t"]}


@functools.lru_cache(maxsize=None)
def operands():
    params = gptj_params(jax.random.key(0), shards=SHARDS, model=MODEL, heads=HEADS,
                         head_dim=HEAD_DIM, ffn=FFN)
    x = jax.random.normal(jax.random.key(1), (BATCH, TOKENS, MODEL))
    return params, x


def mesh():
    return jax.make_mesh((2, 4), ("dp", "mp"), axis_types=(AxisType.Explicit,) * 2)


def layer_body(attention, layout):
    seq = "t" if layout == "named" else None

    def body(params, x):
        f, g = fg_operators(nx.psum, "s")
        return gptj_layer(params, x, f, g, HEAD_DIM, ATTENTION[attention], seq)
    return body


def x_axes(layout):
    return [*TOKEN_NAMES[layout], ...]


def outside_step(attention, placement):
    """jax.value_and_grad of the mean square of the xmapped layer's output."""
    layout, resources = PLACEMENTS[placement]
    layer = nx.xmap(layer_body(attention, layout), (GPTJ_AXES, x_axes(layout)), x_axes(layout),
                    axis_resources=resources)
    return jax.jit(jax.value_and_grad(lambda p, x: jnp.mean(layer(p, x) ** 2), argnums=(0, 1)))


def inside_step(attention, placement):
    """GPT-J's step: jax.value_and_grad in the body, of each batch position's
    loss (the mean square over its tokens); every position's loss and
    gradients come out, to be averaged outside (a pmean over a looped name
    is not allowed in the body)."""
    layout, resources = PLACEMENTS[placement]
    body = layer_body(attention, layout)
    names = TOKEN_NAMES[layout]

    def step(params, x):
        def loss(params, x):
            per_position = jnp.mean(body(params, x) ** 2)
            return nx.mean(per_position, "t") if layout == "named" else per_position
        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    per_position = {name: [*names, *axes] for name, axes in GPTJ_AXES.items()}
    return jax.jit(nx.xmap(step, (GPTJ_AXES, x_axes(layout)), (names, (per_position, x_axes(layout))),
                           axis_resources=resources))


# --- the positional reference ------------------------------------------------


def reference_layer(params, x, f_cotangent_scale=1.0):
    """x [B, T, D]; every shard's heads at once, causal softmax with -inf.
    ``f_cotangent_scale`` multiplies the cotangent of what enters the shards'
    work: outside the xmap, f's psum backward receives a cotangent that is
    already whole and sums it over the shards (docs/xmap.md, "Custom rules
    with named collectives")."""
    @jax.custom_vjp
    def into_shards(h):
        return h
    into_shards.defvjp(lambda h: (h, None), lambda _, ct: (ct * f_cotangent_scale,))

    h = into_shards(layer_norm(x) * params["ln"])
    local = HEADS // SHARDS
    qkv = jnp.einsum("btd,sde->bste", h, params["qkv"]).reshape(
        -1, SHARDS, TOKENS, 3, local, HEAD_DIM)
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    scores = jnp.einsum("bsqhd,bskhd->bshqk", q, k) / np.sqrt(HEAD_DIM)
    scores = jnp.where(np.tril(np.ones((TOKENS, TOKENS), bool)), scores, -jnp.inf)
    heads = jnp.einsum("bshqk,bskhd->bsqhd", jax.nn.softmax(scores, -1), v)
    attended = jnp.einsum("bsqe,sem->bqm", heads.reshape(-1, SHARDS, TOKENS, local * HEAD_DIM),
                          params["out"])
    hidden = jax.nn.gelu(jnp.einsum("btd,sdf->bstf", h, params["ffn_in"]))
    mlp = jnp.einsum("bstf,sfm->btm", hidden, params["ffn_out"])
    return x + attended + mlp


@functools.lru_cache(maxsize=None)
def reference_outside():
    loss = lambda p, x: jnp.mean(reference_layer(p, x, SHARDS) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*operands())


@functools.lru_cache(maxsize=None)
def reference_inside():
    """Each batch position's loss and gradients (a vmap of the one-example step)."""
    loss = lambda p, x: jnp.mean(reference_layer(p, x[None])[0] ** 2)
    return jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)), in_axes=(None, 0)))(
        *operands())


def per_batch_position(step_result):
    """A named-sequence step's per-(batch, token) results as the batch
    positions': every token position computes its batch position's loss and
    takes its gradient, and the named reductions over "t" (the mean, the
    keys' gather) transpose to sums over the positions (docs/xmap.md), so
    each position's weight gradients sum to TOKENS times the batch
    position's, and each token's input gradient is TOKENS times its own.
    GPT-J would take the mean over "t" as it does over "b"."""
    loss, (params, x) = jax.tree.map(np.asarray, step_result)
    np.testing.assert_array_equal(loss, np.broadcast_to(loss[:, :1], loss.shape))
    return loss[:, 0], (jax.tree.map(lambda g: np.mean(g, 1), params), x / TOKENS)


def assert_tree_close(got, want):
    """Every leaf to f32 rounding of the leaf's largest magnitude."""
    assert jax.tree.structure(tuple(got)) == jax.tree.structure(tuple(want))
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        try:
            assert_close(g, w, scale=4 * max(1.0, float(np.max(np.abs(np.asarray(w))))))
        except AssertionError as error:
            raise AssertionError(f"{jax.tree_util.keystr(path)}: {error}") from None


# --- the tests ---------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_same_loss_and_gradients_on_every_placement(placement):
    """Outside the xmap and inside the body, nx.attention's layer gives the
    hand-written layer's loss and gradients, and both the positional
    reference's. (One compile per placement: the four steps in one jit.)"""
    steps = {(attention, where): make(attention, placement) for attention in ATTENTION
             for where, make in (("outside", outside_step), ("inside", inside_step))}
    args = operands()
    with jax.set_mesh(mesh()):
        got = dict(zip(steps, jax.jit(lambda *a: [s(*a) for s in steps.values()])(*args)))
    for where in ("outside", "inside"):
        assert_tree_close(got["nx.attention", where], got["materialized", where])
    assert_tree_close(got["nx.attention", "outside"], reference_outside())
    inside = got["nx.attention", "inside"]
    if PLACEMENTS[placement][0] == "named":
        inside = per_batch_position(inside)
    assert_tree_close(inside, reference_inside())


def test_training_step_temp_drops_by_the_score_matrices():
    """Compiled, never run (CPU): the hand-written layer's step holds at least
    three [heads, T, T] f32 matrices more than the layer with v in place of
    its attention (3.85 measured), nx.attention's less than one (0.68), so
    the drop is at least two score matrices (3.17 measured)."""
    size = LAYER_SIZES["small"]   # 1024 tokens, 4 heads, head dim 32, f32
    temp, scores = layer_memory(size), score_matrix_bytes(size)
    floor = temp[WITHOUT_ATTENTION]
    assert temp["materialized"] >= floor + 3 * scores, (temp, scores)
    assert temp["nx.attention"] <= floor + scores, (temp, scores)
    assert temp["nx.attention"] <= temp["materialized"] - 2 * scores, (temp, scores)
