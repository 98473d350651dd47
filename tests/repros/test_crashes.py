"""Regression tests of crashes and raw errors: each runs the
reported program (``files/<name>``) unchanged and checks what it prints."""
import ast
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from tests.repros._run import printed_lines


def _lines(value) -> list[str]:
    """How ``print(value)`` shows an array, line by line (stripped, as printed_lines)."""
    return [line.strip() for line in str(np.asarray(value)).splitlines() if line.strip()]


# --- p02: a list of specs for a list argument ---------------------------------


def test_p02_list_of_specs_for_a_list_argument():
    ones = np.ones(4, np.float32)
    assert printed_lines("p02_list_spec_container.py") == [
        "[" + ", ".join([repr(jnp.asarray(ones))] * 3) + "]"]


# --- s01, r15: bf16 Pallas matmuls in interpret mode ---------------------------


def test_s01_bf16_pallas_matmul_under_float32_precision():
    assert printed_lines("s01_bf16_pallas_matmul_precision.py") == [
        "float32 pallas ok", "bfloat16 pallas ok"]


def test_r15_pallas_bf16_dot_transposed_operand():
    assert printed_lines("r15_pallas_bf16_dot.py") == ["(17, 8)", "(17, 8)"]


@pytest.mark.parametrize("spec", ["ij,jk->ik", "ji,jk->ik"])
def test_pallas_bf16_matmul_in_interpret_mode_matches_xla(spec):
    """The interpret-mode kernel accumulates in f32, as the GPU/TPU kernels do
    (value and gradient equal to the xla path up to bf16 rounding)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((17, 17)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((17, 8)), jnp.bfloat16)

    def value_and_grads(kernels):
        f = lambda a, b: nx.einsum(spec, a, b).astype(jnp.float32).sum()
        with nx.kernels.use(kernels):
            out = jax.jit(lambda a, b: nx.einsum(spec, a, b))(x, y)
            grads = jax.jit(jax.grad(f, (0, 1)))(x, y)
        return [np.asarray(v, np.float32) for v in (out, *grads)]

    for got, want in zip(value_and_grads("pallas"), value_and_grads("xla")):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


# --- r08: bf16 collectives that sum over part of a mesh (XLA:CPU abort) -------


def _r08_expected(op: str):
    """The positional program of the repro's body over its input (ones (8, 3))."""
    x = np.ones((8, 3), np.float32)
    # psum_scatter: position a gets row a of the sum over positions of broadcast_to(x[a], (8, 3)).
    summed_rows = np.stack([np.broadcast_to(row, (8, 3)) for row in x]).sum(0)
    return {"einsum": (x * x).sum(0), "pdot": x.T @ x, "psum": x.sum(0),
            "psum_scatter": summed_rows}[op]


@pytest.mark.parametrize("op", ["einsum", "pdot", "psum_scatter", "psum"])
def test_r08_bf16_sums_over_part_of_a_mesh(op):
    expected = jnp.asarray(_r08_expected(op), jnp.bfloat16)
    assert printed_lines("r08_bf16_einsum_abort.py", op) == _lines(expected)


# --- p01, p03: the legacy `with mesh:` under jax.jit and pjit -------------------


def test_p01_jit_of_xmap_under_legacy_mesh():
    assert printed_lines("p01_legacy_mesh_jit.py") == [str(np.float32(np.ones((4, 3)).sum() * 2))]


def test_p03_pjit_of_xmap_under_legacy_mesh():
    x = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    assert printed_lines("p03_pjit_legacy_mesh.py") == _lines(x.sum(0))


def test_legacy_mesh_result_does_not_depend_on_call_history():
    """An xmap first called eagerly, then under jax.jit (and the reverse), under `with mesh:`."""
    mesh = jax.make_mesh((2,), ("x",))
    x = jnp.ones((4, 3))
    expected = np.asarray(x * 2).sum(0)
    for jit_first in (False, True):
        g = nx.xmap(lambda v: nx.psum(v * 2, "i"), in_axes=["i", ...], out_axes=[...],
                    axis_resources={"i": "x"})
        calls = [jax.jit(g), g] if jit_first else [g, jax.jit(g)]
        with warnings.catch_warnings():   # `with mesh:` is deprecated in JAX
            warnings.simplefilter("ignore", DeprecationWarning)
            with mesh:
                results = [np.asarray(call(x)) for call in calls * 2]
        for result in results:
            np.testing.assert_allclose(result, expected)


