"""The differential oracle: random named programs x placements x
transformations, each against its positional twin (tests/oracle/_programs.py)
or against the same program with no resources. Resources never change results.

A case is one program under one placement and one transformation. For speed,
each hypothesis example draws a seed for a batch of programs (chains of 1-3
ops that together use every op) and runs the batch as one xmap per
(placement, transformation); every program keeps its own output and is
compared on its own. Each program takes its own copy of x, so one jitted
backward pass gives every program's gradient. The positional twins run once
per example (jitted, one batch per transformation) and serve every placement.

Profiles: ``ci`` (default, derandomized) and ``local`` (NXOPS_ORACLE_PROFILE=local,
more examples). NXOPS_ORACLE_OPS=sum,psum restricts the ops drawn.
"""
from __future__ import annotations

import collections
import os

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from tests.oracle import _programs as P

# No shrinking: an example is a whole batch (minutes); a failure names its seed
# and program, which reproduce it exactly.
_NO_SHRINK = (hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate)
hypothesis.settings.register_profile("ci", max_examples=1, derandomize=True, deadline=None,
                                     print_blob=True, phases=_NO_SHRINK)
hypothesis.settings.register_profile("local", max_examples=20, deadline=None, print_blob=True,
                                     phases=_NO_SHRINK)
PROFILE = os.environ.get("NXOPS_ORACLE_PROFILE", "ci")
PROGRAMS_PER_EXAMPLE = 24   # the composed oracle (test_oracle_composed.py) shares the budget
STRAIGHT_LINE_FLOOR = 1000
OP_NAMES_RESTRICTED = bool(os.environ.get("NXOPS_ORACLE_OPS"))
OP_NAMES = sorted(os.environ["NXOPS_ORACLE_OPS"].split(",")) if OP_NAMES_RESTRICTED else sorted(
    P.OPS)

# (id, mesh shape and axis names or None, the axis name, axis_resources)
PLACEMENTS = [
    ("none", None, "a", {}),
    ("mesh8", ((8,), ("x",)), "a", {"a": "x"}),
    ("mesh2x4_minor", ((2, 4), ("x", "y")), "a", {"a": "y"}),
    ("mesh2x4_both", ((2, 4), ("x", "y")), "a", {"a": ("x", "y")}),
    ("mesh2x2x2_two", ((2, 2, 2), ("x", "y", "z")), "a", {"a": ("y", "z")}),
    ("auto_mesh8", ((8,), ("x",), "auto"), "a", {"a": "x"}),
    ("loop", None, "a", {"a": "loop2"}),
    ("mesh_and_loop", ((2, 4), ("x", "y")), "a", {"a": ("y", "loop2")}),
    ("name_spelled_like_mesh_axis", ((2, 4), ("x", "y")), "x", {"x": "y"}),
]
TRANSFORMS = ("forward", "forward_nan", "jit", "vmap", "grad_outside", "grad_inside")
COUNTS: collections.Counter = collections.Counter()
EXAMPLES_RUN: list[int] = []   # the seeds of the examples run in this session
NAN_INPUTS = P.inputs(7, nan=True)

def draw_programs(seed: int, count: int = PROGRAMS_PER_EXAMPLE) -> list[tuple[str, ...]]:
    """``count`` distinct chains of 1-3 ops; the ops cycle through a shuffled
    vocabulary, so every op appears in every batch (when count allows)."""
    rng = np.random.default_rng(seed)
    pool, programs = [], []
    while len(programs) < count:
        if len(pool) < 3:
            pool += list(rng.permutation(OP_NAMES))
        length = int(rng.integers(1, 4))
        program, pool = tuple(str(op) for op in pool[:length]), pool[length:]
        if program not in programs:
            programs.append(program)
    return programs


def _mesh(spec):
    if spec is None:
        return None
    shape, names, *kind = spec
    types = (jax.sharding.AxisType.Auto,) * len(names) if kind else None
    return jax.make_mesh(shape, names, axis_types=types)


