"""``python -m nxops.measure``: reading a jax.profiler trace on a GPU (a
synthetic trace: no GPU here), the fake timer of ``--dry``, the table it
writes into NXOPS_MEASURED_DIR and what `auto` and ``explain`` make of it:
a fresh entry decides (both ways), a stale one is passed over, a corrupt file
is ignored with a warning naming it."""
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest

import nxops as nx
from nxops.kernels import _measured, _registry
from nxops.measure import _cases, _table, _timing

ROWS_LSE = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)     # kernels/rows_lse_4096x4096_f32
COLS_SUM = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)     # kernels/cols_sum_4096x4096_f32


def _meta(kind, pid, name, tid=None):
    return {"ph": "M", "name": kind, "pid": pid, **({"tid": tid} if tid else {}), "args": {"name": name}}


def test_gpu_time_is_the_stream_events_not_the_summary_lines():
    trace = {"traceEvents": [
        _meta("process_name", 1, "/host:CPU"), _meta("process_name", 2, "/device:GPU:0"),
        _meta("thread_name", 2, "Stream #13(Kernels)", tid=13), _meta("thread_name", 2, "XLA Ops", tid=99),
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 500, "name": "host work"},
        {"ph": "X", "pid": 2, "tid": 13, "ts": 10, "dur": 30, "name": "loop_reduce_fusion"},
        {"ph": "X", "pid": 2, "tid": 13, "ts": 50, "dur": 20, "name": "nxops_reduce_rows"},
        {"ph": "X", "pid": 2, "tid": 99, "ts": 10, "dur": 60, "name": "reduce.1"},
    ]}
    events, source = _timing._device_events(trace)
    assert source == "GPU stream events"
    assert sorted(e["dur"] for e in events) == [20, 30]


def test_summary_lists_the_kernels_that_win_and_the_incorrect_results():
    lines = [dict(section="kernels", case="c", backend=b, kern_us=us, correct=ok)
             for b, us, ok in (("xla", 100.0, True), ("pallas", 60.0, True), ("triton", 96.0, False))]
    text = _timing.summary(lines)
    assert "| kernels/c | pallas | 0.60 |" in text and "triton |" not in text.split("XLA:")[1]
    assert "incorrect: kernels/c triton" in text


def test_summary_gives_the_fused_cross_entropy_over_the_unfused_program():
    fused, unfused = _cases.XENT_NAMES
    lines = [dict(section="cross_entropy", case=name, backend=b, kern_us=us, correct=True)
             for name, b, us in ((fused, "xla", 900.0), (unfused, "xla", 1200.0),
                                 (fused, "pallas", 800.0), (unfused, "pallas", 1200.0),
                                 (_cases.XENT_STORED, "pallas", 1320.0))]
    assert _timing.summary(lines).splitlines()[-2:] == [
        "cross-entropy fused / unfused (value_and_grad): xla 0.75, pallas 0.67",
        "cross-entropy fused stored backward / unfused (value_and_grad): pallas 1.10"]


def test_the_fake_timer_is_the_bytes_times_a_fixed_ratio():
    case = _cases.case("kernels", "rows_lse_4096x4096_f32", scale=64)   # 64 x 64 f32: 16 KiB
    assert _timing.fake_us(case, "xla", "xla:reduce") == 16.384
    assert _timing.fake_us(case, "pallas", "pallas:reduce") == pytest.approx(16.384 * 0.8)
    assert _timing.fake_us(case, "auto", "xla:reduce") == 16.384


def _explain_rows_lse():
    choice = nx.kernels.explain(lambda x: nx.logsumexp(x, 1), ROWS_LSE, platform="cuda")
    return choice.reports[0].choice


