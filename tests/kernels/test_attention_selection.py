"""`auto` for nx.attention on cuda follows the measured table like every other
op: a table (this machine's, NXOPS_MEASURED_DIR) with the Pallas kernel at
most 0.95x XLA's time makes it the pick; slower, or no entry (the shipped
table has none: no GPU has measured it), keeps XLA's reference."""
import json

import jax
import jax.numpy as jnp
import pytest

import nxops as nx
from nxops.kernels import _measured, _registry

S = jax.ShapeDtypeStruct
Q = S((16, 1024, 64), jnp.bfloat16)   # 16 heads of 1024 tokens


def attend(q, k, v):
    return nx.attention(q, k, v, seq=1, q_seq=1, causal=True)


def _choice():
    (report,) = nx.kernels.explain(attend, Q, Q, Q, platform="cuda").reports
    return report.choice


def _write_table(directory, case_key, ratio):
    pallas = _registry.lookup("attention", "pallas")
    entry = {"key": case_key, "backends": {"pallas": {
        "ratio": ratio, "kernel_us": 100.0 * ratio, "xla_us": 100.0,
        "version": _measured.kernel_version(pallas), "device": "NVIDIA H200",
        "date": "2026-11-29", "cases": ["attention/causal_bf16"]}}}
    (directory / "sm_90.json").write_text(json.dumps(
        {"arch": "sm_90", "format": _measured.FORMAT, "entries": [entry]}))
    _measured.load.cache_clear()


def test_without_a_measured_entry_auto_keeps_the_reference():
    choice = _choice()
    assert choice.case.startswith("attention/causal/-/bfloat16/"), choice.case
    assert choice.case not in _measured.load("sm_90")
    assert choice.kernel.backend == "xla", choice.describe()


@pytest.mark.parametrize("ratio, picked", [(0.6, "pallas"), (1.3, "xla")])
def test_auto_follows_the_measured_table(tmp_path, nxops_config, ratio, picked):
    case_key = _choice().case
    _write_table(tmp_path, case_key, ratio)
    nxops_config("MEASURED_DIR", str(tmp_path))
    try:
        choice = _choice()
    finally:
        _measured.load.cache_clear()
    assert choice.kernel.backend == picked, choice.describe()
    assert f"pallas {ratio:.2f}x XLA" in choice.describe()
