#!/usr/bin/env bash
# Runs the whole test suite, then the benchmark code once (untimed) on CPU.
source "$(dirname "$0")/_venv.sh"
python -m pytest tests -q "$@"
python -m pytest bench -q -m quick --benchmark-disable
