"""Inputs made on one mesh, used by nx.xmap under another: other sizes with the
same axis names, other names, a flat mesh against a 2-D one (which XLA's
partitioner represents with sub-axes), Explicit against Auto axes, the legacy
``with mesh:``, the same devices in another order, a subset of them, other
devices. Called with concrete arrays, xmap moves them onto its mesh and gives
NumPy's result on every placement; traced (jax.jit, jax.grad), it raises an
NxopsError saying where the input lives and how to move it. XLA used to abort
the whole process on some of these ("Manual sub-axis isn't supported"), so
each case runs in a process of its own: an abort fails one test, not the run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

_WORKER = Path(__file__).with_name("_other_mesh_worker.py")


def run_case(*argv: str) -> list[str]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(_WORKER), *argv], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    return done.stdout.splitlines()


def _placements_of(used: str) -> list[str]:
    names = {"(2,4) xy": "xy", "(4,2) xy": "xy", "legacy": "xy", "(8,) x": "x",
             "(2,2) xy first 4": "xy", "(2,4) xy auto": "xy", "(4,2) xy auto": "xy"}[used]
    res = ["{}"] + [f"{{'b': '{n}'}}" for n in names]
    return res + ([f"{{'b': {tuple(names)!r}}}"] if len(names) > 1 else [])


MOVED = [   # (made on, used under, input's spec there)
    ("(2,4) xy", "(4,2) xy", "repl"),            # same names, other sizes (the abort)
    ("(2,4) xy", "(4,2) xy", "1"),
    ("(2,4) pq", "(4,2) xy", "1"),               # other names
    ("(8,) x", "(2,4) xy", "0"),                 # a flat mesh: sub-axes of the 2-D one
    ("(2,4) xy", "(8,) x", "all"),
    ("(2,4) xy auto", "(2,4) xy", "1"),          # Auto axes, used under Explicit ones
    ("(2,4) xy", "(2,4) xy auto", "1"),          # and the other way
    ("(2,4) xy auto", "(4,2) xy auto", "1"),
    ("(2,4) xy", "legacy", "1"),                 # the legacy `with mesh:`
    ("(2,4) xy reversed", "(2,4) xy", "1"),      # the same devices in another order
    ("(2,2) xy first 4", "(2,4) xy", "1"),       # some of the mesh's devices
    ("(2,2) xy last 4", "(2,2) xy first 4", "0"),  # other devices
]


@pytest.mark.parametrize("made,used,spec", MOVED, ids=[f"{m}-on-{u}-{s}" for m, u, s in MOVED])
def test_concrete_input_from_another_mesh_is_moved_onto_the_xmaps_mesh(made, used, spec):
    lines = run_case(made, used, spec)
    assert lines == [f"{res} ok" for res in _placements_of(used)]


def test_lowering_for_an_input_from_another_mesh_compiles_for_the_xmaps_mesh():
    lines = run_case("(2,4) xy", "(4,2) xy", "1", "lower")
    assert lines == [f"{res} ok" for res in _placements_of("(4,2) xy")]


def test_an_input_typed_on_a_mesh_with_none_in_scope_runs_as_before():
    assert run_case("(2,4) xy", "none", "1") == ["{} ok"]


@pytest.mark.parametrize("how", ["jit", "grad"])
@pytest.mark.parametrize("made,used", [("(2,4) xy", "(4,2) xy"), ("(8,) x", "(2,4) xy"),
                                       ("(2,4) xy auto", "(4,2) xy auto")])
def test_traced_input_from_another_mesh_is_an_nxops_error_saying_how_to_move_it(made, used, how):
    lines = run_case(made, used, "0", how)
    assert len(lines) == len(_placements_of(used)), lines
    for line, res in zip(lines, _placements_of(used)):
        assert line.startswith(f"{res} NxopsError: xmap argument args[0] lives on another mesh"), line
        assert "this xmap runs under mesh {'x': " in line and "jax.device_put(x, " in line, line


def test_inputs_split_differently_on_a_mesh_run_with_none_in_scope():
    """Made under jax.set_mesh (Explicit axes), one split and one replicated,
    used with no mesh: the body's vmap refused inputs split differently."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import nxops as nx
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    data = np.arange(32, dtype=np.float32).reshape(8, 4)
    x = jax.device_put(data, NamedSharding(mesh, P("x")))
    y = jax.device_put(data + 1, NamedSharding(mesh, P()))
    f = nx.xmap(lambda a, b: nx.sum(a * b, "b"), [["b", ...], ["b", ...]], [...])
    for run in (f, jax.jit(f)):
        np.testing.assert_allclose(np.asarray(run(x, y)), (data * (data + 1)).sum(0))
