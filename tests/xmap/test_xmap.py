"""nx.xmap results against NumPy and positional programs, on 8 simulated devices."""
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import nxops as nx
from nxops.xmap import SerialLoop, serial_loop, xmap

RNG = np.random.default_rng(0)
A = RNG.standard_normal((8, 4, 3)).astype(np.float32)   # names a (8), b (4); positional 3
W = RNG.standard_normal((4, 3, 5)).astype(np.float32)   # names b (4); positional (3, 5)


def close(x, y, tol=1e-4):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


# -- specs ---------------------------------------------------------------------

def test_list_spec_with_positional_dims_and_transposed_output():
    f = xmap(lambda x: x * 2, [None, "b", "a"], ["a", "b", None])
    x = RNG.standard_normal((3, 4, 8)).astype(np.float32)
    close(f(x), np.transpose(x, (2, 1, 0)) * 2)


def test_dict_specs_and_trailing_dims():
    f = xmap(lambda x: x.sum(), [{1: "a"}], {0: "a"})
    x = RNG.standard_normal((3, 8, 2)).astype(np.float32)
    close(f(x), x.sum(axis=(0, 2)))


def test_docstring_example_outer_products():
    # The old xmap docstring: vdot mapped over rows and columns is a matmul.
    x = RNG.standard_normal((10, 5)).astype(np.float32)
    y = RNG.standard_normal((5, 20)).astype(np.float32)
    f = xmap(jnp.vdot, in_axes=({0: "left"}, {1: "right"}), out_axes=["left", "right", ...])
    close(f(x, y), x @ y)


def test_pytree_prefix_specs_and_outputs():
    def body(params, x):
        return {"y": x @ params["w"] + params["b"], "n": jnp.sum(x)}
    f = xmap(body, ({"w": [...], "b": []}, ["a", None]), {"y": ["a", ...], "n": ["a"]})
    params = {"w": W[0], "b": np.float32(1.5)}
    x = A[:, 0, :]
    out = f(params, x)
    close(out["y"], x @ W[0] + 1.5)
    close(out["n"], x.sum(1))


def test_list_of_specs_means_a_tuple_and_empty_specs():
    f = xmap(lambda x, s: x * s, [["a", ...], {}], ["a", ...])
    close(f(A, np.float32(3)), A * 3)
    g = xmap(lambda x: x + 1, [[...]], [...])
    close(g(A), A + 1)


def test_output_only_name_is_broadcast():
    f = xmap(lambda x: x * 2, [...], ["r", ...], axis_sizes={"r": 3})
    close(f(A[0]), np.broadcast_to(A[0] * 2, (3,) + A[0].shape))


@pytest.mark.parametrize("resources", [None, {"i": "y"}, {"i": ("x", "y")}])
def test_axis_sizes_for_a_name_only_the_body_uses(resources):
    # Old xmap (JAX's testCollectiveOverNoName): psum over a name no spec has.
    def body(x):
        return nx.psum(x ** 2, "i") + nx.pmax(nx.axis_index("i"), "i") * nx.axis_size("i")
    f = xmap(body, ["a", ...], ["a", ...], axis_sizes={"i": 8}, axis_resources=resources)
    x = A[:2, 0]
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        close(f(x), 8 * x ** 2 + 7 * 8)
    raw = xmap(lambda: lax.psum(jnp.array(2) ** 2, "i"), {}, {}, axis_sizes={"i": 4})
    assert int(raw()) == 16


def test_raw_lax_psum_over_a_vmapped_name():
    f = xmap(lambda x: lax.psum(x, "a") - lax.pmax(x, "a"), ["a", ...], [...])
    close(f(A), A.sum(0) - A.max(0))


# -- one program under every assignment of resources ---------------------------

def program(x, w):
    """Uses both names in named ops; results keep a, b or neither."""
    h = jnp.tanh(nx.einsum("ij,jk->ik", x[None], w)[0])     # (5,) per (a, b)
    hb = nx.sum(h, "b")                                       # varies along a
    centred = h - nx.mean(h, ("a", "b"))                      # varies along a, b
    return hb, centred, nx.max(hb, "a")


