"""Cases in the style of JAX's own xmap test suite (jax.experimental.maps'
tests/xmap_test.py, JAX 0.4), written for nxops: maps with list and dict
specs, collectives over one name and over a name on two mesh axes, nested
xmaps on different mesh axes, axis sizes for names only the body uses,
serial loops (alone and with mesh axes), control flow around collectives,
pdot (basic, batched, batched over a sharded name), named reductions and
collectives in every dtype the suite uses, vmap of xmap, and gradients of
first and second order.

Each case runs with the xla kernels and with the pallas kernels (interpret
mode on CPU, as ``NXOPS_KERNELS=pallas`` selects them), with no resources and
on a mesh. A case passes when its result equals the reference computed with
jax.numpy, or when nxops refuses it with an ``NxopsError`` that says why (a
kernel that does not take a dtype); any other exception is a failure.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

import nxops as nx

BACKENDS = ["xla", "pallas"]
MESH = (("x", 2), ("y", 2), ("z", 2))


def _rng():
    return np.random.default_rng(0)


def _mesh():
    names, shape = zip(*MESH)
    return jax.make_mesh(shape, names)


# ---------------------------------------------------------------- the cases
# Each takes the resources of its names ({} or a mesh placement) and returns
# a list of (got, want) pairs.

def basic_specs(resources):
    a = jnp.arange(16 * 8 * 5, dtype=jnp.float32).reshape(16, 8, 5)
    b = jnp.arange(2 * 7, dtype=jnp.float32).reshape(2, 7)
    f = nx.xmap(lambda a, b: (a * 2, b * 4), in_axes=[{0: "a", 1: "b"}, ["c", ...]],
                out_axes=[{0: "a", 1: "b"}, ["c", ...]], axis_resources=resources)
    got = f(a, b)
    return [(got[0], a * 2), (got[1], b * 4)]


def basic_collective(resources):
    a = jnp.arange(16 * 8 * 5, dtype=jnp.float32).reshape(16, 8, 5)
    b = jnp.arange(2 * 7, dtype=jnp.float32).reshape(2, 7)
    f = nx.xmap(lambda a, b: (nx.psum(a * 2, "a"), b * 4), in_axes=[["a", "b", ...], {0: "c"}],
                out_axes=[["b", ...], {0: "c"}], axis_resources=resources)
    got = f(a, b)
    return [(got[0], (a * 2).sum(0)), (got[1], b * 4)]


def one_name_transposed_out(resources):
    v = jnp.arange(4 * 5, dtype=jnp.float32).reshape(4, 5)
    f = nx.xmap(lambda v: (nx.psum(v * 2, "a"), v * 4), in_axes=["a", ...],
                out_axes=[{}, {1: "a"}], axis_resources=resources)
    got = f(v)
    return [(got[0], (v * 2).sum(0)), (got[1], v.T * 4)]


def nested_xmaps(resources):
    outer = {k: v for k, v in resources.items() if k == "a"}
    inner = {k: v for k, v in resources.items() if k == "b"}
    x = jnp.arange(4 * 2 * 5, dtype=jnp.float32).reshape(4, 2, 5)

    def f(x):
        def h(y):
            return jnp.sin(y) * jnp.arange(y.size, dtype=y.dtype), nx.psum(y, ("a", "b"))
        return nx.xmap(h, in_axes={0: "b"}, out_axes=({1: "b"}, {}), axis_resources=inner)(x * 2)

    got = nx.xmap(f, in_axes={1: "a"}, out_axes=({0: "a"}, {}), axis_resources=outer)(x)
    want = ((jnp.sin(x * 2) * jnp.arange(5.0)).transpose(1, 2, 0), (x * 2).sum((0, 1)))
    return [(got[0], want[0]), (got[1], want[1])]


def axis_sizes_and_index(resources):
    f = nx.xmap(lambda: nx.axis_index("i"), in_axes=(), out_axes=["i", ...],
                axis_sizes={"i": 8}, axis_resources={k: v for k, v in resources.items() if k == "i"})
    return [(f(), jnp.arange(8))]


def collective_over_a_body_only_name(resources):
    f = nx.xmap(lambda: nx.psum(jnp.array(2.0) ** 2, "i"), in_axes={}, out_axes={},
                axis_sizes={"i": 4}, axis_resources={k: v for k, v in resources.items() if k == "i"})
    return [(f(), jnp.float32(16.0))]


def broadcast_output(resources):
    f = nx.xmap(lambda x: x, in_axes={}, out_axes=["i"], axis_sizes={"i": 4},
                axis_resources={k: v for k, v in resources.items() if k == "i"})
    return [(f(jnp.asarray(2.0)), jnp.full(4, 2.0))]


def serial_loops(resources):
    x = jnp.arange(16, dtype=jnp.float32)
    loop = nx.SerialLoop(4)
    mesh_axes = resources.get("i", ())
    placements = [{"i": loop}] + ([{"i": (*mesh_axes, loop)}] if mesh_axes else [])
    pairs = []
    for r in placements:
        f = nx.xmap(lambda v: v + 4 - nx.axis_index("i"), in_axes=["i"], out_axes=["i"],
                    axis_resources=r)
        pairs.append((f(x), x + 4 - jnp.arange(16)))
    return pairs


def fori_loop_of_psum(resources):
    x = jnp.arange(8, dtype=jnp.float32) / 8
    f = nx.xmap(lambda v: lax.fori_loop(0, 3, lambda _, v: nx.psum(v, "i") / 4, v),
                in_axes=["i", ...], out_axes=["i", ...],
                axis_resources={k: v for k, v in resources.items() if k == "i"})
    want = x
    for _ in range(3):
        want = jnp.full_like(x, want.sum() / 4)
    return [(f(x), want)]


def pdot_basic(resources):
    rng = _rng()
    x, y = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal((8, 5)).astype(np.float32)
    f = nx.xmap(lambda x, y: nx.pdot(x, y, "i"), in_axes=[{1: "i"}, {0: "i"}], out_axes={},
                axis_resources={k: v for k, v in resources.items() if k == "i"})
    return [(f(x, y), x @ y)]


def pdot_batched(resources):
    rng = _rng()
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    y = rng.standard_normal((2, 8, 5)).astype(np.float32)
    pairs = []
    for name in ("i", "j"):   # the contracted name on the mesh, then the batch name
        f = nx.xmap(lambda x, y: nx.pdot(x, y, "i"), in_axes=[{0: "j", 2: "i"}, {0: "j", 1: "i"}],
                    out_axes=["j", ...],
                    axis_resources={name: resources[name]} if name in resources else {})
        pairs.append((f(x, y), np.einsum("nij,njk->nik", x, y)))
    return pairs


def tensordot_over_two_names(resources):
    x = jnp.arange(30, dtype=jnp.float32).reshape(2, 3, 5)
    f = nx.xmap(lambda x, y: jnp.tensordot(x, y, axes=([1], [1])),
                in_axes=(["i", ...], ["j", ...]), out_axes=["i", "j", ...],
                axis_resources={"i": "x", "j": "y"} if resources else {})
    return [(f(x, x), jnp.einsum("imk,jnk->ijmn", x, x))]


NAMED_REDUCTIONS = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean,
                    "prod": np.prod}


def _named_reductions(dtype):
    def case(resources):
        rng = _rng()
        x = rng.integers(-3, 4, (8, 4, 6)).astype(dtype)
        pairs = []
        for op, ref in NAMED_REDUCTIONS.items():
            for axis, ref_axes in (("i", 0), (("i", 1), (0, 2)), (0, 1)):
                f = nx.xmap(lambda v: getattr(nx, op)(v, axis), in_axes=["i", ...],
                            out_axes=[...] if "i" in np.atleast_1d(axis) else ["i", ...],
                            axis_resources={k: v for k, v in resources.items() if k == "i"})
                want = ref(x, axis=ref_axes)
                pairs.append((f(x), want.astype(jnp.result_type(getattr(jnp, op)(x[:1], 0)))))
        return pairs
    return case


MAPPED_REDUCTIONS = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean,
                     "var": np.var, "std": np.std,
                     "logsumexp": lambda x, axis: np.log(np.sum(np.exp(x), axis=axis))}


def reductions_at_each_mapped_dim(resources):
    """JAX's NamedNumPyTest.testReductions: the name at dim 0 or 2 of a
    (2, 5, 6) array's (8, 5, 6) here, reduced with or without a positional dim."""
    x = _rng().standard_normal((8, 5, 6)).astype(np.float32)
    r = {k: v for k, v in resources.items() if k == "i"}
    pairs = []
    for mapped in (0, 2):
        xm = np.moveaxis(x, 0, mapped)
        for op, ref in MAPPED_REDUCTIONS.items():
            for axes in ("i", (0, "i")):
                f = nx.xmap(lambda v: getattr(nx, op)(v, axes), in_axes={mapped: "i"},
                            out_axes={}, axis_resources=r)
                ref_axes = (mapped,) if axes == "i" else (mapped, int(mapped == 0))
                pairs.append((f(xm), ref(xm, axis=ref_axes)))
    return pairs