def _python(code: str, **env) -> str:
    run = subprocess.run([sys.executable, *code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", **env})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run.stdout


def test_a_dry_run_writes_the_table_a_new_process_reads(tmp_path):
    tables = tmp_path / "measured"
    printed = _python(["-m", "nxops.measure", "--dry", "-k", "rows_lse_4096x4096_f32",
                       "--out", str(tmp_path / "out")], NXOPS_MEASURED_DIR=str(tables))
    assert f"tables ['{tables / 'sm_90.json'}']" in printed
    (entry,) = json.loads((tables / "sm_90.json").read_text())["entries"]
    pallas = entry["backends"]["pallas"]
    assert entry["key"] == "reduce/rows/logsumexp/float32/2^26B" and pallas["ratio"] == 0.8
    assert pallas["device"] == _timing.FAKE_DEVICE
    assert pallas["version"] == _measured.kernel_version(_registry.lookup("reduce", "pallas"))
    lines = [json.loads(line) for line in (tmp_path / "out" / "run.jsonl").read_text().splitlines()]
    assert {line["backend"] for line in lines} == {"xla", "auto", "pallas"}
    assert all(line["correct"] for line in lines)
    code = ("import jax, jax.numpy as jnp, nxops as nx; print(nx.kernels.explain("
            "lambda x: nx.logsumexp(x, 1), jax.ShapeDtypeStruct((4096, 4096), jnp.float32), "
            "platform='cuda'))")
    explained = _python(["-c", code], NXOPS_MEASURED_DIR=str(tables))
    assert "pallas:reduce" in explained
    assert (f"measured pallas 0.80x XLA ({pallas['kernel_us']:.1f} vs {pallas['xla_us']:.1f} us) "
            f"on {_timing.FAKE_DEVICE}, {pallas['date']}") in explained
    assert f"table {tables / 'sm_90.json'}" in explained


def test_a_dry_run_leaves_the_default_tables_alone(tmp_path):
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "NXOPS_MEASURED_DIR"}
    run = subprocess.run([sys.executable, "-m", "nxops.measure", "--dry", "-k", "rows_lse_4096x4096_f32"],
                         capture_output=True, text=True, timeout=600,
                         env={**env, "JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path),
                              "TMPDIR": str(tmp_path / "tmp")})
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"tables ['{tmp_path / 'tmp'}/nxops-measure-dry-" in run.stdout.splitlines()[-1]
    assert not (tmp_path / "nxops").exists()


def _fresh_table(directory, ratios: dict[str, float]) -> None:
    """A table with a pallas entry of the given ratio per catalogue case, of
    the installed kernels, as a run on an H100 would write it."""
    lines = []
    for name, ratio in ratios.items():
        common = dict(run="test", section="kernels", case=name, device="NVIDIA H100 80GB HBM3",
                      compute_capability=90, correct=True)
        lines += [dict(common, backend="xla", kern_us=100.0),
                  dict(common, backend="pallas", kern_us=100.0 * ratio)]
    _table.write_tables(_table.build_tables(lines, "2026-11-28"), directory)


def test_a_fresh_entry_of_this_machine_decides_both_ways(tmp_path, nxops_config):
    _fresh_table(tmp_path, {"rows_lse_4096x4096_f32": 0.5, "cols_sum_4096x4096_f32": 1.25})
    nxops_config("MEASURED_DIR", str(tmp_path))
    table = _measured.load("sm_90", str(tmp_path))
    win = _explain_rows_lse()
    assert win.kernel.name == "pallas:reduce"
    assert f"measured {table[win.case]['pallas'].quote()}" in win.why
    assert f"table {tmp_path / 'sm_90.json'}" in win.why
    loss = nx.kernels.explain(lambda x: nx.sum(x, 0), COLS_SUM, platform="cuda").reports[0].choice
    assert loss.kernel.name == "xla:reduce"
    assert f"measured {table[loss.case]['pallas'].quote()}" in loss.why
    assert "1.25x XLA" in loss.why and "a kernel needs <= 0.95x" in loss.why


def test_a_stale_entry_is_passed_over_for_the_shipped_table(tmp_path, nxops_config):
    _fresh_table(tmp_path, {"rows_lse_4096x4096_f32": 0.5})
    path = tmp_path / "sm_90.json"
    data = json.loads(path.read_text())
    data["entries"][0]["backends"]["pallas"]["version"] = "000000000000"
    path.write_text(json.dumps(data))
    nxops_config("MEASURED_DIR", str(tmp_path))
    choice = _explain_rows_lse()
    assert choice.kernel.name == "xla:reduce"
    assert "pallas stale since 2026-11-28 (kernel 000000000000 measured, now " in choice.why
    assert f"table {path})" in choice.why
    shipped = _measured.load("sm_90")[choice.case]   # then what the shipped table says
    assert all(f"{m.backend} stale since {m.date}" in choice.why for m in shipped.values()
               if m.version != _measured.kernel_version(_registry.lookup("reduce", m.backend)))


@pytest.mark.parametrize("text", ["{not json", "[]", '{"entries": [{"key": "x"}]}',
                                  '{"entries": [{"key": "k", "backends": {"pallas": {"ratio": "a"}}}]}'])
def test_a_corrupt_table_warns_naming_the_file_and_keeps_xla(tmp_path, nxops_config, text):
    (tmp_path / "sm_90.json").write_text(text)
    nxops_config("MEASURED_DIR", str(tmp_path))
    with pytest.warns(UserWarning, match=f"ignoring the measured table {tmp_path / 'sm_90.json'}"):
        choice = _explain_rows_lse()
    assert choice.kernel.name == "xla:reduce"
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # once per file: no warning on every lowering
        _explain_rows_lse()


def test_a_program_given_to_measure_becomes_a_case():
    case = __import__("nxops.measure._cli", fromlist=["user_program"]).user_program(
        "tests.test_measure:_program")
    assert case.section == "user" and case.shapes == (((4096, 4096), jnp.float32),)
    assert _table.case_keys(case) == {"reduce/rows/logsumexp/float32/2^26B"}


def _program():
    return (lambda x: nx.logsumexp(x, 1)), (ROWS_LSE,)
