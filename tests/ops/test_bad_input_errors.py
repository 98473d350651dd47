"""Issue 27's bad calls to named ops (found by fuzzing), each with its exact
call: an NxopsError that says what is wrong, quotes the input, and gives the
fix (before: a bare TypeError, an MLIR verifier error, "not bound here", or
nothing at all)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx

X = jnp.ones((4, 2, 3))


def _body_error(body) -> str:
    f = nx.xmap(body, [["a", "c", ...]], ["a", "c", ...])
    with pytest.raises(nx.NxopsError) as info:
        f(X)
    return str(info.value)


@pytest.mark.parametrize("key", [jnp.zeros(2, jnp.float32), np.zeros(2, np.int32), 0],
                         ids=["float32", "int32", "a seed"])
def test_a_key_that_is_not_a_prng_key(key):
    message = _body_error(lambda x: x + nx.random.normal(key, (3,)))
    assert message.startswith("nx.random.normal: the key is "), message
    assert "not a PRNG key. Make one with jax.random.key(seed)" in message
    if not isinstance(key, int):
        assert f"an array of dtype {key.dtype} and shape (2,)" in message


@pytest.mark.parametrize("sampler", ["normal", "uniform", "bits"])
def test_a_negative_shape(sampler):
    key = jax.random.key(0)
    message = _body_error(lambda x: x + getattr(nx.random, sampler)(key, (-1,)))
    assert f"nx.random.{sampler}: shape=(-1,) has the negative size -1" in message
    assert "give the full shape, e.g. x.shape" in message


def test_bernoulli_with_a_negative_shape():
    with pytest.raises(nx.NxopsError, match=re.escape("shape=(2, -3) has the negative size -3")):
        nx.random.bernoulli(jax.random.key(0), 0.5, (2, -3))


def test_valid_keys_still_sample():
    legacy = jax.random.PRNGKey(0)   # uint32[2]
    np.testing.assert_array_equal(nx.random.normal(legacy, (3,), names=()),
                                  jax.random.normal(legacy, (3,)))


@pytest.mark.parametrize("call,flat", [
    (lambda x: nx.sum(x, (0, ("a", "c"))), "(0, 'a', 'c')"),
    (lambda x: nx.mean(x, (("a",), 1)), "('a', 1)"),
    (lambda x: nx.psum(x, (("a", "c"),)), "('a', 'c')"),
    (lambda x: nx.all_gather(x, ("a", ("c",))), "('a', 'c')"),
    (lambda x: x * nx.axis_index((("a", "c"),)), "('a', 'c')"),
], ids=["sum", "mean", "psum", "all_gather", "axis_index"])
def test_a_nested_tuple_of_axes_says_to_flatten_it(call, flat):
    message = _body_error(call)
    assert "nest the tuple" in message and "not bound" not in message, message
    assert message.endswith(f"For these axes write {flat}."), message


def test_nested_tuple_message_quotes_the_axes():
    message = _body_error(lambda x: nx.sum(x, (0, ("a", "c"))))
    assert message.startswith("nx.sum: the axes (0, ('a', 'c')) nest the tuple ('a', 'c')")


@pytest.mark.parametrize("spec,letter,pointer,renamed", [
    ("<b>b->", "b", 3, "<b>a->"),
    ("ij,<i>jk->ik", "i", 0, "aj,<i>jk->ak"),
    ("k<b,a>,<a>b->k", "b", 10, "k<b,a>,<a>c->k"),
])
def test_a_letter_that_is_also_a_name_is_refused(spec, letter, pointer, renamed):
    with pytest.raises(nx.NxopsError) as info:
        nx.einsum(spec, *[jnp.ones((2, 2))] * (spec.count(",") + 1))
    lines = str(info.value).splitlines()
    assert lines[0] == (f"invalid einsum spec: {letter!r} is both a positional letter and a "
                        f"name in a group (<{letter}>)")
    assert lines[1].strip() == spec and lines[2] == " " * (4 + pointer) + "^"
    assert lines[3].endswith(f"give them different spellings, e.g. {renamed!r}.")


@pytest.mark.parametrize("resources", [{}, {"heads": "x"}, {"heads": ("x", "y")}],
                         ids=["none", "mesh", "whole_mesh"])
def test_a_named_group_missing_on_one_operand_says_to_put_it_on_every_operand(resources):
    a = jnp.asarray(np.random.default_rng(0).normal(size=(4, 5, 3)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(4, 3, 2)), jnp.float32)

    def run(spec):
        with jax.set_mesh(jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4])):
            return nx.xmap(lambda a, w: nx.einsum(spec, a, w), [["heads", ...], ["heads", ...]],
                           [...], axis_resources=resources)(a, w)
    with pytest.raises(nx.NxopsError) as info:
        run("tk,<heads>kd->td")
    message = str(info.value)
    assert message.endswith(
        "If it comes from nx.einsum 'tk,<heads>kd->td': 'heads' is summed only in the operands "
        "whose groups list it, and an operand that omits <heads> keeps varying along it. To "
        "contract 'heads' in every operand, write 'tk<heads>,kd<heads>->td'."), message
    np.testing.assert_allclose(run("tk<heads>,kd<heads>->td"), jnp.einsum("htk,hkd->td", a, w),
                               rtol=1e-5)


def test_an_unrelated_out_axes_error_has_no_einsum_hint():
    f = nx.xmap(lambda a, w: nx.einsum("tk,<heads>kd->td", a, w) + 0 * nx.axis_index("b"),
                [["heads", "b", ...], ["heads", ...]], ["heads", ...])
    with pytest.raises(nx.NxopsError) as info:
        f(jnp.ones((4, 2, 5, 3)), jnp.ones((4, 3, 2)))
    assert "varies along the named axis 'b'" in str(info.value)
    assert "nx.einsum" not in str(info.value)
