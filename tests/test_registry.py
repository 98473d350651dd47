"""The kernel registry and selection: NXOPS_KERNELS parsing and errors,
nx.kernels.use, the jit cache key, auto/explicit choice, and explain."""
import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._extras import skip_without_triton

import nxops as nx
from jax.sharding import PartitionSpec as P

from nxops.kernels import _auto, _choice, _measured, _registry, _selection


def test_parse_whole_and_per_family_selections():
    assert str(_selection.parse_selection("xla")) == "xla"
    sel = _selection.parse_selection(" Reduce=pallas , einsum=xla ")
    assert sel.backend_for("reduce") == "pallas"
    assert sel.backend_for("dot_general") == "xla"
    assert sel.backend_for("all_gather") == "auto"


@pytest.mark.parametrize("value,why", [
    ("fast", "'fast' is neither a backend nor op=backend"),
    ("matmul=xla", "unknown op 'matmul'"),
    ("reduce=cuda", "unknown backend 'cuda'"),
    ("reduce=xla,reduce=pallas", "given twice"),
])
def test_bad_selection_names_value_and_valid_ones(value, why):
    with pytest.raises(nx.NxopsError, match=why) as info:
        _selection.parse_selection(value)
    text = str(info.value)
    assert "NXOPS_KERNELS" in text and repr(value) in text and "auto, xla, pallas, triton" in text


def test_bad_environment_variable_fails_at_import():
    env = dict(os.environ, NXOPS_KERNELS="bogus")
    proc = subprocess.run([sys.executable, "-c", "import nxops"], env=env, capture_output=True,
                          text=True)
    assert proc.returncode != 0
    assert "NXOPS_KERNELS='bogus'" in proc.stderr


def test_environment_variable_sets_the_default():
    env = dict(os.environ, NXOPS_KERNELS="reduce=xla")
    code = "import nxops; print(nxops.kernels._selection.current_selection())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == \
        "reduce=xla,einsum=auto,tile=auto,collective=auto,cross_entropy=auto,attention=auto"


def test_use_is_scoped_and_validated():
    before = _selection.current_selection()
    with nx.kernels.use("xla") as sel:
        assert _selection.current_selection() == sel
        assert str(sel) == "xla"
    assert _selection.current_selection() == before
    with pytest.raises(nx.NxopsError):
        with nx.kernels.use("nonsense"):
            pass


def test_switching_selection_retraces_jitted_functions():
    traces = []

    @jax.jit
    def f(x):
        traces.append(str(_selection.current_selection()))
        return nx.sum(x, 0)
    x = np.ones(4, np.float32)
    f(x)
    f(x)
    with nx.kernels.use("xla"):
        f(x)
    f(x)
    assert traces == ["auto", "xla"]


def test_auto_picks_xla_on_cpu_and_explicit_missing_backend_raises():
    aval = jax.typeof(jnp.ones((3, 4)))
    choice = _choice.choose("reduce", "cpu", _selection.parse_selection("auto"), (aval,),
                              axes=(1,), op="sum")
    assert choice.kernel.backend == "xla"
    saved = dict(_registry._KERNELS)
    try:
        del _registry._KERNELS[("reduce", "triton")]
        with pytest.raises(nx.NxopsError, match=r"'triton' implementation of 'reduce'.*nxops has "
                                                r"no 'triton' kernel for 'reduce' \(its "
                                                r"implementations: pallas, xla\)"):
            _choice.choose("reduce", "cuda", _selection.parse_selection("triton"), (aval,),
                             axes=(1,), op="sum")
    finally:
        _registry._KERNELS.clear()
        _registry._KERNELS.update(saved)


@pytest.mark.parametrize("missing, platform, hint", [
    pytest.param("jax_triton", "cuda", "jax-triton is not installed: pip install .*triton",
                 marks=skip_without_triton),   # with triton missing, that is reported first
    ("triton", "cpu", "triton is not installed: pip install .*triton"),
])
def test_triton_backend_names_the_missing_package(monkeypatch, missing, platform, hint):
    from nxops.kernels.triton import _common as triton_common
    real = triton_common._importable
    monkeypatch.setattr(triton_common, "_importable", lambda m: m != missing and real(m))
    aval = jax.typeof(jnp.ones((3, 4)))
    with pytest.raises(nx.NxopsError, match=hint):
        _choice.choose("reduce", platform, _selection.parse_selection("triton"), (aval,),
                         axes=(1,), op="sum")
    auto = _choice.choose("reduce", platform, _selection.parse_selection("auto"), (aval,),
                            axes=(1,), op="sum")
    assert auto.kernel.backend != "triton"


