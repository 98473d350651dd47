# Sourced by the README commands: makes a venv in the repo root (once; .venv,
# or $NXOPS_VENV) and installs nxops with the extras in NXOPS_EXTRAS (default:
# test) into it. With $NXOPS_JAX (e.g. "jax==0.12.0.1") that JAX goes in
# first, as a user's venv has it; installing nxops must keep it (CI checks:
# ci/py313_check.py).
# pip's output goes to <venv>/install.log; only a failure shows it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
VENV=${NXOPS_VENV:-.venv}
NXOPS_EXTRAS=${NXOPS_EXTRAS:-test}
# nxops runs on the host CPU here; the compile extras (the CUDA plugin, libtpu)
# only compile for GPU/TPU, and the CUDA plugin's device probe fails without this.
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
stamp=$VENV/.nxops-installed-${NXOPS_EXTRAS//,/-}${NXOPS_JAX:+-${NXOPS_JAX//[^A-Za-z0-9.]/}}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "installing nxops[$NXOPS_EXTRAS] ${NXOPS_JAX:-} into $VENV (first run only; log: $VENV/install.log)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  if ! { "$VENV/bin/python" -m pip install --upgrade pip \
         && { [ -z "${NXOPS_JAX:-}" ] || "$VENV/bin/python" -m pip install "$NXOPS_JAX"; } \
         && "$VENV/bin/python" -m pip install -e ".[$NXOPS_EXTRAS]"; } \
       > "$VENV/install.log" 2>&1; then
    grep -iE "error|conflict" "$VENV/install.log" | tail -20 >&2
    echo "pip install failed; full log: $VENV/install.log" >&2
    exit 1
  fi
  touch "$stamp"
fi
export PATH="$PWD/$VENV/bin:$PATH"
