"""Megatron/GPT-J f/g operators (custom_vjps around nx.psum) in xmap bodies:
one gradient on every placement, outside and inside the body,
against the positional program (jax.vmap with axis_name); and a transformer
block written with f/g compiles to no more transposes or copies than the same
block with plain nx.psum."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nxops as nx
from tests._megatron import fg_operators

B, S = 4, 4   # sizes of the names 'b' (batch) and 's' (model shard)


def mlp(psum, fg, x, w1, w2):
    """Column- then row-parallel MLP: x [t, d] (replicated over 's'), w1 [d, h]
    and w2 [h, d] (one shard of h each)."""
    if not fg:
        return psum(jax.nn.gelu(x @ w1) @ w2, "s")
    f, g = fg_operators(psum, "s")
    return g(jax.nn.gelu(f(x) @ w1) @ w2)


PLACEMENTS = [   # (id, axis_resources) on a (2, 4) mesh ('x', 'y')
    ("none", {}),
    ("s_mesh", {"s": "y"}),
    ("both_mesh", {"b": "x", "s": "y"}),
    ("s_part_of_mesh", {"s": "x"}),               # mesh axis of 2 and a vmap tile of 2
    ("s_mesh_b_loop", {"b": nx.SerialLoop(2), "s": "y"}),
    ("b_loop", {"b": nx.SerialLoop(4)}),
]


def _args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B, 8, 16)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((S, 16, 12)) / 4, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((S, 12, 16)) / 4, jnp.float32)
    c = jnp.asarray(rng.standard_normal((B, 8, 16)), jnp.float32)
    return x, w1, w2, c


def _xmap(body, in_axes, out_axes, resources):
    return nx.xmap(body, in_axes, out_axes, axis_resources=resources)


def _positional(body, in_axes_s, in_axes_b, out_axes_s=None):
    """``body`` under jax.vmap over 's' (inner) then 'b' (outer)."""
    over_s = jax.vmap(body, in_axes=in_axes_s, out_axes=out_axes_s, axis_name="s")
    return jax.vmap(over_s, in_axes=in_axes_b, axis_name="b")


@pytest.mark.parametrize("name,resources", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_fg_gradient_outside_the_xmap_is_the_same_on_every_placement(name, resources):
    """jax.grad of the xmap. The reference is the positional program with
    plain lax.psum: g's identity backward gives its weight gradients exactly;
    f's psum backward sums the cotangent of the replicated x, which (as with no
    resources, where x's cotangent arrives whole) multiplies x's gradient by
    the size of 's'. JAX itself cannot differentiate the f/g positional program
    from outside (its bwd's lax.psum finds 's' unbound), hence this reference."""
    x, w1, w2, c = _args()
    loss = lambda f: lambda x, w1, w2: jnp.sum(f(x, w1, w2) * c)
    ref = _positional(functools.partial(mlp, lax.psum, False), (None, 0, 0), (0, None, None))
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(x, w1, w2)
    f = _xmap(functools.partial(mlp, nx.psum, True), [["b", ...], ["s", ...], ["s", ...]],
              ["b", ...], resources)
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        got = jax.grad(loss(f), argnums=(0, 1, 2))(x, w1, w2)
    np.testing.assert_allclose(np.asarray(got[0]), S * np.asarray(want[0]), rtol=1e-4, atol=1e-5)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,resources", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_fg_gradient_inside_the_body_is_the_same_on_every_placement(name, resources):
    """jax.grad inside the body, as GPT-J takes it, against jax.vmap of the
    same body with lax.psum (the positional program differentiates it)."""
    x, w1, w2, c = _args()

    def body(psum):
        def per_position(x, w1, w2, c):
            loss = lambda x, w1, w2: jnp.sum(mlp(psum, True, x, w1, w2) * c)
            return jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)
        return per_position

    want = _positional(body(lax.psum), (None, 0, 0, None), (0, None, None, 0), (None, 0, 0))(
        x, w1, w2, c)
    f = _xmap(body(nx.psum), [["b", ...], ["s", ...], ["s", ...], ["b", ...]],
              (["b", ...], ["b", "s", ...], ["b", "s", ...]), resources)
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        got = f(x, w1, w2, c)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def transformer_block(x, wq, wk, wv, wo, w1, w2, fg):
    """Pre-norm attention + MLP on one batch position: x [t, d]; this shard's
    heads (wq, wk, wv [d, heads, k], wo [heads, k, d]) and hidden units
    (w1 [d, h], w2 [h, d]). With ``fg`` the shards' sums are Megatron's f/g;
    without, plain nx.psum (whose gradients need no f)."""
    f, g = fg_operators(nx.psum, "s") if fg else (lambda v: v, lambda v: nx.psum(v, "s"))

    def norm(v):
        mean = jnp.mean(v, -1, keepdims=True)
        return (v - mean) * lax.rsqrt(jnp.var(v, -1, keepdims=True) + 1e-5)

    u = f(norm(x))
    q, k, v = (jnp.einsum("td,dhk->htk", u, w) for w in (wq, wk, wv))
    attention = jax.nn.softmax(jnp.einsum("hsk,htk->hst", q, k) / 4.0, axis=-1)
    x = x + g(jnp.einsum("hst,htk,hkd->sd", attention, v, wo))
    return x + g(jax.nn.gelu(f(norm(x)) @ w1) @ w2)


