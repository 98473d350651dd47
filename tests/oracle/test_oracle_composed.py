"""The composed oracle: named ops inside control flow (scan, fori, while with
uniform and per-position trip counts, cond, switch, map), remat with policies,
custom_jvp / custom_vjp (Megatron f/g: psum in bwd or fwd) / custom_linear_solve, nested xmaps; every dtype
(f32, bf16, f16, complex64, int32, bool); named sizes 8, 1, 0 and positional
sizes 4, 1, 0; placements on none, whole meshes, part of a mesh, size-1 mesh
axes, serial loops and mixtures. Each case is one program x placement x
transformation (forward, grad outside, grad inside, jvp and jacfwd), compared
with the positional reference written without nxops (tests/oracle/_reference.py).

Programs: tests/oracle/_composed.py; running and comparing: tests/oracle/_runner.py.
Explore one placement with every case (known defects included):
    python -m tests.oracle._runner N D PLACEMENT SEED COUNT

Known defects are listed in KNOWN_DEFECTS below: their cases are left out of
the main tests and run as one strict xfail test per defect, which starts
passing (and so fails as XPASS) once the defect is fixed: then delete its entry.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import subprocess
import sys

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from tests.oracle import _composed as C
from tests.oracle import _runner as run

_DERIVATIVES = frozenset({"grad_outside", "grad_inside", "jvp"})     # jvp: with jacfwd


@dataclasses.dataclass(frozen=True)
class Defect:
    """The cases a defect breaks: a case matches when each given field does
    (ops / wrappers: the program uses one of them)."""
    ops: frozenset = None
    wrappers: frozenset = None
    dtypes: frozenset = None
    sizes: frozenset = None                 # the named size
    positional_sizes: frozenset = None      # the per-position size
    placements: object = None               # ids, or a predicate on run.Placement
    transforms: frozenset = None            # run.TRANSFORMS and "refusal"
    crashes: bool = False                   # aborts the process: checked in a subprocess
    programs: object = None                 # a predicate on the program
    check_programs: int = 6                 # programs drawn for its xfail check
    examples: tuple = ()                    # or these programs (where few drawn ones show it)

    def matches(self, program, transform, placement, n, d):
        def has(field, values):
            return field is None or bool(set(values) & field)
        return (has(self.ops, program.ops) and has(self.wrappers, program.wrappers)
                and has(self.dtypes, [program.dtype]) and has(self.sizes, [n])
                and has(self.positional_sizes, [d])
                and has(self.transforms, [transform]) and _placed(self, placement)
                and (self.programs is None or self.programs(program)))


def _placed(defect, placement):
    if defect.placements is None:
        return True
    if callable(defect.placements):
        return defect.placements(placement)
    return placement.id in defect.placements


def _f(*values):
    return frozenset(values)


def _on_mesh(placement):
    return placement.on_mesh


# The defects this oracle finds that are known and being fixed (repro ids of
# ../shared/repros/). Delete an entry once its fix is merged (its xfail test
# then passes); the cases return to the main tests.
KNOWN_DEFECTS = {}


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


GROUPS_RUN = set()


def _known(program, transform, placement, n, d):
    return [rid for rid, k in KNOWN_DEFECTS.items()
            if k.matches(program, transform, placement, n, d)]


def _placements(n, ids):
    return [p for p in run.PLACEMENTS[n] if ids is None or p.id in ids]


@pytest.mark.parametrize("n,d,count,placement_ids", GROUPS,
                         ids=[f"n{g[0]}_d{g[1]}" for g in GROUPS])
@SETTINGS
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_composed_programs_match_the_reference(n, d, count, placement_ids, seed):
    GROUPS_RUN.add((n, d))
    rng = np.random.default_rng(seed)
    programs = C.draw_programs(rng, count, n, list(C.DTYPES))
    if (n, d) == FG_GROUP:   # Megatron f/g custom rules around the chains
        programs += C.draw_programs(rng, FG_PROGRAMS, n, FG_DTYPES, must_use="megatron_fg")
    group = run.Group(programs, n, d, seed % 2**16)
    unknown = lambda p, t, pl: not _known(p, t, pl, n, d)
    failures = [f for placement in _placements(n, placement_ids)
                for f in run.check_placement(group, placement, selected=unknown)]
    assert not failures, f"seed {seed}: {len(failures)} failures:\n" + "\n".join(failures)


def check_defect(rid: str, seed: int) -> list[str]:
    """The defect's cases in the first group it applies to (by named size, then
    positional size), under at most two placements: cheap, and enough to see
    it fail (and, once fixed, pass)."""
    defect = KNOWN_DEFECTS[rid]
    rng = np.random.default_rng(seed)
    for n, d, _, _ in GROUPS:
        if defect.sizes is not None and n not in defect.sizes:
            continue
        placements = [p for p in run.PLACEMENTS[n] if _placed(defect, p)][:2]
        if not placements or (defect.positional_sizes or {4}).isdisjoint({d}):
            continue
        dtypes = sorted(defect.dtypes or C.DTYPES)
        programs = C.draw_programs(rng, 4 * defect.check_programs, n, dtypes,
                                   wrappers=sorted(defect.wrappers) if defect.wrappers else None,
                                   ops=sorted(defect.ops) if defect.ops else None)
        programs = list(defect.examples) or [
            p for p in programs
            if defect.programs is None or defect.programs(p)][:defect.check_programs]
        group = run.Group(programs, n, d, seed % 2**16)
        crashing = [k for r, k in KNOWN_DEFECTS.items() if k.crashes and r != rid]
        selected = lambda p, t, pl: defect.matches(p, t, pl, n, d) and not any(
            k.matches(p, t, pl, n, d) for k in crashing)     # an abort would end the session
        return [f for placement in placements
                for f in run.check_placement(group, placement, selected=selected,
                                             counts=KNOWN_DEFECT_COUNTS)]
    raise AssertionError(f"{rid}: no group or placement matches the defect")


KNOWN_DEFECT_COUNTS = collections.Counter()   # cases of known defects that passed


@pytest.mark.parametrize("rid", [pytest.param(r, marks=pytest.mark.xfail(strict=True, reason=r))
                                 for r in KNOWN_DEFECTS])
@SETTINGS
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_known_defect_still_fails(rid, seed):
    """Strict xfail: passes (XPASS, a failure) once the defect is fixed."""
    if KNOWN_DEFECTS[rid].crashes:     # an abort would take the whole session with it
        # a deadlocked collective aborts after 5 s instead of XLA:CPU's 40
        flags = os.environ.get("XLA_FLAGS", "") + (
            " --xla_cpu_collective_call_warn_stuck_timeout_seconds=2"
            " --xla_cpu_collective_call_terminate_timeout_seconds=5")
        done = subprocess.run([sys.executable, "-m", "tests.oracle.test_oracle_composed",
                               rid, str(seed)], capture_output=True, text=True, timeout=600,
                              cwd=pathlib.Path(__file__).resolve().parents[2],
                              env={**os.environ, "XLA_FLAGS": flags})
        assert done.returncode == 0, f"{rid} (exit {done.returncode}):\n{done.stdout[-3000:]}" \
                                     f"\n{done.stderr[-2000:]}"
        return
    failures = check_defect(rid, seed)
    assert not failures, f"{rid}: {len(failures)} failures:\n" + "\n".join(failures)


CI_FLOOR = 2000          # cases of both oracles together in the ci profile
COMPOSED_FLOOR = 300     # this file's share, checked when it runs alone


def test_oracle_case_counts():
    """Runs last (after test_oracle.py, which pytest collects first; CI runs
    both): the ci profile's floor on the cases both oracles checked."""
    straight_line = run.straight_line_module()
    composed = run.COUNTS.get("total", 0)
    straight = sum(straight_line.COUNTS.values()) if straight_line else 0
    if PROFILE != "ci" or len(GROUPS_RUN) < len(GROUPS):    # some deselected, or local
        return
    if straight and not straight_line.OP_NAMES_RESTRICTED:
        assert composed + straight >= CI_FLOOR, (
            f"the ci profile must check at least {CI_FLOOR} cases, got {composed} composed "
            f"+ {straight} straight-line")
    assert composed >= COMPOSED_FLOOR, f"the composed oracle checked {composed} cases only"


if __name__ == "__main__":      # a crashing defect's cases, in their own process
    found = check_defect(sys.argv[1], int(sys.argv[2]))
    print("\n".join(found) or "ok")
    sys.exit(1 if found else 0)
