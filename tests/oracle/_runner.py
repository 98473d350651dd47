"""Runs composed programs (tests/oracle/_composed.py) under one placement and
checks each against the positional reference (tests/oracle/_reference.py):
forward, grad outside, grad inside, jvp and jacfwd.

For speed, the programs of a batch run as one xmap per transformation; every
program has its own inputs, so one backward pass gives every program's
gradient. A batch that raises is retried program by program to name the
programs that fail.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import nxops as nx
from tests.oracle import _composed as C
from tests.oracle import _reference as R

# "jvp" also takes jacfwd (along three random directions) in the same jitted program
TRANSFORMS = ("forward", "grad_outside", "grad_inside", "jvp")
COUNTS: collections.Counter = collections.Counter()   # "category:value" -> cases checked


@dataclasses.dataclass(frozen=True)
class Placement:
    id: str
    mesh: tuple | None          # (shape, axis names[, "auto"])
    resources: dict             # for the name "a" (or `name`)
    inner: dict = dataclasses.field(default_factory=dict)   # for the nested xmap's "m"
    name: str = "a"

    @property
    def looped(self):
        return any(str(r).startswith("loop") for r in self._each())

    @property
    def mesh_size(self):
        """How many devices the name is split over (1: none, or size-1 axes)."""
        if self.mesh is None:
            return 1
        sizes = dict(zip(self.mesh[1], self.mesh[0]))
        return int(np.prod([sizes[r] for r in self._each() if r in sizes] or [1]))

    @property
    def on_mesh(self):
        return self.mesh is not None and any(r in self.mesh[1] for r in self._each())

    def _each(self):
        return [r for v in self.resources.values() for r in (v if isinstance(v, tuple) else (v,))]


PLACEMENTS = {     # by the size of the name
    8: [
        Placement("none", None, {}),
        Placement("mesh8", ((8,), ("x",)), {"a": "x"}),
        Placement("part_of_mesh", ((2, 4), ("x", "y")), {"a": "y"}, {"m": "x"}),
        Placement("whole_mesh_2x4", ((2, 4), ("x", "y")), {"a": ("x", "y")}, {"m": "loop2"}),
        Placement("two_of_three_axes", ((2, 2, 2), ("x", "y", "z")), {"a": ("y", "z")},
                  {"m": "x"}),
        Placement("auto_mesh8", ((8,), ("x",), "auto"), {"a": "x"}),
        Placement("size1_mesh_axis", ((8, 1), ("x", "y")), {"a": "y"}),
        Placement("loop2", None, {"a": "loop2"}, {"m": "loop2"}),
        Placement("mesh_and_loop", ((2, 4), ("x", "y")), {"a": ("y", "loop2")}, {"m": "x"}),
        Placement("name_spelled_like_mesh_axis", ((2, 4), ("x", "y")), {"x": "y"}, name="x"),
    ],
    1: [
        Placement("none", None, {}),
        Placement("size1_mesh_axis", ((8, 1), ("x", "y")), {"a": "y"}),
        Placement("size1_and_size2", ((1, 2, 4), ("x", "y", "z")), {"a": "x"}, {"m": "y"}),
        Placement("loop1", None, {"a": "loop1"}),
    ],
    0: [
        Placement("none", None, {}),
        Placement("mesh8", ((8,), ("x",)), {"a": "x"}),
        Placement("part_of_mesh", ((2, 4), ("x", "y")), {"a": "y"}),
        Placement("loop2", None, {"a": "loop2"}),
    ],
}


def _mesh(spec):
    shape, names, *kind = spec
    types = (jax.sharding.AxisType.Auto,) * len(names) if kind else None
    return jax.make_mesh(shape, names, axis_types=types,
                         devices=jax.devices()[:int(np.prod(shape))])


def _resources(resources):
    def one(r):
        return nx.SerialLoop(int(r[4:])) if str(r).startswith("loop") else r
    return {k: tuple(one(r) for r in (v if isinstance(v, tuple) else (v,)))
            for k, v in resources.items()}


# ---------------------------------------------------------------- programs as functions
def _inside_grad(body):
    def grad_body(x, y, w, key):
        ct = y + 2
        return jax.grad(lambda x, w: jnp.sum(jnp.real(body(x, y, w, key) * ct).astype(jnp.float32)),
                        argnums=(0, 1))(x, w)
    return grad_body


def _batch_body(programs, name, M, inner, inside_grad):
    bodies = [C.build(p, name, M, inner, inside_grad) for p in programs]
    if inside_grad:
        bodies = [_inside_grad(b) for b in bodies]

    def body(xs, ys, ws, key):
        return tuple(b(x, y, w, key) for b, x, y, w in zip(bodies, xs, ys, ws))
    return body


def nx_function(programs, placement, inside_grad=False):
    name = placement.name
    body = _batch_body(programs, name, C.NX, _resources(placement.inner), inside_grad)
    return nx.xmap(body, ([name, ...], [name, ...], [...], [...]), [[name, ...]] * len(programs),
                   axis_resources=_resources(placement.resources))


def reference_function(programs, name, inside_grad=False):
    body = _batch_body(programs, name, R, {}, inside_grad)
    return jax.vmap(body, in_axes=(0, 0, None, None), axis_name=name)


def _pick(data, idx):
    return {k: tuple(getattr(data, k)[i] for i in idx) for k in ("X", "Y", "W", "TX", "TW", "CX", "B")}


def run_transform(transform, fn, d, key):
    """The transformation's result for a batch function ``fn(Xs, Ys, Ws, key)``."""
    if transform in ("forward", "grad_inside"):
        return jax.jit(fn)(d["X"], d["Y"], d["W"], key)
    if transform == "grad_outside":
        def loss(Xs, Ws):
            outs = fn(Xs, d["Y"], Ws, key)
            return sum(jnp.sum(jnp.real(o * c).astype(jnp.float32)) for o, c in zip(outs, d["CX"]))
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(d["X"], d["W"])
    if transform == "jvp":
        def forward_mode(X, W, TX, TW):
            f = lambda X, W: fn(X, d["Y"], W, key)
            tangents = jax.jvp(f, (X, W), (TX, TW))[1]

            def along(z):    # jacfwd: a vmap of jvp over the directions
                return f(tuple(x + jnp.tensordot(z, b, 1).astype(x.dtype)
                               for x, b in zip(X, d["B"])), W)
            return tangents, jax.jacfwd(along)(jnp.zeros(3, jnp.float32))
        return jax.jit(forward_mode)(d["X"], d["W"], d["TX"], d["TW"])
    raise ValueError(transform)


