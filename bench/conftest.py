"""pytest configuration for the benchmark suite.

``pytest bench --benchmark-only`` collects the ``bench_*.py`` files here (the
project's pytest settings collect ``test_*.py`` under ``tests/`` only), and
simulates 8 CPU devices for the collective benchmarks. JAX is not pinned to
the CPU: on a GPU/TPU machine the kernels run on the accelerator.
"""
import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES_FLAG).strip()

import pytest  # noqa: E402  (after XLA_FLAGS, like every import that may load jax)

from bench import _peaks  # noqa: E402  (imports jax: after XLA_FLAGS)


def pytest_collect_file(file_path, parent):
    # Files named on the command line are collected by pytest itself.
    if parent.session.isinitpath(file_path):
        return None
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


@pytest.fixture(scope="session")
def peak() -> _peaks.Peak:
    """The default device's peak (published; measured once per session on CPU)."""
    return _peaks.device_peak()


@pytest.fixture(scope="session")
def platform() -> str:
    """The lowering platform of the default device: cpu, cuda, rocm or tpu."""
    return _peaks.platform()


def pytest_report_header(config):
    return f"nxops bench: device {_peaks.device_kind()} ({_peaks.platform()})"


def pytest_benchmark_update_machine_info(config, machine_info):
    # Only what identifies the machine: `--benchmark-compare` warns when
    # machine_info differs, and measured CPU peaks move between runs. The peaks
    # each entry was judged against are in its extra_info["peak"].
    import jax
    machine_info["nxops_device"] = {"device": _peaks.device_kind(), "platform": _peaks.platform(),
                                    "device_count": jax.device_count()}
