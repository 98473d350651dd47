"""Turns a pytest-benchmark JSON file into a markdown table and a PNG plot.

    python -m bench.report RESULTS.json [--plot out.png]

One row per benchmark: op, backend, dtype, size, time (the fastest round),
achieved GB/s or TFLOP/s, % of the device's peak (roofline: the bound of
whichever of memory or compute limits the op), the time relative to the
baseline of its group (``time / baseline``: below 1 is faster), and notes
(collective bytes vs the ring bound, temporary memory vs unlooped). The plot
shows ``time / baseline`` of every nxops entry that ran natively on the
platform (not in an interpreter), coloured by who wins, each bar labelled.
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
    if "temp_ratio_grad" in info:
        notes.append(f"temp forward {info['temp_bytes_forward']} B = "
                     f"{info['temp_ratio_forward']:.3f}x, jax.grad {info['temp_bytes_grad']} B = "
                     f"{info['temp_ratio_grad']:.3f}x unlooped")
    if "ratio_median" in info:
        notes.append(f"xmap / baseline, median of {info['rounds']} interleaved rounds: "
                     f"{info['ratio_median']:.3f} ({info['xmap_median_s'] * 1e3:.3g} ms / "
                     f"{info['baseline_median_s'] * 1e3:.3g} ms)")
    if "note" in info:
        notes.append(info["note"])
    return "; ".join(notes)


def _peak_of(info: dict) -> dict:
    return info.get("peak") or {}


def _fraction(info: dict) -> float | None:
    """% of peak, against published peaks only. A CPU has none: its measured
    stand-ins (a streaming ``x * 2``, a 1024³ matmul) move with the machine's
    load and caches, so fractions against them read 100-450%."""
    if info.get("peak_source") == "measured":
        return None
    return info.get("fraction_of_peak")


def _interpreted(info: dict) -> bool:
    """Runs in an interpreter here (Pallas interpret mode, Triton's interpreter).
    JSON written before the flag existed: a pallas/triton entry on a CPU."""
    if "interpreted" in info:
        return bool(info["interpreted"])
    return (info.get("backend") in ("pallas", "triton")
            and str(info.get("device", "")).startswith("CPU"))


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
            rate=_rate(info), fraction=_fraction(info),
            ratio=seconds / base if base else None, baseline=bool(info.get("baseline")),
            interpreted=_interpreted(info), notes=_notes(info)))
    # Keep each group together, baseline first.
    order = {g: i for i, g in enumerate(dict.fromkeys(r["group"] for r in out))}
    return sorted(out, key=lambda r: (order[r["group"]], not r["baseline"], r["seconds"]))


def device_peak(results: dict) -> dict:
    """The device's peaks of this run: from an entry judged against them (a
    collective's entry has no bandwidth peak); older JSON kept them in
    machine_info."""
    peaks = [_peak_of(b["extra_info"]) for b in results["benchmarks"]]
    with_bandwidth = [p for p in peaks if p.get("hbm_gbps")]
    return ((with_bandwidth or peaks or [{}])[0]
            or results.get("machine_info", {}).get("nxops_peak") or {})


def markdown(results: dict) -> str:
    peak = device_peak(results)
    lines = []
    if peak:
        cache_note = (" % of peak is not shown: a CPU has no published peak, and these "
                      "measured stand-ins move with load and caches (fractions against them "
                      "read above 100%)." if peak.get("source") == "measured" else "")
        lines.append(f"Device: {peak['device']} — peaks ({peak['source']}): "
                     f"{_num(peak['hbm_gbps'])} GB/s, f32 {_num(peak['f32_tflops'])} TFLOP/s, "
                     f"bf16 {_num(peak['bf16_tflops'])} TFLOP/s. Time: fastest round."
                     f"{cache_note}\n")
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


# Within this band of the baseline a ratio is read as "the same": single
# timings on a shared machine move by more than that between runs.
SAME_BAND = (0.9, 1.1)
WIN, SAME, LOSE = "#2e7d32", "#9e9e9e", "#c62828"


def plotted_entries(results: dict, include_interpreted: bool = False) -> tuple[list, list]:
    """(entries the plot shows, entries it leaves out): nxops entries with a
    baseline; interpreted kernels are left out unless asked for, since their
    times say nothing about the hardware they are written for."""
    entries = [r for r in rows(results) if not r["baseline"] and r["ratio"] is not None]
    shown = [r for r in entries if include_interpreted or not r["interpreted"]]
    return shown, [r for r in entries if r not in shown]


def verdict_color(ratio: float) -> str:
    low, high = SAME_BAND
    return WIN if ratio < low else LOSE if ratio > high else SAME


def _label(r: dict) -> str:
    words = str(r["size"]).split(" ")
    size = words[0] if words[0] in ("small", "medium", "large") else str(r["size"]).split(",")[0]
    dtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(r["dtype"], r["dtype"])
    op = r["op"] if len(r["op"]) <= 36 else r["op"][:35] + "…"
    return f"{op} · {dtype} {size} — {r['backend']}"


def plot(results: dict, path: str, include_interpreted: bool = False) -> None:
    """One bar per nxops entry: its time / its group's baseline, on a log axis
    centred on 1, coloured by who wins (green: nxops faster, red: slower,
    grey: within the noise band), each labelled with its ratio."""
    import math

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown, left_out = plotted_entries(results, include_interpreted)
    if not shown:
        raise SystemExit("no nxops entry with a baseline to plot")
    ratios = [r["ratio"] for r in shown]
    reach = max(2.0, *(max(x, 1 / x) for x in ratios))
    reach = min(2 ** math.ceil(math.log2(reach)), 64.0)   # clip far outliers, label them
    fig, ax = plt.subplots(figsize=(11, 0.3 * len(shown) + 2.2))
    y = list(range(len(shown)))
    clipped = [min(max(x, 1 / reach), reach) for x in ratios]
    ax.barh(y, [c - 1 for c in clipped], left=1, height=0.7,
            color=[verdict_color(x) for x in ratios])
    ax.axvspan(*SAME_BAND, color=SAME, alpha=0.15, linewidth=0, zorder=0)
    ax.axvline(1.0, color="black", linewidth=0.8)
    for i, (x, c) in enumerate(zip(ratios, clipped)):
        text = f"{x:.2f}x" + ("  (off scale)" if c != x else "")
        ax.text(c * (1.04 if c >= 1 else 1 / 1.04), i, text, va="center",
                ha="left" if c >= 1 else "right", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlim(1 / (reach * 1.6), reach * 1.6)
    ticks = [2.0 ** k for k in range(-int(math.log2(reach)), int(math.log2(reach)) + 1)]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.set_yticks(y, [_label(r) for r in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time / baseline (same run, log scale): left of 1x nxops is faster")
    legend = fig.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in (WIN, SAME, LOSE)],
        labels=[f"nxops faster (< {SAME_BAND[0]:g}x)",
                f"the same ({SAME_BAND[0]:g}-{SAME_BAND[1]:g}x: run-to-run noise)",
                f"nxops slower (> {SAME_BAND[1]:g}x)"],
        loc="upper center", bbox_to_anchor=(0.5, 0.975), ncol=3, fontsize=8, frameon=False)
    peak = device_peak(results)
    fig.suptitle(f"nxops vs a hand-written JAX baseline — {peak.get('device', '')}", fontsize=10,
                 y=0.998)
    if left_out:
        backends = ", ".join(sorted({r["backend"] for r in left_out}))
        fig.text(0.01, 0.005, f"Not shown: {len(left_out)} interpreted entries ({backends} on "
                 f"this platform run in an interpreter: correct, not a timing of the hardware; "
                 f"--include-interpreted shows them).", fontsize=7, color="#555555")
    top = 1 - 0.4 / fig.get_figheight()   # room for the title and the legend
    fig.tight_layout(rect=(0, 0.25 / fig.get_figheight() if left_out else 0, 1, top))
    del legend
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    parser.add_argument("results", help="JSON written by pytest --benchmark-json")
    parser.add_argument("--plot", metavar="PNG", help="also write a plot of time / baseline")
    parser.add_argument("--include-interpreted", action="store_true",
                        help="also plot kernels that ran in an interpreter (Pallas interpret "
                             "mode, Triton's interpreter on CPU)")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    print(markdown(results))
    if args.plot:
        plot(results, args.plot, include_interpreted=args.include_interpreted)
        print(f"\nplot written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
