"""Test setup: 8 simulated CPU devices, set before JAX is imported."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


# `ci/test.sh` runs the suite on pytest-xdist workers with `--dist loadfile`:
# each file stays on one worker, so its module fixtures (e.g. one deviceless
# compile of every kernel) are made once.


def pytest_sessionfinish(session):
    """On a worker: hand the oracles' summary to the controller, which prints it."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        from tests.oracle import _summary
        workeroutput["nxops_oracle_summary"] = _summary.lines()


_WORKER_SUMMARIES: list = []


def pytest_testnodedown(node, error):
    _WORKER_SUMMARIES.extend(getattr(node, "workeroutput", {}).get("nxops_oracle_summary", []))


def pytest_terminal_summary(terminalreporter):
    from tests.oracle import _summary
    for line in _WORKER_SUMMARIES or _summary.lines():
        terminalreporter.write_line(line)
