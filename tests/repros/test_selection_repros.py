"""The kernel-table and explain repros (f06, f09, f10, f12): each file, run
unchanged, exits 0 and prints its expected result."""
from tests.repros._run import exit_code_and_lines


def test_f06_a_corrupt_table_falls_back_to_xla():
    code, lines = exit_code_and_lines("f06_corrupt_measured_table_raw_error.py")
    assert lines == ["truncated JSON               -> OK",
                     "entries missing 'backends'   -> OK",
                     "a list                       -> OK",
                     "expected: OK (XLA fallback) or an NxopsError naming the table file"], lines
    assert code == 0


def test_f09_explain_never_says_the_kernel_it_picked_was_not_used():
    code, lines = exit_code_and_lines("f09_explain_xla_not_used_contradiction.py")
    assert lines[2] == ("reduce float32[0, 5] xla:reduce xla (requested xla: zero-size operands: "
                        "nothing for a kernel to do)"), lines
    assert lines[-1] == "OK" and code == 0, lines


def test_f10_a_backend_without_a_kernel_for_the_op_says_so():
    code, lines = exit_code_and_lines("f10_triton_unregistered_op_misleading.py")
    assert lines[-1] == (
        "NxopsError: NXOPS_KERNELS asks for the 'triton' implementation of 'cross_entropy' "
        "(op 'cross_entropy'), but nxops has no 'triton' kernel for 'cross_entropy' (its "
        "implementations: pallas, xla). Use cross_entropy=auto or one of those backends."), lines
    assert code == 0


def test_f12_the_readme_example_shows_what_explain_picks():
    code, lines = exit_code_and_lines("f12_measured_table_all_stale.py")
    assert lines[-1] == "explain picks: xla:reduce | README's example shows: ['xla:reduce']", lines
    assert code == 0