def reference(x, w):
    h = np.tanh(np.einsum("abj,bjk->abk", x, w))
    hb = h.sum(1)
    return hb, h - h.mean((0, 1)), hb.max(0)


IN_AXES = (["a", "b", None], ["b", None, None])
OUT_AXES = (["a", None], ["a", "b", None], [None])


def _assignments(axis_names):
    options = [()] + [p for r in (1, 2) for p in itertools.permutations(axis_names, r)]
    for ra, rb in itertools.product(options, options):
        if not set(ra) & set(rb):
            yield {n: r for n, r in (("a", ra), ("b", rb)) if r}


def _divides(assignment, mesh):
    sizes = {"a": 8, "b": 4}
    return all(sizes[n] % np.prod([mesh.shape[m] for m in r]) == 0
               for n, r in assignment.items())


MESH_2x2 = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4])
MESH_8 = jax.make_mesh((2, 4), ("x", "y"))
CASES = ([("2x2", res) for res in _assignments(("x", "y")) if _divides(res, MESH_2x2)]
         + [("2x4", res) for res in _assignments(("x", "y")) if _divides(res, MESH_8)])


@pytest.mark.parametrize("mesh_name,resources", CASES, ids=[f"{m}-{r}" for m, r in CASES])
def test_results_do_not_depend_on_resources(mesh_name, resources):
    mesh = MESH_2x2 if mesh_name == "2x2" else MESH_8
    f = xmap(program, IN_AXES, OUT_AXES, axis_resources=resources)
    with jax.set_mesh(mesh):
        out = f(A, W)
    for got, want in zip(out, reference(A, W)):
        close(got, want)
    hb = out[0]
    mesh_axes = resources.get("a", ())
    if mesh_axes:   # results are global arrays sharded per the plan
        spec = hb.sharding.spec
        assert tuple(spec[0] if isinstance(spec[0], tuple) else (spec[0],)) == tuple(mesh_axes)


def test_eight_device_mesh_with_three_axes():
    mesh = jax.make_mesh((2, 2, 2), ("x", "y", "z"))
    for res in [{"a": ("x", "y", "z")}, {"a": ("z", "x"), "b": "y"}, {"a": "y", "b": ("z", "x")}]:
        f = xmap(program, IN_AXES, OUT_AXES, axis_resources=res)
        with jax.set_mesh(mesh):
            for got, want in zip(f(A, W), reference(A, W)):
                close(got, want)


# -- serial loops ----------------------------------------------------------------

LOOP_PROGRAM_IN = (["a", "b", None], ["b", None, None])


def loop_body(x, w):
    return jnp.tanh(x @ w), jnp.sum(w)


def loop_body_reducing_b(x, w):
    # Collectives over a looped name are not allowed: used when 'b' is not looped.
    h, ws = loop_body(x, w)
    return h, ws, nx.sum(h, "b")


LOOP_OUT = (["a", "b", None], ["b"], ["a", None])


@pytest.mark.parametrize("resources", [
    {"a": SerialLoop(4)},
    {"a": SerialLoop(8), "b": SerialLoop(2)},
    {"a": ("x", SerialLoop(2))},
    {"a": (SerialLoop(2), "x"), "b": "y"},
    {"a": "l", "b": ("x", "l2")},
    {"b": SerialLoop(4)},
], ids=str)
def test_serial_loops(resources):
    b_looped = any(isinstance(r, SerialLoop) or r == "l2"
                   for r in np.atleast_1d(np.array(resources.get("b", ()), dtype=object)))
    body = loop_body if b_looped else loop_body_reducing_b
    f = xmap(body, LOOP_PROGRAM_IN, LOOP_OUT[:2] if b_looped else LOOP_OUT,
             axis_resources=resources)
    with jax.set_mesh(MESH_8), serial_loop("l", 2), serial_loop("l2", 2):
        out = f(A, W)
    h = np.tanh(np.einsum("abj,bjk->abk", A, W))
    close(out[0], h)
    close(out[1], W.sum((1, 2)))
    if not b_looped:
        close(out[2], h.sum(1))


