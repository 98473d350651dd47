"""Issue 27's repros (t01-t11): each file, run unchanged, exits 0 and prints
its expected result. A defect still open is a strict xfail: it fails CI as
XPASS the day it is fixed, so its mark must go then."""
import pytest

from tests.repros._run import exit_code_and_lines

OPEN = pytest.mark.xfail(strict=True, reason="open defect")


def test_t01_fg_custom_vjp_compiles_like_plain_psum():
    code, lines = exit_code_and_lines("t01_fg_custom_vjp_vmap_level.py")
    assert lines[-1] == "OK" and code == 0, lines


def test_t02_axis_sizes_for_a_body_only_name():
    code, lines = exit_code_and_lines("t02_axis_sizes_body_only_name.py")
    assert lines == ["got: 16, expected: 16"] and code == 0, lines


def test_t03_nested_xmap_result_sharded_per_plan_under_auto_mesh():
    code, lines = exit_code_and_lines("t03_nested_xmap_auto_mesh_sharding.py")
    assert lines[-1].startswith("got tile assignment [2, 1, 1, 2],") and code == 0, lines


def test_t04_ppermute_over_mesh_axes_out_of_mesh_order():
    code, lines = exit_code_and_lines("t04_ppermute_mesh_axes_reordered.py")
    assert len(lines) == 2 and all(" ok (axis_index" in line for line in lines) and code == 0, lines


def test_t05_int8_sums_promote_on_every_placement():
    code, lines = exit_code_and_lines("t05_int8_sum_mesh_dtype.py")
    assert len(lines) == 8 and all(line.endswith(" ok") for line in lines) and code == 0, lines


def test_t06_var_with_ddof_at_least_n_is_nan():
    code, lines = exit_code_and_lines("t06_var_ddof_ge_n.py")
    assert lines[0] == "ddof=4: nx.var got [nan nan]  jnp.var [nan nan]", lines
    assert lines[1] == "ddof=5: nx.var got [nan nan]  jnp.var [nan nan]", lines
    assert lines[2].endswith("over 8 elements: nan  jnp.var: nan") and code == 0, lines


def test_t07_export_of_var_over_a_symbolic_name():
    code, lines = exit_code_and_lines("t07_export_symbolic_var.py")
    assert lines[0].endswith("ok True") and lines[1].startswith("got ") and code == 0, lines


def test_t08_input_committed_outside_the_mesh():
    code, lines = exit_code_and_lines("t08_committed_outside_mesh.py")
    assert lines == ["got [ 0.  2.  4.  6.  8. 10. 12. 14.] ok True"] and code == 0, lines


def test_t09_tile_over_a_tuple_of_names():
    code, lines = exit_code_and_lines("t09_tile_tuple_key.py")
    assert lines == ["untile over ('a','b') works: True", "tile: True"] and code == 0, lines


def test_t10_random_follows_x64():
    code, lines = exit_code_and_lines("t10_random_x64_dtype.py")
    assert lines[0][len("got "):].split() == lines[1][len("want"):].split(), lines
    assert lines[2] == "nx.random.normal sample dtype: float64 jax.random.normal: float64", lines
    assert code == 0, lines


def test_t11_fg_custom_vjp_gradient_is_the_same_on_every_placement():
    code, lines = exit_code_and_lines("t11_fg_custom_vjp_grad_by_placement.py")
    assert lines[-1] == "OK: one gradient on every placement" and code == 0, lines
