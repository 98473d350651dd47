"""The composed oracle's custom-rule family: custom_vjps whose forward or
backward is a named collective (tests/_sequence_parallel.py: the
sequence-parallel gather/scatter pair, an all_to_all exchange, a hand-written
ring step, untile/tile; and Megatron's f/g around a per-position value),
inside the composed oracle's wrappers and among its other ops, on every
placement of a name of size 8. Each program is checked forward, with the
gradient taken inside the body and (outside a custom_vjp wrapper) outside
the xmap, against the positional reference (tests/oracle/_reference.py:
custom_rules, what the rules mean there).

A separate draw from test_oracle_composed.py (its own seeded generator), so
that file's programs and cases stay as they were.

Not drawn: a cond or switch whose branch differs per position. Around a
collective there, JAX 0.10's gradient of the jax.vmap reference (inside or
outside) is not the derivative of the program: with x -> ppermute(x) in the
branch of positions 1, 4, 7 of 8, jax.grad gives zero where the explicit
positional program's gradient does not, and lax.ppermute and an all_gather
spelling of it disagree with each other inside the body.
"""
from __future__ import annotations

import collections
import functools
import os

import numpy as np
import pytest

from tests.oracle import _composed as C
from tests.oracle import _runner as run

N, D = 8, 4
DTYPES = ["f32", "c64", "bf16"]
# Sized for CI (about a minute on one core); NXOPS_ORACLE_PROFILE=local draws more.
PROGRAMS = {"ci": 6, "local": 42}[os.environ.get("NXOPS_ORACLE_PROFILE", "ci")]
SEED = 20261133     # a draw in which every rule takes every transform, among other ops
CASES: collections.Counter = collections.Counter()   # placement id -> cases checked


@functools.lru_cache(maxsize=None)
def _group() -> run.Group:
    """One batch for every placement (the reference runs once per transform)."""
    rng = np.random.default_rng(SEED)
    return run.Group(C.draw_rule_programs(rng, PROGRAMS, N, DTYPES), N, D, SEED % 2**16)


@pytest.mark.parametrize("placement", run.PLACEMENTS[N], ids=lambda p: p.id)
def test_custom_rule_programs_match_the_reference(placement):
    counts = collections.Counter()
    failures = run.check_placement(_group(), placement, counts=counts)
    run.COUNTS.update(counts)
    CASES[placement.id] += counts["total"]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)


RULE_FLOOR = 120    # cases this family checks in the ci profile, every placement run


def test_custom_rule_case_counts():
    """Every rule is drawn in a program that takes the forward pass and the
    gradients inside and outside; every placement that ran checked cases;
    and with every placement run, at least RULE_FLOOR cases."""
    if not CASES:
        pytest.skip("the custom-rule family did not run in this session (deselected)")
    for transform in ("forward", "grad_inside", "grad_outside"):
        drawn = {op for p in _group().programs if transform in p.transforms() for op in p.ops}
        assert set(C.RULE_OPS) <= drawn, f"{transform}: rules never drawn: {set(C.RULE_OPS) - drawn}"
    empty = [pid for pid, n in CASES.items() if n == 0]
    assert not empty, f"placements that checked no case: {empty}"
    if len(CASES) < len(run.PLACEMENTS[N]):
        return
    total = sum(CASES.values())
    assert total >= RULE_FLOOR, f"the custom-rule family checked {total} cases only"
