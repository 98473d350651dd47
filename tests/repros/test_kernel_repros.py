"""Repros of kernel defects: each file, run unchanged, exits 0 and prints
its expected result."""
import jax

from tests.repros._run import exit_code_and_lines


def test_b01_pallas_collectives_pass_jax_enable_checks():
    # The interpret-mode ring kernels carry an effect; JAX's typechecker
    # (jax_enable_checks, which the repro turns on) must accept it inside the
    # kernel's custom VJP.
    checks = jax.config.jax_enable_checks
    try:
        code, lines = exit_code_and_lines("b01_pallas_collective_enable_checks.py")
    finally:
        jax.config.update("jax_enable_checks", checks)
    assert lines == ["xla kernels   : [0. 1. 2. 3. 4. 5. 6. 7.]",
                     "pallas kernels: [0. 1. 2. 3. 4. 5. 6. 7.] "
                     "(expected [0. 1. 2. 3. 4. 5. 6. 7.] )"], lines
    assert code == 0, lines
