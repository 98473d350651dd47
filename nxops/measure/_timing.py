"""Times a case under each backend on the GPU at hand, from a
``jax.profiler`` trace.

Per case and backend (xla, pallas, triton, cudnn for attention, and auto
for the report), the
compiled program runs ``calls`` times inside one trace annotation; its time
is the GPU time of every event on the device's stream lines within that
annotation, divided by ``calls`` (wall clock on small ops measures dispatch).
XLA runs beside each backend in the same trace. Each result is checked
against XLA's (float32 ``rel_err``).

With ``fake=True`` (``--dry``, on CPU) everything runs as on a GPU, the
trace included, but the times come from ``fake_us``: fixed ratios, no
measurement of anything, so that a dry run's table is the same on every
machine and has a kernel win to read back.
"""
from __future__ import annotations

import glob
import gzip
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import nxops as nx
from nxops.kernels import _measured
from nxops.measure import _cases as gpu_cases

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


def lowers_for_cuda(case: gpu_cases.GpuCase, backend: str) -> str:
    """Lowers ``case`` for cuda under ``backend``, deviceless (``--dry``: the
    kernels' GPU path up to the custom call, e.g. jax-triton with this
    triton): "ok", or why the backend cannot take the case here."""
    try:
        with nx.kernels.use(backend):
            jax.jit(case.fn).trace(*case.args()).lower(lowering_platforms=("cuda",))
    except nx.NxopsError as e:
        return str(e).split(". ")[0]
    return "ok"


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


# ``fake_us``'s kernel time relative to XLA's, per backend.
FAKE_RATIOS = {"xla": 1.0, "pallas": 0.8, "triton": 0.9}
FAKE_DEVICE = "fake GPU (nxops.measure --dry)"


def fake_us(case: gpu_cases.GpuCase, backend: str, chosen: str) -> float:
    """A deterministic stand-in for a device time: the operands' bytes at
    1 byte/ns, times the backend's ``FAKE_RATIOS`` (auto: its chosen kernels')."""
    nbytes = sum(np.dtype(d).itemsize * int(np.prod(s)) for s, d in case.shapes)
    used = {name.split(":")[0] for name in chosen.split(",") if name} if backend == "auto" \
        else {backend}
    return nbytes / 1e3 * max(FAKE_RATIOS.get(b, 1.0) for b in used or {"xla"})


def time_case(case: gpu_cases.GpuCase, backends, calls: int, fake: bool = False) -> list[dict]:
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
        if fake:
            busy, source = fake_us(case, backend, chosen) * calls, "fake timer (--dry)"
        err = _rel_err(out[backend], reference) if reference is not None else float("nan")
        lines.append({"backend": backend, "kern_us": busy / calls, "wall_us": walls[backend] * 1e6,
                      "rel_err": err, "correct": bool(err <= _tolerance(case)), "chosen": chosen,
                      "timing": source})
        if backend == "xla" and same_as_xla:
            lines.append(dict(lines[-1], backend="auto", timing=source + ", xla's program"))
    return [dict(line, section=case.section, case=case.name) for line in lines]


def device_fields(fake: bool) -> dict:
    """The device a run's lines name: with ``fake``, a GPU of the default
    target's architecture (the one a deviceless ``explain`` reads)."""
    from nxops.kernels import _gpu_target
    if fake:
        return {"device": FAKE_DEVICE, "compute_capability": _gpu_target.DEFAULT_COMPUTE_CAPABILITY}
    device = jax.devices()[0]
    return {"device": device.device_kind, "compute_capability": _gpu_target.capability_of(device)}


def report(lines: list[dict]) -> str:
    """Markdown: per case, XLA's time and each backend's ratio; what auto took."""
    by_case: dict[tuple[str, str], dict[str, dict]] = {}
    for line in lines:
        by_case.setdefault((line["section"], line["case"]), {})[line["backend"]] = line
    rows = ["| case | xla us | pallas/xla | triton/xla | cudnn/xla | auto/xla | auto took | "
            "all correct |", "|---|---|---|---|---|---|---|---|"]
    for (section, name), by in by_case.items():
        xla = by.get("xla", {}).get("kern_us")

        def ratio(b):
            line = by.get(b, {})
            if "kern_us" not in line or not xla:
                return "–"
            return f"{line['kern_us'] / xla:.2f}"
        correct = all(l.get("correct", True) for l in by.values())
        chosen = by.get("auto", {}).get("chosen", "–")
        rows.append(f"| {section}/{name} | {xla if xla is None else f'{xla:.1f}'} "
                    f"| {ratio('pallas')} | {ratio('triton')} | {ratio('cudnn')} | {ratio('auto')} "
                    f"| {chosen} | {'yes' if correct else '**no**'} |")
    return "\n".join(rows) + "\n"


def summary(lines: list[dict]) -> str:
    """The short table a run prints last: how many cases ran and were
    correct, and every case where a kernel measured <= THRESHOLD of XLA."""
    xla = {(l["section"], l["case"]): l["kern_us"] for l in lines if l["backend"] == "xla"}
    def ratio(l):
        return l["kern_us"] / xla[(l["section"], l["case"])]
    wins = [(l["section"], l["case"], l["backend"], ratio(l)) for l in lines
            if l["backend"] in ("pallas", "triton", "cudnn") and xla.get((l["section"], l["case"]))
            and ratio(l) <= _measured.THRESHOLD]
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
    text = []
    for label, case in (("", fused), (" stored backward", gpu_cases.XENT_STORED)):
        ratios = [f"{b} {times[case, b] / times[unfused, b]:.2f}" for b in BACKENDS
                  if times.get((case, b)) and times.get((unfused, b))]
        if ratios:
            text.append(f"cross-entropy fused{label} / unfused (value_and_grad): "
                        f"{', '.join(ratios)}")
    return text
