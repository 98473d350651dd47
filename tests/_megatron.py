"""Megatron's (and GPT-J's) tensor-parallel operators, as those codebases
write them: f (identity forward, ``psum`` backward) and g (``psum`` forward,
identity backward) over ``axis``, with ``psum`` either nx.psum or lax.psum;
and GPT-J's layer written with them, its attention either by hand (the
scores materialized) or ``nx.attention``."""
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import nxops as nx


def fg_operators(psum, axis):
    @jax.custom_vjp
    def f(x):
        return x
    f.defvjp(lambda x: (x, None), lambda _, ct: (psum(ct, axis),))

    @jax.custom_vjp
    def g(x):
        return psum(x, axis)
    g.defvjp(lambda x: (g(x), None), lambda _, ct: (ct,))
    return f, g


def fg_operators_typed(axis):
    """f and g over ``axis`` for ``shard_map(check_vma=True)``: g's identity
    bwd casts its cotangent (invariant along ``axis``, as g's result) to
    varying, as that typing asks of a varying operand's cotangent. Its
    gradients outside are those nx.xmap gives on every placement (the
    no-resources answer): JAX's typing hands f and g their results' whole
    cotangents, summing f's parts where f's result meets the varying weights."""
    @jax.custom_vjp
    def f(x):
        return x
    f.defvjp(lambda x: (x, None), lambda _, ct: (lax.psum(ct, axis),))

    @jax.custom_vjp
    def g(x):
        return lax.psum(x, axis)
    g.defvjp(lambda x: (g(x), None), lambda _, ct: (lax.pcast(ct, axis, to="varying"),))
    return f, g


def times_in_gradient(x, factor):
    """``x``, whose cotangent is multiplied by ``factor``: undoes the division
    of a ``shard_map(check_vma=False)``'s transpose, which hands each of the
    ``factor`` devices a result replicated over them its cotangent over
    ``factor``, so that f/g written for that program see whole cotangents."""
    @jax.custom_vjp
    def scaled(x):
        return x
    scaled.defvjp(lambda x: (x, None), lambda _, ct: (ct * factor,))
    return scaled(x)


# --- GPT-J's layer -----------------------------------------------------------
# One layer norm feeds attention and the MLP in parallel; both add to the
# residual. Each shard holds some heads (and MLP columns): its weights come
# in with a leading shard dim, named "s" in the body (GPTJ_AXES), f before
# the shard's work and g after it. The tokens are either positional in the
# body, x [T, D], or a named sequence, x [D] at one position. (No rotary
# embeddings: the toy layer the benchmarks stack has none.)

GPTJ_AXES = {"ln": [...], "qkv": ["s", ...], "out": ["s", ...], "ffn_in": ["s", ...],
             "ffn_out": ["s", ...]}


def gptj_params(key, *, shards, model, heads, head_dim, ffn, dtype=jnp.float32):
    """One layer's weights, each shard's heads and MLP columns along a leading dim."""
    local = heads // shards
    k = jax.random.split(key, 4)
    normal = lambda key, shape, fan_in: (jax.random.normal(key, shape) / fan_in**0.5
                                         ).astype(dtype)
    return {"ln": jnp.ones((model,), dtype),
            "qkv": normal(k[0], (shards, model, 3 * local * head_dim), model),
            "out": normal(k[1], (shards, local * head_dim, model), heads * head_dim),
            "ffn_in": normal(k[2], (shards, model, ffn // shards), model),
            "ffn_out": normal(k[3], (shards, ffn // shards, model), ffn)}


def layer_norm(x):
    return (x - jnp.mean(x, -1, keepdims=True)) * lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5)


def materialized_attention(q, k, v, seq=None):
    """Causal attention as GPT-J writes it: the [heads, T, T] scores, masked
    with -1e9, a softmax. q, k, v [T, heads, head_dim]; with ``seq`` named,
    [heads, head_dim] at one position, and every position's keys gathered."""
    if seq is None:
        query_positions = jnp.arange(q.shape[0])
    else:
        k, v, q = nx.all_gather(k, seq), nx.all_gather(v, seq), q[None]
        query_positions = nx.axis_index(seq)[None]
    scores = jnp.einsum("thd,shd->hts", q, k) / q.shape[-1]**0.5
    scores = jnp.where(jnp.arange(k.shape[0]) <= query_positions[:, None], scores, -1e9)
    out = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, -1), v)
    return out if seq is None else out[0]


def fused_attention(q, k, v, seq=None):
    """The same with ``nx.attention`` (the scores never held)."""
    if seq is not None:
        return nx.attention(q, k, v, seq=seq, q_seq=seq, causal=True)
    heads_first = lambda x: jnp.swapaxes(x, 0, 1)
    return heads_first(nx.attention(heads_first(q), k, v, seq=0, q_seq=1, causal=True))


ATTENTION = {"materialized": materialized_attention, "nx.attention": fused_attention}


def gptj_layer(p, x, f, g, head_dim, attention=materialized_attention, seq=None):
    """One shard's share of the layer (g sums the shards): x [T, D], or [D]
    at one position of the named sequence ``seq``."""
    h = f(layer_norm(x) * p["ln"])
    qkv = (h @ p["qkv"]).reshape(*h.shape[:-1], -1, head_dim)
    q, k, v = jnp.split(qkv, 3, axis=-2)
    heads = attention(q, k, v, seq)
    mlp = jax.nn.gelu(h @ p["ffn_in"]) @ p["ffn_out"]
    return x + g(heads.reshape(*x.shape[:-1], -1) @ p["out"] + mlp)


def gptj_stack(layers, head_dim):
    """GPT-J's layers in sequence, as ``nx.xmap`` (over the model shards
    ``"s"``, on mesh axis ``"mp"``; the batch ``"b"`` on ``"dp"``) and as its
    hand-written ``shard_map(check_vma=True)`` twin, whose typed f/g give the
    same gradients: (xmapped, twin, specs), the twin's in_specs being specs."""
    def stack(operators):
        def forward(params, x):
            f, g = operators()
            for p in params:
                x = gptj_layer(p, x, f, g, head_dim)
            return x
        return forward

    def local(params, x):   # one shard's weights: the leading shard dim dropped
        shard = [{n: w if n == "ln" else w[0] for n, w in p.items()} for p in params]
        return stack(lambda: fg_operators_typed("mp"))(shard, x[0])[None]
    layer_specs = {"ln": P(), "qkv": P("mp"), "out": P("mp"), "ffn_in": P("mp"),
                   "ffn_out": P("mp")}
    specs = ([layer_specs] * layers, P("dp"))

    def xmapped():
        return nx.xmap(stack(lambda: fg_operators(nx.psum, "s")),
                       ([GPTJ_AXES] * layers, ["b", ...]), ["b", ...],
                       axis_resources={"b": "dp", "s": "mp"})

    def twin():
        return jax.shard_map(local, in_specs=specs, out_specs=P("dp"), check_vma=True)
    return xmapped, twin, specs
