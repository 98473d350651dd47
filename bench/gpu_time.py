"""Times every case of the measured tables on the GPU at hand, from a
``jax.profiler`` trace, and rewrites the tables (``ci/gpu.sh``, section b).

    python -m bench.gpu_time --out DIR [--calls 20] [--table-dir DIR] [--dry]

Per case (bench/gpu_cases.py) and backend (xla, pallas, triton, and auto for
the report), the compiled program runs ``calls`` times inside one trace
annotation; its time is the GPU time of every event on the device's stream
lines within that annotation, divided by ``calls`` (wall clock on small ops
measures dispatch). XLA runs beside each backend in the same trace. Each
result is checked against XLA's (float32 ``rel_err``). Lines go to
``DIR/run.jsonl`` as they come (the format ``bench/measured_table.py``
reads), then the tables are merged into ``--table-dir`` (default: the
package's, the ones `auto` reads) and ``DIR/measured/``, and
``DIR/measured_report.md`` says what `auto` picks now.

``--dry`` (CI, CPU): every case at 1/64 of its size, xla and auto, Pallas
(interpreted) on a few; host times stand in for GPU times and the table is
written for a fake architecture (sm_0) under DIR only.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import gzip
import json
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import nxops as nx
from bench import gpu_cases, measured_table
from nxops.kernels import _measured

BACKENDS = ("xla", "pallas", "triton", "auto")
# Trace lines that are summaries of the stream lines, not more device time.
_DERIVED_LINES = ("XLA Ops", "XLA Modules", "Steps", "TensorFlow", "Framework", "Source")


def _device_events(trace: dict) -> tuple[list[dict], str]:
    """The events of the GPU's stream lines (or, with no GPU in the trace, the
    host's XLA executions: ``--dry``), and which."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpus = {pid for pid, name in processes.items() if "GPU" in name and "host" not in name.lower()}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if gpus:
        on_gpu = [e for e in complete if e["pid"] in gpus]
        streams = [e for e in on_gpu if "Stream" in names.get((e["pid"], e.get("tid")), "")]
        kept = streams or [e for e in on_gpu if not any(
            d in names.get((e["pid"], e.get("tid")), "") for d in _DERIVED_LINES)]
        return kept, "GPU stream events"
    return [e for e in complete if e.get("name") == "ThunkExecutor::Execute (wait for completion)"
            or e.get("name", "").startswith("PjitFunction")], "host (no GPU in the trace)"