# --- r06: while_loop with a per-position trip count and a collective inside ----


def _printed_array(lines: list[str]) -> np.ndarray:
    return np.array(" ".join(lines).replace("[", " ").replace("]", " ").split(), np.float64)


def _r06_positional(x: np.ndarray) -> np.ndarray:
    """vmap's semantics: every position iterates until all are done; a finished
    position keeps its value, and the psum sees every position's current value."""
    trips, count, value = x.astype(int) % 3 + 1, np.zeros(len(x), int), x.astype(np.float64)
    while (count < trips).any():
        active = count < trips
        value = np.where(active, value * 0.5 + value.sum() * 0.01, value)
        count += active
    return value


def test_r06_without_resources_gives_the_positional_result():
    got = _printed_array(printed_lines("r06_while_collective_hang.py", "none"))
    np.testing.assert_allclose(got, _r06_positional(np.arange(8.0)), rtol=1e-6)


def test_r06_on_a_mesh_is_refused_at_trace_time():
    # Unrefused, this deadlocks: XLA:CPU aborts the process after a 40 s rendezvous timeout.
    with pytest.raises(nx.NxopsError, match="predicate that varies along 'a'.*deadlock"):
        printed_lines("r06_while_collective_hang.py")


def _while_with_psum(trips):
    def body(x):
        def step(c):
            return c[0] + 1, c[1] * 0.5 + nx.psum(c[1], "a") * 0.01
        return jax.lax.while_loop(lambda c: c[0] < trips(x), step, (0, x))[1]
    return body


def test_while_with_uniform_trip_count_and_collective_runs_on_a_mesh():
    """A trip count that does not vary along the mesh-mapped name is fine (no refusal)."""
    uniform = _while_with_psum(lambda x: nx.pmax(x.astype(jnp.int32), "a") % 3 + 1)
    x = jnp.arange(8.0)
    want = np.asarray(nx.xmap(uniform, [["a"]], ["a"])(x))
    with jax.set_mesh(jax.make_mesh((4,), ("x",))):
        got = np.asarray(nx.xmap(uniform, [["a"]], ["a"], axis_resources={"a": "x"})(x))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_while_varying_along_another_mesh_axis_than_the_collective_is_allowed():
    """Predicate along 'b' (mesh 'y'), psum over 'a' (mesh 'x'): the devices of one
    psum share 'b's position, hence the trip count."""
    def body(x):
        def step(c):
            return c[0] + 1, c[1] * 0.5 + nx.psum(c[1], "a") * 0.01
        trips = nx.axis_index("b") % 2 + 1
        return jax.lax.while_loop(lambda c: c[0] < trips, step, (0, x))[1]
    x = jnp.arange(8.0).reshape(4, 2)
    f = lambda res: nx.xmap(body, [["a", "b"]], ["a", "b"], axis_resources=res)
    want = np.asarray(f({})(x))
    with jax.set_mesh(jax.make_mesh((4, 2), ("x", "y"))):
        got = np.asarray(f({"a": "x", "b": "y"})(x))
    np.testing.assert_allclose(got, want, rtol=1e-6)


# --- g01: Pallas all_gather inside jax.checkpoint, differentiated --------------


def test_g01_pallas_all_gather_in_remat_is_differentiable():
    lines = printed_lines("g01_pallas_all_gather_in_remat.py")
    assert len(lines) == 6 and all(" ok [" in line for line in lines), lines
    values = {line.split(" ok ")[1] for line in lines}
    assert len(values) == 1, lines   # every kernel choice, with and without checkpoint
    x = np.arange(6.0).reshape(2, 3)
    # Each of the 2 positions takes gathered row 0: position 0's cotangent sums to 2 cos(x0).
    want = np.concatenate([2 * np.cos(x[0]), np.zeros(3)])
    np.testing.assert_allclose(np.array(ast.literal_eval(values.pop())), want, rtol=1e-6)


