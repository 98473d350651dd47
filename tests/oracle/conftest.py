"""Prints the oracles' case counts per category and each test's CPU time at
the end of the session (CPU time, not wall time: CI machines are shared; with
the processes a test ran and waited for, such as the mesh-mismatch family's)."""
import resource
import time

import pytest

_CPU_SECONDS = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    start = _cpu_seconds()
    yield
    _CPU_SECONDS[item.nodeid.split("::", 1)[-1]] = _cpu_seconds() - start


def _cpu_seconds() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def pytest_terminal_summary(terminalreporter):
    from tests.oracle import _runner
    straight = _runner.straight_line_module()
    straight_total = sum(straight.COUNTS.values()) if straight else 0
    if _runner.COUNTS:
        terminalreporter.write_sep("-", "composed oracle case counts")
        terminalreporter.write_line(_runner.format_counts())
    if straight_total:
        terminalreporter.write_sep("-", "straight-line oracle case counts")
        terminalreporter.write_line(straight.format_counts())
    if _runner.COUNTS or straight_total:
        composed = _runner.COUNTS.get("total", 0)
        terminalreporter.write_line(f"oracle cases: {composed} composed + {straight_total} "
                                    f"straight-line = {composed + straight_total}")
    if _CPU_SECONDS:
        terminalreporter.write_sep("-", "oracle CPU seconds per test")
        for name, seconds in sorted(_CPU_SECONDS.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"  {seconds:7.1f}  {name}")