def test_loop_over_output_only_name_and_carried_outputs():
    f = xmap(lambda x: (x * 2, x.sum()), [None, ...], (["r", ...], [...]),
             axis_sizes={"r": 4}, axis_resources={"r": SerialLoop(2)})
    y, s = f(A[0, 0])
    close(y, np.broadcast_to(A[0, 0] * 2, (4, 3)))
    close(s, A[0, 0].sum())


def test_serial_loop_lowers_temp_memory():
    # The (64, 1024) hidden activations are live at once without the loop,
    # 1/8 of them with it (measured: 262144 vs 36996 bytes of temp).
    x = RNG.standard_normal((64, 128)).astype(np.float32)
    m = RNG.standard_normal((128, 1024)).astype(np.float32) / 16
    body = lambda v, m: jnp.tanh(v @ m) @ m.T
    plain = xmap(body, (["a", None], [...]), ["a", None])
    looped = xmap(body, (["a", None], [...]), ["a", None], axis_resources={"a": SerialLoop(8)})
    close(looped(x, m), plain(x, m), tol=1e-3)
    mem = lambda f: f.lower(x, m).compile().memory_analysis().temp_size_in_bytes
    assert mem(looped) < mem(plain) / 2


# -- meshes, shardings and placements -------------------------------------------

@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=str)
def test_inputs_unsharded_committed_or_sharded(axis_type):
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(axis_type,) * 2)
    f = xmap(lambda x: nx.sum(x * x, "a"), ["a", ...], [...], axis_resources={"a": "x"})
    want = (A * A).sum(0)
    with jax.set_mesh(mesh):
        for x in (A, jnp.asarray(A), jax.device_put(A, jax.devices()[3]),
                  jax.device_put(A, NamedSharding(mesh, P(None, "y"))),
                  jax.device_put(A, NamedSharding(mesh, P("x")))):
            close(f(x), want)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=str)
def test_inputs_committed_to_devices_outside_the_mesh(axis_type):
    # docs/xmap.md: such inputs are device_put onto the mesh first (t08).
    mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4],
                         axis_types=(axis_type,) * 2)
    others = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[4:])
    f = xmap(lambda x: x * 2 + nx.sum(x, "a"), ["a", ...], ["a", ...],
             axis_resources={"a": "x"})
    want = A * 2 + A.sum(0)
    with jax.set_mesh(mesh):
        made_here = jnp.asarray(A) * 1   # computed under the mesh, as in t08
        for x in (jax.device_put(made_here, jax.devices()[7]),
                  jax.device_put(made_here, NamedSharding(others, P("x", "y")))):
            got = f(x)
            close(got, want)
            assert got.sharding.is_equivalent_to(NamedSharding(mesh, P("x")), got.ndim)


@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated")
def test_legacy_mesh_context():
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    f = xmap(program, IN_AXES, OUT_AXES, axis_resources={"a": "x", "b": "y"})
    with mesh:
        out = f(A, W)
        lowered = f.lower(A, W)
    for got, want in zip(out, reference(A, W)):
        close(got, want)
    assert isinstance(lowered, jax.stages.Lowered)


# -- composition -------------------------------------------------------------------

def test_nested_xmap_uses_outer_names():
    def outer_body(x):   # x: (4, 3) per a
        inner = xmap(lambda y: nx.sum(y, "b") + nx.sum(nx.sum(y, "a"), "b"), ["b", ...], [...])
        return inner(x)
    f = xmap(outer_body, ["a", ...], ["a", ...])
    close(f(A), A.sum(1) + A.sum((0, 1)))
    with jax.set_mesh(MESH_8):
        g = xmap(lambda x: xmap(lambda y: nx.sum(y, ("a", "b")), ["b", ...], [...],
                                axis_resources={"b": "y"})(x),
                 ["a", ...], [...], axis_resources={"a": "x"})
        close(g(A), A.sum((0, 1)))


