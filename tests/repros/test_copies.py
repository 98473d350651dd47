"""The repro files here are the reported programs, unchanged."""
import pathlib

import pytest

from tests.repros._run import REPROS

SHARED = pathlib.Path(__file__).resolve().parents[3] / "shared" / "repros"


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared/repros is not beside this checkout")
@pytest.mark.parametrize("path", sorted(SHARED.glob("*.py")) if SHARED.is_dir() else [],
                         ids=lambda p: p.name)
def test_repro_is_a_verbatim_copy(path):
    assert (REPROS / path.name).read_text() == path.read_text()
