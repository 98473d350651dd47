"""Defect repros of nx.cross_entropy (f01-f05, f07, f08, f13): each file, run
unchanged, exits 0 and prints its expected result."""
from tests.repros._run import exit_code_and_lines


def test_f01_bf16_hidden_first_under_jit():
    code, lines = exit_code_and_lines("f01_bf16_hidden_first_jit_dotthunk.py")
    assert [line.split()[0] for line in lines] == ["bfloat16", "float16"], lines
    assert all(line.endswith(" OK") for line in lines) and code == 0, lines


def test_f02_pallas_posinf_logit_gives_inf_as_xla():
    code, lines = exit_code_and_lines("f02_pallas_ce_posinf_logit_nan.py")
    assert lines[0] == "unfused  loss [1.3490124       inf] lse [2.3490124       inf]", lines
    assert [line.split()[0] for line in lines[1:]] == ["xla", "pallas"], lines
    assert all(line.endswith(" OK") and "nan" not in line for line in lines[1:]) and code == 0, lines


def test_f03_labels_outside_the_vocab_give_nan():
    code, lines = exit_code_and_lines("f03_ce_out_of_range_labels_silent.py")
    assert lines[0] == "fused  : [2.3025856       nan       nan       nan]", lines
    assert lines[2] == "labels 10 and -100 give finite loss [nan nan]" and code == 0, lines


def test_f04_ignore_index_is_validated():
    code, lines = exit_code_and_lines("f04_ce_ignore_index_unvalidated.py")
    assert len(lines) == 2 and code == 0, lines
    for line, value in zip(lines, ("'-100'", "1099511627776")):
        assert line.startswith(f"ignore_index={value}: NxopsError (good): nx.cross_entropy: "
                               f"ignore_index={value}; give an int in the int32 range"), lines


def test_f05_pallas_vocab_parallel_partial_tile():
    code, lines = exit_code_and_lines("f05_pallas_ce_vocab_parallel_inf.py")
    assert lines == [f"{be:6s} loss [2.0794415 2.0794415 2.0794415 2.0794415]  expected "
                     f"2.0794415 each: OK" for be in ("xla", "pallas")] and code == 0, lines


def test_f07_forward_mode_works():
    code, lines = exit_code_and_lines("f07_ce_forward_mode_raw_error.py")
    assert lines == ["jax.jvp: OK", "jax.hessian: OK", "jax.linearize: OK"] and code == 0, lines


def test_f08_export_with_symbolic_tokens_and_default_chunk():
    code, lines = exit_code_and_lines("f08_ce_symbolic_tokens_default_chunk.py")
    assert lines == [f"vocab_chunk={chunk}: exported, call gives [4.6051702 4.6051702] OK"
                     for chunk in (32, None)] and code == 0, lines


def test_f13_nan_at_an_ignored_position_gives_no_gradient():
    code, lines = exit_code_and_lines("f13_ce_ignored_nan_poisons_dw.py")
    assert lines[0] == "loss 2.5092607 (finite)" and "nan" not in " ".join(lines), lines
    assert lines[1].startswith("dh [[") and ", [0.0, 0.0], [" in lines[1] and code == 0, lines
