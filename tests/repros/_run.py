"""Runs a defect repro (a verbatim copy of ``shared/repros/FILE``) in this process.

Each repro is the program a defect report gave; the regression test is that
program, unchanged, printing its expected result. Running it in-process (JAX
is already imported with 8 CPU devices by conftest.py) keeps it cheap; its
``os.environ`` writes come after JAX's import and change nothing.
"""
from __future__ import annotations

import contextlib
import io
import pathlib
import runpy
import sys

REPROS = pathlib.Path(__file__).parent / "files"


def run_repro(name: str, *argv: str) -> str:
    """Runs ``files/<name>`` as ``python <name> *argv`` and returns its stdout."""
    path = REPROS / name
    out = io.StringIO()
    saved_argv = sys.argv
    sys.argv = [str(path), *argv]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = saved_argv
    return out.getvalue()


def printed_lines(name: str, *argv: str) -> list[str]:
    return [line.strip() for line in run_repro(name, *argv).splitlines() if line.strip()]


def exit_code_and_lines(name: str, *argv: str) -> tuple[int, list[str]]:
    """Runs a repro that ends with ``sys.exit(code)``; returns the code and its
    printed lines. JAX's global config (a repro may turn on x64) is restored."""
    import jax
    x64 = jax.config.jax_enable_x64
    code = 0
    out = io.StringIO()
    saved_argv = sys.argv
    sys.argv = [str(REPROS / name), *argv]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(REPROS / name), run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv = saved_argv
        jax.config.update("jax_enable_x64", x64)
    return code, [line.strip() for line in out.getvalue().splitlines() if line.strip()]
