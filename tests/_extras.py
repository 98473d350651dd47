"""Skips a test module whose optional extra is not installed, saying which and
the command that installs it (ci/test.sh installs every extra, so CI runs them;
the venv of `bash ci/demo.sh` has only the test extra)."""
import pytest

from nxops._install import install_command


def require_extra(extra: str, *modules: str) -> None:
    for module in modules:
        pytest.importorskip(module, reason=f"needs nxops' {extra} extra ({module} is not "
                                           f"installed): {install_command(extra)}")


def missing_extra(extra: str, *modules: str) -> str | None:
    """Why a test of ``extra`` cannot run here, or None when its modules import."""
    import importlib.util
    for module in modules:
        if importlib.util.find_spec(module) is None:
            return f"needs nxops' {extra} extra ({module} is not installed): {install_command(extra)}"
    return None


def skip_without_extra(extra: str, *modules: str) -> pytest.MarkDecorator:
    """A mark that skips one test (or one parameter) when ``extra`` is missing."""
    reason = missing_extra(extra, *modules)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


# The triton backend's tests (run by Triton's interpreter on CPU) need triton itself.
skip_without_triton = skip_without_extra("triton", "triton")


def gpu_compile_missing() -> str | None:
    """Why deviceless GPU compiles cannot run here (no CUDA plugin or no ptxas
    from the nvcc wheel: CUDA 12 for JAX 0.10, CUDA 13 for JAX 0.12), or None."""
    import importlib.util
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin")
    if not any(importlib.util.find_spec(p) is not None for p in plugins):
        return f"needs nxops' compile extra (no CUDA plugin): {install_command('compile')}"
    try:
        from tests._deviceless.gpu import ptxas_path
        ptxas_path()
    except (ImportError, FileNotFoundError):
        return f"needs nxops' compile extra (no ptxas): {install_command('compile')}"
    return None


def require_gpu_compile() -> None:
    reason = gpu_compile_missing()
    if reason:
        pytest.skip(reason, allow_module_level=True)
