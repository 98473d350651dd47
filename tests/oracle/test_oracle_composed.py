"""The composed oracle: named ops inside control flow (scan, fori, while with
uniform and per-position trip counts, cond, switch, map), remat with policies,
custom_jvp / custom_vjp (Megatron f/g: psum in bwd or fwd) / custom_linear_solve, nested xmaps; every dtype
(f32, bf16, f16, complex64, int32, bool); named sizes 8, 1, 0 and positional
sizes 4, 1, 0; placements on none, whole meshes, part of a mesh, size-1 mesh
axes, serial loops and mixtures. Each case is one program x placement x
transformation (forward, grad outside, grad inside, jvp and jacfwd), compared
with the positional reference written without nxops (tests/oracle/_reference.py).

Programs: tests/oracle/_composed.py; running and comparing: tests/oracle/_runner.py.
Explore one placement with every case:
    python -m tests.oracle._runner N D PLACEMENT SEED COUNT
"""
from __future__ import annotations

import collections
import os

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from tests.oracle import _composed as C
from tests.oracle import _runner as run

PROFILE = os.environ.get("NXOPS_ORACLE_PROFILE", "ci")
_NO_SHRINK = (hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate)
hypothesis.settings.register_profile("composed_ci", max_examples=1, derandomize=True,
                                     deadline=None, print_blob=True, phases=_NO_SHRINK)
hypothesis.settings.register_profile("composed_local", max_examples=10, deadline=None,
                                     print_blob=True, phases=_NO_SHRINK)
SETTINGS = hypothesis.settings.get_profile(f"composed_{PROFILE}")

# (named size, positional size, programs per example, placement ids or None for all).
# Sized for the CI budget (XLA:CPU compiling the batches is most of the time; a
# case costs about ten times one of the straight-line oracle's). The straight-line
# oracle (test_oracle.py) covers mesh8, auto_mesh8, three mesh axes, a mesh axis
# with a loop and a name spelled like a mesh axis; the local profile draws more examples.
GROUPS = [
    (8, 4, 22, ("none", "part_of_mesh", "whole_mesh_2x4")),   # + FG_PROGRAMS
    (8, 1, 8, ("size1_mesh_axis",)),
    (8, 0, 6, ("none", "loop2")),
    (1, 4, 8, ("size1_mesh_axis", "loop1")),
    (0, 4, 8, ("none", "mesh8")),
]

# The group that also draws programs wrapped in Megatron's f/g (custom_vjps
# around psum: tests/_megatron.py: fg_operators), and how many.
FG_GROUP, FG_PROGRAMS, FG_DTYPES = (8, 4), 4, ["f32", "c64", "bf16"]


# What ran in this session, for the counts test: hypothesis examples per
# group (n, d), cases checked per group and placement (n, d, placement id).
EXAMPLES_RUN: collections.Counter = collections.Counter()
CASES: collections.Counter = collections.Counter()


def _placements(n, ids):
    return [p for p in run.PLACEMENTS[n] if ids is None or p.id in ids]


@pytest.mark.parametrize("n,d,count,placement_ids", GROUPS,
                         ids=[f"n{g[0]}_d{g[1]}" for g in GROUPS])
@SETTINGS
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_composed_programs_match_the_reference(n, d, count, placement_ids, seed):
    EXAMPLES_RUN[n, d] += 1
    rng = np.random.default_rng(seed)
    programs = C.draw_programs(rng, count, n, list(C.DTYPES))
    if (n, d) == FG_GROUP:   # Megatron f/g custom rules around the chains
        programs += C.draw_programs(rng, FG_PROGRAMS, n, FG_DTYPES, must_use="megatron_fg")
    group = run.Group(programs, n, d, seed % 2**16)
    failures = []
    for placement in _placements(n, placement_ids):
        counts = collections.Counter()
        failures += run.check_placement(group, placement, counts=counts)
        run.COUNTS.update(counts)
        CASES[n, d, placement.id] += counts["total"]
    assert not failures, f"seed {seed}: {len(failures)} failures:\n" + "\n".join(failures)


CI_FLOOR = 1400          # cases of both oracles together in the ci profile
COMPOSED_FLOOR = 300     # this file's share, checked when it runs alone


def test_oracle_case_counts():
    """Runs last (after test_oracle.py, which pytest collects first; CI runs
    both). In every profile: each placement of each group that ran checked
    cases in every example (a program it refuses counts as one). In the ci
    profile with every group run: the floors on the cases checked."""
    if not EXAMPLES_RUN:
        pytest.skip("the composed oracle did not run in this session (deselected)")
    for n, d, _, placement_ids in GROUPS:
        examples = EXAMPLES_RUN[n, d]
        short = {p.id: CASES[n, d, p.id] for p in _placements(n, placement_ids)
                 if CASES[n, d, p.id] < examples}
        assert not short, f"group n={n} d={d}, {examples} examples: cases per placement {short}"
    straight_line = run.straight_line_module()
    composed = run.COUNTS.get("total", 0)
    straight = sum(straight_line.COUNTS.values()) if straight_line else 0
    if PROFILE != "ci" or len(EXAMPLES_RUN) < len(GROUPS):
        return
    if straight and not straight_line.OP_NAMES_RESTRICTED:
        assert composed + straight >= CI_FLOOR, (
            f"the ci profile must check at least {CI_FLOOR} cases, got {composed} composed "
            f"+ {straight} straight-line")
    assert composed >= COMPOSED_FLOOR, f"the composed oracle checked {composed} cases only"
