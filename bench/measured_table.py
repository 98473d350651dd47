"""Writes the measured tables `auto` reads on cuda (nxops/kernels/measured/),
from a GPU run's JSON lines.

    python -m bench.measured_table RUN.jsonl [--commit REV] [--out DIR] [--date YYYY-MM-DD]

Each line is one (case, backend) of a run: ``run``, ``section``, ``case`` (a
name of bench/gpu_cases.py), ``backend`` (xla, pallas, triton; baseline and
auto are not table entries), ``device``, ``kern_us`` (summed GPU kernel time
per call), ``correct``; optionally ``compute_capability`` and ``date``. A
backend's ratio is its ``kern_us`` over ``xla``'s in the same run and case.

Every case is lowered here (deviceless, for cuda) to find its table key(s)
(nxops.kernels._measured.Case). A case whose nxops ops all have one key feeds
that key; a program mixing several (the MLP) feeds none, nor one whose
operand XLA fuses into the op (``GpuCase.feeds_table``). Where several cases
feed one key, the worst ratio stands (a kernel must win in each). Incorrect
results are never entries. Each entry records the kernel version that ran:
the source hash of the working tree, or with ``--commit`` of that commit (the
kernels the run measured; the H200 run, bench/gpu_runs/h200_2026-11-26.jsonl,
measured ed145d9).

The table of each architecture is merged into ``--out`` (default: the
package's ``nxops/kernels/measured/``): keys measured now replace old ones.
``ci/gpu.sh`` calls ``write_tables`` after timing.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import pathlib
import re
import subprocess
from typing import Callable, Iterable

import nxops as nx
from bench import gpu_cases
from nxops.kernels import _measured, _registry

# Compute capability by device kind, for lines that do not carry one.
CAPABILITY_BY_KIND = {"H100": 90, "H200": 90, "GH200": 90, "H800": 90, "A100": 80, "A800": 80,
                      "L4": 89, "L40": 89, "RTX 4090": 89, "B200": 100, "B300": 103}


def capability_of(line: dict) -> int | None:
    if line.get("compute_capability") is not None:
        return int(line["compute_capability"])
    device = str(line.get("device", ""))
    for kind, capability in sorted(CAPABILITY_BY_KIND.items(), key=lambda kv: -len(kv[0])):
        if kind in device:
            return capability
    return None


@functools.cache
def case_keys(section: str, name: str) -> frozenset[str]:
    """The table keys of a case's nxops ops, lowered deviceless for cuda
    (none for a case that does not feed the table)."""
    case = gpu_cases.case(section, name)
    if not case.feeds_table:
        return frozenset()
    with nx.kernels.use("xla"):
        explanation = nx.kernels.explain(case.fn, *case.args(), platform="cuda")
    return frozenset(r.choice.case for r in explanation.reports)


def git_reader(commit: str) -> Callable[[str], str | None]:
    """Reads a module's source at ``commit`` (None: no such module there)."""
    root = pathlib.Path(__file__).resolve().parents[1]

    def read(module: str) -> str | None:
        path = module.replace(".", "/") + ".py"
        out = subprocess.run(["git", "-C", str(root), "show", f"{commit}:{path}"],
                             capture_output=True, text=True)
        return out.stdout if out.returncode == 0 else None
    return read


def _versions(read: Callable[[str], str | None] | None) -> dict[tuple[str, str], str]:
    """{(op, backend): kernel version} of every registered kernel."""
    return {(k.op, k.backend): (_measured.version_of_module(_measured.kernel_module(k), read)
                                if read else _measured.kernel_version(k))
            for k in _registry.registered()}


def build_tables(lines: Iterable[dict], date: str,
                 read: Callable[[str], str | None] | None = None) -> dict[str, dict]:
    """{arch: table} from a run's lines (see the module docstring)."""
    lines = list(lines)
    versions = _versions(read)
    xla = {(l["run"], l["section"], l["case"]): l for l in lines if l["backend"] == "xla"}
    entries: dict[tuple[str, str], dict] = {}
    for line in lines:
        reference = xla.get((line["run"], line["section"], line["case"]))
        if line["backend"] not in ("pallas", "triton") or not reference or not line.get("correct"):
            continue
        capability = capability_of(line)
        keys = case_keys(line["section"], line["case"])
        if capability is None or len(keys) != 1 or "" in keys:
            continue
        (key,) = keys
        op = key.split("/")[0]
        ratio = line["kern_us"] / reference["kern_us"]
        arch = _measured.arch_name(capability)
        entry = entries.setdefault((arch, key), {"key": key, "backends": {}})
        old = entry["backends"].get(line["backend"])
        if old is None or ratio > old["ratio"]:
            entry["backends"][line["backend"]] = {
                "ratio": round(ratio, 4), "kernel_us": round(line["kern_us"], 2),
                "xla_us": round(reference["kern_us"], 2),
                "version": versions[(op, line["backend"])], "device": line["device"],
                "date": line.get("date", date),
                "cases": sorted({*(old or {}).get("cases", ()), f"{line['section']}/{line['case']}"})}
        else:
            old["cases"] = sorted({*old["cases"], f"{line['section']}/{line['case']}"})
    tables: dict[str, dict] = {}
    for (arch, _), entry in sorted(entries.items()):
        tables.setdefault(arch, {"format": _measured.FORMAT, "arch": arch, "entries": []})
        tables[arch]["entries"].append(entry)
    return tables


def write_tables(tables: dict[str, dict], out: pathlib.Path) -> list[pathlib.Path]:
    """Merges each table into ``out/ARCH.json`` (measured keys replace old ones)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for arch, table in tables.items():
        path = out / f"{arch}.json"
        old = json.loads(path.read_text())["entries"] if path.is_file() else []
        merged = {e["key"]: e for e in old} | {e["key"]: e for e in table["entries"]}
        table = dict(table, entries=[merged[k] for k in sorted(merged)])
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        written.append(path)
    _measured.load.cache_clear()
    return written


def read_lines(path: pathlib.Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def date_of(path: pathlib.Path) -> str:
    found = re.search(r"\d{4}-\d{2}-\d{2}", path.name)
    return found.group(0) if found else datetime.date.today().isoformat()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl", type=pathlib.Path)
    parser.add_argument("--commit", help="hash the kernels' sources at this commit")
    parser.add_argument("--out", type=pathlib.Path, default=_measured.TABLE_DIR)
    parser.add_argument("--date", help="the run's date (default: from the file name, or today)")
    args = parser.parse_args(argv)
    tables = build_tables(read_lines(args.jsonl), args.date or date_of(args.jsonl),
                          git_reader(args.commit) if args.commit else None)
    for path in write_tables(tables, args.out):
        print(f"wrote {path} ({len(json.loads(path.read_text())['entries'])} cases)")


if __name__ == "__main__":
    main()
