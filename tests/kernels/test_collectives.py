"""The Pallas TPU ring collectives (``nxops/kernels/pallas/collectives.py``)
against the xla reference (``lax.all_gather`` / ``lax.psum_scatter``).

On CPU they run under the TPU interpret mode on the 8 simulated devices, with
its race detector on; every device's result is compared. Shards are tiny:
each interpreted run costs about a second on a 2-core machine. Data are small
integers, so every dtype's sums are exact and results must match bit for bit.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

from nxops._errors import NxopsError
from nxops.kernels import _choice, _selection
from nxops.kernels.pallas import collectives as pallas_collectives
from nxops.kernels.xla import collectives as xla_collectives

EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto


def make_mesh(shape, names, axis_type=EXPLICIT):
    devices = jax.devices()[:int(np.prod(shape))]
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape), devices=devices)


def small_ints(shape, dtype, seed=0):
    values = np.random.default_rng(seed).integers(-4, 5, size=shape)
    return jnp.asarray(values, dtype=dtype)


def per_device_results(body, x, mesh, spec, check_vma=True):
    """Runs ``body`` on every device; the result stacks all devices' outputs."""
    x = jax.device_put(x, jax.NamedSharding(mesh, spec))
    fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma)
    return np.asarray(jax.jit(fn)(x))


def assert_no_races():
    assert tpu_interpret.races is not None, "the race detector did not run"
    assert not tpu_interpret.races.races_found, "the interpret mode's race detector found races"


def check(op, x, mesh, spec, axis_name, check_vma=True, **params):
    ours = getattr(pallas_collectives, op)
    reference = getattr(xla_collectives, op)
    got = per_device_results(lambda s: ours(s, axis_name, platform="cpu", **params),
                             x, mesh, spec, check_vma)
    assert_no_races()
    want = per_device_results(lambda s: reference(s, axis_name, **params), x, mesh, spec, check_vma)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


# ---------------------------------------------------------------------------
# All-gather

ALL_GATHER_CASES = [
    # devices, shard shape, dtype, axis, tiled   (ring direction of the shard)
    (2, (2, 3), jnp.float32, 0, True),        # unidirectional
    (4, (2, 3), jnp.float32, 0, True),
    (8, (2, 3), jnp.float32, 0, True),
    (8, (16, 4), jnp.float32, 1, False),      # bidirectional, cut at 8 sublanes
    (4, (4, 5, 2), jnp.bfloat16, 2, True),    # bidirectional along the leading dim
    (4, (3,), jnp.int32, 0, False),           # a vector
    (2, (3, 2, 4), jnp.float16, -1, True),    # odd cut: halves of 1 and 2
    (8, (3, 2, 5), jnp.int8, 1, False),
]


@pytest.mark.parametrize("n,shape,dtype,axis,tiled", ALL_GATHER_CASES)
def test_all_gather_matches_xla(n, shape, dtype, axis, tiled):
    mesh = make_mesh((n,), ("x",))
    x = small_ints((n * shape[0],) + shape[1:], dtype)
    check("all_gather", x, mesh, P("x"), "x", axis=axis, tiled=tiled)


# ---------------------------------------------------------------------------
# Reduce-scatter

REDUCE_SCATTER_CASES = [
    # devices, shard shape, dtype, scatter_dimension, tiled
    (2, (4, 3), jnp.float32, 0, True),        # unidirectional
    (4, (8, 3), jnp.float32, 0, True),
    (8, (16, 3), jnp.float32, 0, True),
    (2, (32, 4), jnp.float32, 0, True),       # chunk (16, 4): bidirectional, cut at 8 sublanes
    (4, (3, 8, 2), jnp.bfloat16, 1, True),    # chunk (3, 2, 2): bidirectional, halves 1 and 2
    (8, (8, 5), jnp.float32, 0, False),
    (4, (2, 4), jnp.int32, 1, False),
    (4, (2, 3, 8), jnp.float16, 2, True),
]


@pytest.mark.parametrize("n,shape,dtype,dim,tiled", REDUCE_SCATTER_CASES)
def test_reduce_scatter_matches_xla(n, shape, dtype, dim, tiled):
    mesh = make_mesh((n,), ("x",))
    x = small_ints((n * shape[0],) + shape[1:], dtype, seed=n)
    check("reduce_scatter", x, mesh, P("x"), "x", scatter_dimension=dim, tiled=tiled)


