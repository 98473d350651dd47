"""Regression tests for crashes, raw errors and silent mistakes
(defects 5-7 and 9-17): each case gives a correct result against NumPy, or an
NxopsError that names the problem."""
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from nxops.kernels import _selection

AUTO = jax.sharding.AxisType.Auto


def _mesh(shape=(2, 4), names=("x", "y"), auto=False):
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(names) if auto else None)


def _np_all_to_all(xs, split_axis, concat_axis, tiled):
    """lax.all_to_all, positionally: xs[j] is position j's value."""
    n = len(xs)
    chunks = [np.split(x, n, axis=split_axis) for x in xs]
    out = []
    for i in range(n):
        pieces = [chunks[j][i] for j in range(n)]
        if tiled:
            out.append(np.concatenate(pieces, axis=concat_axis))
        else:
            pieces = [np.squeeze(p, split_axis) for p in pieces]
            out.append(np.stack(pieces, axis=concat_axis))
    return np.stack(out)


A2A_CASES = [(1, -2, True), (-1, 0, True), (1, 0, True), (0, 1, False), (-2, -1, False)]


@pytest.mark.parametrize("split,concat,tiled", A2A_CASES)
@pytest.mark.parametrize("resources", [{}, {"a": "x"}, {"a": ("x", "y")}], ids=str)
def test_all_to_all_with_negative_and_tiled_axes_matches_lax_semantics(split, concat, tiled,
                                                                        resources):
    v = np.arange(8 * 8 * 8, dtype=np.float32).reshape(8, 8, 8)
    with jax.set_mesh(_mesh()):
        got = nx.xmap(lambda v: nx.all_to_all(v, "a", split, concat, tiled=tiled),
                      ["a", ...], ["a", ...], axis_resources=resources)(v)
    want = _np_all_to_all(list(v), split % 2, concat % 2, tiled)
    np.testing.assert_array_equal(got, want)


def test_all_to_all_over_a_name_on_devices_and_a_tile_matches_lax_semantics():
    v = np.arange(8 * 8 * 2, dtype=np.float32).reshape(8, 8, 2)
    with jax.set_mesh(_mesh()):   # 'a' of size 8 on mesh axis x (2): a local tile of 4
        got = nx.xmap(lambda v: nx.all_to_all(v, "a", 0, 1, tiled=True), ["a", ...],
                      ["a", ...], axis_resources={"a": "x"})(v)
    np.testing.assert_array_equal(got, _np_all_to_all(list(v), 0, 1, True))


@pytest.mark.parametrize("call,message", [
    (lambda v: nx.all_to_all(v, "a", 5, 0), "split_axis=5 is not a dim"),
    (lambda v: nx.all_to_all(v, "a", 0, 1), "must be exactly 8"),
    (lambda v: nx.all_to_all(v, "a", 1, 0, tiled=True), "must be a multiple of 8"),
    (lambda v: nx.ppermute(v, "a", 3), "must be a list of"),
    (lambda v: nx.ppermute(v, "a", [(0, 1, 2)]), "must be a list of"),
    (lambda v: nx.ppermute(v, "a", [(0, 9)]), "out of range"),
    (lambda v: nx.ppermute(v, "a", [(0, 1), (2, 1)]), "repeats a destination"),
], ids=["a2a_axis_range", "a2a_untiled_size", "a2a_tiled_size", "perm_int", "perm_triple",
        "perm_range", "perm_repeat"])
def test_bad_collective_arguments_raise_nxops_errors(call, message):
    with pytest.raises(nx.NxopsError, match=message):
        nx.xmap(call, ["a", ...], ["a", ...])(jnp.ones((8, 2, 4)))


