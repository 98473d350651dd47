#!/usr/bin/env bash
# Runs ruff (configured in pyproject.toml), the whole test suite (with the
# deviceless GPU/TPU compile and Triton interpreter checks), then every
# benchmark once, untimed, on CPU at its small size (so benchmark code cannot rot; each benchmark also checks its result;
# the medium and large sizes run the same code on more data), and ci/gpu.sh
# in its CPU dry mode.
# With arguments, runs only what they select, as pytest would
# (`bash ci/test.sh tests/xmap -x`), and no benchmarks.
NXOPS_EXTRAS=test,compile,triton source "$(dirname "$0")/_venv.sh"
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
python -m ruff check
python -m pytest tests -q
python -m pytest bench -q --benchmark-disable -k "not medium and not large"
# ci/gpu.sh's CPU dry run (~1 min): the GPU script cannot rot between GPU runs.
bash "$(dirname "$0")/gpu.sh" --dry "$(mktemp -d)"
