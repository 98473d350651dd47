#!/usr/bin/env bash
# Measures nxops on the one GPU of this machine, with no network, in at most
# 8 minutes, each section under its own time limit, results written as they come:
#   (a) the one-device kernel tests on cuda (JAX_PLATFORMS=cuda,cpu)
#   (b) every case of the measured tables, timed from jax.profiler traces
#       (bench/gpu_time.py): rewrites nxops/kernels/measured/ARCH.json (what
#       `auto` reads) and writes OUT/measured_report.md
#   (c) the benchmarks (pytest bench --benchmark-only) at GPU sizes
# and prints a short table last.
#
#   bash ci/gpu.sh [--dry] [OUT]      (OUT: $OUT, else ./gpu-out)
#
# Runs from the source tree with the machine's Python (JAX, triton, pytest,
# hypothesis, pytest-benchmark installed); pure-Python wheels it lacks (e.g.
# jax-triton) are installed from $NXOPS_WHEELS (a directory) into OUT/.site,
# never from a registry. --dry: on CPU at tiny sizes (CI, ci/test.sh; ~1 min).
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
KERNEL_TESTS="tests/kernels/test_triton_versions.py tests/kernels/test_measured_selection.py
  tests/kernels/test_pallas_reduce.py tests/kernels/test_triton_kernels.py
  tests/kernels/test_pallas_dot_general.py tests/kernels/test_pallas_tile.py"
if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
  LIMIT_A=30 LIMIT_B=60 LIMIT_C=30
  TESTS_ARGS="--collect-only"
  TIME_ARGS="--dry"
  BENCH=(bench/bench_reduce.py -k "small and sum and xla and float32")
else
  export JAX_PLATFORMS=cuda,cpu
  LIMIT_A=150 LIMIT_B=240 LIMIT_C=60
  TESTS_ARGS=""
  TIME_ARGS=""
  BENCH=(bench/bench_reduce.py bench/bench_einsum.py)
fi
status() {  # section, exit code -> a word
  case "$2" in 0) echo "$1: ok";; 124|137) echo "$1: TIMED OUT";; *) echo "$1: FAILED (exit $2)";; esac
}

echo "== (a) kernel tests on ${JAX_PLATFORMS} (limit ${LIMIT_A}s)"
# shellcheck disable=SC2086
timeout "$LIMIT_A" "$PY" -m pytest -q -p no:cacheprovider $TESTS_ARGS $KERNEL_TESTS \
  --junitxml="$OUT/kernel_tests.xml" > "$OUT/kernel_tests.log" 2>&1
A=$?; tail -3 "$OUT/kernel_tests.log"

echo "== (b) measured tables (limit ${LIMIT_B}s)"
# shellcheck disable=SC2086
timeout "$LIMIT_B" "$PY" -m bench.gpu_time --out "$OUT" $TIME_ARGS > "$OUT/gpu_time.log" 2>&1
B=$?; tail -2 "$OUT/gpu_time.log"

echo "== (c) benchmarks (limit ${LIMIT_C}s)"
timeout "$LIMIT_C" "$PY" -m pytest -q -p no:cacheprovider "${BENCH[@]}" --benchmark-only \
  --benchmark-json="$OUT/bench.json" > "$OUT/bench.log" 2>&1
C=$?; tail -2 "$OUT/bench.log"

echo "== summary (results in $OUT)"
status "(a) kernel tests" "$A"; status "(b) measured tables" "$B"; status "(c) benchmarks" "$C"
[ -f "$OUT/summary.md" ] && cat "$OUT/summary.md"
[ "$A$B$C" = "000" ]
