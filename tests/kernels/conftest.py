"""The ``kernels`` fixture: the backend a test is parametrized with."""
from typing import Iterator

import pytest

from tests.kernels._reference import Backend, small_blocks


@pytest.fixture
def kernels(backend: str) -> Iterator[Backend]:
    """The kernels of ``backend`` (a test's parameter), with small blocks."""
    with small_blocks(backend):
        yield Backend(backend)
