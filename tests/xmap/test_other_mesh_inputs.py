"""Inputs made on one mesh, used by nx.xmap under another: other sizes with the
same axis names, other names, a flat mesh against a 2-D one (which XLA's
partitioner represents with sub-axes), Explicit against Auto axes, the legacy
``with mesh:``, the same devices in another order, a subset of them, other
devices. Called with concrete arrays, xmap moves them onto its mesh and gives
NumPy's result on every placement; traced (jax.jit, jax.grad), it raises an
NxopsError saying where the input lives and how to move it. XLA used to abort
the whole process on some of these ("Manual sub-axis isn't supported"), so
the cases run in a process apart from pytest's: all of them in one (JAX starts
once), and where that process dies, each case in a process of its own, so
that an abort fails its own test, not the run."""
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_WORKER = Path(__file__).with_name("_other_mesh_worker.py")
_CASE = "== case "


def _worker(argv: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(_WORKER), *argv], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=Path(__file__).parents[2])


@functools.cache
def _every_case_in_one_process() -> dict[tuple[str, ...], list[str]]:
    """{case argv: its lines}, from one worker process running every case of
    this module; empty where that process failed."""
    argv = [arg for case in ALL_CASES for arg in ("--", *case)][1:]
    done = _worker(argv, timeout=300 + 30 * len(ALL_CASES))
    if done.returncode != 0:
        return {}
    lines: dict[tuple[str, ...], list[str]] = {}
    for line in done.stdout.splitlines():
        if line.startswith(_CASE):
            case = lines.setdefault(tuple(json.loads(line.removeprefix(_CASE))), [])
        else:
            case.append(line)
    return lines


def run_case(*argv: str) -> list[str]:
    if (lines := _every_case_in_one_process().get(argv)) is not None:
        return lines
    done = _worker(list(argv), timeout=300)   # a process of its own: an abort fails this case only
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    return done.stdout.splitlines()[1:]   # after its "== case" line


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


LOWERED = ("(2,4) xy", "(4,2) xy", "1", "lower")
UNSCOPED = ("(2,4) xy", "none", "1")
TRACED = [(made, used, how) for made, used in [("(2,4) xy", "(4,2) xy"), ("(8,) x", "(2,4) xy"),
                                               ("(2,4) xy auto", "(4,2) xy auto")]
          for how in ("jit", "grad")]
ALL_CASES = (MOVED + [LOWERED, UNSCOPED]
             + [(made, used, "0", how) for made, used, how in TRACED])


@pytest.mark.parametrize("made,used,spec", MOVED, ids=[f"{m}-on-{u}-{s}" for m, u, s in MOVED])
def test_concrete_input_from_another_mesh_is_moved_onto_the_xmaps_mesh(made, used, spec):
    lines = run_case(made, used, spec)
    assert lines == [f"{res} ok" for res in _placements_of(used)]


def test_lowering_for_an_input_from_another_mesh_compiles_for_the_xmaps_mesh():
    lines = run_case(*LOWERED)
    assert lines == [f"{res} ok" for res in _placements_of("(4,2) xy")]


def test_an_input_typed_on_a_mesh_with_none_in_scope_runs_as_before():
    assert run_case(*UNSCOPED) == ["{} ok"]


@pytest.mark.parametrize("made,used,how", TRACED)
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
