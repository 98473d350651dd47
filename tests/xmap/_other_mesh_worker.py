"""Runs one case of tests/xmap/test_other_mesh_inputs.py in a process of its
own (XLA aborts the whole process on some of these inputs): an array made on
one mesh (``--made``) passed to an ``nx.xmap`` called under another
(``--used``), for each placement of the name. Prints, per placement, ``<res>
ok`` when the result equals NumPy's, ``<res> WRONG ...`` otherwise, or
``<res> NxopsError: <message>``.

Usage: python _other_mesh_worker.py MADE USED SPEC [HOW] [-- MADE USED SPEC [HOW] ...]
  MADE / USED: a mesh key of MESHES; USED may also be "legacy" (the same as
    "(4,2) xy", entered with the legacy ``with mesh:``) or "none"
  SPEC: the input's PartitionSpec on MADE: "repl", "0" or "1" (split over its
    first or second axis), "all" (over all its axes)
  HOW: "call" (default), "jit" (inside jax.jit), "grad" (jax.grad), "lower"
Several cases, separated by "--", run one after the other in this process
(starting JAX once); each case's lines follow a line ``== case <its argv as JSON>``.
"""
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import nxops as nx

E, A = AxisType.Explicit, AxisType.Auto
DEVICES = jax.devices()


def _mesh(shape, names, types=E, devices=None):
    return jax.make_mesh(shape, names, axis_types=(types,) * len(shape), devices=devices)


MESHES = {
    "(2,4) xy": lambda: _mesh((2, 4), ("x", "y")),
    "(4,2) xy": lambda: _mesh((4, 2), ("x", "y")),
    "(8,) x": lambda: _mesh((8,), ("x",)),
    "(2,4) pq": lambda: _mesh((2, 4), ("p", "q")),
    "(2,4) xy auto": lambda: _mesh((2, 4), ("x", "y"), A),
    "(4,2) xy auto": lambda: _mesh((4, 2), ("x", "y"), A),
    "(2,4) xy reversed": lambda: _mesh((2, 4), ("x", "y"), devices=DEVICES[::-1]),
    "(2,2) xy first 4": lambda: _mesh((2, 2), ("x", "y"), devices=DEVICES[:4]),
    "(2,2) xy last 4": lambda: _mesh((2, 2), ("x", "y"), devices=DEVICES[4:]),
    "legacy": lambda: jax.sharding.Mesh(np.array(DEVICES).reshape(4, 2), ("x", "y")),
}


def _spec(spec: str, mesh) -> P:
    if spec == "repl":
        return P()
    return P(tuple(mesh.axis_names)) if spec == "all" else P(mesh.axis_names[int(spec)])


def placements(mesh) -> list[dict]:
    """No resources, and the name on each mesh axis and on all of them."""
    names = mesh.axis_names if mesh is not None else ()
    return [{}] + [{"b": n} for n in names] + ([{"b": tuple(names)}] if len(names) > 1 else [])


def main(made: str, used: str, spec: str, how: str = "call") -> None:
    data = np.arange(64, dtype=np.float32).reshape(8, 8) % 13
    made_mesh = MESHES[made]()
    x = jax.device_put(data, NamedSharding(made_mesh, _spec(spec, made_mesh)))
    used_mesh = None if used == "none" else MESHES[used]()
    context = (jax.set_mesh(used_mesh) if used not in ("none", "legacy") else
               used_mesh if used == "legacy" else _no_context())
    with context:
        for res in placements(used_mesh):
            print(res, _one(x, data, res, how))


class _no_context:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _one(x, data, res, how: str) -> str:
    f = nx.xmap(lambda v: nx.sum(v * v, "b"), [["b", ...]], [...], axis_resources=res)
    want = np.sum(data * data, 0)
    try:
        if how == "grad":
            got, want = jax.grad(lambda v: f(v).sum())(x), 2 * data
        elif how == "jit":
            got = jax.jit(f)(x)
        elif how == "lower":   # compiled for the xmap's mesh, whatever x's
            compiled = f.lower(x).compile()
            got = compiled(jax.device_put(x, compiled.input_shardings[0][0]))
        else:
            got = f(x)
    except nx.NxopsError as e:
        return f"NxopsError: {e}"
    got = np.asarray(got)
    return "ok" if np.allclose(got, want) else f"WRONG {got.ravel()[:4]} want {want.ravel()[:4]}"


def cases(argv: list[str]) -> list[list[str]]:
    """The command line's cases: argument lists separated by "--"."""
    found = [[]]
    for arg in argv:
        found.append([]) if arg == "--" else found[-1].append(arg)
    return found


if __name__ == "__main__":
    for case in cases(sys.argv[1:]):
        print("== case", json.dumps(case), flush=True)
        main(*case)