# ---------------------------------------------------------------------------
# Meshes: Auto axes, check_vma off, one axis of a 2-D mesh


@pytest.mark.parametrize("op,params", [
    ("all_gather", dict(axis=0, tiled=True)),
    ("reduce_scatter", dict(scatter_dimension=0, tiled=True)),
])
def test_auto_axes_and_check_vma_off(op, params):
    mesh = make_mesh((4,), ("x",), AUTO)
    x = small_ints((16, 3, 2), jnp.float32)
    check(op, x, mesh, P("x"), "x", **params)
    check(op, x, mesh, P("x"), "x", check_vma=False, **params)


@pytest.mark.parametrize("axis_name", ["x", "y", ("y",)])
@pytest.mark.parametrize("op,params", [
    ("all_gather", dict(axis=1, tiled=False)),
    ("reduce_scatter", dict(scatter_dimension=0, tiled=True)),
])
def test_one_axis_of_a_2d_mesh(op, params, axis_name):
    """Neighbours are found along one axis; the other keeps its coordinate."""
    mesh = make_mesh((4, 2), ("x", "y"))
    x = small_ints((16, 6, 2), jnp.float32, seed=3)
    check(op, x, mesh, P("x", "y"), axis_name, **params)


def test_results_have_the_reference_types():
    """All-gather results are invariant over the axis, reduce-scatter ones vary."""
    mesh = make_mesh((2,), ("x",))
    x = jax.ShapeDtypeStruct((4, 3), jnp.float32, sharding=jax.NamedSharding(mesh, P("x")))

    def types(body):
        jaxpr = jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
        inner = jaxpr.eqns[0].params["jaxpr"]
        return [str(v.aval) for v in inner.outvars]

    for op, params in (("all_gather", dict(axis=0, tiled=True)),
                       ("reduce_scatter", dict(scatter_dimension=0, tiled=True))):
        ours = getattr(pallas_collectives, op)
        reference = getattr(xla_collectives, op)
        assert types(lambda s: ours(s, "x", platform="cpu", **params)) == \
            types(lambda s: reference(s, "x", **params))


# ---------------------------------------------------------------------------
# Lowering for TPU (on CPU: Mosaic custom calls, no TPU needed)