def test_fg_transformer_block_compiles_to_no_more_transposes_or_copies_than_plain_psum():
    rng = np.random.default_rng(1)
    shapes = [(B, 8, 16), (S, 16, 2, 4), (S, 16, 2, 4), (S, 16, 2, 4), (S, 2, 4, 16),
              (S, 16, 8), (S, 8, 16)]
    args = [jnp.asarray(rng.standard_normal(s) / 4, jnp.float32) for s in shapes]
    in_axes = [["b", ...]] + [["s", ...]] * 6
    counts, values = {}, {}
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        for fg in (False, True):
            def loss(*a, fg=fg):
                return nx.mean(jnp.mean(transformer_block(*a, fg=fg) ** 2), "b")
            step = jax.jit(jax.value_and_grad(
                nx.xmap(loss, in_axes, [...], axis_resources={"b": "x", "s": "y"}),
                argnums=tuple(range(1, 7))))
            text = step.lower(*args).compile().as_text()
            counts[fg] = {op: text.count(f" {op}(") for op in ("transpose", "copy")}
            values[fg] = step(*args)
    assert counts[True]["transpose"] <= counts[False]["transpose"], counts
    assert counts[True]["copy"] <= counts[False]["copy"], counts
    np.testing.assert_allclose(values[True][0], values[False][0], rtol=1e-6)


def test_custom_vjp_differentiated_again_by_other_arguments():
    """JAX traces a custom_vjp's fwd again for another set of differentiated
    arguments: the rule's wrapper keeps JAX's stores (was: StoreException)."""
    @jax.custom_vjp
    def scale(x, w):
        return x * w
    scale.defvjp(lambda x, w: (scale(x, w), (x, w)), lambda r, ct: (ct * r[1], ct * r[0]))
    f = nx.xmap(lambda x, w: jnp.sum(scale(x, w)), [["a", ...], [...]], ["a"])
    x, w = jnp.arange(12.0).reshape(4, 3), jnp.arange(3.0) + 1
    loss = lambda x, w: jnp.sum(f(x, w))
    np.testing.assert_allclose(jax.grad(loss, 0)(x, w), np.broadcast_to(w, (4, 3)))
    np.testing.assert_allclose(jax.grad(loss, 1)(x, w), x.sum(0))
    np.testing.assert_allclose(jax.grad(loss, (0, 1))(x, w)[1], x.sum(0))


def test_bwd_whose_variance_depends_on_its_residuals_is_refused_outside_on_a_mesh():
    """bwd's cotangent for the replicated w is ct * z, whose variance along
    the mesh axis comes from a residual: nxops cannot tell how to hand it back
    to shard_map, and says so."""
    @jax.custom_vjp
    def h(w, z):
        return nx.psum(z, "s") * w
    h.defvjp(lambda w, z: (h(w, z), (w, z)),
             lambda r, ct: (ct * r[1], nx.psum(ct * r[0], "s") + 0 * ct))
    z, w = jnp.arange(8.0).reshape(S, 2), jnp.ones(2)
    f = nx.xmap(h, [[...], ["s", ...]], [...], axis_resources={"s": "y"})
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        with pytest.raises(nx.NxopsError, match="varies along mesh axis 'y' or not depending"):
            jax.grad(lambda w: jnp.sum(f(w, z)))(w)


