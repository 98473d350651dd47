#!/usr/bin/env bash
# The main job: nxops on a simulated 8-device CPU mesh, printing which kernels ran.
source "$(dirname "$0")/_venv.sh"
# When the compile extra is installed (the tests install it), its CUDA plugin
# logs that this machine has no CUDA driver: expected here, so not shown.
python ci/demo.py "$@" 2> >(grep -v -E "cudart_stub|before absl::InitializeLog" >&2)
