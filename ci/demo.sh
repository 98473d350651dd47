#!/usr/bin/env bash
# The main job: nxops on a simulated 8-device CPU mesh, printing which kernels ran.
source "$(dirname "$0")/_venv.sh"
python ci/demo.py "$@"
