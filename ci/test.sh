#!/usr/bin/env bash
# Runs the whole test suite (with the deviceless GPU/TPU compile and Triton
# interpreter checks), then every benchmark once, untimed, on CPU (so
# benchmark code cannot rot; each benchmark also checks its result).
NXOPS_EXTRAS=test,compile,triton source "$(dirname "$0")/_venv.sh"
python -m pytest tests -q "$@"
python -m pytest bench -q --benchmark-disable
