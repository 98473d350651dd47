"""Integer and float64 reductions under an explicitly requested Pallas or
Triton reduce: refused with the reason (the kernels accumulate in float32) and
the selection that runs them (reduce=auto, XLA), never a raw error; under
reduce=auto they give jnp's results."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from tests._extras import skip_without_extra

OPS = ["sum", "max", "min", "prod"]


def _named(op):
    return nx.xmap(lambda v: getattr(nx, op)(v, "a"), [["a", ...]], [...])


@pytest.mark.parametrize("selection", [
    "pallas", pytest.param("reduce=triton", marks=skip_without_extra("triton", "triton", "jax_triton"))])
@pytest.mark.parametrize("dtype", ["int32", "float64"])
@pytest.mark.parametrize("op", OPS)
def test_requested_kernel_refuses_integer_and_float64_reductions_saying_why(op, dtype, selection):
    with jax.enable_x64(dtype == "float64"):
        x = jnp.arange(24).reshape(4, 6).astype(dtype)
        with nx.kernels.use(selection), pytest.raises(nx.NxopsError) as refused:
            _named(op)(x)
    message = str(refused.value)
    assert f"not {dtype}: they accumulate in float32" in message, message
    assert "NXOPS_KERNELS=reduce=auto" in message, message


@pytest.mark.parametrize("op", OPS)
def test_integer_reductions_run_in_xla_under_auto(op):
    x = (jnp.arange(24).reshape(4, 6) % 5 + 1).astype(jnp.int32)
    with nx.kernels.use("reduce=auto"):
        got = _named(op)(x)
    want = getattr(np, op)(np.asarray(x), axis=0)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)
