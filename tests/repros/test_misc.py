"""Issue 20 repros (helper misc): each file runs unchanged and prints its expected result."""
from tests.repros._run import printed_lines


def test_g02_raw_lax_on_a_mesh_mapped_name_names_the_nx_op():
    lines = printed_lines("g02_raw_lax_on_logical_name.py")
    mapped, unmapped = lines[:3], lines[3:]
    assert mapped[0].startswith("{'shard': 'mp'}  lax.axis_index  NxopsError: jax.lax.axis_index "
                                "over 'shard'")
    assert "Use nx.axis_index" in mapped[0]
    assert mapped[1].startswith("{'shard': 'mp'}  lax.psum        NxopsError: jax.lax.psum over")
    assert "Use nx.psum" in mapped[1]
    assert mapped[2] == "{'shard': 'mp'}  nx.axis_index   ok [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]"
    assert unmapped == ["{}               lax.axis_index  ok [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]",
                        "{}               lax.psum        ok [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]",
                        "{}               nx.axis_index   ok [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]"]


def test_r16_mesh_only_bool_psum_scatter_and_complex_logsumexp():
    assert printed_lines("r16_bool_psum_scatter_complex_lse.py") == [
        "psum_scatter bool {} ok int32",
        "psum_scatter bool {'a': 'x'} ok int32",
        "logsumexp complex64 {} ok complex64",
        "logsumexp complex64 {'a': 'x'} ok complex64",
    ]
