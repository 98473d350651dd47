#!/usr/bin/env bash
# Runs ruff (configured in pyproject.toml), the whole test suite (with the
# deviceless GPU/TPU compile and Triton interpreter checks), then every
# benchmark once, untimed, on CPU at its small size (so benchmark code cannot rot; each benchmark also checks its result;
# the medium and large sizes run the same code on more data), and ci/gpu.sh
# in its CPU dry mode.
# With arguments, runs only what they select, as pytest would
# (`bash ci/test.sh tests/xmap -x`), and no benchmarks.
#
# Two venvs (ci/_venv.sh): the tests run in .venv, the README's (nxops and its
# test tools); whatever they skipped there (the tests that need the compile,
# triton or docs extras, and any other skip) runs again in .venv-compile,
# which adds those extras. The benchmarks and gpu.sh's dry run use .venv-compile.
NXOPS_EXTRAS=test source "$(dirname "$0")/_venv.sh"

# .venv-compile installs (on the first run: downloads of about 3 GB) while the
# tests run in .venv; what uses it waits for it.
compile_venv_log=$(mktemp)
( install_compile_venv ) > "$compile_venv_log" 2>&1 &
compile_venv_pid=$!
COMPILE_PYTHON=$COMPILE_VENV/bin/python
compile_venv_ready() {   # waits for the install; its output, and its failure, show here
  [ -n "$compile_venv_pid" ] || return 0
  local status=0
  wait "$compile_venv_pid" || status=$?
  compile_venv_pid=
  cat "$compile_venv_log"
  rm -f "$compile_venv_log"
  return "$status"
}

check_clean_venv() {   # the README's venv: no CUDA plugin or libtpu, and `import jax` prints nothing
  local found noise
  found=$(python -c 'import importlib.util as u
print(*[m for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu") if u.find_spec(m)])')
  noise=$(env -u JAX_PLATFORMS python -c 'import jax; jax.devices()' 2>&1 >/dev/null || true)
  [ -z "$found$noise" ] && return 0
  echo "$VENV is not clean: ${found:+it has $found (made by an older ci/test.sh: remove $VENV and rerun)}${noise:+ importing JAX prints: $noise}" >&2
  [ "${CI:-}" != "true" ]   # in CI a failure; elsewhere a warning
}

# Each step prints when it starts (seconds since this script started) and each
# pytest run lists its slowest tests (--durations): where CI's time goes.
step() { echo "== [$SECONDS s] $*"; }

rerun_workers() {   # NXOPS_RERUN_WORKERS=N (N > 1): the rerun on N pytest-xdist workers
  # Most of the rerun is ptxas and XLA's GPU/TPU compilers, one file's module
  # fixture each: whole files go to a worker (loadfile), so each fixture is
  # compiled once. CI sets it where the rerun has the machine to itself.
  local workers=${NXOPS_RERUN_WORKERS:-1}
  if [ "$workers" -gt 1 ]; then echo "-n $workers --dist loadfile"; fi
}

pytest_both() {   # pytest args...: in $VENV, then what it skipped in $COMPILE_VENV
  local skipped status=0 ids
  skipped=$(mktemp)
  # Every test's time, per stack, for finding where CI's time goes (.ci-junit-py311.xml)
  NXOPS_SKIPPED_LOG=$skipped python -m pytest -q --durations=25 \
    --junitxml=".ci-junit-py$(python -c 'import sys; print("%d%d" % sys.version_info[:2])').xml" \
    "$@" || status=$?
  if [ -s "$skipped" ]; then
    mapfile -t ids < <(sort -u "$skipped")
    compile_venv_ready || return
    step "${#ids[@]} skipped in $VENV, again in $COMPILE_VENV (compile, triton and docs extras):"
    "$COMPILE_PYTHON" -m pytest -q -rs --durations=10 $(rerun_workers) "${ids[@]}" || status=$?
  fi
  rm -f "$skipped"
  return "$status"
}

check_clean_venv
if [ "$#" -gt 0 ]; then
  step "pytest $*"
  status=0
  pytest_both "$@" || status=$?
  compile_venv_ready || status=$?
  step "done"
  exit "$status"
fi
step "ruff"
python -m ruff check
step "the test suite"
pytest_both tests
step "the benchmarks, untimed"
compile_venv_ready
"$COMPILE_PYTHON" -m pytest bench -q --benchmark-disable --durations=10 -k "not medium and not large"
# ci/gpu.sh's CPU dry run (~1 min): the GPU script cannot rot between GPU runs.
step "ci/gpu.sh --dry"
PYTHON=$COMPILE_PYTHON bash "$(dirname "$0")/gpu.sh" --dry "$(mktemp -d)"
step "done"
