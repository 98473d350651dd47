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
install_compile_venv

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

pytest_both() {   # pytest args...: in $VENV, then what it skipped in $COMPILE_VENV
  local skipped status=0 ids
  skipped=$(mktemp)
  NXOPS_SKIPPED_LOG=$skipped python -m pytest -q --durations=25 "$@" || status=$?
  if [ -s "$skipped" ]; then
    mapfile -t ids < <(sort -u "$skipped")
    step "${#ids[@]} skipped in $VENV, again in $COMPILE_VENV (compile, triton and docs extras):"
    "$COMPILE_PYTHON" -m pytest -q -rs --durations=10 "${ids[@]}" || status=$?
  fi
  rm -f "$skipped"
  return "$status"
}

check_clean_venv
if [ "$#" -gt 0 ]; then
  step "pytest $*"
  status=0
  pytest_both "$@" || status=$?
  step "done"
  exit "$status"
fi
step "ruff"
python -m ruff check
step "the test suite"
pytest_both tests
step "the benchmarks, untimed"
"$COMPILE_PYTHON" -m pytest bench -q --benchmark-disable --durations=10 -k "not medium and not large"
# ci/gpu.sh's CPU dry run (~1 min): the GPU script cannot rot between GPU runs.
step "ci/gpu.sh --dry"
PYTHON=$COMPILE_PYTHON bash "$(dirname "$0")/gpu.sh" --dry "$(mktemp -d)"
step "done"