def one_hot_along_a_name(resources):
    """JAX's NamedNNTest.testOneHot and testOneHotOutOfBound."""
    r = {k: v for k, v in resources.items() if k == "j"}
    f = nx.xmap(lambda _: (nx.one_hot(jnp.array([1, 0, -1, 2]), axis="j"),
                           nx.one_hot(jnp.array([-1, 2]), axis="j")),
                in_axes=["j", ...], out_axes=(["j", ...], ["j", ...]), axis_resources=r)
    got = f(jnp.ones(2, jnp.int32))
    return [(got[0], np.array([[0, 1, 0, 0], [1, 0, 0, 0]])), (got[1], np.zeros((2, 2)))]


def random_is_resource_independent(resources):
    """JAX's NamedRandomTest.testSamplerResourceIndependence: the same draws
    along a name on every placement; different ones at each position."""
    r = {k: v for k, v in resources.items() if k in "ij"}
    def sample(r):
        def body():      # the key made in the body, as in JAX's test
            key = jax.random.key(0)
            return (nx.random.uniform(key, (3,), names=("i", "j")),
                    nx.random.normal(key, (3,), names="i"))
        return nx.xmap(body,
                       in_axes=(), out_axes=(["i", "j", ...], ["i", ...]),
                       axis_sizes={"i": 4, "j": 2}, axis_resources=r)()
    want, got = sample({}), sample(r)
    distinct = len(np.unique(np.asarray(want[0]).reshape(8, 3), axis=0)) == 8
    return [(got[0], want[0]), (got[1], want[1]), (np.asarray(distinct), np.asarray(True))]


