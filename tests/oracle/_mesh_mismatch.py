"""The oracle's mesh-mismatch family: the straight-line oracle's programs
(tests/oracle/test_oracle.py) with inputs made on another mesh than the one
the xmap runs under (other sizes, other names, Explicit or Auto axes), on each
of its placements, against the positional twins' results.

- forward, concrete inputs: xmap moves them onto its mesh; the results are the
  twins' (``forward``);
- jax.jit of the xmap, or jax.jit(jax.grad(...)) of a loss of it: the inputs
  are traced, so xmap cannot move them: an NxopsError saying the input lives
  on another mesh (``refused_jit``, ``refused_grad``). Where no mesh is in
  scope, or the meshes are the same, they run and give the twins' results;
- the same, with the inputs moved first as the error says (``jit_moved``,
  ``grad_moved``): the twins' results.

XLA used to abort the process on such inputs, so each made mesh runs in a
process of its own (test_oracle_mesh_mismatch.py):
    python -m tests.oracle._mesh_mismatch MADE SEED COUNT
prints one ``MISMATCH ...`` line per wrong case and ends with ``counts {...}``
(cases per transformation:placement), as JSON.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import nxops as nx
from tests.oracle import _programs as P
from tests.oracle import test_oracle as oracle

# The meshes inputs are made on: (shape, axis names, axis type).
MADE = {
    "2x4_explicit": ((2, 4), ("x", "y"), AxisType.Explicit),
    "4x2_explicit": ((4, 2), ("x", "y"), AxisType.Explicit),
    "8_auto": ((8,), ("x",), AxisType.Auto),
    "2x4_auto_pq": ((2, 4), ("p", "q"), AxisType.Auto),
}
COUNTS: collections.Counter = collections.Counter()


def made_inputs(made: str, data):
    """``data`` (X, Y, key) with X split over the made mesh's first axis and Y
    replicated on it."""
    shape, names, axis_type = MADE[made]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
    X, Y, key = data
    return (jax.device_put(X, NamedSharding(mesh, PartitionSpec(names[0]))),
            jax.device_put(Y, NamedSharding(mesh, PartitionSpec())), key), mesh


def _check(got, want, tag, programs):
    for ops, g, w in zip(programs, got, want):
        if not np.allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-4, equal_nan=True):
            print(f"MISMATCH {tag} {ops}")
        COUNTS[tag] += 1


def _refused(fn, tag, programs) -> None:
    try:
        fn()
    except nx.NxopsError as e:
        if "lives on another mesh" in str(e) and "jax.device_put(x, " in str(e):
            COUNTS[tag] += len(programs)
            return
        print(f"MISMATCH {tag}: {str(e)[:300]}")
        return
    print(f"MISMATCH {tag}: ran, but an input from another mesh cannot be moved in a trace")


def _grad(f, programs):
    def loss(Xs, Y, key):
        return sum(jnp.sum(out * (Y + 2.0)) for out in f(Xs, Y, key))
    return jax.jit(jax.grad(loss))


def run_placement(made: str, programs, placement, data, refs) -> None:
    pid, mesh_spec, name, resources = placement
    looped = any("loop2" in (v if isinstance(v, tuple) else (v,)) for v in resources.values())
    if looped:   # collectives over a loop are refused (the straight-line oracle checks that)
        keep = [not P.uses_collectives(p) for p in programs]
        refs = {t: [w for w, k in zip(ws, keep) if k] for t, ws in refs.items()}
        programs = [p for p, k in zip(programs, keep) if k]
    if not programs:
        return
    (X, Y, key), made_mesh = made_inputs(made, data)
    mesh = oracle._mesh(mesh_spec)
    f = oracle._xmap(programs, name, resources)
    Xs = oracle._each(programs, X)
    with (jax.set_mesh(mesh) if mesh is not None else oracle._nullcontext()):
        _check(f(Xs, Y, key), refs["forward"], f"forward:{pid}", programs)
        if mesh is None or mesh.abstract_mesh == made_mesh.abstract_mesh:
            _check(jax.jit(f)(Xs, Y, key), refs["forward"], f"jit:{pid}", programs)
            _check(_grad(f, programs)(Xs, Y, key), refs["grad_outside"], f"grad:{pid}", programs)
            return
        _refused(lambda: jax.jit(f)(Xs, Y, key), f"refused_jit:{pid}", programs)
        _refused(lambda: _grad(f, programs)(Xs, Y, key), f"refused_grad:{pid}", programs)
        here = NamedSharding(mesh, PartitionSpec())   # as the error says: onto this mesh
        Xm, Ym = jax.device_put(X, here), jax.device_put(Y, here)
        Xms = oracle._each(programs, Xm)
        _check(jax.jit(f)(Xms, Ym, key), refs["forward"], f"jit_moved:{pid}", programs)
        _check(_grad(f, programs)(Xms, Ym, key), refs["grad_outside"], f"grad_moved:{pid}",
               programs)


def main(made: str, seed: int, count: int) -> None:
    programs = oracle.draw_programs(seed, count)
    data = P.inputs(seed % 2**16)
    refs = oracle._references(programs, data, oracle.NAN_INPUTS)
    for placement in oracle.PLACEMENTS:
        run_placement(made, programs, placement, data, refs)
    print("counts " + json.dumps(dict(sorted(COUNTS.items()))))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
