"""The placement repros: each file, run unchanged, exits 0 and prints its
expected result. The other-mesh one aborted the whole process inside XLA, so
it runs in a process of its own: an abort fails this test, not the run."""
import os
import subprocess
import sys
from pathlib import Path

from tests.repros._run import REPROS, exit_code_and_lines

ROOT = Path(__file__).parents[2]


def test_t12_input_made_under_another_mesh_gives_the_sum_and_never_aborts():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
                   [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run([sys.executable, str(REPROS / "t12_other_mesh_abort.py")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 0, (done.returncode, lines, done.stderr[-2000:])
    assert lines == ["{} [821 822] want [821 822]",
                     "{'b': ('x', 'y')} [821 822] want [821 822]",
                     "{'b': 'y'} [821 822] want [821 822]",
                     "ok"], lines


def test_f11_custom_vjp_gather_gradient_outside_is_the_same_on_every_placement():
    code, lines = exit_code_and_lines("f11_custom_vjp_allgather_grad_outside_placement.py")
    assert lines == ["none    : grad / plain gradient = 4.000",
                     "s on y  : grad / plain gradient = 4.000",
                     "s on x  : grad / plain gradient = 4.000",
                     "same on every placement: True"] and code == 0, lines


def test_g03_pmax_over_a_mesh_axis_is_one_all_reduce_as_in_the_twin():
    code, lines = exit_code_and_lines("g03_pmax_two_all_reduces.py")
    assert lines == ["all-reduces: nx.xmap 1, shard_map twin 1"] and code == 0, lines
