"""Test setup: 8 simulated CPU devices, set before JAX is imported."""
import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `auto` reads this machine's measured tables first: the tests see only the
# shipped ones (and the tables they write themselves).
os.environ["NXOPS_MEASURED_DIR"] = tempfile.mkdtemp(prefix="nxops-tests-measured-")
# Tests stage the same program many times (each placement of an oracle case, a
# twin beside its xmap, a closure retraced per parameter): JAX's persistent
# cache, keyed by the program's fingerprint, lets XLA compile each once per run.
# A fresh directory per run (about 80 MB for the suite), removed at its end, so
# no run reads another's executables.
_XLA_CACHE = tempfile.mkdtemp(prefix="nxops-tests-xla-")
atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _XLA_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


import contextlib

import pytest


@pytest.fixture
def nxops_config():
    """Sets an NXOPS_* config state for the rest of the test, as its context
    manager does: ``nxops_config("MGPU_COLLECTIVES", "1")``."""
    from nxops import _config
    with contextlib.ExitStack() as stack:
        yield lambda name, value: stack.enter_context(getattr(_config, name)(value))


@pytest.fixture
def measured_kernels(monkeypatch):
    """Takes the installed kernels for the ones nxops/kernels/measured/ measured,
    so that a test pins the choice the table makes whatever kernels were edited
    since (an edited kernel's entries are stale, and `auto` keeps XLA there:
    tests/kernels/test_measured_selection.py)."""
    from nxops.kernels import _measured
    recorded = {(key.split("/")[0], m.backend): m.version
                for key, by in _measured.load("sm_90").items() for m in by.values()}
    monkeypatch.setattr(_measured, "kernel_version",
                        lambda k: recorded.get((k.op, k.backend), "unmeasured"))
    return recorded


# ci/test.sh runs the suite in the README's venv, then again, in the venv with
# the compile and triton extras, whatever was skipped: it names a file here.
_SKIPPED_LOG = os.environ.get("NXOPS_SKIPPED_LOG")


def _log_skipped(nodeid: str) -> None:
    with open(_SKIPPED_LOG, "a") as log:
        log.write(nodeid + "\n")


def pytest_runtest_logreport(report):
    if _SKIPPED_LOG and report.skipped and not hasattr(report, "wasxfail"):
        _log_skipped(report.nodeid)


def pytest_collectreport(report):
    if _SKIPPED_LOG and report.skipped:   # a module skipped whole (pytest.importorskip)
        _log_skipped(report.nodeid)
