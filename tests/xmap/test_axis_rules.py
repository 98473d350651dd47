"""Logical axis rules (flax's priority semantics, written out as cases without
importing flax) and the nx.axis_rules context."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from nxops.xmap._rules import check_rules, resources_from_rules

# (names, rules, expected {name: mesh axes}); as flax's logical_to_mesh_axes
# resolves the same names as the dims of one array.
PRIORITY_CASES = [
    # the first matching rule wins
    (("batch", "embed"), [("batch", "data"), ("embed", "model")],
     {"batch": ("data",), "embed": ("model",)}),
    # a mesh axis is used at most once: 'vocab' takes 'model' first, 'embed' falls through
    (("batch", "vocab", "embed"), [("batch", "data"), ("vocab", "model"), ("embed", "model")],
     {"batch": ("data",), "vocab": ("model",)}),
    # a later rule for the same name applies when the earlier one's axes are taken
    (("heads", "kv"), [("heads", "model"), ("kv", "model"), ("kv", "data")],
     {"heads": ("model",), "kv": ("data",)}),
    # None assigns "no resources" and stops later rules for that name
    (("batch",), [("batch", None), ("batch", "data")], {}),
    # a tuple of mesh axes, and a rule whose axes are partly taken is skipped
    (("batch", "seq"), [("batch", ("data", "model")), ("seq", "model"), ("seq", "data")],
     {"batch": ("data", "model")}),
    # names without a rule run without resources; rules for absent names are ignored
    (("a",), [("b", "data")], {}),
    # order of rules, not of names, decides
    (("embed", "vocab"), [("vocab", "model"), ("embed", "model")], {"vocab": ("model",)}),
]


@pytest.mark.parametrize("names,rules,want", PRIORITY_CASES)
def test_rules_follow_flax_priority_semantics(names, rules, want):
    assert resources_from_rules(names, check_rules(rules)) == want


@pytest.mark.parametrize("rules,message", [
    ("batch", "sequence of"), ([("batch",)], "pair"), ([(1, "x")], "pair"),
    ([("batch", 3)], "mesh axis name"),
])
def test_malformed_rules_raise_nxops_errors(rules, message):
    with pytest.raises(nx.NxopsError, match=message):
        check_rules(rules)


def _body(x, w):
    return nx.einsum("<b,k>,<k,h>-><b,h>", x, w)


def _run(axis_resources=None, rules_ctx=None):
    x = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4)
    w = jnp.arange(4 * 4, dtype=jnp.float32).reshape(4, 4)
    f = nx.xmap(_body, (["b", "k"], ["k", "h"]), ["b", "h"], axis_resources=axis_resources)
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):
        if rules_ctx is None:
            return f(x, w), f.lower(x, w).as_text(), x @ w
        with nx.axis_rules(rules_ctx):
            return f(x, w), f.lower(x, w).as_text(), x @ w


def test_a_rule_table_as_axis_resources_shards_like_the_dict_it_resolves_to():
    rules = [("b", "data"), ("h", "model"), ("k", "model")]   # 'k' loses 'model' to 'h'
    got, text, want = _run(rules)
    np.testing.assert_allclose(got, want)
    _, dict_text, _ = _run({"b": "data", "h": "model"})
    assert text == dict_text


def test_axis_rules_context_applies_to_xmaps_without_axis_resources_at_call_time():
    rules = [("b", "data"), ("h", "model")]
    got, text, want = _run(rules_ctx=rules)
    np.testing.assert_allclose(got, want)
    _, dict_text, _ = _run({"b": "data", "h": "model"})
    _, plain_text, _ = _run()
    assert text == dict_text and text != plain_text


def test_explicit_axis_resources_ignore_the_rules_context():
    _, text, _ = _run({"b": "data"}, rules_ctx=[("h", "model")])
    _, dict_text, _ = _run({"b": "data"})
    assert text == dict_text
