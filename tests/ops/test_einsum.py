"""nx.einsum and nx.pdot against np.einsum: positional, named (vmap), mesh
(shard_map), gradients, dtypes, random specs (hypothesis), and spec errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import nxops as nx
from nxops.ops._einsum_spec import parse_einsum_spec
from tests.ops._util import assert_close


def rand(*shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("spec,shapes", [
    ("ij,jk->ik", [(3, 5), (5, 7)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ijk,kl->li", [(3, 4, 5), (5, 6)]),
    ("i,i->", [(7,), (7,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("ii->i", [(4, 4)]),
    ("ij->ji", [(3, 5)]),
    ("ij->", [(3, 5)]),
    ("...k,kl", [(2, 3, 5), (5, 4)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (1, 4, 5)]),
    ("ab,bc,cd->ad", [(3, 4), (4, 5), (5, 2)]),
    ("abc,cd,bd->a", [(2, 3, 4), (4, 5), (3, 5)]),
    ("ij,kj", [(3, 4), (5, 4)]),
])
def test_positional_matches_numpy(spec, shapes):
    ops = [rand(*s, seed=i) for i, s in enumerate(shapes)]
    assert_close(nx.einsum(spec, *ops), np.einsum(spec, *ops), scale=10)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_output_dtype_follows_jnp(dtype):
    a, b = rand(3, 4, dtype=dtype), rand(4, 5, dtype=dtype)
    out = nx.einsum("ij,jk->ik", a, b)
    assert out.dtype == jnp.einsum("ij,jk->ik", a, b).dtype
    assert_close(out, np.einsum("ij,jk->ik", a.astype(np.float32), b.astype(np.float32)), dtype, scale=5)
    mixed = nx.einsum("ij,jk->ik", a, rand(4, 5))
    assert mixed.dtype == jnp.result_type(dtype, np.float32)


def named_matmul(x, w, spec):
    """x[b, k], w[k, m]; b and k vmapped as names."""
    inner = jax.vmap(lambda xr, wr: nx.einsum(spec, xr, wr), in_axes=(0, 0), axis_name="k",
                     out_axes=None)
    return jax.vmap(inner, in_axes=(0, None), axis_name="b")(x, w)


@pytest.mark.parametrize("spec", ["<k>,<k>m->m", "<b,k>,<k>m->m<b>", "{b,k},{k}m->{b}m",
                                  "<k,b>,m<k>->m<b>"])
def test_named_contraction_in_vmap(spec):
    x, w = rand(7, 5), rand(5, 3)
    assert_close(named_matmul(x, w, spec), x @ w, scale=10)


def test_named_batch_axis_and_positional_contraction():
    a, b = rand(4, 3, 5), rand(4, 5, 2)
    f = jax.vmap(lambda p, q: nx.einsum("ij<n>,jk<n>->ik<n>", p, q), axis_name="n")
    assert_close(f(a, b), np.einsum("nij,njk->nik", a, b), scale=10)


def test_name_in_one_operand_only_is_summed():
    a, b = rand(4, 3), rand(3, 2)
    f = jax.vmap(lambda p: nx.einsum("i<n>,ij->j", p, b), axis_name="n", out_axes=None)
    assert_close(f(a), a.sum(0) @ b, scale=10)


def test_operand_replicated_along_contracted_name():
    # w does not vary along 'k' (in_axes None): the sum sees k equal copies.
    x, w = rand(5, 3), rand(3, 2)
    f = jax.vmap(lambda xr: nx.einsum("i<k>,ij<k>->j", xr, w), axis_name="k", out_axes=None)
    assert_close(f(x), x.sum(0) @ w, scale=10)


def test_three_operands_with_names():
    a, b, c = rand(4, 3), rand(4, 3, 5), rand(5, 2)
    f = jax.vmap(lambda p, q: nx.einsum("i<n>,ij<n>,jk->k", p, q, c), axis_name="n", out_axes=None)
    assert_close(f(a, b), np.einsum("ni,nij,jk->k", a, b, c), scale=10)


def test_gradient_of_named_einsum_matches_positional():
    x, w = rand(7, 5), rand(5, 3)
    loss = lambda x, w: (named_matmul(x, w, "<b,k>,<k>m->m<b>") ** 2).sum()
    ref = lambda x, w: ((x @ w) ** 2).sum()
    for g, r in zip(jax.grad(loss, (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w)):
        assert_close(g, r, scale=10)


def test_gradient_of_positional_einsum_with_batch_and_transpose():
    a, b = rand(2, 3, 4), rand(2, 5, 4)
    f = lambda a, b: (nx.einsum("bij,bkj->kbi", a, b) * np.arange(3.0)).sum()
    ref = lambda a, b: (jnp.einsum("bij,bkj->kbi", a, b) * np.arange(3.0)).sum()
    for g, r in zip(jax.grad(f, (0, 1))(a, b), jax.grad(ref, (0, 1))(a, b)):
        assert_close(g, r, scale=10)


def test_contraction_over_mesh_axis(mesh8):
    x, w = rand(4, 16), rand(16, 3)
    with jax.set_mesh(mesh8):
        xs = jax.device_put(x, NamedSharding(mesh8, P(None, "x")))
        ws = jax.device_put(w, NamedSharding(mesh8, P("x")))
        f = jax.jit(jax.shard_map(lambda a, b: nx.einsum("bk<x>,k<x>m->bm", a, b), mesh=mesh8,
                                  in_specs=(P(None, "x"), P("x")), out_specs=P()))
        assert_close(f(xs, ws), x @ w, scale=10)
        g = jax.grad(lambda a: (f(a, ws) ** 2).sum())(xs)
    assert_close(g, jax.grad(lambda a: ((a @ w) ** 2).sum())(x), scale=10)


def test_mesh_name_kept_in_output(mesh2x4):
    a, b = rand(8, 3), rand(3, 2)
    with jax.set_mesh(mesh2x4):
        f = jax.jit(jax.shard_map(lambda p: nx.einsum("ni<y>,ij->nj<y>", p, b), mesh=mesh2x4,
                                  in_specs=P("y"), out_specs=P("y")))
        out = f(jax.device_put(a, NamedSharding(mesh2x4, P("y"))))
    assert_close(out, a @ b, scale=10)


def test_pdot_like_lax_pdot():
    x, w = rand(7, 5), rand(5, 3)
    f = jax.vmap(lambda xc, wc: nx.pdot(xc, wc, "k"), axis_name="k", in_axes=(1, 0), out_axes=None)
    assert_close(f(x, w), x @ w, scale=10)
    a, b = rand(4, 2, 3, 6), rand(4, 2, 6, 5)  # [k, batch, i, j] x [k, batch, j, l]
    g = jax.vmap(lambda p, q: nx.pdot(p, q, "k", pos_contract=((2,), (1,)), pos_batch=((0,), (0,))),
                 axis_name="k", out_axes=None)
    assert_close(g(a, b), np.einsum("kbij,kbjl->bil", a, b), scale=10)


def test_pdot_over_mesh_axis(mesh8):
    x, w = rand(3, 8), rand(8, 2)
    with jax.set_mesh(mesh8):
        f = jax.jit(jax.shard_map(lambda a, b: nx.pdot(a, b, "x", pos_contract=((1,), (0,))),
                                  mesh=mesh8, in_specs=(P(None, "x"), P("x")), out_specs=P()))
        out = f(jax.device_put(x, NamedSharding(mesh8, P(None, "x"))),
                jax.device_put(w, NamedSharding(mesh8, P("x"))))
    assert_close(out, x @ w, scale=10)


def test_precision_is_passed_through():
    a, b = rand(3, 4), rand(4, 5)
    out = nx.einsum("ij,jk->ik", a, b, precision=lax.Precision.HIGHEST)
    assert_close(out, a @ b, scale=10)
    text = jax.jit(lambda a, b: nx.einsum("ij,jk->ik", a, b, precision=lax.Precision.HIGHEST)) \
        .lower(a, b).as_text()
    assert "HIGHEST" in text


# --- random specs (hypothesis) -------------------------------------------------

LETTERS = "abcdef"


@st.composite
def einsum_problems(draw):
    sizes = {c: draw(st.integers(1, 4)) for c in LETTERS}
    n_ops = draw(st.integers(1, 3))
    terms = [draw(st.lists(st.sampled_from(LETTERS), min_size=0, max_size=3, unique=True))
             for _ in range(n_ops)]
    # Each term's letters are split into positional ones and one named one.
    named = [draw(st.sampled_from(t)) if t and draw(st.booleans()) else None for t in terms]
    used = sorted({c for t in terms for c in t})
    out = draw(st.lists(st.sampled_from(used), unique=True, max_size=len(used))) if used else []
    return sizes, terms, named, out


@settings(max_examples=40, deadline=None)
@given(einsum_problems())
def test_random_specs_match_np_einsum(problem):
    sizes, terms, named, out = problem
    operands = [rand(*[sizes[c] for c in t], seed=i) for i, t in enumerate(terms)]
    expected = np.einsum(",".join("".join(t) for t in terms) + "->" + "".join(out), *operands)
    # The named letter of each term becomes a vmapped axis name; vmap every
    # letter that is named anywhere, in all operands carrying it.
    names = sorted({n for n in named if n is not None})

    def term_text(t, is_output=False):
        pos = "".join(c for c in t if c not in names)
        group = [c for c in t if c in names]
        return pos + (f"<{','.join(group)}>" if group else "")
    spec = ",".join(term_text(t) for t in terms) + "->" + term_text(out, True)

    fn = lambda *ops: nx.einsum(spec, *ops)
    for name in reversed(names):
        outer = names[:names.index(name)]  # already vmapped away at this level
        in_axes = tuple(t.index(name) - sum(1 for c in t[:t.index(name)] if c in outer)
                        if name in t else None for t in terms)
        fn = jax.vmap(fn, in_axes=in_axes, axis_name=name,
                      out_axes=0 if name in out else None)
    result = fn(*operands)
    # The result's named dims come first (in `names` order), then positional.
    out_names = [c for c in names if c in out]
    got_order = out_names + [c for c in out if c not in names]
    expected = np.einsum("".join(out) + "->" + "".join(got_order), expected) if out else expected
    assert_close(result, expected, scale=50)


# --- spec parsing and errors -------------------------------------------------------


def test_parse_named_groups_anywhere_and_both_brackets():
    spec = parse_einsum_spec("n<b,k>, {k,m} -> n<b,m>")
    assert spec.inputs[0].positional == ("n",) and spec.inputs[0].names == ("b", "k")
    assert spec.inputs[1].names == ("k", "m") and spec.output.names == ("b", "m")
    assert parse_einsum_spec("<i>jk,<i>->jk").inputs[0].positional == ("j", "k")


def test_parse_is_cached():
    assert parse_einsum_spec("ij,jk->ik") is parse_einsum_spec("ij,jk->ik")


@pytest.mark.parametrize("spec,message", [
    ("ij,jk->iq", "result letter 'q' is in no operand"),
    ("<a>,<b>-><c>", "result name 'c' is in no operand"),
    ("i<a,b>j<c>->i", "at most one named group"),
    ("i<a,b->i", "unclosed named group"),
    ("i<a,,b>->i", "empty name"),
    ("i<1a>->i", "not a valid axis name"),
    ("i<a,a>->i", "appears twice in one group"),
    ("i$j->i", "unexpected character '\\$'"),
    ("ij->ii", "appears twice in the result"),
    ("ij->i->j", "'->' appears twice"),
    ("i->...i", "'...' in the result but in no operand"),
])
def test_bad_specs_quote_and_point(spec, message):
    with pytest.raises(nx.NxopsError, match=message) as info:
        parse_einsum_spec(spec)
    assert spec in str(info.value) and "^" in str(info.value)


def test_operand_count_and_rank_errors():
    with pytest.raises(nx.NxopsError, match="has 2 operand terms but was given 1"):
        nx.einsum("ij,jk->ik", np.ones((2, 2)))
    with pytest.raises(nx.NxopsError,
                       match=r"'ij' has 2 positional letters but its operand has shape \(2, 2, 2\)"):
        nx.einsum("ij,jk->ik", np.ones((2, 2, 2)), np.ones((2, 2)))
    with pytest.raises(nx.NxopsError, match="letter 'j' has size 3 in one operand and 4"):
        nx.einsum("ij,jk->ik", np.ones((2, 3)), np.ones((4, 2)))


def test_unbound_name_in_spec():
    with pytest.raises(nx.NxopsError, match="axis name 'k' is not bound"):
        nx.einsum("i<k>,i<k>->i", np.ones(3), np.ones(3))


def test_pdot_errors():
    with pytest.raises(nx.NxopsError, match="must pair up"):
        jax.vmap(lambda a: nx.pdot(a, a, "k", pos_contract=((0,), ())), axis_name="k")(np.ones((2, 3)))
    with pytest.raises(nx.NxopsError, match="out of range"):
        jax.vmap(lambda a: nx.pdot(a, a, "k", pos_contract=((5,), (0,))), axis_name="k")(np.ones((2, 3)))


@pytest.mark.parametrize("resources", [{}, {"a": "x"}, {"a": ("x", "y")}, {"a": "y"}], ids=str)
def test_operand_without_the_contracted_name_multiplies_the_finished_sum_on_every_placement(
        resources):
    # Found by the oracle: '<a>i,<a>i,i->i' with a third operand that varies along 'a'
    # but does not list it. It is not indexed by 'a' (einsum semantics, as under vmap),
    # so the result is sum_a(x_a * y_a) * z at each position, on mesh devices too.
    rng = np.random.default_rng(0)
    x, y, z = (rng.standard_normal((8, 4)).astype(np.float32) for _ in range(3))
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        got = nx.xmap(lambda x, y, z: nx.einsum("<a>i,<a>i,i->i", x, y, z),
                      (["a", ...], ["a", ...], ["a", ...]), ["a", ...],
                      axis_resources=resources)(x, y, z)
    np.testing.assert_allclose(got, (x * y).sum(0) * z, rtol=1e-5, atol=1e-5)