def logsumexp_and_pmean(resources):
    x = _rng().standard_normal((8, 4)).astype(np.float32)
    r = {k: v for k, v in resources.items() if k == "i"}
    f = nx.xmap(lambda v: (nx.logsumexp(v, "i"), v - nx.pmean(v, "i"), nx.pmax(v, "i")),
                in_axes=["i", ...], out_axes=([...], ["i", ...], [...]), axis_resources=r)
    got = f(x)
    return [(got[0], jax.nn.logsumexp(x, 0)), (got[1], x - x.mean(0)), (got[2], x.max(0))]


def collectives(resources):
    x = _rng().standard_normal((8, 8, 3)).astype(np.float32)
    r = {k: v for k, v in resources.items() if k == "i"}
    cycle = [(i, (i + 1) % 8) for i in range(8)]
    f = nx.xmap(lambda v: (nx.all_gather(v, "i"), nx.psum_scatter(v, "i", tiled=True),
                           nx.all_to_all(v, "i", 0, 0, tiled=True), nx.ppermute(v, "i", cycle)),
                in_axes=["i", ...], out_axes=[["i", ...]] * 4, axis_resources=r)
    gathered, scattered, exchanged, permuted = f(x)
    return [(gathered, np.broadcast_to(x, (8,) + x.shape)),
            (scattered, x.sum(0).reshape(8, 1, 3)),
            (exchanged, x.transpose(1, 0, 2)),
            (permuted, np.roll(x, 1, axis=0))]


def named_einsum(resources):
    rng = _rng()
    x, y = rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((8, 4, 3)).astype(np.float32)
    r = {k: v for k, v in resources.items() if k == "i"}
    f = nx.xmap(lambda x, y: nx.einsum("{i}k,{i}kn->n", x, y), in_axes=[["i", ...]] * 2,
                out_axes=[...], axis_resources=r)
    return [(f(x, y), np.einsum("ik,ikn->n", x, y))]


def vmap_of_xmap(resources):
    """jax.vmap around an xmap whose body uses the vmapped value: closed over
    with no resources (as JAX's testBatchingPostProcess), passed as an
    argument on mesh axes (test_closing_over_a_traced_value_on_mesh_axes)."""
    x = jnp.arange(16, dtype=jnp.float32).reshape(8, 2)
    r = {k: v for k, v in resources.items() if k == "i"}
    if not r:
        f = jax.vmap(lambda y: nx.xmap(lambda v: v + y, in_axes=["i", ...],
                                       out_axes=["i", ...])(x))
    else:
        f = jax.vmap(lambda y: nx.xmap(lambda v, y: v + y, in_axes=(["i", ...], [...]),
                                       out_axes=["i", ...], axis_resources=r)(x, y))
    return [(f(x * 2), jax.vmap(lambda y: x + y)(x * 2))]