def _read_trace(directory: str) -> dict:
    (path,) = glob.glob(f"{directory}/**/perfetto_trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        return json.load(f)


def _compile(case: gpu_cases.GpuCase, backend: str):
    with nx.kernels.use(backend):
        compiled = jax.jit(case.fn).lower(*case.args()).compile()
        explanation = nx.kernels.explain(case.fn, *case.args())
    chosen = sorted({r.choice.kernel.name for r in explanation.reports})
    return compiled, ",".join(chosen)


def _rel_err(got, want) -> float:
    got = np.concatenate([np.asarray(g, np.float32).ravel() for g in jax.tree.leaves(got)])
    want = np.concatenate([np.asarray(w, np.float32).ravel() for w in jax.tree.leaves(want)])
    finite = np.isfinite(want)
    scale = float(np.linalg.norm(want[finite])) or 1.0
    return float(np.linalg.norm((got - want)[finite]) / scale)


def _tolerance(case: gpu_cases.GpuCase) -> float:
    dtype = jnp.dtype(case.shapes[0][1])
    if case.section == "programs" or dtype != jnp.float32:
        return 3e-2
    return 1e-2 if any(w in case.name for w in ("matmul", "skinny", "odd", "batched", "pdot")) \
        else 1e-4


def time_case(case: gpu_cases.GpuCase, backends, calls: int) -> list[dict]:
    """One trace, every backend's calls in an annotation of their own."""
    args = case.arrays()
    runs, lines = {}, []
    for backend in backends:
        try:
            compiled, chosen = _compile(case, backend)
        except nx.NxopsError as e:   # the backend cannot take this case here
            lines.append({"backend": backend, "skipped": str(e).split(". ")[0]})
            continue
        jax.block_until_ready(compiled(*args))   # warm up
        runs[backend] = (compiled, chosen)
    same_as_xla = "auto" in runs and "xla" in runs and runs["auto"][1] == runs["xla"][1]
    if same_as_xla:   # auto chose XLA for every op: the very program, timed once
        del runs["auto"]
    out = {}
    with tempfile.TemporaryDirectory() as log_dir:
        walls = {}
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for backend, (compiled, _) in runs.items():
                with jax.profiler.TraceAnnotation(f"nxops_gpu_time:{backend}"):
                    start = time.perf_counter()
                    for _ in range(calls):
                        out[backend] = compiled(*args)
                    jax.block_until_ready(out[backend])
                    walls[backend] = (time.perf_counter() - start) / calls
        trace = _read_trace(log_dir)
    events, source = _device_events(trace)
    windows = {}
    for e in trace["traceEvents"]:   # the trace keeps the annotation's full name in long_name
        name = str(e.get("args", {}).get("long_name") or e.get("name", ""))
        if e.get("ph") == "X" and name.startswith("nxops_gpu_time:"):
            windows[name.split(":", 1)[1]] = (e["ts"], e["ts"] + e["dur"])
    reference = out.get("xla")
    for backend, (_, chosen) in runs.items():
        lo, hi = windows[backend]
        busy = sum(e["dur"] for e in events if lo <= e["ts"] <= hi)
        err = _rel_err(out[backend], reference) if reference is not None else float("nan")
        lines.append({"backend": backend, "kern_us": busy / calls, "wall_us": walls[backend] * 1e6,
                      "rel_err": err, "correct": bool(err <= _tolerance(case)), "chosen": chosen,
                      "timing": source})
        if backend == "xla" and same_as_xla:
            lines.append(dict(lines[-1], backend="auto", timing=source + ", xla's program"))
    return [dict(line, section=case.section, case=case.name) for line in lines]


def _device_fields(dry: bool) -> dict:
    device = jax.devices()[0]
    from nxops.kernels._gpu_target import capability_of
    capability = 0 if dry else capability_of(device)
    return {"device": device.device_kind, "compute_capability": capability}


def report(lines: list[dict]) -> str:
    """Markdown: per case, XLA's time and each backend's ratio; what auto took."""
    by_case: dict[tuple[str, str], dict[str, dict]] = {}
    for line in lines:
        by_case.setdefault((line["section"], line["case"]), {})[line["backend"]] = line
    rows = ["| case | xla us | pallas/xla | triton/xla | auto/xla | auto took | all correct |",
            "|---|---|---|---|---|---|---|"]
    for (section, name), by in by_case.items():
        xla = by.get("xla", {}).get("kern_us")

        def ratio(b):
            line = by.get(b, {})
            if "kern_us" not in line or not xla:
                return "–"
            return f"{line['kern_us'] / xla:.2f}"
        correct = all(l.get("correct", True) for l in by.values())
        rows.append(f"| {section}/{name} | {xla if xla is None else f'{xla:.1f}'} | {ratio('pallas')} "
                    f"| {ratio('triton')} | {ratio('auto')} | {by.get('auto', {}).get('chosen', '–')} "
                    f"| {'yes' if correct else '**no**'} |")
    return "\n".join(rows) + "\n"


def summary(lines: list[dict]) -> str:
    """The short table ``ci/gpu.sh`` prints last: how many cases ran and were
    correct, and every case where a kernel measured <= THRESHOLD of XLA."""
    xla = {(l["section"], l["case"]): l["kern_us"] for l in lines if l["backend"] == "xla"}
    wins = [(l["section"], l["case"], l["backend"], l["kern_us"] / xla[(l["section"], l["case"])])
            for l in lines if l["backend"] in ("pallas", "triton") and xla.get((l["section"], l["case"]))
            and l["kern_us"] / xla[(l["section"], l["case"])] <= _measured.THRESHOLD]
    wrong = sorted({f"{l['section']}/{l['case']} {l['backend']}" for l in lines if not l["correct"]})
    text = [f"{len(xla)} cases timed; incorrect: {', '.join(wrong) or 'none'}",
            f"kernels at <= {_measured.THRESHOLD}x XLA:", "| case | backend | /xla |", "|---|---|---|"]
    text += [f"| {s}/{c} | {b} | {r:.2f} |" for s, c, b, r in sorted(wins)]
    return "\n".join(text + _fused_vs_unfused(lines)) + "\n"


def _fused_vs_unfused(lines: list[dict]) -> list[str]:
    """nx.cross_entropy's forward + backward over the unfused program's, per
    backend both ran under (the goal: at most 1.0)."""
    times = {(l["case"], l["backend"]): l["kern_us"] for l in lines if l["section"] == "cross_entropy"}
    fused, unfused = gpu_cases.XENT_NAMES
    ratios = [f"{b} {times[fused, b] / times[unfused, b]:.2f}" for b in BACKENDS
              if times.get((fused, b)) and times.get((unfused, b))]
    return [f"cross-entropy fused / unfused (value_and_grad): {', '.join(ratios)}"] if ratios else []


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--table-dir", type=pathlib.Path, default=_measured.TABLE_DIR)
    parser.add_argument("--dry", action="store_true")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    scale, calls = (64, 2) if args.dry else (1, args.calls)
    fields = dict(_device_fields(args.dry), run="gpu_time",
                  date=datetime.date.today().isoformat())
    lines, path = [], args.out / "run.jsonl"
    path.write_text("")
    for case in gpu_cases.all_cases(scale):
        if args.k not in case.name:
            continue
        backends = BACKENDS
        if args.dry:   # interpreters: Pallas on a few cases, Triton's (minutes) never
            kernels = case.name in ("rows_lse_4096x4096_f32", "cols_sum_4096x4096_f32")
            backends = ("xla", "auto") + (("pallas",) if kernels else ())
        started = time.perf_counter()
        for line in time_case(case, backends, calls):
            line = dict(fields, **line)
            lines.append(line)
            with path.open("a") as f:
                f.write(json.dumps(line) + "\n")
        print(f"{case.section}/{case.name}: {time.perf_counter() - started:.1f} s", flush=True)
        # after every case: a run cut at its time limit keeps what it measured
        written = _write_results(lines, fields["date"], args)
    print(f"wrote {path}, {args.out / 'measured_report.md'}, tables {[str(t) for t in written]}")


def _write_results(lines: list[dict], date: str, args) -> list[pathlib.Path]:
    timed = [l for l in lines if "kern_us" in l]
    tables = measured_table.build_tables(timed, date)
    written = measured_table.write_tables(tables, args.out / "measured")
    if not args.dry:   # merged into the tables `auto` reads (keys measured now replace)
        measured_table.write_tables(tables, args.table_dir)
    (args.out / "measured_report.md").write_text(report(timed))
    (args.out / "summary.md").write_text(summary(timed))
    return written


if __name__ == "__main__":
    main()