@pytest.mark.parametrize("wrap", ["checkpoint", "scan"])
@pytest.mark.parametrize("name,resources", [PLACEMENTS[0], PLACEMENTS[3]],
                         ids=[PLACEMENTS[0][0], PLACEMENTS[3][0]])
def test_fg_inside_a_sub_jaxpr_differentiates_outside(wrap, name, resources):
    """f/g inside jax.checkpoint or lax.scan, on a name with a vmap level: JAX
    traces g's nested fwd on a fresh trace that saw neither the level nor its
    axis environment ("axis name 'a' is not bound here", found by the oracle)."""
    x, w1, w2, c = _args()
    wrappers = {"checkpoint": lambda f: jax.checkpoint(f),
                "scan": lambda f: lambda *a: lax.scan(lambda _, __: (f(*a), None), f(*a) * 0,
                                                      None, length=1)[0]}
    loss = lambda f: lambda x, w1, w2: jnp.sum(f(x, w1, w2) * c)
    ref = _positional(functools.partial(mlp, lax.psum, False), (None, 0, 0), (0, None, None))
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(x, w1, w2)
    f = _xmap(wrappers[wrap](functools.partial(mlp, nx.psum, True)),
              [["b", ...], ["s", ...], ["s", ...]], ["b", ...], resources)
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        got = jax.grad(loss(f), argnums=(0, 1, 2))(x, w1, w2)
    np.testing.assert_allclose(np.asarray(got[0]), S * np.asarray(want[0]), rtol=1e-4, atol=1e-5)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


# --- grad outside the xmap vs its shard_map twins ---------------------------
# jax.value_and_grad of an f/g MLP taken outside, with x on 'b' (mesh axis dp)
# and replicated over 's' (mesh axis mp), as bench_first_call's fg_mlp. nxops
# gives the no-resources answer on every placement (module docstring of
# nxops/xmap/_custom_rules.py): the weights' exact gradients and x's times the
# size of 's' (f's psum backward sums a cotangent already whole). Two
# hand-written shard_map programs compute exactly that: with check_vma=True,
# whose typing hands f and g whole cotangents (g's bwd then casts its
# cotangent to varying, as that typing asks), and with check_vma=False, whose
# transpose hands each device 1/mp of the replicated result's cotangent, with
# that cotangent multiplied back by mp. nxops compiles to as many all-reduces
# of as many bytes as either. The plain check_vma=False program with the same
# f/g computes other gradients (x's loss gradient, the weights' 1/mp of theirs).


def _all_reduces(compiled) -> list:
    """(group size, bytes per device) of each all-reduce, sorted."""
    return sorted((c.group_size, c.bytes_per_device) for c in nx.hlo.collectives(compiled)
                  if c.kind == "all-reduce")


def _fg_twins(mp):
    from jax.sharding import PartitionSpec as P
    from tests._megatron import fg_operators_typed, times_in_gradient
    specs = (P("dp"), P("mp"), P("mp"))
    local = lambda psum: lambda x, w1, w2: mlp(
        lambda v, _: psum(v, "mp"), True, x[0], w1[0], w2[0])[None]

    def typed(x, w1, w2):
        f, g = fg_operators_typed("mp")
        return g(jax.nn.gelu(f(x[0]) @ w1[0]) @ w2[0])[None]
    twin = lambda body, check: jax.shard_map(body, in_specs=specs, out_specs=P("dp"),
                                             check_vma=check)
    return specs, {"check_vma=True": twin(typed, True),
                   "check_vma=False, cotangent x mp": twin(
                       lambda *a: times_in_gradient(local(lax.psum)(*a), mp), False),
                   "check_vma=False": twin(local(lax.psum), False)}