def _resources(resources):
    return {k: tuple(nx.SerialLoop(2) if r == "loop2" else r
                     for r in (v if isinstance(v, tuple) else (v,)))
            for k, v in resources.items()}


def _xmap(programs, name, resources, inside_grad=False):
    bodies = [P.named_program(ops, name) for ops in programs]
    if inside_grad:   # jax.grad inside the body, per program
        bodies = [(lambda b: lambda x, y, k: jax.grad(lambda x: jnp.sum(b(x, y, k) * (y + 2)))(x))(b)
                  for b in bodies]

    def body(xs, y, key):     # each program its own x: one backward pass gives every gradient
        return tuple(b(x, y, key) for b, x in zip(bodies, xs))
    return nx.xmap(body, (tuple([name, ...] for _ in programs), [name, ...], [...]),
                   [[name, ...]] * len(programs), axis_resources=_resources(resources))


def _each(programs, X):
    return (X,) * len(programs)


def _close(got, want, what):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4,
                               equal_nan=True, err_msg=what)


def _check_forward(programs, f, X, Y, key, tag, want, wrap=lambda f: f):
    got = wrap(f)(_each(programs, X), Y, key)
    for ops, out, w in zip(programs, got, want):
        _close(out, w, f"{tag} {ops}")
        COUNTS[tag] += 1


def _vmap_input(X):
    return jnp.stack([X, X[::-1] * 0.9])


def _check_vmap(programs, f, X, Y, key, tag, want):
    got = jax.vmap(f, in_axes=(0, None, None))(_each(programs, _vmap_input(X)), Y, key)
    for ops, out, w in zip(programs, got, want):
        _close(out, w, f"{tag} {ops}")
        COUNTS[tag] += 1


def _per_program_grads(fn, programs, X, Y, key):
    """Every program's gradient (with a position-dependent cotangent) from one
    jitted backward pass: each program has its own copy of X."""
    def loss(Xs):
        return sum(jnp.sum(out * (Y + 2.0)) for out in fn(Xs, Y, key))
    return jax.jit(jax.grad(loss))(_each(programs, X))


def _check_grad_outside(programs, f, X, Y, key, tag, want):
    got = _per_program_grads(f, programs, X, Y, key)
    for ops, g, w in zip(programs, got, want):
        _close(g, w, f"{tag} {ops}")
        COUNTS[tag] += 1


def _references(programs, data, data_nan):
    """The positional twins' results, once per example (every placement must
    give them): one jitted batch per transformation."""
    positional = [P.positional_program(ops) for ops in programs]

    def forward(X, Y, key):
        return tuple(p(X, Y, key) for p in positional)

    def grads(X, Y, key):
        return tuple(jax.grad(lambda X, p=p: jnp.sum(p(X, Y, key) * (Y + 2.0)))(X)
                     for p in positional)
    X, Y, key = data
    return {"forward": jax.jit(forward)(*data), "forward_nan": jax.jit(forward)(*data_nan),
            "vmap": jax.jit(jax.vmap(forward, in_axes=(0, None, None)))(_vmap_input(X), Y, key),
            "grad_outside": jax.jit(grads)(*data)}


