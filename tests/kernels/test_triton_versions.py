"""Which JAX / jax-triton / triton sets the triton backend accepts, the error
an incompatible set gives, `auto` passing over it, and the TMA_TF32 shim that
lets jax-triton 0.4 load with triton 3.6 (versions faked: one stack here)."""
import sys
import types

import jax
import jax.numpy as jnp
import pytest

import nxops as nx
from nxops.kernels.triton import _versions


@pytest.mark.parametrize("jax_v, jax_triton, triton, problem", [
    ("0.10.2", "0.3.1", "3.8.0", None),
    ("0.11.2", "0.4.1", "3.6.0", None),      # with the shim (the H200's stack)
    ("0.11.2", "0.4.1", "3.7.1", None),
    ("0.12.0.1", "0.4.1", "3.9.0", None),
    ("0.10.2", "0.4.1", "3.8.0", "requires JAX >= 0.11"),
    ("0.11.2", "0.3.0", "3.6.0", "older than nxops supports"),
    ("0.11.2", "0.4.1", "3.5.1", "triton 3.5.1 is older"),
])
def test_pairs(jax_v, jax_triton, triton, problem):
    found = _versions.pair_problem(jax_v, jax_triton, triton)
    assert found is None if problem is None else problem in found


def test_the_error_names_the_versions_and_the_fix():
    text = _versions.problem({"jax": "0.10.2", "jax-triton": "0.4.1", "triton": "3.8.0"})
    assert "JAX 0.10.2, jax-triton 0.4.1, triton 3.8.0" in text and "Fix: pip install" in text


def test_a_jax_triton_imported_before_nxops_with_a_stubbed_backend_is_reported(monkeypatch):
    stub = type("_Stub", (), {})
    monkeypatch.setitem(sys.modules, "jax_triton.triton_lib",
                        types.SimpleNamespace(cb=types.SimpleNamespace(CUDABackend=stub)))
    text = _versions.problem({"jax": "0.11.2", "jax-triton": "0.4.1", "triton": "3.6.0"})
    assert "imported before nxops" in text and "triton 3.6.0" in text
    assert "import nxops before jax_triton" in text and "pip install 'triton>=3.7" in text


def test_the_shim_defines_tma_tf32_only_for_triton_before_3_7(monkeypatch):
    pytest.importorskip("triton")
    import triton.backends.nvidia as nvidia
    driver = types.ModuleType("driver")
    monkeypatch.setattr(nvidia, "driver", driver, raising=False)
    monkeypatch.delitem(sys.modules, "jax_triton.triton_lib", raising=False)
    versions = {"triton": "3.7.0", "jax-triton": "0.4.1"}
    monkeypatch.setattr(_versions, "installed", versions.get)
    _versions.provide_tma_tf32()
    assert not hasattr(driver, "TMA_TF32")
    versions["triton"] = "3.6.0"
    _versions.provide_tma_tf32()
    assert driver.TMA_TF32 == _versions.TMA_TF32


def test_an_incompatible_stack_raises_when_asked_for_and_auto_passes_over_it(monkeypatch,
                                                                            measured_kernels):
    pytest.importorskip("triton")
    problem = _versions.problem({"jax": "0.10.2", "jax-triton": "0.4.1", "triton": "3.8.0"})
    monkeypatch.setattr(_versions, "_installed_problem", lambda: problem)
    x = jax.ShapeDtypeStruct((16384, 8192), jnp.float32)   # measured: triton 0.71x, pallas 0.94x
    fn = lambda x: nx.logsumexp(x, 1)
    with nx.kernels.use("triton"), pytest.raises(nx.NxopsError, match="incompatible Triton stack"):
        nx.kernels.explain(fn, x, platform="cuda")
    choice = nx.kernels.explain(fn, x, platform="cuda").reports[0].choice
    assert choice.kernel.backend == "pallas"
    assert "triton not used: incompatible Triton stack" in choice.describe()
    # the interpreter on cpu needs no jax-triton
    with nx.kernels.use("triton"):
        assert nx.kernels.explain(fn, jax.ShapeDtypeStruct((4, 8), jnp.float32),
                                  platform="cpu").backends() == {"reduce": {"triton"}}
