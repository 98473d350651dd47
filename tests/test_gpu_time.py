"""bench/gpu_time.py's reading of a jax.profiler trace on a GPU (a synthetic
trace: no GPU here; ci/gpu.sh --dry runs the rest on CPU): only the device's
stream lines count, not the summary lines over them, nor host events."""
from bench import gpu_time


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
    events, source = gpu_time._device_events(trace)
    assert source == "GPU stream events"
    assert sorted(e["dur"] for e in events) == [20, 30]


def test_summary_lists_the_kernels_that_win_and_the_incorrect_results():
    lines = [dict(section="kernels", case="c", backend=b, kern_us=us, correct=ok)
             for b, us, ok in (("xla", 100.0, True), ("pallas", 60.0, True), ("triton", 96.0, False))]
    text = gpu_time.summary(lines)
    assert "| kernels/c | pallas | 0.60 |" in text and "triton |" not in text.split("XLA:")[1]
    assert "incorrect: kernels/c triton" in text


def test_summary_gives_the_fused_cross_entropy_over_the_unfused_program():
    fused, unfused = gpu_time.gpu_cases.XENT_NAMES
    lines = [dict(section="cross_entropy", case=name, backend=b, kern_us=us, correct=True)
             for name, b, us in ((fused, "xla", 900.0), (unfused, "xla", 1200.0),
                                 (fused, "pallas", 800.0))]
    assert gpu_time.summary(lines).splitlines()[-1] == \
        "cross-entropy fused / unfused (value_and_grad): xla 0.75"
