"""The measured tables `auto` reads on cuda, built from a run's JSON lines.

Each line is one (case, backend) of a run: ``run``, ``section``, ``case`` (a
name of ``_cases``, or a program given to ``--program``), ``backend`` (xla,
pallas, triton; auto is not a table entry), ``device``, ``kern_us`` (summed
device kernel time per call), ``correct``; optionally ``compute_capability``
and ``date``. A backend's ratio is its ``kern_us`` over ``xla``'s in the same
run and case.

Every case is lowered (deviceless, for cuda) to find its table key(s)
(``nxops.kernels._measured.Case``). A case whose nxops ops all have one key
feeds that key; a program mixing several feeds none, nor one whose operand
XLA fuses into the op (``GpuCase.feeds_table``). Where several cases feed one
key, the worst ratio stands (a kernel must win in each). Incorrect results
are never entries. Each entry records the kernel version that ran: the
source hash of the installed kernels, or with ``--commit`` of that commit's.
Writing merges into ``ARCH.json``: keys measured now replace old ones.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import pathlib
import re
import subprocess
from typing import Callable, Iterable, Mapping

from nxops.kernels import _explain, _measured, _registry, _selection
from nxops.measure import _cases
from nxops.measure._cases import GpuCase

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


def case_keys(case: GpuCase) -> frozenset[str]:
    """The table keys of a case's nxops ops, lowered deviceless for cuda
    (none for a case that does not feed the table)."""
    if not case.feeds_table:
        return frozenset()
    with _selection.use("xla"):
        explanation = _explain.explain(case.fn, *case.args(), platform="cuda")
    return frozenset(r.choice.case for r in explanation.reports)


@functools.cache
def _catalogue_keys(section: str, name: str) -> frozenset[str]:
    return case_keys(_cases.case(section, name))


def git_reader(commit: str) -> Callable[[str], str | None]:
    """Reads a module's source at ``commit`` (None: no such module there)."""
    root = pathlib.Path(__file__).resolve().parents[2]

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
                 read: Callable[[str], str | None] | None = None,
                 programs: Mapping[tuple[str, str], GpuCase] | None = None) -> dict[str, dict]:
    """{arch: table} from a run's lines (see the module docstring);
    ``programs``: the cases that are not in the catalogue, by (section, name)."""
    lines = list(lines)
    programs = programs or {}
    versions = _versions(read)
    xla = {(l["run"], l["section"], l["case"]): l for l in lines if l["backend"] == "xla"}
    entries: dict[tuple[str, str], dict] = {}
    for line in lines:
        reference = xla.get((line["run"], line["section"], line["case"]))
        if line["backend"] not in ("pallas", "triton", "cudnn") or not reference or \
                not line.get("correct"):
            continue
        capability = capability_of(line)
        section_name = (line["section"], line["case"])
        keys = (case_keys(programs[section_name]) if section_name in programs
                else _catalogue_keys(*section_name))
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
    """Merges each table into ``out/ARCH.json`` (measured keys replace old ones;
    an unreadable old file is replaced). Each file is written whole, then
    renamed: a reader never sees half a table."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for arch, table in tables.items():
        path = out / f"{arch}.json"
        merged = {e["key"]: e for e in _old_entries(path)} | {e["key"]: e for e in table["entries"]}
        table = dict(table, entries=[merged[k] for k in sorted(merged)])
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        partial.replace(path)
        written.append(path)
    _measured.load.cache_clear()
    return written


def _old_entries(path: pathlib.Path) -> list[dict]:
    try:
        entries = json.loads(path.read_text())["entries"]
        return [e for e in entries if isinstance(e, dict) and "key" in e]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def read_lines(path: pathlib.Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def date_of(path: pathlib.Path) -> str:
    found = re.search(r"\d{4}-\d{2}-\d{2}", path.name)
    return found.group(0) if found else datetime.date.today().isoformat()


def what_auto_takes(arch: str, directory: pathlib.Path | None = None) -> str:
    """What `auto` takes from ``arch``'s table in ``directory`` (default: the
    shipped one) with the installed kernels: one line of counts, then each
    fresh entry at <= THRESHOLD of XLA's time (the kernels it takes)."""
    name = f"{arch}.json ({'shipped' if directory is None else directory})"
    table = _measured.load(arch, str(directory) if directory else None)
    if not table:
        return f"{name}: no table"
    versions = _versions(None)
    entries = [(key, m) for key, by in sorted(table.items()) for m in by.values()]
    fresh = [(key, m) for key, m in entries
             if m.version == versions.get((key.split("/")[0], m.backend))]
    wins = [(key, m) for key, m in fresh if m.ratio <= _measured.THRESHOLD]
    dates = sorted({m.date for _, m in entries})
    lines = [f"{name}: {len(table)} cases, {len(entries)} entries measured {', '.join(dates)}: "
             f"{len(fresh)} fresh, {len(entries) - len(fresh)} stale (kernels edited since)"]
    lines += [f"auto takes {m.backend} for {key}: {m.quote()}" for key, m in wins]
    if not wins:
        lines.append(f"auto takes no kernel: no fresh entry at <= {_measured.THRESHOLD}x XLA")
    return "\n".join(lines)
