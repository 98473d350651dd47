"""``python -m nxops.measure``: the command line (see the package docstring)."""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import pathlib
import tempfile
import time

import jax

from nxops import _config
from nxops.measure import _cases, _table, _timing
from nxops.measure._cases import GpuCase

BACKENDS = ("xla", "pallas", "triton", "auto")   # attention's cases add cudnn
# --dry runs the kernels in their interpreters: Pallas on these cases only,
# Triton's (minutes per case) never.
DRY_KERNEL_CASES = ("rows_lse_4096x4096_f32", "cols_sum_4096x4096_f32")
DRY_SCALE, DRY_CALLS = 64, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nxops.measure",
                                     description="Times nxops' kernels against XLA on this "
                                                 "machine's GPU and writes the table auto reads.")
    parser.add_argument("--dry", action="store_true",
                        help="on CPU, at 1/64 of the sizes, with a fake device timer (a rehearsal)")
    parser.add_argument("--out", type=pathlib.Path,
                        help="the run's lines and reports (default: TABLE_DIR/last-run)")
    parser.add_argument("--table-dir", type=pathlib.Path,
                        help="where the table goes (default: NXOPS_MEASURED_DIR, ~/.cache/nxops/"
                             "measured; with --dry and neither given: OUT/measured, OUT a "
                             "temporary directory if not given)")
    parser.add_argument("--calls", type=int, default=20, help="calls per backend and case")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    parser.add_argument("--program", action="append", default=[], metavar="MODULE:FN",
                        help="also measure a program: FN() returns (function, args)")
    parser.add_argument("--time-limit", type=float, default=0,
                        help="start no case after this many seconds (0: no limit)")
    parser.add_argument("--from-run", type=pathlib.Path, metavar="RUN.jsonl",
                        help="write the table from a run's lines instead of measuring")
    parser.add_argument("--commit", help="with --from-run: the kernels' versions at this commit")
    parser.add_argument("--show", action="store_true",
                        help="print what auto takes from this GPU's tables (this machine's, "
                             "then the shipped one) and measure nothing")
    return parser


def _table_dir(args) -> pathlib.Path:
    if args.table_dir:
        return args.table_dir
    if args.dry and not _config.MEASURED_DIR.value:
        # a rehearsal's fake times never reach the tables `auto` reads by default
        out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="nxops-measure-dry-"))
        return out / "measured"
    return _config.measured_dir()


def user_program(spec: str) -> GpuCase:
    """The case of ``--program module:fn``: ``fn()`` returns (function, args)."""
    module, _, name = spec.partition(":")
    fn, args = getattr(importlib.import_module(module), name)()
    shapes = tuple((tuple(a.shape), a.dtype) for a in args)
    return GpuCase(spec, "user", fn, shapes, "a program given to --program")


def _cases_to_run(args) -> list[tuple[GpuCase, tuple[str, ...]]]:
    scale = DRY_SCALE if args.dry else 1
    cases = [c for c in _cases.all_cases(scale) if args.k in c.name]
    cases += [user_program(spec) for spec in args.program]
    if not args.dry:
        return [(c, BACKENDS + (("cudnn",) if c.section == "attention" else ())) for c in cases]
    return [(c, ("xla", "auto") + (("pallas",) if c.name in DRY_KERNEL_CASES else ()))
            for c in cases]


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.show:
        return _show(args)
    if args.from_run:
        return _from_run(args)
    table_dir = _table_dir(args)
    out = args.out or table_dir / "last-run"
    out.mkdir(parents=True, exist_ok=True)
    fields = dict(_timing.device_fields(args.dry), run="nxops.measure",
                  date=datetime.date.today().isoformat(), jax=jax.__version__)
    run = _Run(out, table_dir, fields["date"], dry=args.dry)
    todo = _cases_to_run(args)
    if args.dry:   # the kernels' GPU path, deviceless, up to what only a GPU runs
        for case in (c for c, _ in todo if c.name in DRY_KERNEL_CASES):
            for backend in ("pallas", "triton"):
                print(f"{case.name} lowers for cuda under {backend}: "
                      f"{_timing.lowers_for_cuda(case, backend)}", flush=True)
    started = time.perf_counter()
    for i, (case, backends) in enumerate(todo):
        if args.time_limit and time.perf_counter() - started > args.time_limit:
            print(f"time limit ({args.time_limit:.0f} s): {len(todo) - i} cases not run", flush=True)
            break
        case_started = time.perf_counter()
        calls = DRY_CALLS if args.dry else args.calls
        run.add([dict(fields, **line) for line in
                 _timing.time_case(case, backends, calls, fake=args.dry)], case)
        print(f"{case.section}/{case.name}: {time.perf_counter() - case_started:.1f} s", flush=True)
    print(f"wrote {out / 'run.jsonl'}, {out / 'measured_report.md'}, tables "
          f"{[str(p) for p in run.tables]}")
    return 0


class _Run:
    """A run's results, written after every case: a run cut at its time limit
    keeps what it measured."""

    def __init__(self, out: pathlib.Path, table_dir: pathlib.Path, date: str, dry: bool):
        self.out, self.table_dir, self.date, self.dry = out, table_dir, date, dry
        self.lines: list[dict] = []
        self.programs: dict[tuple[str, str], GpuCase] = {}
        self.tables: list[pathlib.Path] = []
        (out / "run.jsonl").write_text("")

    def add(self, lines: list[dict], case: GpuCase) -> None:
        if case.section == "user":
            self.programs[(case.section, case.name)] = case
        self.lines += lines
        with (self.out / "run.jsonl").open("a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
        timed = [line for line in self.lines if "kern_us" in line]
        tables = _table.build_tables(timed, self.date, programs=self.programs)
        self.tables = _table.write_tables(tables, self.table_dir)
        (self.out / "measured_report.md").write_text(_timing.report(timed))
        (self.out / "summary.md").write_text(_timing.summary(timed))


def _from_run(args) -> int:
    lines = _table.read_lines(args.from_run)
    tables = _table.build_tables(lines, _table.date_of(args.from_run),
                                 _table.git_reader(args.commit) if args.commit else None)
    for path in _table.write_tables(tables, args.table_dir or _config.measured_dir()):
        print(f"wrote {path} ({len(json.loads(path.read_text())['entries'])} cases)")
    return 0


def _show(args) -> int:
    from nxops.kernels import _gpu_target, _measured
    arch = _measured.arch_name(_gpu_target.compute_capability())
    print(_table.what_auto_takes(arch, args.table_dir or _config.measured_dir()))
    print(_table.what_auto_takes(arch))
    return 0