def _run_placement(programs, placement, data, reference_inside, refs):
    pid, mesh_spec, name, resources = placement
    X, Y, key = data
    mesh = _mesh(mesh_spec)
    every = programs
    looped = any("loop2" in (v if isinstance(v, tuple) else (v,)) for v in resources.values())
    context = jax.set_mesh(mesh) if mesh is not None else _nullcontext()
    with context:
        if looped:   # collectives over a serial loop are refused; the rest must run
            refused = [p for p in programs if P.uses_collectives(p)]
            for ops in refused:
                with pytest.raises(nx.NxopsError, match="serial loop"):
                    _xmap([ops], name, resources)((X,), Y, key)
                COUNTS[f"refused:{pid}"] += 1
            programs = [p for p in programs if not P.uses_collectives(p)]
            if not programs:
                return
        want = {t: [w for p, w in zip(every, refs[t]) if p in programs] for t in refs}
        f = _xmap(programs, name, resources)
        _check_forward(programs, f, X, Y, key, f"forward:{pid}", want["forward"])
        _check_forward(programs, f, *NAN_INPUTS, f"forward_nan:{pid}", want["forward_nan"])
        _check_forward(programs, f, X, Y, key, f"jit:{pid}", want["forward"], wrap=jax.jit)
        _check_vmap(programs, f, X, Y, key, f"vmap:{pid}", want["vmap"])
        _check_grad_outside(programs, f, X, Y, key, f"grad_outside:{pid}", want["grad_outside"])
        inside = _xmap(programs, name, resources, inside_grad=True)(_each(programs, X), Y, key)
        for ops, got in zip(programs, inside):
            _close(got, reference_inside[ops], f"grad_inside:{pid} {ops}")
            COUNTS[f"grad_inside:{pid}"] += 1


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _grad_inside_reference(programs, data):
    """jax.grad inside the body with no resources: what every placement must give."""
    X, Y, key = data
    out = _xmap(programs, "a", {}, inside_grad=True)(_each(programs, X), Y, key)
    return dict(zip(programs, out))


@hypothesis.settings(hypothesis.settings.get_profile(PROFILE))
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_resources_never_change_results(seed):
    EXAMPLES_RUN.append(seed)
    programs = draw_programs(seed)
    data = P.inputs(seed % 2**16)
    reference_inside = _grad_inside_reference(programs, data)
    refs = _references(programs, data, NAN_INPUTS)
    for placement in PLACEMENTS:
        _run_placement(programs, placement, data, reference_inside, refs)


def test_oracle_case_counts(capsys):
    """Runs after the oracle (same module): prints the case counts and checks
    them. In every profile: every op is in a drawn program, and under every
    placement every drawn program was checked by every transformation, or
    refused (collectives over a serial loop). In the ci profile: the floor on
    the cases checked."""
    with capsys.disabled():
        _print_counts()
    if not EXAMPLES_RUN:
        pytest.skip("the straight-line oracle did not run in this session (deselected)")
    batches = [draw_programs(seed) for seed in EXAMPLES_RUN]
    drawn = sum(len(programs) for programs in batches)
    unused = set(OP_NAMES) - {op for programs in batches for ops in programs for op in ops}
    assert not unused, f"ops in no drawn program: {sorted(unused)}"
    for pid, *_ in PLACEMENTS:
        checked = {t: COUNTS[f"{t}:{pid}"] for t in TRANSFORMS}
        assert len(set(checked.values())) == 1, f"{pid}: cases per transformation {checked}"
        assert checked["forward"] + COUNTS[f"refused:{pid}"] == drawn, (
            f"{pid}: {checked['forward']} programs checked and {COUNTS[f'refused:{pid}']} "
            f"refused of {drawn} drawn")
    if PROFILE == "ci" and not OP_NAMES_RESTRICTED:
        # its share; both oracles together: test_oracle_composed.test_oracle_case_counts
        total = sum(COUNTS.values())
        assert total >= STRAIGHT_LINE_FLOOR, (
            f"the ci profile must check at least {STRAIGHT_LINE_FLOOR} cases, got {total}")


def format_counts():
    """Cases per transformation and per placement (the conftest prints it)."""
    by = {"transform": collections.Counter(), "placement": collections.Counter()}
    for key, n in COUNTS.items():
        transform, placement = key.split(":")
        by["transform"][transform] += n
        by["placement"][placement] += n
    lines = [f"straight-line oracle: {sum(COUNTS.values())} cases"]
    lines += [f"  {cat}: " + ", ".join(f"{k}={v}" for k, v in sorted(c.items()))
              for cat, c in by.items()]
    return "\n".join(lines)


def _print_counts():
    print("\n" + format_counts())