@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.int8, jnp.int16, jnp.uint8, jnp.bfloat16])
def test_one_operand_einsum_keeps_the_operand_dtype_like_jnp(dtype):
    x = jnp.ones((2, 3), dtype)
    got = nx.einsum("ak->k", x)
    want = jnp.einsum("ak->k", x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_xmap_of_an_xmap_object_keeps_its_own_specs():
    inner = nx.xmap(lambda x: x, in_axes={}, out_axes=["i"], axis_sizes={"i": 4})
    outer = nx.xmap(inner, in_axes={}, out_axes=["j", ...], axis_sizes={"j": 7})
    assert outer(jnp.float32(1)).shape == (7, 4)


def _np_ppermute(x, perm):
    out = np.zeros_like(x)
    for src, dst in perm:
        out[dst] = x[src]
    return out


PERMS = {"cycle": [(i, (i + 1) % 8) for i in range(8)], "partial": [(0, 1), (1, 2)],
         "swap": [(0, 7), (7, 0)]}


@pytest.mark.parametrize("perm", PERMS, ids=list(PERMS))
@pytest.mark.parametrize("resources", [{}, {"a": "x"}, {"a": ("x", "y")}, {"a": "y"}], ids=str)
def test_ppermute_full_and_partial_on_every_placement_matches_lax_semantics(perm, resources):
    v = np.arange(8, dtype=np.float32) + 1
    with jax.set_mesh(_mesh()):
        got = nx.xmap(lambda v: nx.ppermute(v, "a", PERMS[perm]), ["a"], ["a"],
                      axis_resources=resources)(v)
    np.testing.assert_array_equal(got, _np_ppermute(v, PERMS[perm]))


def test_all_gather_over_a_vmapped_and_a_mesh_mapped_name_orders_positions_major_to_minor():
    v = np.arange(8, dtype=np.float32).reshape(4, 2)
    with jax.set_mesh(_mesh()):
        got = nx.xmap(lambda v: nx.all_gather(v, ("c", "a")), ["c", "a"], [...],
                      axis_resources={"a": "x"})(v)
    np.testing.assert_array_equal(got, v.reshape(-1))


def test_pallas_collectives_on_auto_axes_decline_with_a_reason():
    x = jnp.arange(16.0).reshape(8, 2)
    with jax.set_mesh(_mesh(auto=True)):
        f = nx.xmap(lambda v: nx.untile(v, {"a": 0}), ["a", ...], [...],
                    axis_resources={"a": "x"})
        with nx.kernels.use("collective=auto"):
            np.testing.assert_array_equal(f(x), np.arange(16.0))
        with nx.kernels.use("collective=pallas"), pytest.raises(
                nx.NxopsError, match="cannot be partitioned automatically"):
            f(x)


@pytest.mark.parametrize("resources", [{}, {"a": "x"}], ids=str)
def test_input_committed_outside_the_mesh_is_moved_onto_it(resources):
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    x = jax.device_put(jnp.arange(8.0), jax.devices()[7])
    with jax.set_mesh(mesh):
        got = nx.xmap(lambda v: v * 2, ["a"], ["a"], axis_resources=resources)(x)
    np.testing.assert_array_equal(got, np.arange(8.0) * 2)


_BF16_ON_PART_OF_THE_MESH = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np, nxops as nx
b = jnp.arange(8.0).astype(jnp.bfloat16)
with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
    for op, want in (("sum", 28.0), ("max", 7.0), ("min", 0.0)):
        got = nx.xmap(lambda v: getattr(nx, op)(v, "a"), ["a"], [...],
                      axis_resources={"a": "x"})(b)
        assert got.dtype == jnp.bfloat16 and float(got) == want, (op, got)
print("ok")
"""


def test_bf16_reductions_over_some_mesh_axes_do_not_abort_the_process():
    # In a subprocess: before the fix, XLA:CPU aborted the whole process.
    run = subprocess.run([sys.executable, "-c", _BF16_ON_PART_OF_THE_MESH], capture_output=True,
                         text=True, timeout=120, env={**__import__("os").environ,
                                                      "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


def test_all_gather_of_an_empty_mesh_mapped_value_is_empty():
    with jax.set_mesh(_mesh()):
        got = nx.xmap(lambda v: nx.all_gather(v, "a"), ["a", ...], [...],
                      axis_resources={"a": "x"})(jnp.zeros((2, 0)))
    assert got.shape == (2, 0)


@pytest.mark.parametrize("op,np_op", [("pmax", np.max), ("pmin", np.min)])
def test_complex_extrema_over_the_mesh_order_lexicographically_like_jnp(op, np_op):
    z = np.array([1 + 2j, 1 + 3j, 0 + 5j, 1 - 1j], np.complex64)
    with jax.set_mesh(_mesh((4,), ("x",))):
        got = nx.xmap(lambda v: getattr(nx, op)(v, "a"), ["a"], [...],
                      axis_resources={"a": "x"})(z)
    assert complex(got) == complex(np_op(z))


@pytest.mark.parametrize("in_axes,message", [
    ([{0: "i", "x": "j"}], "Invalid xmap in_axes entry"),
    ([{True: "a"}], "Invalid xmap in_axes entry"),
    (([["i"], ["i"]],), "in_axes"),
], ids=["mixed_dict_keys", "bool_key", "list_of_specs"])
def test_malformed_in_axes_raise_nxops_errors(in_axes, message):
    with pytest.raises(nx.NxopsError, match=message):
        nx.xmap(lambda a: a, in_axes, [...])(jnp.ones((4, 3)))


def test_pdot_with_non_tuple_dims_raises_an_nxops_error():
    with pytest.raises(nx.NxopsError, match="pos_contract"):
        nx.xmap(lambda a, b: nx.pdot(a, b, "i", pos_contract=(0, 0)), (["i", ...], ["i", ...]),
                [...])(jnp.ones((4, 3)), jnp.ones((4, 3)))


def test_empty_nxops_kernels_means_auto():
    assert str(_selection.parse_selection("")) == str(_selection.parse_selection("auto"))
    probe = "import nxops; print(nxops.kernels._selection.current_selection())"
    run = subprocess.run([sys.executable, "-c", probe],
                         capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "NXOPS_KERNELS": "", "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(_selection.parse_selection("auto"))


def test_explain_from_several_threads_reports_only_its_own_kernels():
    x = jnp.ones((16, 16))
    results, errors = {}, []

    def worker(selection):
        try:
            for _ in range(3):
                with nx.kernels.use(selection):
                    report = nx.kernels.explain(lambda v: nx.sum(v, 0), x)
                results.setdefault(selection, []).append(report.backends())
        except Exception as e:   # surfaced below: a failing thread must fail the test
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in ("xla", "pallas") * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert all(r == {"reduce": {"xla"}} for r in results["xla"]), results["xla"]
    assert all(r == {"reduce": {"pallas"}} for r in results["pallas"]), results["pallas"]


def test_equal_xmaps_of_one_function_trace_it_once():
    traces = []

    def body(x):
        traces.append(1)
        return x * 2

    for _ in range(3):
        nx.xmap(body, ["i"], ["i"])(jnp.ones(4))
    assert len(traces) == 1
    nx.xmap(body, ["i"], ["i"], axis_sizes={"i": 4})(jnp.ones(4))   # another definition
    assert len(traces) == 2
