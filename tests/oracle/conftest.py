"""Records each oracle test's CPU time for the summary at the end of the
session (tests/oracle/_summary.py, printed by tests/conftest.py)."""
import time

import pytest

from tests.oracle import _summary


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    start = time.process_time()
    yield
    _summary.CPU_SECONDS[item.nodeid.split("::", 1)[-1]] = time.process_time() - start
