"""Every python block of the documentation runs as written on a one-device CPU
machine (a block fenced ```` ```python notest ```` is a fragment and is not run).

The blocks run under pytest-markdown-docs in a fresh process: this one has 8
simulated devices (tests/conftest.py), and a reader's machine has one.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
               *(ROOT / "nxops" / "kernels").rglob("*.md")])
RUNNABLE_FENCE = re.compile(r"^```(?:python|python3|py)(?:[ \t]+(?P<info>[^\n]*))?$", re.M)


def runnable_blocks(path: pathlib.Path) -> int:
    """The python fences pytest-markdown-docs runs (all but ``notest`` ones)."""
    return sum("notest" not in (m.group("info") or "").split()
               for m in RUNNABLE_FENCE.finditer(path.read_text()))


def one_device_env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                              env.get("XLA_FLAGS", "")).strip()
    return env


def test_every_python_block_in_the_docs_runs_on_one_device():
    pytest.importorskip("pytest_markdown_docs",
                        reason="needs the test extra: pip install -e '.[test]'")
    expected = sum(runnable_blocks(p) for p in DOCS)
    assert expected >= 4, "the README and docs/xmap.md examples were not found"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--markdown-docs", "-m", "markdown-docs", "-q",
         "-p", "no:cacheprovider", *map(str, DOCS)],
        cwd=ROOT, env=one_device_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert f"{expected} passed" in run.stdout, run.stdout[-3000:]