@pytest.mark.parametrize("mp", [2, 4])
def test_fg_grad_outside_compiles_like_its_twins_with_the_same_gradients(mp):
    from jax.sharding import NamedSharding
    rng = np.random.default_rng(2)
    shapes = [(2, 8, 16), (mp, 16, 12), (mp, 12, 16)]
    args = [jnp.asarray(rng.standard_normal(s) / 4, jnp.float32) for s in shapes]
    specs, twins = _fg_twins(mp)
    programs = {"xmap": nx.xmap(lambda x, w1, w2: mlp(lambda v, _: nx.psum(v, "s"), True,
                                                      x, w1, w2),
                                [["b", ...], ["s", ...], ["s", ...]], ["b", ...],
                                axis_resources={"b": "dp", "s": "mp"}), **twins}
    ref = _positional(functools.partial(mlp, lax.psum, False), (None, 0, 0), (0, None, None))
    ref_loss, ref_grads = jax.value_and_grad(lambda *a: jnp.mean(ref(*a) ** 2),
                                             argnums=(0, 1, 2))(*args)
    mesh = jax.make_mesh((2, mp), ("dp", "mp"), devices=jax.devices()[:2 * mp])
    got, all_reduces = {}, {}
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        for name, p in programs.items():
            step = lambda argnums: jax.jit(jax.value_and_grad(
                lambda *a: jnp.mean(p(*a) ** 2), argnums=argnums))
            got[name] = step((0, 1, 2))(*placed)
            # also for the gradient of x alone, as bench_first_call's fg_mlp takes it
            all_reduces[name] = [_all_reduces(step(a).lower(*placed).compile())
                                 for a in ((0, 1, 2), 0)]
    close = functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6)
    no_resources = [mp * np.asarray(ref_grads[0]), *ref_grads[1:]]
    for name, (loss, grads) in got.items():
        close(loss, ref_loss)
        want = (no_resources if name != "check_vma=False"
                else [ref_grads[0], *(np.asarray(r) / mp for r in ref_grads[1:])])
        for g, w in zip(grads, want):
            close(g, w)
    for name in ("check_vma=True", "check_vma=False, cotangent x mp"):
        assert all_reduces["xmap"] == all_reduces[name], (name, all_reduces)
    assert len(all_reduces["xmap"][1]) == 4, all_reduces["xmap"]


def test_fg_stack_grad_outside_needs_no_more_all_reduces_than_its_typed_twin():
    """Two GPT-J layers (f/g in each) with the gradient outside: each layer's
    g feeds the next layer's f, whose bwd hands back a cotangent the same on
    every device, so no g sums its cotangent; the check_vma=True twin, which
    computes the same gradients, runs at least as many all-reduces."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tests._megatron import gptj_params, gptj_stack
    mp, layers, head_dim = 2, 2, 8
    keys = jax.random.split(jax.random.key(3), layers + 1)
    params = [gptj_params(k, shards=mp, model=32, heads=4, head_dim=head_dim, ffn=64)
              for k in keys[1:]]
    x = jax.random.normal(keys[0], (2, 8, 32))
    xmapped, twin, specs = gptj_stack(layers, head_dim)
    programs = {"xmap": xmapped(), "twin": twin()}
    mesh = jax.make_mesh((2, mp), ("dp", "mp"), devices=jax.devices()[:2 * mp])
    got, all_reduces = {}, {}
    with jax.set_mesh(mesh):
        placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                              (params, x), specs, is_leaf=lambda s: isinstance(s, P))
        for name, p in programs.items():
            step = jax.jit(jax.value_and_grad(lambda *a: jnp.mean(p(*a) ** 2), argnums=(0, 1)))
            got[name] = step(*placed)
            all_reduces[name] = _all_reduces(step.lower(*placed).compile())
    for a, b in zip(jax.tree.leaves(got["xmap"]), jax.tree.leaves(got["twin"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    (xmap_count, xmap_bytes), (twin_count, twin_bytes) = [
        (len(a), sum(b for _, b in a)) for a in all_reduces.values()]
    assert xmap_count <= twin_count and xmap_bytes <= twin_bytes, all_reduces