def test_explicit_backend_that_cannot_take_a_case_raises_with_reasons():
    def picky(*avals, platform, **params):
        return ["only even sizes"] if avals[0].shape[0] % 2 else []
    kernel = nx.kernels.Kernel(op="tile", backend="triton", platforms=("cpu",),
                               fn=lambda *a, **k: None, not_supported_reasons=picky)
    saved = dict(_registry._KERNELS)
    try:
        _registry._KERNELS[("tile", "triton")] = kernel
        aval = jax.typeof(jnp.ones(3))
        with pytest.raises(nx.NxopsError, match="cannot run this case.*only even sizes.*tile=auto"):
            _choice.choose("tile", "cpu", _selection.parse_selection("triton"), (aval,))
        even = jax.typeof(jnp.ones(4))
        assert _choice.choose("tile", "cpu", _selection.parse_selection("triton"), (even,)).kernel is kernel
    finally:
        _registry._KERNELS.clear()
        _registry._KERNELS.update(saved)


def test_registering_twice_is_an_error():
    existing = nx.kernels.registered("reduce")[0]
    clone = nx.kernels.Kernel(op=existing.op, backend=existing.backend,
                              platforms=existing.platforms, fn=existing.fn)
    with pytest.raises(ValueError, match="already registered"):
        nx.kernels.register(clone)


def test_explain_reports_every_kernel_op():
    def program(x, w):
        y = jax.vmap(lambda r: nx.einsum("i<n>,ij->j<n>", r, w), axis_name="n")(x)
        return nx.logsumexp(y, (0, 1))
    x, w = np.ones((4, 3), np.float32), np.ones((3, 2), np.float32)
    report = nx.kernels.explain(program, x, w)
    assert report.backends() == {"dot_general": {"xla"}, "reduce": {"xla"}}
    text = str(report)
    assert "dot_general" in text and "xla:reduce" in text and "on cpu" in text
    # Explaining twice (jit caches warm) reports the same.
    assert nx.kernels.explain(program, x, w).backends() == report.backends()


def test_explain_program_without_nxops_ops():
    assert "no nxops kernel ops" in str(nx.kernels.explain(lambda x: x + 1, np.ones(2)))


def test_lowering_reports_unbound_names():
    # Names left after batching cannot lower (an internal invariant, checked).
    from nxops.ops._reduce import reduce_p
    with pytest.raises(nx.NxopsError, match="unbound names"):
        jax.jit(lambda x: reduce_p.bind(x, axes=(), op="sum", axis_names=("q",),
                                        kernels="auto")).lower(np.ones(2, np.float32))


def test_mosaic_kernels_need_every_mesh_axis_manual_on_tpu():
    # Mosaic custom calls cannot be split by XLA's partitioner: under auto-
    # partitioned mesh axes `auto` keeps xla and says why; an explicit
    # `pallas` raises. With every axis manual, the Pallas kernel is used.
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    x = np.ones((8, 4), np.float32)
    partial_mesh = nx.xmap(lambda v: nx.sum(v, ("b", 0)), [["b", ...]], [...], axis_resources={"b": "x"})
    full_mesh = nx.xmap(lambda v: nx.sum(v, ("b", 0)), [["b", ...]], [...], axis_resources={"b": ("x", "y")})
    with jax.set_mesh(mesh):
        assert nx.kernels.explain(partial_mesh, x, platform="tpu").backends() == {"reduce": {"xla"}}
        with nx.kernels.use("pallas"):
            assert nx.kernels.explain(full_mesh, x, platform="tpu").backends() == {"reduce": {"pallas"}}
            with pytest.raises(nx.NxopsError, match="every mesh axis is manual"):
                nx.kernels.explain(partial_mesh, x, platform="tpu")


def test_auto_on_tpu_keeps_xla_until_a_tpu_measures_a_kernel():
    # nothing measured on a TPU: every case keeps XLA, and says so
    aval = jax.typeof(jnp.ones((8, 128)))
    auto = _selection.parse_selection("auto")
    lse = _choice.choose("reduce", "tpu", auto, (aval,), False, (_auto.ARGUMENT,),
                           axes=(1,), op="logsumexp")
    assert lse.kernel.backend == "xla"
    assert "nothing measured on tpu" in lse.describe()
    total = _choice.choose("reduce", "tpu", auto, (aval,), False, (_auto.ARGUMENT,),
                             axes=(1,), op="sum")
    assert total.kernel.backend == "xla" and "nothing measured on tpu" in total.describe()
    gather = _choice.choose("all_gather", "tpu", auto, (aval,), axis_name="x", axis=0, tiled=True)
    assert gather.kernel.backend == "xla"
    explicit = _choice.choose("all_gather", "tpu", _selection.parse_selection("collective=pallas"),
                                (aval,), axis_name="x", axis=0, tiled=True)
    assert explicit.kernel.backend == "pallas"


