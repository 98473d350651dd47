"""The API reference (docs/api.md, built by mkdocs + mkdocstrings from the
docstrings): every public name has an entry and an example, every example
runs as written, and the site builds with warnings as errors."""
import doctest
import inspect
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from tests._extras import require_extra

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = (ROOT / "docs" / "api.md").read_text()
# nx.kernels' public surface: what a user calls (the rest is the registry's contract with nxops.ops).
KERNELS = ("use", "explain", "Explanation", "Kernel", "register", "registered")


def public_names() -> dict[str, object]:
    """Dotted name (as api.md writes it) -> object, for every public name."""
    names = {}
    for name in nx.__all__:
        obj = getattr(nx, name)
        if not inspect.ismodule(obj):   # nxops.xmap is also a package: its function is nxops.xmap.xmap
            names["nxops.xmap.xmap" if name == "xmap" else f"nxops.{name}"] = obj
    for module, members in ((nx.random, nx.random.__all__), (nx.kernels, KERNELS),
                            (nx.hlo, nx.hlo.__all__)):
        for name in members:
            names[f"{module.__name__}.{name}"] = getattr(module, name)
    for method in ("lower", "in_shardings"):
        xmapped = nx.xmap(lambda x: x, [...], [...])
        names[f"nxops.xmap.XmapFunction.{method}"] = getattr(type(xmapped), method)
    return names


NAMES = public_names()
ENTRIES = set(re.findall(r"^::: (\S+)", API, re.M))


def covered(dotted: str) -> bool:
    """An entry of its own, or a member listed under its class's entry."""
    owner, _, member = dotted.rpartition(".")
    return dotted in ENTRIES or (owner in ENTRIES and re.search(rf"- {member}\b", API) is not None)


def test_every_public_name_has_an_entry():
    missing = [name for name in NAMES if not covered(name)]
    assert not missing, f"add '::: NAME' to docs/api.md for {missing}"


@pytest.mark.parametrize("dotted", sorted(NAMES))
def test_every_public_name_has_an_example_that_runs(dotted):
    assert jax.device_count() >= 2, "tests/conftest.py gives 8 devices (nx.hlo's examples need 2)"
    obj = inspect.unwrap(NAMES[dotted])
    tests = doctest.DocTestFinder(recurse=False).find(obj, dotted, globs={
        "jax": jax, "jnp": jnp, "np": np, "nx": nx})
    examples = [t for t in tests if t.examples]
    assert examples, f"{dotted}'s docstring has no '>>>' example"
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in examples:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{dotted}: {result.failed} of {result.attempted} examples failed"


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    require_extra("docs", "mkdocs", "mkdocstrings", "mkdocstrings_handlers.python")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    page = (tmp_path / "site" / "api" / "index.html").read_text()
    for dotted in NAMES:
        assert dotted.rpartition(".")[2] in page, f"{dotted} is not on the API page"
