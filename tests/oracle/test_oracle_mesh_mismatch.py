"""The oracle's mesh-mismatch family (tests/oracle/_mesh_mismatch.py): the
straight-line oracle's programs, on each of its placements, with inputs made on
other meshes (other sizes, other names, Explicit and Auto axes). Concrete
inputs are moved and give the positional twins' results; traced ones are an
NxopsError saying where they live, and once moved as it says give the twins'
results too. One process per made mesh: XLA used to abort on such inputs, and
an abort must fail one test, not the run. Its own draws (seeds below): the other
families' fixed draws do not change. Each made mesh draws its own programs (seed
SEED + its index), so that the family checks more distinct programs than one
shared draw would, at the cost of a few programs per process: a program batch
is compiled per placement and transformation, which is most of the time."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.oracle._mesh_mismatch import MADE

ROOT = Path(__file__).parents[2]
SEED, PROGRAMS = 0, 4
if os.environ.get("NXOPS_ORACLE_PROFILE") == "local":
    SEED, PROGRAMS = int.from_bytes(os.urandom(3), "little"), 20


@pytest.mark.parametrize("made", sorted(MADE))
def test_inputs_from_another_mesh_give_the_twins_results_or_a_clear_refusal(made):
    seed = SEED + sorted(MADE).index(made)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
                   [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run([sys.executable, "-m", "tests.oracle._mesh_mismatch", made, str(seed),
                           str(PROGRAMS)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=1200)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, (done.returncode, lines[-20:], done.stderr[-3000:])
    assert not [line for line in lines if line.startswith("MISMATCH")], (seed, lines)
    counts = json.loads(lines[-1].removeprefix("counts "))
    with_mesh = [p[0] for p in _placements() if p[1] is not None and p[0] != "mesh_and_loop"]
    for pid in with_mesh:   # every placement on a mesh ran forward and the moved jit and grad
        assert counts[f"forward:{pid}"], (pid, counts)
        assert counts.get(f"grad_moved:{pid}", 0) + counts.get(f"grad:{pid}", 0), (pid, counts)
    print(f"\nmesh-mismatch oracle, made on {made}: {sum(counts.values())} cases "
          f"(seed {seed}, {PROGRAMS} programs)")


def _placements():
    from tests.oracle.test_oracle import PLACEMENTS
    return PLACEMENTS