@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated")
@pytest.mark.parametrize("enter", ["with mesh", "jax.set_mesh"])
def test_nested_results_under_an_auto_mesh_are_sharded_per_the_plan(enter):
    # The outer plan puts dim 0 on 'y'; the inner name's 'x' must not leak (t03).
    def outer_body(x):
        inner = xmap(lambda y: (jnp.sin(y), nx.psum(y, ("a", "b"))), ["b", ...],
                     (["b", ...], [...]), axis_resources={"b": "x"})
        return inner(x * 2)
    f = xmap(outer_body, [None, "a", ...], (["a", ...], [...]), axis_resources={"a": "y"})
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    x = RNG.standard_normal((4, 2, 5)).astype(np.float32)
    with (mesh if enter == "with mesh" else jax.set_mesh(mesh)):
        sines, total = f(x)
    close(sines, np.sin(2 * x).transpose(1, 0, 2))
    close(total, 2 * x.sum((0, 1)))
    assert sines.sharding.is_equivalent_to(NamedSharding(mesh, P("y")), sines.ndim)
    assert total.sharding.is_equivalent_to(NamedSharding(mesh, P()), total.ndim)


@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated")
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=str)
def test_outer_plan_off_the_mesh_over_a_nested_one_on_it(axis_type):
    # The outer plan maps nothing to the mesh: its result is replicated, not
    # sharded like the inner one's, under jax.set_mesh and then under the
    # legacy `with mesh:` (the same xmap object in both contexts).
    inner = xmap(lambda v: v * 2, ["b", ...], ["b", ...], axis_resources={"b": "y"})
    outer = xmap(lambda v: inner(v) + 1, ["a", ...], ["a", ...])
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(axis_type,) * 2)
    x = A[:2, :4]
    for context in (jax.set_mesh(mesh), mesh):
        with context:
            got = outer(x)
        close(got, x * 2 + 1)
        assert got.sharding.is_equivalent_to(NamedSharding(mesh, P()), got.ndim)


def test_grad_vmap_and_jit_of_xmapped():
    f = xmap(lambda x, w: nx.sum(jnp.tanh(x @ w), ("a", "b")).sum(), LOOP_PROGRAM_IN, [...])
    pos = lambda x, w: jnp.tanh(jnp.einsum("abj,bjk->abk", x, w)).sum()
    with jax.set_mesh(MESH_8):
        fr = xmap(f.__wrapped__, LOOP_PROGRAM_IN, [...], axis_resources={"a": "x", "b": "y"})
        for fn in (f, fr):
            close(jax.grad(fn, argnums=(0, 1))(A, W)[1], jax.grad(pos, argnums=(0, 1))(A, W)[1])
            close(jax.jit(fn)(A, W), pos(A, W))
            xs = np.stack([A, A * 2])
            close(jax.vmap(fn, in_axes=(0, None))(xs, W), jax.vmap(pos, in_axes=(0, None))(xs, W))


def test_named_ops_inside_scan_cond_and_checkpoint():
    def body(x):
        def step(c, row):
            return c + nx.sum(row, "a"), None
        total, _ = lax.scan(step, jnp.zeros(()), x)
        centred = lax.cond(total > 0, lambda v: v - nx.mean(v, "a"), lambda v: -v, x)
        return total, jax.checkpoint(lambda v: nx.max(v, "a"))(centred)
    x = RNG.standard_normal((8, 5)).astype(np.float32)
    want_total = x.sum()
    want_centred = x - x.mean(0) if want_total > 0 else -x
    for res in ({}, {"a": "x"}):
        with jax.set_mesh(MESH_8):
            f = xmap(body, ["a", None], ([], [None]), axis_resources=res)
            total, mx = f(x)
        close(total, want_total)
        close(mx, want_centred.max(0))