def _per_program(transform, result, count):
    if transform in ("grad_outside", "jvp"):
        first, second = result
        return [(first[i], second[i]) for i in range(count)]
    return list(result)


# ---------------------------------------------------------------- comparison
def compare(got, want, dtype, what):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), f"{what}: structure {got} vs {want}"
    tol = C.TOLERANCE[dtype]
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"{what}: got {g.dtype}{list(g.shape)}, want {w.dtype}{list(w.shape)}")
        if tol == 0:
            np.testing.assert_array_equal(g, w, err_msg=what)
            continue
        g64, w64 = g.astype(np.complex128), w.astype(np.complex128)
        if dtype in ("bf16", "f16"):   # past the dtype's range, rounding decides where inf falls
            wild = ~np.isfinite(g64) | ~np.isfinite(w64) | (np.abs(w64) > 1e3)
            g64, w64 = np.where(wild, 0, g64), np.where(wild, 0, w64)
        scale = float(np.nanmax(np.abs(w64), initial=0.0)) if np.isfinite(w64).any() else 0.0
        np.testing.assert_allclose(g64, w64, rtol=tol, atol=tol * (1 + scale), equal_nan=True,
                                   err_msg=what)


@dataclasses.dataclass
class Group:
    """A batch of programs at named size n and positional size d, with their
    inputs and (lazily) their reference results per name and transform."""
    programs: list
    n: int
    d: int
    seed: int

    def __post_init__(self):
        self.data = C.inputs(self.programs, self.n, self.d, self.seed)
        self._refs = {}

    def reference(self, name, transform, idx):
        """Per program: its reference result, or the exception computing it raised."""
        key = (name, transform)
        if key not in self._refs:
            every = [i for i, p in enumerate(self.programs) if transform in p.transforms()]
            self._refs[key] = self._reference(name, transform, every)
        return [self._refs[key][i] for i in idx]

    def _reference(self, name, transform, idx):
        if not idx:
            return {}
        try:
            fn = reference_function([self.programs[i] for i in idx], name,
                                    inside_grad=transform == "grad_inside")
            result = run_transform(transform, fn, _pick(self.data, idx), self.data.key)
            return dict(zip(idx, _per_program(transform, result, len(idx))))
        except Exception as e:  # jitted errors surface on read
            if len(idx) == 1:
                return {idx[0]: e}
            return {i: r for j in idx for i, r in self._reference(name, transform, [j]).items()}


