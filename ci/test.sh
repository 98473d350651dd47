#!/usr/bin/env bash
# Runs the whole test suite, then every benchmark once, untimed, on CPU (so
# benchmark code cannot rot; each benchmark also checks its result).
source "$(dirname "$0")/_venv.sh"
python -m pytest tests -q "$@"
python -m pytest bench -q --benchmark-disable
