"""An NxopsError's traceback ends at the user's line: nxops' frames are
hidden as JAX hides its own, and the switches show them again."""
import os
import pathlib
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import pytest

import nxops as nx

NXOPS_DIR = str(pathlib.Path(nx.__file__).resolve().parent)


def frames_of(call) -> list[traceback.FrameSummary]:
    with pytest.raises(nx.NxopsError) as info:
        call()
    return traceback.extract_tb(info.value.__traceback__)


def assert_ends_at_users_line(frames, code: str):
    last = frames[-1]
    assert last.filename == __file__ and code in last.line, traceback.format_list(frames)
    inside = [f for f in frames if f.filename.startswith(NXOPS_DIR)]
    assert not inside, traceback.format_list(inside)


def test_an_op_called_outside_xmap():
    x = jnp.ones(3)
    assert_ends_at_users_line(frames_of(lambda: nx.einsum('<i>,<i>-><>', x, x)),
                              "nx.einsum('<i>,<i>-><>', x, x)")


def test_a_bad_xmap_definition():
    assert_ends_at_users_line(
        frames_of(lambda: nx.xmap(lambda a: a, ['batch', ...], ['btach', ...])),
        "nx.xmap(lambda a: a, ['batch', ...], ['btach', ...])")


def test_an_error_in_the_body_ends_at_the_bodys_line():
    def body(x):
        return nx.sum(x, 'hiden')    # the user's mistake
    f = nx.xmap(body, [['batch', 'hidden', ...]], ['batch', ...])
    frames = frames_of(lambda: f(jnp.ones((8, 4))))
    assert_ends_at_users_line(frames, "nx.sum(x, 'hiden')")
    assert any("f(jnp.ones((8, 4)))" in (fr.line or "") for fr in frames)   # and the call


def test_an_error_under_a_mesh_from_the_callable():
    f = nx.xmap(lambda a: a, ['batch', ...], ['batch', ...], axis_resources={'batch': 'dta'})
    with jax.set_mesh(jax.make_mesh((8,), ('data',))):
        assert_ends_at_users_line(frames_of(lambda: f(jnp.ones((8, 3)))), "f(jnp.ones((8, 3)))")


SCRIPT = """
import jax.numpy as jnp, nxops as nx, traceback
try:
    nx.xmap(lambda x: nx.sum(x, 'hiden'), [['b', 'h', ...]], ['b', ...])(jnp.ones((2, 3)))
except nx.NxopsError as e:
    print(sum(f.filename.startswith({nxops!r}) for f in traceback.extract_tb(e.__traceback__)))
"""


def nxops_frames_shown(**env) -> int:
    run = subprocess.run([sys.executable, "-c", SCRIPT.format(nxops=NXOPS_DIR)],
                         env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return int(run.stdout.split()[-1])


def test_switches_show_nxops_frames():
    assert nxops_frames_shown() == 0
    assert nxops_frames_shown(NXOPS_TRACEBACK_FILTERING="off") > 2
    assert nxops_frames_shown(JAX_TRACEBACK_FILTERING="off") > 2
