"""Every user error of nx.xmap: one NxopsError (a ValueError) that quotes the spec."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from nxops import NxopsError
from nxops.xmap import SerialLoop, serial_loop, xmap


def _raises(match):
    return pytest.raises(NxopsError, match=match)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("x", "y"))


X = np.ones((4, 6), np.float32)


def test_errors_are_value_errors():
    assert issubclass(NxopsError, ValueError)


# -- specs, at xmap time ----------------------------------------------------

def test_duplicate_name_in_spec():
    with _raises(re.escape("['a', 'a']")):
        xmap(lambda x: x, [["a", "a"]], [...])


def test_negative_axis_in_dict_spec():
    with _raises(r"negative axes in in_axes.*\{-1: 'a'\}"):
        xmap(lambda x: x, [{-1: "a"}], [...])


@pytest.mark.parametrize("spec", ["a", 3, [["a", 1]], [{"a": 0}], [["a", ..., "b"]]])
def test_malformed_spec(spec):
    with _raises("Invalid xmap in_axes"):
        xmap(lambda x: x, spec, [...])


def test_out_axes_names_not_defined():
    with _raises(r"out_axes must also appear in in_axes or axis_sizes.*'b'"):
        xmap(lambda x: x, ["a", ...], ["a", "b", ...])


def test_resources_for_undefined_name():
    with _raises(r"assigned resources have to appear.*'c'"):
        xmap(lambda x: x, ["a", ...], ["a", ...], axis_resources={"c": "x"})


def test_resource_repeated_for_one_name():
    with _raises(r"distinct resources.*\('x', 'x'\).*'a'"):
        xmap(lambda x: x, ["a", ...], ["a", ...], axis_resources={"a": ("x", "x")})


def test_bad_resource_type():
    with _raises("a resource is a mesh axis name"):
        xmap(lambda x: x, ["a", ...], ["a", ...], axis_resources={"a": 3})


def test_not_callable():
    with _raises("callable"):
        xmap(3, ["a", ...], ["a", ...])


def test_bad_axis_size():
    with _raises("positive ints"):
        xmap(lambda x: x, [...], ["b", ...], axis_sizes={"b": 0})


def test_bad_loops():
    with _raises("positive int"):
        SerialLoop(0)
    with _raises("positive int"):
        with serial_loop("l", -1):
            pass
    with _raises("already in scope"):
        with serial_loop("l", 2), serial_loop("l", 2):
            pass


# -- arguments, at call time --------------------------------------------------

def test_rank_assertion_of_an_input():
    f = xmap(lambda x: x, [["a", None]], [...])
    with _raises(r"\['a', None\].*rank 2.*rank 3 \(and shape \(4, 6, 1\)\)"):
        f(np.ones((4, 6, 1)))


def test_rank_too_small_for_spec():
    f = xmap(lambda x: x, [{3: "a"}], [...])
    with _raises(r"\{3: 'a'\}.*at least 4 dimensions.*rank 2"):
        f(X)


def test_inconsistent_sizes():
    f = xmap(lambda x, y: x, (["a", ...], ["a", ...]), [...])
    with _raises(r"'a' was previously inferred to be 4.*shape \(5, 6\).*4 != 5|5 != 4"):
        f(X, np.ones((5, 6)))


def test_size_conflicts_with_axis_sizes():
    f = xmap(lambda x: x, ["a", ...], ["a", ...], axis_sizes={"a": 3})
    with _raises("previously inferred to be 3 \\(from axis_sizes\\)"):
        f(X)


def test_size_not_inferable():
    f = xmap(lambda x, y: x, (["i", ...], ["a", ...]), ["a", ...])
    with _raises(r"Failed to infer size of axes: 'a'.*axis_sizes"):
        f(X, [])


def test_spec_tree_not_a_prefix():
    f = xmap(lambda x, y: x, (["a", ...], ["a", ...], ["a", ...]), [...])
    with _raises("tree prefix"):
        f(X, X)


def test_keyword_arguments():
    f = xmap(lambda x: x, ["a", ...], ["a", ...])
    with _raises("positional arguments only"):
        f(x=X)


def test_resources_missing_from_scope(mesh):
    f = xmap(lambda x: x, ["a", ...], ["a", ...], axis_resources={"a": "z"})
    with _raises(r"insufficient.*'z'.*\['x', 'y'\]"):
        with jax.set_mesh(mesh):
            f(X)
    with _raises(r"insufficient.*'z'.*Mesh axes in scope: none"):
        f(X)
    g = xmap(lambda x: x, ["a", ...], ["a", ...], axis_resources={"a": "loop"})
    with _raises(r"insufficient.*'loop'"):
        g(X)


def test_size_not_divisible(mesh):
    f = xmap(lambda x: x, [None, "b"], [None, "b"], axis_resources={"b": "x"})
    with _raises(r"'b' \(6\) is not divisible.*\('x'\) of total size 4.*x=4"):
        with jax.set_mesh(mesh):
            f(X)
    g = xmap(lambda x: x, [None, "b"], [None, "b"], axis_resources={"b": SerialLoop(4)})
    with _raises(r"'b' \(6\) is not divisible"):
        g(X)


def test_output_varies_along_omitted_name():
    f = xmap(lambda x: x * 2, ["a", ...], [...])
    with _raises(r"out_axes specification of \[\.\.\.\].*varies along the named axis 'a'"):
        f(X)


def test_output_rank_assertion():
    f = xmap(lambda x: x, ["a", ...], ["a", None, None])
    with _raises(r"\['a', None, None\].*rank 3.*shape \(6,\)"):
        f(X)
    g = xmap(lambda x: x, ["a", ...], {3: "a"})
    with _raises(r"\{3: 'a'\}.*at least 3 positional dimensions.*only has 1"):
        g(X)


def test_collective_over_a_looped_name():
    f = xmap(lambda x: nx.sum(x, "a"), ["a", ...], [...], axis_resources={"a": SerialLoop(2)})
    with _raises("serial loop"):
        f(X)


def test_names_sharing_a_resource_in_one_value(mesh):
    f = xmap(lambda x: x, ["a", "b"], ["a", "b"], axis_resources={"a": "x", "b": "x"})
    with _raises(r"'a' and 'b' are both mapped to the resource 'x'.*\['a', 'b'\]"):
        with jax.set_mesh(mesh):
            f(np.ones((4, 4)))
    # ... also in a result (the inputs carry one name each).
    g = xmap(lambda x, y: x * y, (["a", ...], ["b", ...]), ["a", "b", ...],
             axis_resources={"a": "x", "b": "x"})
    with _raises("both mapped to the resource 'x'.*result"):
        with jax.set_mesh(mesh):
            g(np.ones(4), np.ones(4))


def test_shadowing_an_enclosing_name():
    inner = xmap(lambda y: y, ["a", ...], ["a", ...])
    outer = xmap(lambda x: inner(x), ["a", ...], ["a", ...])
    with _raises("cannot shadow.*'a'"):
        outer(np.ones((4, 3)))


@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated")
def test_changing_the_mesh_inside_xmap(mesh):
    other = jax.make_mesh((2, 4), ("x", "y"))

    def body(x):
        with other:   # (jax.set_mesh itself refuses to run inside jit)
            return xmap(lambda y: y, ["b", ...], ["b", ...])(x)

    f = xmap(body, ["a", ...], ["a", ...])
    with jax.set_mesh(mesh):
        with _raises("Changing the physical mesh is not allowed inside xmap"):
            f(np.ones((4, 2)))


def test_mesh_axis_already_used_by_enclosing_xmap(mesh):
    inner = xmap(lambda y: y, ["b", ...], ["b", ...], axis_resources={"b": "x"})
    outer = xmap(lambda x: inner(x), ["a", ...], ["a", ...], axis_resources={"a": "x"})
    with jax.set_mesh(mesh):
        with _raises("already maps over"):
            outer(np.ones((4, 4)))


@pytest.mark.parametrize("raw, nx_op, outside", [(jax.lax.psum, "nx.psum", "jnp.sum"),
                                                  (jax.lax.pmean, "nx.pmean", "jnp.mean")])
def test_raw_collective_over_a_looped_name(raw, nx_op, outside):
    # A looped name's vmap tile is mangled, so a raw collective cannot silently
    # reduce over one chunk only. The nx op is refused on a loop too:
    # the error says what does work, which the test then follows.
    body = lambda x: x * 2
    f = xmap(lambda x: raw(body(x), "a"), ["a", ...], [...],
             axis_resources={"a": SerialLoop(2)})
    with _raises(rf"jax.lax.{raw.__name__} over 'a'.*mapped to serial loops .*No collective "
                 rf"spans a serial loop \({nx_op} is refused there too.*keep 'a' in the value's "
                 rf"out_axes and reduce the xmap's result outside it \({outside}\(result, "
                 rf"axis=<the dimension of 'a'>\).*or map 'a' to mesh axes \(or nothing\)"):
        f(X)
    kept = xmap(body, ["a", ...], ["a", ...], axis_resources={"a": SerialLoop(2)})
    got = {"jnp.sum": jnp.sum, "jnp.mean": jnp.mean}[outside](kept(X), axis=0)
    want = jax.vmap(lambda x: raw(body(x), "a"), axis_name="a", out_axes=None)(X)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_axis_index_over_a_looped_name_still_advises_nx():
    f = xmap(lambda x: x + jax.lax.axis_index("a"), ["a", ...], ["a", ...],
             axis_resources={"a": SerialLoop(2)})
    with _raises(r"jax.lax.axis_index over 'a'.*Use nx.axis_index \(same arguments\)"):
        f(X)


# -- two names sharing a resource, co-occurring inside the body ------------------
# Each device (or loop step) holds matching chunks of both names only, so these
# bodies would silently compute wrong results (old xmap left them unchecked).

U = np.arange(4, dtype=np.float32) + 1
V = np.arange(4, dtype=np.float32) * 10 + 3


def _scan_body(u, v):
    carry, _ = jax.lax.scan(lambda c, _: (c * v, None), u, None, length=3)
    return nx.sum(nx.sum(carry, "a"), "b")


def _cond_body(u, v):
    picked = jax.lax.cond(u > 2, lambda: v, lambda: -v)   # the predicate varies along a
    return nx.psum(picked, ("a", "b"))


COOCCURRING_BODIES = {
    "intermediate": lambda u, v: nx.sum(nx.sum(jnp.tanh(u * v), "a"), "b"),
    "one_reduction": lambda u, v: nx.sum(u * v, ("a", "b")),
    "einsum": lambda u, v: nx.sum(nx.einsum("{a},{b}->{a,b}", u, v), ("a", "b")),
    "scan": _scan_body,
    "cond": _cond_body,
    "checkpoint": lambda u, v: nx.psum(jax.checkpoint(lambda x, y: x * y)(u, v), ("a", "b")),
}


@pytest.mark.parametrize("body", COOCCURRING_BODIES.values(), ids=COOCCURRING_BODIES)
def test_names_sharing_a_resource_cooccur_in_the_body(mesh, body):
    f = xmap(body, (["a"], ["b"]), [], axis_resources={"a": "x", "b": "x"})
    with jax.set_mesh(mesh):
        with _raises(r"'a' and 'b' are both mapped to the resource 'x', but in the xmapped "
                     r"function .* varies along both \(at .*test_errors.py:\d+.*\).*Map one "
                     r"of them to other resources"):
            f(U, V)
    # The same body is fine when the names do not share a resource.
    with jax.set_mesh(mesh):
        xmap(body, (["a"], ["b"]), [], axis_resources={"a": "x", "b": "y"})(U, V[:2])


def test_collective_over_one_shared_name_of_a_value_along_the_other(mesh):
    # max over b of a value varying along a: a psum over 'x' would mix a's chunks.
    f = xmap(lambda u, v: nx.sum(nx.max(u, "b"), "a") + 0 * nx.sum(v, "b"), (["a"], ["b"]), [],
             axis_resources={"a": "x", "b": "x"})
    with jax.set_mesh(mesh):
        with _raises(r"'b' and 'a' are both mapped to the resource 'x', but in the xmapped "
                     r"function nx_reduce over 'b' takes a value that varies along 'a'"):
            f(U, V)


def test_names_sharing_a_loop_cooccur_in_the_body():
    f = xmap(lambda u, v: u * v * 0 + u, (["a"], ["b"]), ["a"], axis_resources={"a": "l", "b": "l"})
    with serial_loop("l", 2):
        with _raises(r"'a' and 'b' are both mapped to the resource l, .*varies along both"):
            f(U, V)


def test_einsum_over_two_names_sharing_a_mesh_axis_is_refused():
    # Each device holds chunk i of both 'a' and 'b': the cross terms are missing.
    mesh = jax.make_mesh((8,), ("x",))
    u, v = np.arange(8, dtype=np.float32), np.arange(16, dtype=np.float32)
    f = nx.xmap(lambda p, q: nx.einsum("{a},{b}->", p, q), [["a"], ["b"]], [],
                axis_resources={"a": "x", "b": "x"})
    with jax.set_mesh(mesh), pytest.raises(nx.NxopsError, match="'a' and 'b' are both carried by axis 'x'"):
        f(u, v)
    g = nx.xmap(lambda p, q: nx.einsum("{a},{b}->", p, q), [["a"], ["b"]], [],
                axis_resources={"a": "x"})
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(g(u, v), u.sum() * v.sum())


# -- unclear errors, each with the exact call ----------------------

def test_dict_spec_with_a_float_key_quotes_the_whole_spec():
    with _raises(re.escape("entry {0.5: 'a'} (in in_axes=[{0.5: 'a'}])")):
        xmap(lambda x: x, in_axes=[{0.5: "a"}], out_axes=["a", ...])


def test_tuple_inside_a_list_spec_quotes_the_whole_spec():
    with _raises(re.escape("entry [('a',), ...] (in in_axes=[[('a',), ...]])")):
        xmap(lambda x: x, in_axes=[[("a",), ...]], out_axes=["a", ...])


def test_spec_listing_more_dims_than_the_argument_has():
    f = xmap(lambda x: x, in_axes=["a", None, None, ...], out_axes=["a", ...])
    with _raises(re.escape("['a', None, None, ...], which implies that it has at least 3 "
                           "dimensions, but the argument has rank 2")):
        f(jnp.ones((2, 3)))


@pytest.mark.parametrize("resources", [None, {"a": "x", "zz": "y"}])
def test_axis_sizes_for_a_name_nothing_uses(mesh, resources):
    # Likely misspelled: neither the specs nor the body use it (known once traced).
    f = xmap(lambda x: x * 2, ["a", ...], ["a", ...], axis_sizes={"zz": 2},
             axis_resources=resources)
    with jax.set_mesh(mesh), _raises(
            r"axis_sizes=\{'zz': 2\} gives the size of 'zz', which no in_axes or out_axes "
            r"names \(in_axes=\['a', \.\.\.\], out_axes=\['a', \.\.\.\]\) and no collective "
            r"or named op of the body uses\. Remove it, or check the spelling"):
        f(jnp.ones((4, 3)))


def test_donate_argnums_beyond_the_arguments():
    f = xmap(lambda x: x, ["a", ...], ["a", ...], donate_argnums=5)
    with _raises(r"donate_argnums=\(5,\) names argument position\(s\) 5, but the call passes 1"):
        np.asarray(f(jnp.ones((2, 3))))


def test_negative_donate_argnums():
    with _raises(r"donate_argnums=-1: give argument positions as ints >= 0"):
        xmap(lambda x: x, ["a", ...], ["a", ...], donate_argnums=-1)


def test_string_argument_is_named():
    f = xmap(lambda x: x, ["a", ...], ["a", ...])
    with _raises(r"xmap argument args\[0\] is of type str \('abc'\), not an array"):
        f("abc")
    with _raises(r"xmap argument args\[1\]\['k'\] is of type object"):
        f.lower(np.ones(2), {"k": object()})


def test_float_axis_of_a_reduction():
    f = xmap(lambda x: nx.sum(x, 1.0), ["a", ...], ["a", ...])
    with _raises(r"nx.sum: axis 1.0 contains the float 1.0; use an int for a positional axis"):
        f(jnp.ones((2, 3)))


def test_numpy_int_axis_is_positional():
    f = xmap(lambda x: nx.sum(x, np.int64(0)), ["a", ...], ["a", ...])
    np.testing.assert_array_equal(np.asarray(f(jnp.ones((2, 3)))), np.full(2, 3.0))


def test_explain_for_an_unknown_platform():
    with _raises(r"'quantum'.*'cpu', 'cuda', 'rocm', 'tpu'"):
        nx.kernels.explain(lambda x: nx.sum(x, 0), jnp.ones(3), platform="quantum")


@pytest.mark.parametrize("op", ["max", "min", "pmax"])
@pytest.mark.parametrize("resources", [{}, {"a": "x"}], ids=str)
def test_extremum_over_a_size_0_name(op, resources, mesh):
    reduce = getattr(nx, op)
    f = xmap(lambda x: reduce(x, "a"), ["a", ...], [...], axis_resources=resources)
    with jax.set_mesh(mesh), _raises(rf"nx.{op}\(x, .*'a'.*\) reduces over a dimension of size 0"):
        np.asarray(f(jnp.ones((0, 3))))


# -- raw jax.lax / jnp on xmap names: the nx op to use (issues 19, 20 g02) ----

RAW_CALLS = [
    ("jax.lax.pmean", lambda x: jax.lax.pmean(x, "batch"), "nx.pmean"),
    ("jax.lax.psum", lambda x: jax.lax.psum(x, "batch"), "nx.psum"),
    ("jax.lax.pmax", lambda x: jax.lax.pmax(x, "batch"), "nx.pmax"),
    ("jax.lax.pmin", lambda x: jax.lax.pmin(x, "batch"), "nx.pmin"),
    ("jax.lax.all_gather", lambda x: jax.lax.all_gather(x, "batch")[0], "nx.all_gather"),
    ("jax.lax.ppermute", lambda x: jax.lax.ppermute(x, "batch", [(0, 1), (1, 0)]), "nx.ppermute"),
    ("jax.lax.all_to_all", lambda x: jax.lax.all_to_all(x, "batch", 0, 0), "nx.all_to_all"),
    ("jax.lax.psum_scatter", lambda x: jax.lax.psum_scatter(x, "batch", tiled=True),
     "nx.psum_scatter"),
    ("jax.lax.axis_index", lambda x: x * jax.lax.axis_index("batch"), "nx.axis_index"),
]


@pytest.mark.parametrize("call,body,replacement", RAW_CALLS, ids=[c[0] for c in RAW_CALLS])
def test_raw_lax_collective_on_a_mesh_mapped_name(call, body, replacement):
    f = xmap(body, ["batch", ...], ["batch", ...], axis_resources={"batch": "x"})
    with jax.set_mesh(jax.make_mesh((2,), ("x",))):
        with _raises(rf"{re.escape(call)} over 'batch' in the xmapped function: 'batch' is an "
                     rf"nx.xmap name, mapped to mesh axes \('x',\).*Use {re.escape(replacement)}"):
            f(jnp.ones((2, 2)))


@pytest.mark.parametrize("resources", [{"batch": "x"}, {}], ids=str)
def test_jnp_sum_over_a_name_names_nx_sum(resources):
    f = xmap(lambda x: x * 0 + jnp.sum(x, axis="batch"), ["batch", ...], ["batch", ...],
             axis_resources=resources)
    with jax.set_mesh(jax.make_mesh((2,), ("x",))):
        with _raises(r"jnp.sum\(x, axis='batch'\) in the xmapped function: jnp reductions take "
                     r"positional \(int\) axes only.*nx.sum\(x, 'batch'\)"):
            f(jnp.ones((2, 2)))


def test_raw_psum_on_an_unknown_name():
    f = xmap(lambda x: jax.lax.psum(x, "nope"), ["batch", ...], ["batch", ...])
    with _raises(r"jax.lax.psum over 'nope'.*'nope' is not an axis name bound here "
                 r"\(xmap names: 'batch'\). Use nx.psum"):
        f(jnp.ones((2, 2)))


# -- bad inputs -----------------------------------------------------------------

def _has_devices(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


@pytest.mark.filterwarnings("ignore:backend and device argument on jit is deprecated")
@pytest.mark.skipif(_has_devices("gpu"), reason="a GPU is present: backend='gpu' runs")
def test_backend_gpu_without_a_gpu_says_gpu_means_cuda():
    f = xmap(lambda x: x * 2, ["a", ...], ["a", ...], backend="gpu")
    with _raises(r"nx.xmap\(\.\.\., backend='gpu'\): this process has no cuda devices \('gpu' "
                 r"means 'cuda': NVIDIA GPUs\); JAX's default backend here is 'cpu'\. Leave "
                 r"backend unset"):
        f(jnp.ones(4))
    assert np.array_equal(xmap(f.__wrapped__, ["a", ...], ["a", ...], backend="CPU")(
        jnp.arange(4.0)), np.arange(4.0) * 2)


def test_unknown_backend_lists_the_platforms():
    with _raises(r"nx.xmap\(\.\.\., backend='metal'\): unknown platform 'metal'\. Use one of "
                 r"'cpu', 'cuda', 'rocm', 'tpu' \('gpu' means 'cuda'; AMD GPUs are 'rocm'\)"):
        xmap(lambda x: x, ["a", ...], ["a", ...], backend="metal")


@pytest.mark.parametrize("resources", [None, {"a": "x"}])
def test_set_mesh_inside_the_body(mesh, resources):
    def body(x):
        with jax.set_mesh(mesh):
            return x * 2
    f = xmap(body, ["a", ...], ["a", ...], axis_resources=resources)
    with jax.set_mesh(mesh), _raises(
            r"jax.set_mesh inside the xmapped function: the body is traced inside jax.jit, where "
            r"JAX refuses to change the mesh.*Call the xmap under `with jax.set_mesh\(mesh\):` "
            r"instead, and map names to the mesh's axes with axis_resources"):
        f(jnp.ones((4, 3)))


@pytest.mark.parametrize("shared", ["named", "SerialLoop"])
def test_nested_xmap_on_the_loop_its_enclosing_xmap_loops_over(shared):
    loop = "l" if shared == "named" else SerialLoop(2)
    inner = xmap(lambda v: v * 2, ["b", ...], ["b", ...], axis_resources={"b": loop})
    outer = xmap(lambda v: inner(v), ["a", ...], ["a", ...], axis_resources={"a": loop})
    with serial_loop("l", 2), _raises(
            r"axis_resources\['b'\] uses the serial loop '(l|SerialLoop#\d+\(2\))', which the "
            r"enclosing xmap already loops over for its name 'a'.*Give the inner name another "
            r"loop"):
        outer(np.ones((4, 4), np.float32))
    with serial_loop("l", 2), serial_loop("m", 2):   # the fix the message gives
        fixed = xmap(lambda v: xmap(lambda w: w * 2, ["b", ...], ["b", ...],
                                    axis_resources={"b": "m"})(v),
                     ["a", ...], ["a", ...], axis_resources={"a": loop})
        np.testing.assert_array_equal(np.asarray(fixed(np.ones((4, 4), np.float32))), 2.0)
