#!/usr/bin/env bash
# Measures nxops on the one GPU of this machine, with no network, in at most
# 8 minutes, each section under its own time limit, results written as they come:
#   (a) the one-device kernel tests on cuda (JAX_PLATFORMS=cuda,cpu)
#   (b) python -m nxops.measure: every measured case timed from jax.profiler
#       traces -> OUT/run.jsonl, OUT/measured_report.md, OUT/summary.md and
#       OUT/measured/ARCH.json; merged into the shipped table
#       (nxops/kernels/measured/) for the repository to commit
#   (c) the benchmarks (pytest bench --benchmark-only) at GPU sizes
# and prints a short table last.
#
#   bash ci/gpu.sh [--dry] [OUT]      (OUT: $OUT, else ./gpu-out)
#
# Runs from the source tree with $PYTHON, else the repository's .venv/bin/python,
# else the machine's python (JAX, triton, pytest, hypothesis, pytest-benchmark
# installed); pure-Python wheels it lacks (e.g. jax-triton) are installed from
# $NXOPS_WHEELS (a directory) into OUT/.site, never from a registry.
# --dry: on CPU at 1/64 of the sizes with a fake device timer (CI runs it);
# the shipped table is left alone.
# A section that reaches its limit is interrupted (SIGINT): pytest writes its
# report of what ran, nxops.measure has written every case it finished.
set -uo pipefail   # no -e: a failing or timed-out section must not stop the others
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry" ]; then DRY=1; shift; fi
OUT=$(mkdir -p "${1:-${OUT:-gpu-out}}" && cd "${1:-${OUT:-gpu-out}}" && pwd)
# The repository's Python: $PYTHON, else its venv's (.venv, made by the README's
# commands; `pip install -e '.[gpu]'` there on a GPU machine), else the machine's.
VENV_PY=${NXOPS_VENV:-.venv}/bin/python
PY=${PYTHON:-$( [ -x "$VENV_PY" ] && echo "$VENV_PY" || command -v python || command -v python3)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${NXOPS_WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --target "$OUT/.site" "$NXOPS_WHEELS"/*.whl \
    && export PYTHONPATH="$OUT/.site:$PYTHONPATH"
fi
# The one-device kernel tests (the collectives need a mesh of devices).
KERNEL_TESTS=(tests/kernels tests/test_measure.py --ignore-glob='*collective*'
              --ignore-glob='*integration*')
if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
  export NXOPS_MEASURED_DIR="$OUT/measured"
  LIMIT_A=120 LIMIT_B=300 LIMIT_C=120
  TESTS_ARGS=(--collect-only)
  MEASURE_ARGS=(--dry)
  BENCH=(bench/bench_reduce.py -k "small and sum and xla and float32")
else
  export JAX_PLATFORMS=cuda,cpu
  LIMIT_A=150 LIMIT_B=240 LIMIT_C=90
  TESTS_ARGS=()
  MEASURE_ARGS=()
  BENCH=(bench/bench_reduce.py bench/bench_einsum.py bench/bench_attention.py::test_time_gpu)
fi
status() {  # section, exit code -> a word
  case "$2" in 0) echo "$1: ok";; 124|137) echo "$1: TIMED OUT (what ran is in $OUT)";;
    *) echo "$1: FAILED (exit $2)";; esac
}
limited() {  # seconds, command...: SIGINT at the limit, SIGKILL 20 s later
  local limit=$1; shift
  timeout -s INT -k 20 "$limit" "$@"
}

echo "== (a) kernel tests on ${JAX_PLATFORMS} (limit ${LIMIT_A}s; $PY)"
limited "$LIMIT_A" "$PY" -m pytest -q -p no:cacheprovider "${TESTS_ARGS[@]}" "${KERNEL_TESTS[@]}" \
  --junitxml="$OUT/kernel_tests.xml" > "$OUT/kernel_tests.log" 2>&1
A=$?; tail -3 "$OUT/kernel_tests.log"

echo "== (b) python -m nxops.measure (limit ${LIMIT_B}s)"
# --time-limit: start no case after 80% of the limit, so the section ends by itself.
limited "$LIMIT_B" "$PY" -m nxops.measure "${MEASURE_ARGS[@]}" --out "$OUT" \
  --table-dir "$OUT/measured" --time-limit $((LIMIT_B * 4 / 5)) > "$OUT/measure.log" 2>&1
B=$?; tail -2 "$OUT/measure.log"
if [ "$DRY" = 0 ] && [ -s "$OUT/run.jsonl" ]; then
  "$PY" -m nxops.measure --from-run "$OUT/run.jsonl" --table-dir nxops/kernels/measured \
    | tail -2
fi

echo "== (c) benchmarks (limit ${LIMIT_C}s)"
limited "$LIMIT_C" "$PY" -m pytest -q -p no:cacheprovider "${BENCH[@]}" --benchmark-only \
  --benchmark-json="$OUT/bench.json" > "$OUT/bench.log" 2>&1
C=$?; tail -2 "$OUT/bench.log"

echo "== summary (results in $OUT)"
status "(a) kernel tests" "$A"; status "(b) nxops.measure" "$B"; status "(c) benchmarks" "$C"
[ -f "$OUT/summary.md" ] && cat "$OUT/summary.md"
[ "$A$B$C" = "000" ]
