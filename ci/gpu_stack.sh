#!/usr/bin/env bash
# Rehearses the GPU run on the GPU machines' software stack, without a GPU, so
# that the first run on a GPU can only fail on the GPU itself. The stack:
# JAX 0.11.2 with the CUDA 13 plugin, triton 3.6.0, numpy, pytest, hypothesis
# and pytest-benchmark; no jax-triton (ci/gpu.sh installs it from a wheel
# directory, NXOPS_WHEELS, with pip --no-index: those machines have no
# network) and nxops not installed (ci/gpu.sh runs it from the source tree).
# Then `ci/gpu.sh --dry` must pass.
#
#   bash ci/gpu_stack.sh [OUT]      (CI: bash ci/py313.sh run "bash ci/gpu_stack.sh")
#
# The venv ($NXOPS_GPU_STACK_VENV, default .venv-gpu-stack) and its wheel
# directory are made on the first run (pip needs the network then only).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NXOPS_GPU_STACK_VENV:-.venv-gpu-stack}
WHEELS=$PWD/$VENV/wheels
STACK=(jax==0.11.2 jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2 triton==3.6.0
       numpy pytest hypothesis pytest-benchmark)
if [ ! -f "$VENV/.installed" ]; then
  echo "making $VENV: ${STACK[*]}; jax-triton 0.4.1 into $WHEELS (log: $VENV/install.log)"
  "${PYTHON:-python3}" -m venv "$VENV"
  if ! { "$VENV/bin/python" -m pip install "${STACK[@]}" \
         && "$VENV/bin/python" -m pip download --no-deps jax-triton==0.4.1 -d "$WHEELS"; } \
       > "$VENV/install.log" 2>&1; then
    tail -20 "$VENV/install.log" >&2
    exit 1
  fi
  touch "$VENV/.installed"
fi
# What those machines do not have (checked from outside the source tree).
VPY=$PWD/$VENV/bin/python
EMPTY=$(mktemp -d)   # no nxops there (the chroot mounts the checkout at /nxops)
if (cd "$EMPTY" && "$VPY" -c "import jax_triton" 2> /dev/null) \
   || (cd "$EMPTY" && "$VPY" -c "import nxops" 2> /dev/null); then
  echo "$VENV must have neither jax-triton nor nxops installed" >&2
  exit 1
fi
"$VENV/bin/python" -m pip list 2> /dev/null | grep -iE "^(jax|jaxlib|jax-cuda13-plugin|triton) "
OUT=${1:-$(mktemp -d)}
start=$SECONDS
PYTHON=$VPY NXOPS_WHEELS=$WHEELS bash ci/gpu.sh --dry "$OUT"
# jax-triton from the wheel directory with this triton: the Triton kernels lower for cuda.
grep "lowers for cuda" "$OUT/measure.log"
! grep "lowers for cuda under triton:" "$OUT/measure.log" | grep -v ": ok$"
echo "ci/gpu.sh --dry on the GPU machines' stack: passed in $((SECONDS - start)) s"
