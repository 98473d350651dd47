"""Every NXOPS_* variable is a config state: read and validated at import,
part of jit's cache key, scoped by its context manager."""
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import nxops as nx
from nxops import _config

SWITCHES = [("KERNELS", "xla"), ("AUTOTUNE", "on"), ("AUTOTUNE_CACHE", "/nonexistent/autotune"),
            ("MEASURED_DIR", "/nonexistent/measured"), ("MGPU_COLLECTIVES", "yes"),
            ("TRACEBACK_FILTERING", "off")]
VARIABLES = sorted(f"NXOPS_{name}" for name, _ in SWITCHES)


@pytest.mark.parametrize("name, value", SWITCHES, ids=[n for n, _ in SWITCHES])
def test_switching_a_variable_recompiles(name, value):
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return nx.sum(x, 0)

    x = np.ones((3, 2), np.float32)
    f(x), f(x)
    assert len(traces) == 1
    with getattr(_config, name)(value):
        assert getattr(_config, name).value == value
        f(x)
        assert len(traces) == 2
        f(x)
        assert len(traces) == 2
    f(x)   # back to the outer value: its program again
    assert len(traces) == 2


@pytest.mark.parametrize("text, on", [("1", True), ("TRUE", True), ("Yes", True), ("on", True),
                                      ("0", False), ("false", False), ("NO", False), ("Off", False),
                                      ("", False), (True, True), (False, False)])
def test_flags_accept_the_usual_spellings(text, on):
    with _config.AUTOTUNE(text), _config.MGPU_COLLECTIVES(text):
        assert _config.autotune() is on and _config.mgpu_collectives() is on


@pytest.mark.parametrize("text", ["2", "enabled", "y", "t"])
def test_flags_refuse_other_values_listing_the_valid_ones(text):
    with pytest.raises(nx.NxopsError, match=r"invalid NXOPS_AUTOTUNE=.*valid values are "
                                            r"1, true, yes, on, 0, false, no, off"):
        with _config.AUTOTUNE(text):
            pass


def _import_with(env: dict) -> subprocess.CompletedProcess:
    code = ("from nxops import _config as c; print(c.autotune(), c.mgpu_collectives(), "
            "c.measured_dir(), c.autotune_cache())")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, timeout=300)


def test_the_environment_sets_the_defaults_and_a_bad_value_fails_the_import(tmp_path):
    run = _import_with({"NXOPS_AUTOTUNE": "Yes", "NXOPS_MGPU_COLLECTIVES": "off",
                        "NXOPS_MEASURED_DIR": str(tmp_path / "m"),
                        "NXOPS_AUTOTUNE_CACHE": str(tmp_path / "a")})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "False", str(tmp_path / "m"), str(tmp_path / "a")]
    bad = _import_with({"NXOPS_MGPU_COLLECTIVES": "sure"})
    assert bad.returncode != 0
    assert "invalid NXOPS_MGPU_COLLECTIVES='sure': valid values are 1, true" in bad.stderr


def test_defaults_are_per_user_cache_directories(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with _config.MEASURED_DIR(""), _config.AUTOTUNE_CACHE(""):
        assert _config.measured_dir() == tmp_path / "nxops" / "measured"
        assert _config.autotune_cache() == tmp_path / "nxops" / "autotune"


def test_every_nxops_variable_is_declared_here_and_read_nowhere_else():
    package = pathlib.Path(nx.__file__).parent
    declared = set(re.findall(r'^\w+ = _(?:state|flag)\(\s*"(NXOPS_\w+)"',
                              (package / "_config.py").read_text(), re.M))
    assert sorted(declared) == VARIABLES
    for path in package.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"(environ|getenv)[^\n]*NXOPS_", text), path