@pytest.mark.parametrize("selection", ["xla", "pallas"])
def test_zero_size_operands_need_no_kernel(selection):
    with nx.kernels.use(selection):
        np.testing.assert_array_equal(nx.sum(np.ones((0, 3), np.float32), 0), np.zeros(3))
        assert nx.max(np.ones((2, 0), np.float32), 0).shape == (0,)
        empty = nx.einsum("ij,jk->ik", np.ones((0, 3), np.float32), np.ones((3, 2), np.float32))
        assert empty.shape == (0, 2)
        np.testing.assert_array_equal(nx.einsum("ij,jk->ik", np.ones((2, 0), np.float32),
                                                np.ones((0, 2), np.float32)), np.zeros((2, 2)))
        report = nx.kernels.explain(lambda x: nx.sum(x, 0), np.ones((0, 3), np.float32))
    assert report.backends() == {"reduce": {"xla"}} and "zero-size" in str(report)


def test_explain_for_another_platform_covers_collectives():
    mesh = jax.make_mesh((8,), ("x",))
    fn = jax.jit(jax.shard_map(lambda v: nx.untile(v, {"x": 0}), mesh=mesh,
                               in_specs=P("x"), out_specs=P()))
    x = jax.device_put(np.ones((16, 4), np.float32), jax.NamedSharding(mesh, P("x")))
    with jax.set_mesh(mesh):
        assert nx.kernels.explain(fn, x).backends() == {"all_gather": {"xla"}}
        with nx.kernels.use("collective=pallas"):
            report = nx.kernels.explain(fn, x, platform="tpu")
    assert report.platform == "tpu" and report.backends() == {"all_gather": {"pallas"}}


@skip_without_triton
def test_auto_on_cuda_takes_the_fastest_measured_kernel_and_passes_over_one_that_cannot_run(
        monkeypatch, measured_kernels):
    # rows logsumexp of 16384x8192 f32 on the H200 (nxops/kernels/measured/sm_90.json):
    # both kernels measured under 0.95x XLA there; the faster one is taken.
    aval = jax.ShapeDtypeStruct((16384, 8192), jnp.float32)
    auto = _selection.parse_selection("auto")
    case = ("reduce", "cuda", auto, (aval,), False, (_auto.ARGUMENT,))
    params = dict(axes=(1,), op="logsumexp")
    measured = _measured.load("sm_90")[_measured.case_of("reduce", (aval,), params).key]
    faster, slower = sorted(measured.values(), key=lambda m: m.ratio)
    assert slower.ratio <= _measured.THRESHOLD
    choice = _choice.choose(*case, **params)
    assert choice.kernel.backend == faster.backend and faster.quote() in choice.describe()
    # Where the faster kernel cannot run (e.g. it does not load), the other takes the case.
    declined = _registry._KERNELS[("reduce", faster.backend)]
    monkeypatch.setitem(_registry._KERNELS, ("reduce", faster.backend), dataclasses.replace(
        declined, not_supported_reasons=lambda *a, **k: ["declined for the test"]))
    choice = _choice.choose(*case, **params)
    assert choice.kernel.backend == slower.backend and slower.quote() in choice.describe()
    assert "declined for the test" in choice.describe()


@pytest.mark.parametrize("op, params", [
    ("dot_general", dict(dimension_numbers=(((1,), (0,)), ((), ())))),
    ("tile", dict(dim=0, count=2)),
])
def test_auto_on_cuda_keeps_xla_for_matmuls_and_tiles(op, params):
    aval = jax.typeof(jnp.ones((4, 4)))
    avals = {"dot_general": (aval, aval), "tile": (aval, jax.typeof(jnp.int32(0)))}[op]
    choice = _choice.choose(op, "cuda", _selection.parse_selection("auto"), avals,
                              False, (_auto.ARGUMENT,) * 2, **params)
    assert choice.kernel.backend == "xla" and "unmeasured on sm_90" in choice.describe()