def test_donate_argnums_and_backend():
    f = xmap(lambda x: x + 1, ["a", ...], ["a", ...], donate_argnums=0, backend="cpu")
    x = jnp.asarray(A)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # CPU may decline some donations
        close(f(x), A + 1)
    assert x.is_deleted()


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=str)
def test_donation_takes_effect_for_inputs_placed_per_the_plan(axis_type):
    # docs/xmap.md: under a mesh an input sharded per the plan (as the compiled
    # input_shardings name) is donated; one the program must move is copied,
    # and the caller's array survives.
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(axis_type,) * 2)
    f = xmap(lambda w: w * 0.5 + nx.sum(w, "a"), ["a", ...], ["a", ...],
             axis_resources={"a": "x"}, donate_argnums=0)
    want = A * 0.5 + A.sum(0)
    with jax.set_mesh(mesh):
        (placed,), _ = f.lower(A).compile().input_shardings
        assert placed == NamedSharding(mesh, P("x"))
        on_one_device = jax.device_put(A, jax.devices()[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # JAX may warn the copy's donation is unusable
            close(f(on_one_device), want)
        assert not on_one_device.is_deleted()
        w = jax.device_put(A, placed)
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # no "donated buffers were not usable"
            close(f(w), want)
        assert w.is_deleted()


def test_lower_returns_jax_lowered():
    f = xmap(program, IN_AXES, OUT_AXES, axis_resources={"a": "x"})
    with jax.set_mesh(MESH_8):
        lowered = f.lower(A, W)
    assert isinstance(lowered, jax.stages.Lowered)
    assert "shard_map" in lowered.as_text() or "sdy.manual_computation" in lowered.as_text()
    compiled = lowered.compile()
    assert compiled.memory_analysis() is not None
    assert compiled.cost_analysis() is not None
    for got, want in zip(compiled(A, W), reference(A, W)):
        close(got, want)


def test_plan_and_trace_are_cached():
    traces = []

    def body(x):
        traces.append(x.shape)
        return nx.sum(x, "a")

    f = xmap(body, ["a", ...], [...], axis_resources={"a": "x"})
    with jax.set_mesh(MESH_8):
        for _ in range(3):
            close(f(A), A.sum(0))
        assert len(traces) == 1
        f(A[:, :2])   # a new shape: one more trace
        assert len(traces) == 2
    with jax.set_mesh(MESH_2x2):   # another mesh: a new plan
        close(f(A), A.sum(0))
    assert len(traces) == 3


# -- names sharing a resource without co-occurring in one value -------------------

def separate_names(u, w):
    """u varies along a, w along b; no value varies along both."""
    su = nx.sum(jnp.sin(u), "a")                                      # (3,)
    carried, _ = lax.scan(lambda c, _: (c * 0.5 + 1, None), w, None, length=2)
    return u * 2, jnp.tanh(carried) + su[:, None], su @ nx.max(w, "b")


def separate_names_reference(u, w):
    su = np.sin(u).sum(0)
    carried = (w * 0.5 + 1) * 0.5 + 1
    return u * 2, np.tanh(carried) + su[:, None], su @ w.max(0)


SEPARATE_IN = (["a", None], ["b", None, None])
SEPARATE_OUT = (["a", None], ["b", None, None], [None])


@pytest.mark.parametrize("resources", [{"a": "y", "b": "y"}, {"a": ("x", "y"), "b": "x"}],
                         ids=str)
def test_names_sharing_a_resource_without_cooccurring(resources):
    u = A[:, 0, :]
    unplaced = xmap(separate_names, SEPARATE_IN, SEPARATE_OUT, axis_resources={})(u, W)
    with jax.set_mesh(MESH_8):
        out = xmap(separate_names, SEPARATE_IN, SEPARATE_OUT, axis_resources=resources)(u, W)
    for got, want, ref in zip(out, unplaced, separate_names_reference(u, W)):
        close(got, want)
        close(got, ref)


def test_names_sharing_a_loop_without_cooccurring():
    body = lambda u, w: (u * 2, jnp.tanh(w) + 1)
    u = A[:, 0, :]
    with serial_loop("l", 2):
        out = xmap(body, SEPARATE_IN, SEPARATE_OUT[:2], axis_resources={"a": "l", "b": "l"})(u, W)
    close(out[0], u * 2)
    close(out[1], np.tanh(W) + 1)


def test_sharing_check_is_traced_once_per_plan():
    traces = []

    def body(u, w):
        traces.append(1)
        return separate_names(u, w)

    f = xmap(body, SEPARATE_IN, SEPARATE_OUT, axis_resources={"a": "y", "b": "y"})
    with jax.set_mesh(MESH_8):
        f(A[:, 0, :], W)
        first = len(traces)
        for _ in range(3):
            f(A[:, 0, :], W)
    assert len(traces) == first   # repeated calls neither re-plan nor re-check
