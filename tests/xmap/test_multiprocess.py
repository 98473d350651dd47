"""nx.xmap across 2 processes x 4 CPU devices (jax.distributed on 127.0.0.1)
gives exactly the single-process results: a training step (data and model
parallel, one name on a serial loop, forward and jax.grad) and every named
collective; process-local inputs and cross-process Pallas collectives are
refused with NxopsErrors."""
import importlib.util
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

_WORKER = Path(__file__).with_name("_multiprocess_worker.py")
_spec = importlib.util.spec_from_file_location("_multiprocess_worker", _WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

NUM_PROCESSES = 2
TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def multiprocess_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiprocess") / "results.npz"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    children = [subprocess.Popen([sys.executable, str(_WORKER), str(i), str(NUM_PROCESSES),
                                  str(port), str(out)], env=env, start_new_session=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for i in range(NUM_PROCESSES)]
    logs = []
    try:
        for child in children:
            logs.append(child.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for child in children:   # on a timeout or error, kill the whole process group
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    failed = [(c.returncode, log[-3000:]) for c, log in zip(children, logs) if c.returncode]
    assert not failed and len(logs) == NUM_PROCESSES, failed
    return dict(np.load(out))


@pytest.fixture(scope="module")
def single_process_results():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh):
        return worker.run_all(mesh, lambda name, a, pspec: jax.device_put(
            a, NamedSharding(mesh, pspec)))


def test_xmap_over_two_processes_matches_one_process(multiprocess_results,
                                                      single_process_results):
    assert set(single_process_results) <= set(multiprocess_results)
    for name, want in single_process_results.items():
        np.testing.assert_allclose(multiprocess_results[name], want, rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def test_process_local_inputs_and_cross_process_pallas_collectives_are_refused(
        multiprocess_results):
    assert multiprocess_results["local_input"] == 1
    assert multiprocess_results["pallas_collective"] == 1