def refusal_expected(program, placement, n):
    """None, or why nxops must refuse the program under this placement."""
    if n == 0 and set(program.ops) & C.NO_IDENTITY:
        return ""     # max / min over no positions
    if placement.looped and program.collective:
        return "serial loop"
    if ("while_per_position" in program.wrappers and program.collective
            and placement.on_mesh and placement.mesh_size > 1):
        return ""     # a collective in a loop whose trip count differs across devices
    return None


def _refusal_acceptable(program, placement, error) -> bool:
    """Whether ``error`` is a refusal nxops may give for this program: a
    per-position while around a collective on a mesh, or a nested xmap on mesh
    axes closing over its enclosing body's values (JAX cannot: o04)."""
    if not isinstance(error, nx.NxopsError):
        return False
    if "while_per_position" in program.wrappers and program.collective and placement.on_mesh:
        return True
    inner_on_mesh = placement.mesh is not None and any(
        r in placement.mesh[1] for v in placement.inner.values()
        for r in (v if isinstance(v, tuple) else (v,)))
    return ("nested_xmap" in program.wrappers and inner_on_mesh
            and "closes over a value of the enclosing body" in str(error))


def check_placement(group: Group, placement: Placement, selected=lambda p, t, pl: True,
                    max_refusals=3, counts=COUNTS) -> list[str]:
    """Checks every selected (program, transform) under ``placement``; returns
    the failures (one line each) and counts the cases checked."""
    failures = []
    for transform in TRANSFORMS:    # the reference runs on no mesh (JAX 0.12 types its
        group.reference(placement.name, transform, [])   # values by an enclosing one)
    context = jax.set_mesh(_mesh(placement.mesh)) if placement.mesh else contextlib.nullcontext()
    with context:
        refused = [i for i, p in enumerate(group.programs)
                   if refusal_expected(p, placement, group.n) is not None
                   and selected(p, "refusal", placement)]
        for i in refused[:max_refusals]:
            failures += _check_refusal(group, i, placement, counts)
        for transform in TRANSFORMS:
            idx = [i for i, p in enumerate(group.programs)
                   if transform in p.transforms() and refusal_expected(p, placement, group.n) is None
                   and selected(p, transform, placement)]
            if idx:
                failures += _check_batch(group, idx, placement, transform, counts)
    return failures


