"""Turns a pytest-benchmark JSON file into a markdown table and a PNG plot.

    python -m bench.report RESULTS.json [--plot out.png]

One row per benchmark: op, backend, dtype, size, time (the fastest round),
achieved GB/s or TFLOP/s, % of the device's peak (roofline: the bound of
whichever of memory or compute limits the op), the time relative to the
baseline of its group (``time / baseline``: below 1 is faster), and notes
(collective bytes vs the ring bound, temporary memory vs unlooped). The plot
shows ``time / baseline`` of every nxops entry.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _rate(info: dict) -> str:
    """TFLOP/s for compute-heavy ops (over 1 FLOP per byte), else GB/s."""
    if "tflops" in info and info.get("flops", 0) > info.get("bytes", 0):
        return f"{info['tflops']:.3g} TFLOP/s"
    if "gbps" in info:
        return f"{info['gbps']:.3g} GB/s"
    return ""


def _notes(info: dict) -> str:
    notes = []
    if "bytes_ratio_to_ring" in info:
        notes.append(f"{info['bytes_per_device']:.0f} B/device = "
                     f"{info['bytes_ratio_to_ring']:.2f}x ring bound ({info['hlo_collectives']})")
    if "temp_ratio_to_unlooped" in info:
        notes.append(f"temp {info['temp_bytes']} B = {info['temp_ratio_to_unlooped']:.3f}x unlooped")
    if "note" in info:
        notes.append(info["note"])
    return "; ".join(notes)


def rows(results: dict) -> list[dict[str, Any]]:
    """One dict per benchmark, with its ratio to its group's baseline."""
    benchmarks = results["benchmarks"]
    baseline_time = {b["group"]: b["stats"]["min"] for b in benchmarks
                     if b["extra_info"].get("baseline")}
    out = []
    for b in benchmarks:
        info, seconds = b["extra_info"], b["stats"]["min"]
        base = baseline_time.get(b["group"])
        out.append(dict(
            group=b["group"], op=info.get("op", b["name"]), backend=info.get("backend", ""),
            dtype=info.get("dtype", ""), size=info.get("size", ""), seconds=seconds,
            rate=_rate(info), fraction=info.get("fraction_of_peak"),
            ratio=seconds / base if base else None, baseline=bool(info.get("baseline")),
            notes=_notes(info)))
    # Keep each group together, baseline first.
    order = {g: i for i, g in enumerate(dict.fromkeys(r["group"] for r in out))}
    return sorted(out, key=lambda r: (order[r["group"]], not r["baseline"], r["seconds"]))


def markdown(results: dict) -> str:
    peak = results.get("machine_info", {}).get("nxops_peak") or {}
    lines = []
    if peak:
        lines.append(f"Device: {peak['device']} — peaks ({peak['source']}): "
                     f"{peak['hbm_gbps']} GB/s, f32 {_num(peak['f32_tflops'])} TFLOP/s, "
                     f"bf16 {_num(peak['bf16_tflops'])} TFLOP/s. Time: fastest round.\n")
    lines.append("| op | backend | dtype | size | time | GB/s or TFLOP/s | % of peak "
                 "| time / baseline | notes |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in rows(results):
        fraction = f"{100 * r['fraction']:.1f}%" if r["fraction"] is not None else ""
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else ""
        lines.append(f"| {r['op']} | {r['backend']} | {r['dtype']} | {r['size']} | "
                     f"{_time(r['seconds'])} | {r['rate']} | {fraction} | {ratio} | {r['notes']} |")
    return "\n".join(lines)


def _num(value) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else "n/a"


def plot(results: dict, path: str) -> None:
    """A bar per nxops entry: its time relative to the group's baseline (log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [r for r in rows(results) if not r["baseline"] and r["ratio"] is not None]
    backends = sorted({r["backend"] for r in entries})
    colors = {b: f"C{i}" for i, b in enumerate(backends)}
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(entries) + 1.5))
    labels = [f"{r['group']} [{r['backend']}]" for r in entries]
    ax.barh(range(len(entries)), [r["ratio"] for r in entries],
            color=[colors[r["backend"]] for r in entries])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(entries)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time / baseline (log scale; < 1 is faster than the hand-written JAX baseline)")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[b]) for b in backends],
              labels=backends, loc="lower right", fontsize=8)
    peak = results.get("machine_info", {}).get("nxops_peak") or {}
    ax.set_title(f"nxops vs baseline — {peak.get('device', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    parser.add_argument("results", help="JSON written by pytest --benchmark-json")
    parser.add_argument("--plot", metavar="PNG", help="also write a plot of time / baseline")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    print(markdown(results))
    if args.plot:
        plot(results, args.plot)
        print(f"\nplot written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
