"""Fixtures for the named-op tests: meshes over the 8 simulated CPU devices."""
import jax
import pytest
from jax.sharding import AxisType

@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def mesh8(request):
    return jax.make_mesh((8,), ("x",), axis_types=(request.param,))


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def mesh2x4(request):
    return jax.make_mesh((2, 4), ("x", "y"), axis_types=(request.param,) * 2)
