"""nx.__version__ is the version pyproject.toml builds nxops with, and the
changelog has an entry for it."""
import importlib
import importlib.metadata
import json
import pathlib
import tomllib

import pytest

import nxops as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]


def pyproject_version() -> str:
    """The version setuptools gives the built package: pyproject names the
    attribute that holds it (the one place it is written)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["dynamic"] == ["version"]
    module, attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"].rsplit(".", 1)
    return getattr(importlib.import_module(module), attr)


def test_version_matches_pyproject():
    assert nx.__version__ == pyproject_version()
    assert [int(part) for part in nx.__version__.split(".")] >= [0, 2, 0]


def test_installed_metadata_matches_when_installed_from_this_checkout():
    here = [dist for dist in importlib.metadata.distributions(name="nxops")
            if json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
            .removeprefix("file://") == str(ROOT)]
    if not here:   # e.g. running from the source tree, as ci/gpu.sh does
        pytest.skip("nxops is not installed from this checkout")
    for dist in here:
        assert dist.version == nx.__version__, (
            f"the installed metadata says {dist.version}: reinstall (pip install -e .)")


def test_changelog_has_an_entry_for_this_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {nx.__version__}" in changelog