def gradients(resources):
    """First and second order, forward and reverse (JAX's testAutodiffNoBroadcast)."""
    r = {k: v for k, v in resources.items() if k == "i"}
    f = nx.xmap(lambda x, y: jnp.cos(lax.dot(x, jnp.sin(y), precision=lax.Precision.HIGHEST)),
                in_axes=(["i", ...], [None, "i"]), out_axes=["i"], axis_resources=r)
    x = jnp.arange(32, dtype=jnp.float32).reshape(8, 4) / 100
    y = jnp.arange(32, dtype=jnp.float32).reshape(4, 8) / 100
    check_grads(f, (x, y), order=2, atol=1e-2, rtol=1e-2)
    loss = nx.xmap(lambda v: nx.sum(jnp.sin(v) * nx.max(v, "i"), ("i", 0)), in_axes=["i", ...],
                   out_axes=[...], axis_resources=r)
    z = x.at[3, 1].set(1.0)
    want = jax.grad(lambda v: jnp.sum(jnp.sin(v) * v.max(0)))(z)
    return [(jax.grad(loss)(z), want)]


CASES = {
    "basic_specs": basic_specs,
    "basic_collective": basic_collective,
    "one_name_transposed_out": one_name_transposed_out,
    "nested_xmaps": nested_xmaps,
    "axis_sizes_and_index": axis_sizes_and_index,
    "collective_over_a_body_only_name": collective_over_a_body_only_name,
    "broadcast_output": broadcast_output,
    "serial_loops": serial_loops,
    "fori_loop_of_psum": fori_loop_of_psum,
    "pdot_basic": pdot_basic,
    "pdot_batched": pdot_batched,
    "tensordot_over_two_names": tensordot_over_two_names,
    "named_reductions_f32": _named_reductions(np.float32),
    "named_reductions_i32": _named_reductions(np.int32),
    "reductions_at_each_mapped_dim": reductions_at_each_mapped_dim,
    "one_hot_along_a_name": one_hot_along_a_name,
    "random_is_resource_independent": random_is_resource_independent,
    "logsumexp_and_pmean": logsumexp_and_pmean,
    "collectives": collectives,
    "named_einsum": named_einsum,
    "vmap_of_xmap": vmap_of_xmap,
    "gradients": gradients,
}

PLACEMENTS = {
    "none": {},
    "mesh": {"a": "x", "b": "y", "c": "z", "i": ("x", "y"), "j": "z"},
}
_USED = {"basic_specs": "abc", "basic_collective": "abc", "one_name_transposed_out": "a",
         "nested_xmaps": "ab"}


def _resources(case, placement):
    """The placement's resources for the names the case maps."""
    resources = PLACEMENTS[placement]
    if case in _USED:
        names = set(_USED[case])
        resources = {k: v for k, v in resources.items() if k in names}
        if case == "one_name_transposed_out" and resources:
            resources = {"a": ("x", "y")}
    return resources


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_jax_xmap_suite_case(backend, case, placement):
    try:
        with jax.set_mesh(_mesh()), nx.kernels.use(backend):
            pairs = CASES[case](_resources(case, placement))
            pairs = [(np.asarray(g), np.asarray(w)) for g, w in pairs]
    except nx.NxopsError as e:      # a refusal must say why
        assert len(str(e)) > 40 and backend != "xla", f"xla refused {case}: {e}"
        return
    for got, want in pairs:
        assert got.shape == want.shape, (got.shape, want.shape)
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("outer", ["vmap", "jit"])
def test_closing_over_a_traced_value_on_mesh_axes_is_refused_with_the_fix(outer):
    """JAX cannot mix a tracer typed on the all-Explicit mesh with the body's
    values inside the shard_map: an NxopsError says to pass it as an argument."""
    x = jnp.arange(16, dtype=jnp.float32).reshape(8, 2)
    wrap = jax.vmap if outer == "vmap" else jax.jit
    f = wrap(lambda y: nx.xmap(lambda v: v + y, in_axes=["i", ...], out_axes=["i", ...],
                               axis_resources={"i": ("x", "y")})(x))
    with jax.set_mesh(_mesh()):
        with pytest.raises(nx.NxopsError, match="closes over a value traced outside it.*"
                                                 "Pass the value to the xmapped function"):
            f(x * 2 if outer == "vmap" else x[0])
