"""nxops names the supported JAX range when imported with another JAX."""
import os
import subprocess
import sys

import pytest

from nxops._supported_jax import check_jax_version


@pytest.mark.parametrize("version", ["0.10.2", "0.11.2", "0.12.0.1", "0.12.1.dev20261101"])
def test_supported_versions_pass(version):
    check_jax_version(version)


@pytest.mark.parametrize("version", ["0.9.2", "0.10.1", "0.13.0", "1.0.0"])
def test_unsupported_versions_name_the_range(version):
    with pytest.raises(ImportError, match=r"JAX >= 0\.10\.2 and < 0\.13.*this is JAX " + version):
        check_jax_version(version)


def test_import_with_jax_0_9_fails_naming_the_range():
    program = "import jax; jax.__version__ = '0.9.2'; import nxops"
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert run.returncode != 0
    assert "ImportError: nxops supports JAX >= 0.10.2 and < 0.13" in run.stderr
