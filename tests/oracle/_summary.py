"""The oracles' case counts per category and each oracle test's CPU time (CPU
time, not wall time: CI machines are shared), as lines for the end of the
session. A pytest-xdist worker hands them to the controller (tests/conftest.py)."""
from __future__ import annotations

CPU_SECONDS: dict[str, float] = {}     # oracle test -> CPU seconds (tests/oracle/conftest.py)


def _header(title: str) -> str:
    return f"{'-' * 25} {title} {'-' * 25}"


def lines() -> list[str]:
    from tests.oracle import _runner
    straight = _runner.straight_line_module()
    straight_total = sum(straight.COUNTS.values()) if straight else 0
    out = []
    if _runner.COUNTS:
        out += [_header("composed oracle case counts"), *_runner.format_counts().splitlines()]
    if straight_total:
        out += [_header("straight-line oracle case counts"), *straight.format_counts().splitlines()]
    if _runner.COUNTS or straight_total:
        composed = _runner.COUNTS.get("total", 0)
        out.append(f"oracle cases: {composed} composed + {straight_total} straight-line = "
                   f"{composed + straight_total}")
    if CPU_SECONDS:
        out.append(_header("oracle CPU seconds per test"))
        out += [f"  {seconds:7.1f}  {name}"
                for name, seconds in sorted(CPU_SECONDS.items(), key=lambda kv: -kv[1])]
    return out
