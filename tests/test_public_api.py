"""The public names of DESIGN.md's API contract exist and are what they say."""
import importlib
import inspect

import nxops as nx

API = ["xmap", "SerialLoop", "serial_loop", "sum", "max", "min", "mean", "prod", "logsumexp", "var", "std",
       "psum", "pmax", "pmin", "pmean", "einsum", "pdot", "axis_index", "axis_size", "one_hot",
       "all_gather", "psum_scatter", "all_to_all", "ppermute", "tile", "untile", "cross_entropy", "attention",
       "SequenceLayout", "NxopsError"]


def test_every_public_name_is_exported():
    missing = [name for name in API if not hasattr(nx, name)]
    assert not missing
    assert set(API) <= set(nx.__all__)


def test_xmap_is_the_function_even_after_importing_the_package_modules():
    importlib.import_module("nxops.xmap._xmap")
    importlib.reload(nx)
    assert inspect.isfunction(nx.xmap)
    assert "in_axes" in inspect.signature(nx.xmap).parameters


def test_kernels_namespace_is_what_users_call():
    assert sorted(nx.kernels.__all__) == ["Explanation", "Kernel", "explain", "register",
                                          "registered", "use"]
    for name in nx.kernels.__all__:
        assert hasattr(nx.kernels, name)


def test_public_functions_have_docstrings():
    undocumented = [name for name in API if not (getattr(nx, name).__doc__ or "").strip()]
    assert not undocumented