# --- r07: custom_jvp / custom_vjp rules using named ops, grad outside ------------


def test_r07_custom_jvp_with_named_ops_grad_outside():
    x = np.arange(8.0, dtype=np.float32)
    value = x.sum() * x                      # g(v) * v with g = psum
    grad = jax.grad(lambda v: (v.sum() * v).sum())(jnp.asarray(x))   # the positional program
    assert printed_lines("r07_custom_vjp_grad_outside.py") == _lines(value) + _lines(grad)


@jax.custom_jvp
def _psum_a(v):
    return nx.psum(v, "a")


_psum_a.defjvp(lambda p, t: (_psum_a(p[0]), nx.psum(t[0], "a")))


@jax.custom_vjp
def _scaled_psum_a(v):
    return nx.psum(v, "a") * nx.axis_index("a")


_scaled_psum_a.defvjp(lambda v: (_scaled_psum_a(v), None),
                      lambda _, ct: (nx.psum(ct * nx.axis_index("a"), "a"),))


@pytest.mark.parametrize("resources", [{}, {"a": "x"}])
def test_custom_rules_with_named_ops_differentiate_outside_on_every_placement(resources):
    """Rules traced lazily (after the xmap's trace) still see the names, on a mesh too."""
    x = jnp.arange(8.0)
    positional = {
        "jvp": (lambda v: _psum_a(v) * v, lambda v: v.sum() * v),
        "vjp": (_scaled_psum_a, lambda v: v.sum() * jnp.arange(8.0)),
    }
    with jax.set_mesh(jax.make_mesh((4,), ("x",))):
        for body, reference in positional.values():
            f = nx.xmap(body, [["a"]], ["a"], axis_resources=resources)
            got = jax.grad(lambda v: f(v).sum())(x)
            np.testing.assert_allclose(np.asarray(got),
                                       np.asarray(jax.grad(lambda v: reference(v).sum())(x)))
        f = nx.xmap(positional["jvp"][0], [["a"]], ["a"], axis_resources=resources)
        tangent = jax.jvp(f, (x,), (jnp.ones(8),))[1]
        want = jax.jvp(positional["jvp"][1], (x,), (jnp.ones(8),))[1]
        np.testing.assert_allclose(np.asarray(tangent), np.asarray(want))


# --- s03: a PRNG key made under the mesh, closed over by the body ---------------


def test_s03_key_made_under_the_mesh_and_closed_over():
    placements = [{}, {"b": "x"}, {"b": ("y", nx.SerialLoop(2))}]
    assert printed_lines("s03_closed_over_key_under_mesh.py") == [
        *(f"{res} ok 16 distinct" for res in placements), "all equal: True"]


def test_closed_over_array_made_under_the_mesh_is_refused_clearly_where_jax_cannot():
    """A key folded in the body works (above); an array entering a jnp op inside
    the shard_map is JAX's limitation (jax-ml/jax#29162): an NxopsError says what
    to do, and passing it as an argument works."""
    with jax.set_mesh(jax.make_mesh((2, 4), ("x", "y"))):
        offset = jnp.arange(3.0)
        x = jnp.ones((8, 3))
        closed = nx.xmap(lambda v: v * 2 + offset, [["b", ...]], ["b", ...],
                         axis_resources={"b": "y"})
        with pytest.raises(nx.NxopsError, match=r"closes over arrays .*float32\[3\].*as arguments"):
            closed(x)
        passed = nx.xmap(lambda v, o: v * 2 + o, [["b", ...], [...]], ["b", ...],
                         axis_resources={"b": "y"})
        np.testing.assert_allclose(np.asarray(passed(x, offset)), np.ones((8, 3)) * 2 + np.arange(3.0))