@pytest.mark.parametrize("op,params", [
    ("all_gather", dict(axis=1, tiled=True)),
    ("all_gather", dict(axis=0, tiled=False)),
    ("reduce_scatter", dict(scatter_dimension=0, tiled=True)),
    ("reduce_scatter", dict(scatter_dimension=1, tiled=False)),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_mosaic_for_tpu(op, params, dtype):
    mesh = make_mesh((4, 2), ("x", "y"))
    x = jax.ShapeDtypeStruct((64, 4, 128), dtype, sharding=jax.NamedSharding(mesh, P("x")))
    ours = getattr(pallas_collectives, op)
    fn = jax.jit(jax.shard_map(lambda s: ours(s, "x", platform="tpu", **params),
                               mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    text = fn.trace(x).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    assert "stablehlo.all_gather" not in text and "stablehlo.reduce_scatter" not in text


# ---------------------------------------------------------------------------
# Ring geometry and the registry


def test_split_prefers_leading_dims_and_aligned_tiles():
    split = pallas_collectives._split
    assert (split((3, 8, 128), 4).dim, split((3, 8, 128), 4).cut) == (0, 1)
    assert (split((16, 5), 4).dim, split((16, 5), 4).cut) == (0, 8)
    assert split((16, 5), 2).dim is None          # bf16 sublane tiles hold 16 rows
    assert (split((1, 4, 256), 4).dim, split((1, 4, 256), 4).cut) == (2, 128)
    assert not split((5, 3), 4).bidirectional
    assert not split((), 4).bidirectional


def test_registered_for_cpu_and_tpu():
    selection = _selection.parse_selection("collective=pallas")
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    for platform in ("cpu", "tpu"):
        choice = _choice.choose("all_gather", platform, selection, [x], axis_name="x",
                                  axis=0, tiled=True)
        assert choice.kernel is pallas_collectives.ALL_GATHER
        choice = _choice.choose("reduce_scatter", platform, selection, [x], axis_name="x",
                                  scatter_dimension=0, tiled=True)
        assert choice.kernel is pallas_collectives.REDUCE_SCATTER
    with pytest.raises(NxopsError, match="runs on cpu, cuda, tpu, not rocm"):
        _choice.choose("all_gather", "rocm", selection, [x], axis_name="x", axis=0, tiled=True)


@pytest.mark.parametrize("aval,axis_name,platform,reason", [
    (jax.ShapeDtypeStruct((8,), jnp.float32), ("x", "y"), "tpu", "one mesh axis"),
    (jax.ShapeDtypeStruct((8,), jnp.float64), "x", "tpu", "dtype float64"),
    (jax.ShapeDtypeStruct((128, 1024), jnp.float32), "x", "cpu", "too large for the TPU interpret"),
    (jax.ShapeDtypeStruct((2048, 1024), jnp.float32), "x", "tpu", "VMEM budget"),
])
def test_not_supported_reasons(aval, axis_name, platform, reason):
    ag = pallas_collectives.all_gather_not_supported_reasons(
        aval, axis_name=axis_name, platform=platform, axis=0, tiled=True)
    rs = pallas_collectives.reduce_scatter_not_supported_reasons(
        aval, axis_name=axis_name, platform=platform, scatter_dimension=0, tiled=True)
    assert any(reason in r for r in rs), rs
    if reason != "VMEM budget":  # the all-gather streams HBM to HBM: no VMEM limit
        assert any(reason in r for r in ag), ag
    else:
        assert not ag
    selection = _selection.parse_selection("collective=pallas")
    with pytest.raises(NxopsError, match="cannot run this case"):
        _choice.choose("reduce_scatter", platform, selection, [aval], axis_name=axis_name,
                         scatter_dimension=0, tiled=True)


# ---------------------------------------------------------------------------
# CUDA: JAX's Mosaic GPU multimem collectives, opt-in, lowered on CPU


@pytest.mark.parametrize("op,params", [
    ("all_gather", dict(axis=0, tiled=False)),
    ("all_gather", dict(axis=1, tiled=True)),
    ("reduce_scatter", dict(scatter_dimension=1, tiled=True)),
])
def test_cuda_lowers_to_mosaic_gpu_when_opted_in(nxops_config, op, params):
    nxops_config("MGPU_COLLECTIVES", "1")
    mesh = make_mesh((8,), ("x",))
    x = jax.ShapeDtypeStruct((8 * 64, 256), jnp.bfloat16, sharding=jax.NamedSharding(mesh, P("x")))
    ours = getattr(pallas_collectives, op)
    reference = getattr(xla_collectives, op)
    fn = jax.jit(jax.shard_map(lambda s: ours(s, "x", platform="cuda", **params),
                               mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    text = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "stablehlo.all_gather" not in text
    want = jax.shard_map(lambda s: reference(s, "x", **params), mesh=mesh, in_specs=P("x"),
                         out_specs=P("x"))
    assert jax.eval_shape(fn, x).shape == jax.eval_shape(want, x).shape


def test_cuda_needs_opt_in_one_axis_meshes_and_128_element_pieces(monkeypatch, nxops_config):
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    selection = _selection.parse_selection("collective=pallas")
    nxops_config("MGPU_COLLECTIVES", "0")
    with pytest.raises(NxopsError, match="NXOPS_MGPU_COLLECTIVES=1"):
        _choice.choose("all_gather", "cuda", selection, [x], axis_name="x", axis=0, tiled=True)
    auto = _choice.choose("all_gather", "cuda", _selection.parse_selection("auto"), [x],
                            axis_name="x", axis=0, tiled=True)
    assert auto.kernel.backend == "xla"  # NCCL unless opted in

    nxops_config("MGPU_COLLECTIVES", "1")
    reasons = pallas_collectives.all_gather_not_supported_reasons
    assert reasons(x, "x", platform="cuda", axis=0, tiled=True) == []
    assert "multiple of 128" in " ".join(
        reasons(jax.ShapeDtypeStruct((3, 5), jnp.float32), "x", platform="cuda", axis=0, tiled=True))

    found = []
    mesh = make_mesh((4, 2), ("x", "y"))

    def body(s):
        found.extend(reasons(jax.typeof(s), "x", platform="cuda", axis=0, tiled=True))
        return s

    jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
        jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=jax.NamedSharding(mesh, P("x"))))
    assert any("every mesh axis" in r for r in found), found


@pytest.mark.parametrize("n,rows,refused", [(8, 8, False), (8, 32, True), (2, 32, False)])
def test_interpret_mode_refuses_buffers_that_deadlock(n, rows, refused):
    """8 devices deadlock the interpret mode with 16 KiB shards (128 KiB gathered)."""
    mesh = make_mesh((n,), ("x",))
    found = []

    def body(s):
        found.append(pallas_collectives.all_gather_not_supported_reasons(
            jax.typeof(s), "x", platform="cpu", axis=0, tiled=True))
        return s

    x = jax.ShapeDtypeStruct((n * rows, 128), jnp.float32, sharding=jax.NamedSharding(mesh, P("x")))
    jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
    (reasons,) = found
    assert bool(reasons) == refused, reasons


# ---------------------------------------------------------------------------
# Gradient (through the reference's transpose) and vmap (batch as a leading dim)


def _loss_and_batched(impl, n, check_vma):
    """A scalar loss using both collectives, and a vmapped batch of them."""
    mesh = make_mesh((n,), ("x",))
    kw = dict(platform="cpu") if impl is pallas_collectives else {}

    def body(s):
        gathered = impl.all_gather(s, "x", axis=1, tiled=True, **kw)
        scattered = impl.reduce_scatter(s * s, "x", scatter_dimension=0, tiled=False, **kw)
        return (gathered ** 2).sum() + jax.lax.psum((scattered ** 3).sum(), "x")

    loss = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=check_vma)
    batched = jax.shard_map(jax.vmap(lambda s: impl.all_gather(s, "x", axis=0, tiled=False, **kw)),
                            mesh=mesh, in_specs=P(None, "x"), out_specs=P(None, "x"),
                            check_vma=check_vma)
    return mesh, loss, batched


@pytest.mark.parametrize("check_vma", [True, False])
def test_gradient_and_vmap_match_xla(check_vma):
    n = 4
    x = small_ints((n * n, 3), jnp.float32, seed=5)
    results = []
    for impl in (pallas_collectives, xla_collectives):
        mesh, loss, batched = _loss_and_batched(impl, n, check_vma)
        xs = jax.device_put(x, jax.NamedSharding(mesh, P("x")))
        grad = np.asarray(jax.jit(jax.grad(loss))(xs))
        stacked = jax.device_put(jnp.stack([x, 2 * x]), jax.NamedSharding(mesh, P(None, "x")))
        results.append((grad, np.asarray(jax.jit(batched)(stacked))))
    (grad, vmapped), (want_grad, want_vmapped) = results
    np.testing.assert_array_equal(grad, want_grad)
    np.testing.assert_array_equal(vmapped, want_vmapped)
    assert np.abs(want_grad).sum() > 0


@pytest.mark.parametrize("op", ["all_gather", "psum_scatter"])
def test_values_and_gradients_pass_jax_own_checks(op):
    """The kernels carry an effect (interpret mode's ordered host callbacks);
    under ``jax_enable_checks`` JAX typechecks every jaxpr, the custom VJP
    around the kernel included."""
    import nxops as nx

    if op == "all_gather":
        def body(v):
            return nx.all_gather(v, "i", axis=0, tiled=True)
        out_axes = [None]
    else:
        def body(v):
            return nx.psum_scatter(v, "i", scatter_dimension=0, tiled=True)
        out_axes = ["i", None]
    f = nx.xmap(body, in_axes=["i", None], out_axes=out_axes, axis_resources={"i": "x"})
    x = jnp.arange(16.0).reshape(2, 8)

    def loss(v):   # a weight per result element: every cotangent differs
        out = f(v)
        return jnp.sum(out * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape))

    mesh = jax.make_mesh((2,), ("x",))
    with jax.set_mesh(mesh), jax.enable_checks(True):
        with nx.kernels.use("xla"):
            want, want_grad = jax.value_and_grad(loss)(x)
        with nx.kernels.use("collective=pallas"):
            got, got_grad = jax.value_and_grad(loss)(x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_grad, want_grad)
