"""bench.report on a small pytest-benchmark JSON: the plot shows the entries
that ran natively, the table gives "% of peak" against published peaks only
(not a CPU's measured stand-ins), and the device's peaks come from the entries (machine_info holds
only what identifies the machine, so --benchmark-compare does not warn)."""
import json

import pytest

from bench import report

CPU_PEAK = {"device": "CPU (cpu, 8 devices)", "hbm_gbps": 50.0, "bf16_tflops": 0.1,
            "f32_tflops": 0.2, "source": "measured"}


def entry(group, backend, seconds, *, interpreted=False, nbytes=2**21, fraction=1.5):
    return {"group": group, "name": f"test[{group}-{backend}]", "stats": {"min": seconds},
            "extra_info": {"op": group, "backend": backend, "dtype": "float32", "size": "small",
                           "baseline": backend == "baseline", "interpreted": interpreted,
                           "bytes": nbytes, "flops": 0, "gbps": nbytes / seconds / 1e9,
                           "fraction_of_peak": fraction, "peak": CPU_PEAK,
                           "peak_source": "measured", "device": CPU_PEAK["device"]}}


RESULTS = {"machine_info": {"nxops_device": {"device": "cpu", "platform": "cpu"}},
           "benchmarks": [entry("sum", "baseline", 1e-3), entry("sum", "xla", 0.5e-3),
                          entry("sum", "pallas", 80e-3, interpreted=True),
                          entry("max", "baseline", 1e-3, nbytes=2**27, fraction=0.8),
                          entry("max", "xla", 1.5e-3, nbytes=2**27, fraction=0.5)]}


def test_plot_leaves_out_interpreted_entries_and_colours_by_winner(tmp_path):
    shown, left_out = report.plotted_entries(RESULTS)
    assert [(r["group"], r["backend"]) for r in shown] == [("sum", "xla"), ("max", "xla")]
    assert [r["backend"] for r in left_out] == ["pallas"]
    assert [report.verdict_color(r["ratio"]) for r in shown] == [report.WIN, report.LOSE]
    assert report.verdict_color(1.05) == report.SAME
    pytest.importorskip("matplotlib")
    path = tmp_path / "plot.png"
    report.plot(RESULTS, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_takes_peaks_from_entries_and_shows_fractions_of_published_peaks_only(tmp_path):
    table = report.markdown(RESULTS)
    assert "Device: CPU (cpu, 8 devices) — peaks (measured): 50 GB/s" in table
    assert "% of peak is not shown" in table
    fractions = [line.split(" | ")[6] for line in table.splitlines()
                 if line.startswith("| ") and "---" not in line and not line.startswith("| op")]
    assert fractions == [""] * 5    # measured CPU peaks: no fraction
    published = json.loads(json.dumps(RESULTS))
    for b in published["benchmarks"]:
        b["extra_info"].update(peak_source="published",
                               peak=dict(CPU_PEAK, device="NVIDIA H100 SXM", source="published"))
    assert "| 50.0% |" in report.markdown(published)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(RESULTS))
    assert report.main([str(path)]) == 0