def _check_refusal(group, i, placement, counts):
    program = group.programs[i]
    want = refusal_expected(program, placement, group.n)
    d = _pick(group.data, [i])
    f = nx_function([program], placement)
    what = f"refusal:{placement.id} n={group.n} d={group.d} {program}"
    try:
        jax.eval_shape(f, d["X"], d["Y"], d["W"], group.data.key)     # traces; runs nothing
    except nx.NxopsError as e:
        if re.search(want, str(e)):
            _count(counts, "refusal", placement, program, group)
            return []
        return [f"{what}: NxopsError without {want!r}: {str(e)[:200]}"]
    except Exception as e:  # a raw error is the failure being reported
        return [f"{what}: {type(e).__name__} (want NxopsError): {_short(e)}"]
    return [f"{what}: not refused (want NxopsError matching {want!r})"]


def _check_batch(group, idx, placement, transform, counts):
    programs = [group.programs[i] for i in idx]
    try:
        got = _per_program(transform, run_transform(
            transform, nx_function(programs, placement, transform == "grad_inside"),
            _pick(group.data, idx), group.data.key), len(idx))
    except Exception as e:
        if len(idx) > 1:       # name the programs that fail
            return [f for i in idx
                    for f in _check_batch(group, [i], placement, transform, counts)]
        if _refusal_acceptable(programs[0], placement, e):
            _count(counts, transform, placement, programs[0], group)
            return []
        return [f"{transform}:{placement.id} n={group.n} d={group.d} {programs[0]}: "
                f"{type(e).__name__}: {_short(e)}"]
    want = group.reference(placement.name, transform, idx)
    failures = []
    for program, g, w in zip(programs, got, want):
        what = f"{transform}:{placement.id} n={group.n} d={group.d} {program}"
        if isinstance(w, Exception):
            failures.append(f"{what}: the REFERENCE raised {type(w).__name__}: {_short(w)}")
            continue
        try:
            compare(g, w, program.dtype, what)
            _count(counts, transform, placement, program, group)
        except AssertionError as e:
            failures.append(_short(e, 600))
        except Exception as e:
            failures.append(f"{what}: reading the result: {type(e).__name__}: {_short(e)}")
    return failures


def _count(counts, transform, placement, program, group):
    checks = ["jvp", "jacfwd"] if transform == "jvp" else [transform]   # one program, both
    for check in checks:
        counts[f"transform:{check}"] += 1
        counts[f"placement:{placement.id}"] += 1
        counts[f"dtype:{program.dtype}"] += 1
        counts[f"size:n={group.n},d={group.d}"] += 1
        for w in program.wrappers:
            counts[f"wrapper:{w}"] += 1
        for op in set(program.ops):
            counts[f"op:{op}"] += 1
        counts["total"] += 1


def straight_line_module():
    """The straight-line oracle's module as pytest imported it (its COUNTS), or None."""
    import sys
    for module in list(sys.modules.values()):
        if str(getattr(module, "__file__", "")).endswith("oracle/test_oracle.py"):
            return module
    return None


def _short(e, limit=300):
    text = " ".join(str(e).split())
    return text[:limit] + (" ..." if len(text) > limit else "")


def format_counts(counts=COUNTS):
    lines = [f"composed oracle: {counts.get('total', 0)} cases"]
    categories = collections.defaultdict(list)
    for key, n in sorted(counts.items()):
        if ":" in key:
            cat, value = key.split(":", 1)
            categories[cat].append(f"{value}={n}")
    for cat, values in categories.items():
        lines.append(f"  {cat}: " + ", ".join(values))
    return "\n".join(lines)


def main(argv):
    """python -m tests.oracle._runner N D PLACEMENT SEED COUNT: explore one placement."""
    n, d, pid, seed, count = int(argv[0]), int(argv[1]), argv[2], int(argv[3]), int(argv[4])
    placement = next(p for p in PLACEMENTS[n] if p.id == pid)
    rng = np.random.default_rng(seed)
    programs = C.draw_programs(rng, count, n, list(C.DTYPES))
    group = Group(programs, n, d, seed)
    try:
        failures = check_placement(group, placement, max_refusals=100)
    except Exception:
        traceback.print_exc()
        raise
    for f in failures:
        print("FAIL", f)
    print(format_counts())


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
